"""Remembered sha256 results, so a 100 MB+ model file is hashed once rather than on every load.

A record is trusted while the file's stamp (size, mtime in ns, inode) is unchanged; any rewrite
in place moves the mtime and any replacement moves the inode, so either forces a rehash. The
stamp is taken *before* hashing: a file that changes while being hashed gets a record that is
already stale. Records live in one JSON object, `<cache_dir>/sha256-records.json`:

    {"/abs/path/file.gguf": {"size": 98362432, "mtime_ns": ..., "ino": ..., "sha256": "..."}}

Writes are read-modify-write under a file lock and land by atomic rename. Storing is best
effort: a read-only cache directory costs a rehash next time, never a failure.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specinfer.packs.file_lock import file_lock

CHUNK_BYTES = 1 << 20
Progress = Callable[[int, int], None]  # (bytes_done, bytes_total)


@dataclass(frozen=True)
class FileStamp:
    size: int  # bytes
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return digest.hexdigest()


class HashRecords:
    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.path = cache_dir / "sha256-records.json"

    def lookup(self, file: Path) -> str | None:
        """The recorded sha256 of `file` if its stamp still matches, else None."""
        entry = self._load().get(str(file.resolve()))
        if not isinstance(entry, dict):
            return None
        try:
            recorded = FileStamp(entry["size"], entry["mtime_ns"], entry["ino"])
            sha = entry["sha256"]
        except KeyError:
            return None
        try:
            current = FileStamp.of(file)
        except OSError:
            return None
        return sha if recorded == current and isinstance(sha, str) else None

    def sha256(self, file: Path, *, force: bool = False, progress: Progress | None = None) -> str:
        """sha256 of `file`: the remembered one while its stamp holds (unless `force`), else
        computed now and remembered."""
        digest = None if force else self.lookup(file)
        if digest is None:
            stamp = FileStamp.of(file)
            digest = sha256_file(file, progress)
            self.store(file, stamp, digest)
        return digest

    def store(self, file: Path, stamp: FileStamp, sha256: str) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with file_lock(self.cache_dir / ".sha256-records.lock"):
                records = self._load()
                records[str(file.resolve())] = {**asdict(stamp), "sha256": sha256}
                fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=".sha256-records.", suffix=".tmp")
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(records, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        except OSError:
            pass  # best effort, see the module docstring

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}  # absent or damaged: every file simply gets rehashed
        return data if isinstance(data, dict) else {}

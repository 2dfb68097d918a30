"""Resolve a pack name to a complete, verified `.gguf` file on disk.

Single-file packs are used in place, in site-packages, after a sha256 check whose result is
remembered (see `hash_records`). Multi-part packs are concatenated once into the cache
directory. Assembly protocol, all under a per-pack file lock:

  1. an assembled file already at the final path is reused if its size is right and its hash
     (remembered, or recomputed when the record is missing or stale) matches; otherwise it is
     a damaged copy and is deleted (the installed parts are the source of truth);
  2. temp files left by a killed assembler are removed;
  3. the parts are streamed into a temp file in the same directory, hashed while writing,
     flushed and fsynced;
  4. only if the hash matches is the temp file renamed over the final path (atomic) and the
     directory fsynced; on a mismatch or any exception, KeyboardInterrupt included, the temp
     file is removed. The final path therefore only ever holds a complete, verified file.

Packages are located with `importlib.util.find_spec` on top-level names, which finds a
package's directory without executing its `__init__`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

from specinfer.packs.errors import PackCorruptedError, PackNotInstalledError
from specinfer.packs.file_lock import file_lock
from specinfer.packs.hash_records import CHUNK_BYTES, FileStamp, HashRecords, Progress
from specinfer.packs.registry import BUILTIN_PACKS, ModelPack, PackPart, PackRegistry


def default_cache_dir() -> Path:
    env = os.environ.get("SPECINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specinfer" / "packs"


def is_pack_name(s: object, registry: PackRegistry = BUILTIN_PACKS) -> bool:
    return isinstance(s, str) and s in registry


def find_part(part: PackPart) -> Path | None:
    """The installed file of `part`, or None if its package or the file is absent."""
    for package_dir in _package_dirs(part.package):
        candidate = package_dir / part.relpath
        if candidate.is_file():
            return candidate
    return None


def installed_parts(pack: ModelPack) -> list[Path]:
    """Paths of every part, in order; raises PackNotInstalledError naming what is missing."""
    paths, missing = [], []
    for part in pack.parts:
        path = find_part(part)
        if path is not None:
            paths.append(path)
        elif _package_dirs(part.package):
            missing.append(f"{part.relpath} missing from installed package {part.package}")
        else:
            missing.append(f"package {part.package} not found")
    if missing:
        raise PackNotInstalledError(pack.name, missing, pack.install_command)
    return paths


def resolve_pack(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    registry: PackRegistry = BUILTIN_PACKS,
    force_verify: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Path of the complete, sha256-verified `.gguf` of pack `name`.

    cache_dir: where assembled files and hash records live (default `default_cache_dir()`).
    force_verify: rehash even if a hash record with a matching stamp exists.
    progress: called as progress(bytes_done, bytes_total) while hashing or assembling.
    """
    pack = registry.get(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    parts = installed_parts(pack)
    records = HashRecords(cache)
    if pack.is_single_file:
        digest = records.sha256(parts[0], force=force_verify, progress=progress)
        if digest != pack.sha256:
            raise PackCorruptedError(pack.name, str(parts[0]), pack.sha256, digest, pack.install_command)
        return parts[0]
    return _assemble(pack, parts, cache, records, force_verify, progress)


def _assemble(
    pack: ModelPack,
    parts: list[Path],
    cache: Path,
    records: HashRecords,
    force_verify: bool,
    progress: Progress | None,
) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / pack.filename
    with file_lock(cache / f".{pack.filename}.lock"):
        if final.exists():
            if _assembled_ok(pack, parts, final, records, force_verify, progress):
                return final
            final.unlink()
        for stale in cache.glob(f".{pack.filename}.*.partial"):
            stale.unlink(missing_ok=True)
        _write_verified(pack, parts, final, records, progress)
    return final


def _assembled_ok(
    pack: ModelPack,
    parts: list[Path],
    final: Path,
    records: HashRecords,
    force_verify: bool,
    progress: Progress | None,
) -> bool:
    if final.stat().st_size != sum(p.stat().st_size for p in parts):
        return False  # cheap: no need to hash a file of the wrong length
    return records.sha256(final, force=force_verify, progress=progress) == pack.sha256


def _write_verified(
    pack: ModelPack, parts: list[Path], final: Path, records: HashRecords, progress: Progress | None
) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{pack.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        total = sum(p.stat().st_size for p in parts)
        done = 0
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != pack.sha256:
            described = "the concatenation of " + ", ".join(str(p) for p in parts)
            raise PackCorruptedError(pack.name, described, pack.sha256, actual, pack.install_command)
        stamp = FileStamp.of(tmp)  # rename keeps size, mtime and inode
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)
    records.store(final, stamp, actual)


def _fsync_dir(path: Path) -> None:
    # makes the rename itself durable; some filesystems refuse to open directories
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _package_dirs(package: str) -> list[Path]:
    spec = _find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        # the import system caches directory listings; a package installed after this process
        # first looked would stay invisible without a cache refresh
        importlib.invalidate_caches()
        spec = _find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(loc) for loc in spec.submodule_search_locations]


def _find_spec(package: str):
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):  # ValueError: in sys.modules with __spec__ None
        return None

"""What is installed: one PackStatus per known pack, cheap unless asked to verify."""
from __future__ import annotations

import enum
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from specinfer.packs.errors import PackNotInstalledError
from specinfer.packs.hash_records import CHUNK_BYTES, HashRecords
from specinfer.packs.registry import BUILTIN_PACKS, ModelPack, PackRegistry
from specinfer.packs.resolve import default_cache_dir, installed_parts


class HashStatus(str, enum.Enum):
    OK = "ok"
    MISMATCH = "mismatch"
    UNCHECKED = "unchecked"  # installed, but no valid hash record and verify=False
    NOT_INSTALLED = "not installed"


@dataclass(frozen=True)
class PackStatus:
    name: str
    installed: bool  # every part present
    size_bytes: int | None  # total of the installed parts; None when not installed
    hash_status: HashStatus
    path: Path | None  # the usable file: in site-packages, or assembled in the cache; else None
    missing: tuple[str, ...]  # what is not installed, one entry per missing part
    install_command: str


def list_packs(
    *,
    verify: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    registry: PackRegistry = BUILTIN_PACKS,
) -> list[PackStatus]:
    """Status of every pack in `registry`, in table order.

    verify=False reads only file sizes and hash records: "ok"/"mismatch" when a record with a
    matching stamp exists, "unchecked" otherwise. verify=True hashes what has no valid record
    (a multi-part pack not yet assembled is hashed part by part, without writing anything).
    """
    records = HashRecords(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    return [_status(pack, records, verify) for pack in registry.packs]


def _status(pack: ModelPack, records: HashRecords, verify: bool) -> PackStatus:
    try:
        parts = installed_parts(pack)
    except PackNotInstalledError as e:
        return PackStatus(pack.name, False, None, HashStatus.NOT_INSTALLED, None, e.missing, pack.install_command)
    size = sum(p.stat().st_size for p in parts)
    if pack.is_single_file:
        path: Path | None = parts[0]
    else:
        assembled = records.cache_dir / pack.filename
        path = assembled if assembled.is_file() else None
    if path is not None:
        digest = records.sha256(path) if verify else records.lookup(path)
    elif verify:
        digest = _concatenation_digest(parts)
    else:
        digest = None
    if digest is None and pack.size_bytes is not None and size != pack.size_bytes:
        hash_status = HashStatus.MISMATCH  # wrong length: no need to hash to know
    elif digest is None:
        hash_status = HashStatus.UNCHECKED
    else:
        hash_status = HashStatus.OK if digest == pack.sha256 else HashStatus.MISMATCH
    return PackStatus(pack.name, True, size, hash_status, path, (), pack.install_command)


def _concatenation_digest(parts: list[Path]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        with open(part, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()

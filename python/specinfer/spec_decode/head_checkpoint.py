"""Reading and writing draft-head checkpoints (MLP speculator, Medusa, EAGLE): config.json plus
tensors in safetensors (single, sharded with an index) or a torch pickle (`*.pt`, `*.bin`).

`TensorSet` hands tensors out by name with a checked shape and refuses, naming the tensor, a
missing one, a wrong shape, or any tensor left unused at the end: nothing in a checkpoint is
silently dropped (vLLM drops Medusa/EAGLE biases and a missing d2t without a word).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def read_config(path: Path, what: str) -> dict:
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"speculative.model {str(path)!r}: no config.json (expected a {what} checkpoint)")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e


def _safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except Exception as e:  # SafetensorError is an Exception subclass
            raise ValueError(f"{file}: corrupted or truncated safetensors file ({type(e).__name__}: {e})") from e
    return out


def read_tensors(path: Path, candidates: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], Path]:
    """The tensors of the first existing file among `candidates` (a `*.index.json` names shards)."""
    path = Path(path)
    for name in candidates:
        file = path / name
        if not file.exists():
            continue
        if name.endswith(".index.json"):
            index = json.loads(file.read_text())
            shards = sorted(set(index.get("weight_map", {}).values()))
            return _safetensors([path / s for s in shards]), file
        if name.endswith(".safetensors"):
            return _safetensors([file]), file
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{file}: expected a state dict of tensors, got {type(state).__name__}")
        return dict(state), file
    raise FileNotFoundError(f"speculative.model {str(path)!r}: no weights file (looked for {list(candidates)})")


class TensorSet:
    """Named tensors of one checkpoint file, handed out once each with a checked shape."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: Path, *, dtype, device, prefix: str = ""):
        """prefix: what the file puts before every name (stripped in `tensors`, restored in errors)."""
        self.tensors, self.source, self.dtype, self.device = dict(tensors), source, dtype, device
        self.prefix = prefix
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...], *, dtype=None) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.source}: missing tensor {self.prefix + name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.source}: tensor {self.prefix + name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return t.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def take_tied_copy(self, name: str, like: torch.Tensor, tied_to: str) -> None:
        """A tied checkpoint may store each tied tensor again: it must equal the one it is tied to."""
        if name not in self.tensors:
            return
        t = self.take(name, tuple(like.shape))
        if not torch.equal(t, like):
            raise ValueError(f"{self.source}: tensor {self.prefix + name!r} differs from {self.prefix + tied_to!r} although the config ties them")

    def finish(self) -> None:
        unused = sorted(self.prefix + n for n in set(self.tensors) - self.used)
        if unused:
            more = f" (and {len(unused) - 5} more)" if len(unused) > 5 else ""
            raise ValueError(f"{self.source}: unexpected tensors {unused[:5]}{more}: the loader would ignore them")


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor], file: str) -> None:
    """config.json + one safetensors file; tied tensors are stored as independent copies."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}, str(path / file))


def check_field(cfg: dict, name: str, want, source: str) -> None:
    if cfg.get(name) != want:
        raise ValueError(f"{source}: config field {name!r} is {cfg.get(name)!r}, but the target has {want!r}")

"""The serving load benchmark's configuration (`specinfer bench serve-load --out DIR`): N concurrent
streaming clients against `specinfer serve`, with and without speculation. Frozen, validated,
loaded from a preset (`LOAD_PRESETS`) or a JSON file whose "kind" is "serve_load"."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

KIND = "serve_load"


@dataclass(frozen=True)
class LoadMethod:
    """One server configuration: `speculative` is a SpeculativeConfig dict (None: no speculation)."""
    name: str
    speculative: dict | None = None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError("method.name must be a non-empty string")
        if self.speculative is not None and not isinstance(self.speculative, dict):
            raise ValueError(f"method {self.name!r}: speculative must be a dict or null")


@dataclass(frozen=True)
class LoadConfig:
    name: str
    model: str  # target: pack name, HF directory or .gguf file
    methods: tuple[LoadMethod, ...]
    concurrency: tuple[int, ...] = (1, 8, 32)  # simultaneous streaming clients, one level each
    requests_per_client: int = 4  # each client sends these back to back (a closed loop)
    tasks: tuple[str, ...] = ("chat", "code_editing")  # prompt sets, sent as chat messages, round robin
    prompts: tuple[str, ...] | None = None  # explicit user messages instead of `tasks`
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    repeats: int = 2  # methods interleaved: A B A B ...
    dtype: str = "float32"
    threads: int | None = None  # the server's torch threads (None: torch's choice)
    server_args: tuple[str, ...] = ()  # more `specinfer serve` flags, e.g. ("--max-num-seqs", "32")
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    warmup: bool = True
    notes: str = ""

    def __post_init__(self):
        if not self.methods:
            raise ValueError("config.methods is empty")
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"config.methods has duplicate names: {names}")
        for key in ("requests_per_client", "max_tokens", "repeats"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"config.{key} must be an integer >= 1 (got {v!r})")
        if not self.concurrency or any(not isinstance(c, int) or isinstance(c, bool) or c < 1
                                       for c in self.concurrency):
            raise ValueError(f"config.concurrency must be integers >= 1 (got {self.concurrency!r})")
        if self.prompts is not None and (not self.prompts or not all(isinstance(p, str) and p for p in self.prompts)):
            raise ValueError("config.prompts must be non-empty strings")
        if self.prompts is None and not self.tasks:
            raise ValueError("config.tasks is empty (and no config.prompts)")
        if not self.temperature >= 0:
            raise ValueError(f"config.temperature must be >= 0 (got {self.temperature!r})")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"config.threads must be an integer >= 1 or null (got {self.threads!r})")
        if not all(isinstance(a, str) for a in self.server_args):
            raise ValueError("config.server_args must be strings")

    @property
    def baseline(self) -> LoadMethod | None:
        return next((m for m in self.methods if m.speculative is None), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = KIND
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoadConfig":
        if not isinstance(d, dict):
            raise ValueError("a load benchmark config must be a JSON object")
        d = {k: v for k, v in d.items() if k != "kind"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown keys {unknown}; known: {sorted(known)}")
        if "name" not in d or "model" not in d:
            raise ValueError("config needs 'name' and 'model'")
        methods = []
        for m in d.get("methods", ()):
            if not isinstance(m, dict):
                raise ValueError(f"config.methods entries must be objects (got {m!r})")
            bad = sorted(set(m) - {"name", "speculative"})
            if bad:
                raise ValueError(f"method {m.get('name')!r} has unknown keys {bad}; known: ['name', 'speculative']")
            methods.append(LoadMethod(**m))
        d["methods"] = tuple(methods)
        for key in ("concurrency", "tasks", "prompts", "server_args"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


LOAD_PRESETS: dict[str, dict] = {
    "serve-load": dict(
        name="serve-load", model="smollm2-135m", concurrency=(1, 8, 32), requests_per_client=4,
        tasks=("chat", "code_editing"), max_tokens=128, repeats=2, threads=1,
        server_args=("--max-num-seqs", "32"),
        methods=[dict(name="no-spec"),
                 dict(name="ngram-k4", speculative={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 4})],
        notes="N concurrent streaming chat clients against `specinfer serve` on SmolLM2-135M, with and "
              "without n-gram speculation: requests/s, output tokens/s, TTFT and TPOT percentiles as the "
              "clients measure them; every request completes or is refused with a status; no block leaks"),
}


def is_load_config(name_or_path) -> bool:
    """Whether `specinfer bench` should hand this config to the load benchmark."""
    if isinstance(name_or_path, dict):
        return name_or_path.get("kind") == KIND
    if str(name_or_path) in LOAD_PRESETS:
        return True
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".json":
        try:
            return json.loads(path.read_text(encoding="utf-8")).get("kind") == KIND
        except (json.JSONDecodeError, AttributeError, OSError):
            return False
    return False


def load_load_config(name_or_path, **overrides) -> LoadConfig:
    """A preset name, a JSON file or a dict; `overrides` (not None) replace top-level keys."""
    if isinstance(name_or_path, dict):
        d = dict(name_or_path)
    elif str(name_or_path) in LOAD_PRESETS:
        d = dict(LOAD_PRESETS[str(name_or_path)])
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"{name_or_path!r} is neither a load preset ({sorted(LOAD_PRESETS)}) nor a JSON file")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    d.update({k: v for k, v in overrides.items() if v is not None})
    return LoadConfig.from_dict(d)

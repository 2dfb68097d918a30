"""The GGUF file a llama.cpp peer runs: the model's own file ("pack"), or an f32 / f16 GGUF
converted once from the HF export of the same weights by llama.cpp's `convert_hf_to_gguf.py`,
or llama.cpp's own Q8_0 quantized once from that f32 file (`llama_model_quantize`). Made files
are cached under ~/.cache/specinfer/bench/gguf/ as `<model stem>.<type>.gguf`.

Nothing here is faked: when a file cannot be made (no converter, conversion failed, llama_cpp
missing) the peer is recorded as unavailable with the reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specinfer.bench.peers import PeerUnavailable

CONVERT_ENV = "SPECINFER_BENCH_LLAMA_CPP_CONVERT"


def cache_dir() -> Path:
    return Path.home() / ".cache" / "specinfer" / "bench" / "gguf"


def model_file(model: str) -> str:
    """The model's own file or directory (a pack name resolved, a path kept)."""
    if os.path.exists(model):
        return model
    from specinfer.packs import resolve_pack

    return str(resolve_pack(model))


def gguf_path(model: str, gguf_type: str) -> Path:
    """Where the `gguf_type` file of `model` lives (made or not)."""
    stem = Path(model_file(model)).name
    stem = stem[:-len(".gguf")] if stem.endswith(".gguf") else stem
    return cache_dir() / f"{stem}.{gguf_type}.gguf"


def resolve_gguf(model: str, gguf_type: str, *, convert_script: str | None = None, threads: int = 1,
                 log=lambda msg: None) -> str:
    """The GGUF file for (model, gguf_type), made and cached if needed."""
    if model.endswith(".gguf") and gguf_type == "pack":
        return model_file(model)
    if gguf_type == "pack":
        path = model_file(model)
        if not path.endswith(".gguf"):
            raise PeerUnavailable(f"gguf_type 'pack' needs a .gguf model file ({path} is not one)")
        return path
    out = gguf_path(model, gguf_type)
    if out.is_file():
        return str(out)
    if gguf_type in ("f32", "f16"):
        _convert(model, gguf_type, out, convert_script, log)
    elif gguf_type == "q8_0":
        source = resolve_gguf(model, "f32", convert_script=convert_script, threads=threads, log=log)
        quantize(source, str(out), "q8_0", threads=threads, log=log)
    else:
        raise PeerUnavailable(f"gguf_type {gguf_type!r} is unknown")
    return str(out)


def _convert(model: str, outtype: str, out: Path, convert_script: str | None, log) -> None:
    script = convert_script or os.environ.get(CONVERT_ENV)
    if not script:
        raise PeerUnavailable(
            f"no {outtype} GGUF at {out} and no converter: set {CONVERT_ENV} (or the config's llama_cpp_convert) "
            "to llama.cpp's convert_hf_to_gguf.py (vendor/llama.cpp/ in the llama-cpp-python sdist)")
    if not os.path.isfile(script):
        raise PeerUnavailable(f"llama_cpp_convert {script!r} is not a file")
    from specinfer.bench.peers.vllm import export_hf_dir

    hf_dir = export_hf_dir(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    env = dict(os.environ)
    gguf_py = os.path.join(os.path.dirname(os.path.abspath(script)), "gguf-py")
    env["PYTHONPATH"] = gguf_py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, script, hf_dir, "--outtype", outtype, "--outfile", str(tmp)]
    log(f"[bench] making {out.name}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise PeerUnavailable(f"convert_hf_to_gguf.py failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    os.replace(tmp, out)


FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def quantize(source: str, out: str, gguf_type: str, *, threads: int = 1, log=lambda msg: None) -> None:
    """llama.cpp's own quantizer (what `llama-quantize` runs), through llama-cpp-python."""
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[gguf_type])
    params.nthread = threads
    tmp = out + ".partial"
    log(f"[bench] making {os.path.basename(out)}: llama_model_quantize({source}, {gguf_type})")
    rc = llama_cpp.llama_model_quantize(source.encode(), tmp.encode(), params)
    if rc != 0 or not os.path.isfile(tmp):
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise PeerUnavailable(f"llama_model_quantize({source}, {gguf_type}) failed with {rc}")
    os.replace(tmp, out)


def import_llama_cpp():
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        raise PeerUnavailable(f"llama_cpp is not importable in this environment ({type(e).__name__}: {e}); "
                              "install llama-cpp-python (docs/benchmarking.md, 'Set-up (once)')") from None
    return llama_cpp

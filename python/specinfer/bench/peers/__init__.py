"""The peers a benchmark compares specinfer with, one module each: HF transformers (hf.py), vLLM
(vllm.py, in its own Python through vllm_worker.py), llama.cpp through llama-cpp-python
(llama_cpp.py, GGUF files from gguf_files.py). Each loads lazily and raises PeerUnavailable when
its engine is not installed here."""


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (not installed, unsupported mode); recorded, never faked."""

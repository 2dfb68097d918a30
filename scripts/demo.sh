#!/usr/bin/env bash
# The main job: set up, then speculative decoding on the real SmolLM2-135M, side by side with
# plain decoding (greedy outputs are checked to be identical).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m specinfer demo "$@"

#!/usr/bin/env bash
# The test command: set up, then the Rust core's tests, then the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test -p specinfer_scheduler -p specinfer_kernels --release --quiet
python3 -m pytest -q -p no:cacheprovider --durations=25 "$@"

#!/usr/bin/env bash
# The one prepared CUDA device check of issue 10 (< 10 minutes on one H200). Run from anywhere:
#
#   OUT=/some/dir bash benches/device/check.sh
#
# The device machine has torch, triton, transformers and pytest but not specinfer: this installs
# specinfer's abi3 wheel and gguf from the wheels carried in .whl/ (gitignored; build them as
# docs/lab/2026-12-notebook.md "Device check" says), then runs
#   1. the gpu-marked tests (engine on CUDA vs the CPU reference for every proposer x scorer,
#      seeded sampling on the device, Triton vs torch_ref at realistic sizes, CUDA-graph replay
#      == eager, the gpu_memory_utilization budget) and the Triton kernels' own CUDA test;
#   2. benches/device/throughput.py: decode tokens/s vs HF transformers, CUDA graphs vs eager,
#      speculative speedups, on a random Llama built on the device; per step the target's device
#      time (CUDA events) and the bubble beside it, for the overlapped and the serial step loop.
# Everything lands under $OUT: pip.log, nvidia-smi.txt, gpu_tests.log/.xml, triton_cuda.log,
# throughput.log and throughput.json, summary.txt. A failing step is recorded and the next runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/bench_out_device}"
mkdir -p "$OUT"
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }

step "machine"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/summary.txt"

step "install specinfer + gguf from .whl/"
if ! ls .whl/specinfer-*.whl > /dev/null 2>&1; then
    echo "no .whl/specinfer-*.whl: build the wheels first (docs/lab/2026-12-notebook.md, Device check)" | tee -a "$OUT/summary.txt"
    exit 2
fi
# --no-deps: the machine already has torch/numpy/safetensors/tokenizers/tqdm/jinja2 (via torch and
# transformers) and cannot reach an index; gguf is imported only to load .gguf files
if ! python3 -m pip install --no-index --no-deps --force-reinstall .whl/specinfer-*.whl .whl/gguf-*.whl \
        > "$OUT/pip.log" 2>&1; then
    # a read-only or pip-less environment: a wheel is a zip, unpack it onto PYTHONPATH instead
    echo "pip install failed (see pip.log); unpacking the wheels into $OUT/site" | tee -a "$OUT/summary.txt"
    mkdir -p "$OUT/site"
    for w in .whl/specinfer-*.whl .whl/gguf-*.whl; do
        python3 -m zipfile -e "$w" "$OUT/site" || { echo "cannot unpack $w" | tee -a "$OUT/summary.txt"; exit 3; }
    done
    export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# run the tests against the installed wheel, not a source tree
python3 -c "import specinfer, specinfer._core, specinfer.kernels.triton; print('specinfer from', specinfer.__file__)" \
    2>&1 | tee -a "$OUT/summary.txt"

step "gpu tests (tests/test_gpu.py -m gpu)"
# a per-test limit where pytest-timeout is installed (the device image has it): one hung kernel
# compile must not eat the other tests' time
per_test=$(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout=100)
env -u TRITON_INTERPRET timeout 200 python3 -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -rA $per_test \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
rc=$?; tail -n 15 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"; [ $rc -eq 0 ] || status=1

step "Triton kernels on CUDA (tests/test_triton_attention.py::test_triton_backend_on_cuda)"
timeout 45 python3 -m pytest "tests/test_triton_attention.py::test_triton_backend_on_cuda" -m gpu -q \
    -p no:cacheprovider > "$OUT/triton_cuda.log" 2>&1
rc=$?; tail -n 3 "$OUT/triton_cuda.log" | tee -a "$OUT/summary.txt"; [ $rc -eq 0 ] || status=1

step "throughput (benches/device/throughput.py)"
env -u TRITON_INTERPRET timeout 330 python3 benches/device/throughput.py --out "$OUT" > "$OUT/throughput.log" 2>&1
rc=$?; grep '^{"batch"' "$OUT/throughput.log" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || { status=1; echo "throughput exit $rc:" | tee -a "$OUT/summary.txt"; tail -n 5 "$OUT/throughput.log" | tee -a "$OUT/summary.txt"; }

step "done: status $status"
exit $status

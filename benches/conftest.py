import os
import sys
from pathlib import Path

# The repository root holds kernels/ (packed into the wheel as specinfer.kernels). On sys.path, as
# `python -m pytest` from the root puts it, it would shadow the PyPI package `kernels` that
# transformers (>= 5.2x) imports with its models: keep the root off the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
THREADS = int(os.environ.get("SPECINFER_BENCH_THREADS", "1"))
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def bench_threads():
    return THREADS

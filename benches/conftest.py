import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
THREADS = int(os.environ.get("SPECINFER_BENCH_THREADS", "1"))
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def bench_threads():
    return THREADS

import os
import sys

# `python -m specinfer` puts the working directory first on sys.path. Run from a checkout of this
# repository, its kernels/ folder (packed into the wheel as specinfer.kernels) would shadow the
# PyPI package `kernels` that transformers imports (the bench's HF peers, train-heads' reference
# checks): keep the checkout's root off the path; specinfer itself is imported as installed.
_cwd = os.path.abspath(os.curdir)
if os.path.isfile(os.path.join(_cwd, "kernels", "triton", "paged_attention.py")):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _cwd]

from specinfer.cli import main  # noqa: E402

raise SystemExit(main())

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

# Without a GPU the Triton kernels run under the interpreter. It is read when triton is first
# imported, which `import specinfer` can already do (llguidance, torch inductor): set it here,
# before any test module imports either, so test files run alone or in any order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
# tiny test models gain nothing from threads, and OpenMP spin-waits collapse on a busy 2-core box
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A cache of tiny random models by (arch, tied, seed): built once per session."""
    from tiny_models import build_tiny_model

    cache = {}

    def get(arch="llama", tied=False, seed=0, **kw):
        key = (arch, tied, seed, tuple(sorted(kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}_{'tied' if tied else 'untied'}_{seed}")
            model = build_tiny_model(path, arch, tied=tied, seed=seed, **kw)
            cache[key] = (path, model)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def target_and_draft(tiny_dir, tmp_path_factory):
    """The tiny llama target and a slightly perturbed copy of it as a draft (agrees with the
    target often but not always): (target_dir, draft_dir), built once per session."""
    from tiny_models import build_tiny_model

    target, _ = tiny_dir("llama", False)
    draft = tmp_path_factory.mktemp("perturbed_draft")
    build_tiny_model(draft, "llama", base=target, perturb=0.004)
    return target, draft


@pytest.fixture(scope="module")
def target(tiny_dir):
    """The tiny llama target most proposer tests draft for (a test module may define its own)."""
    return tiny_dir("llama", False)[0]


@pytest.fixture(scope="module")
def ref(target):
    """The target's greedy outputs for spec_cases' prompts: (prompts, token ids)."""
    from spec_cases import reference

    return reference(target)


@pytest.fixture(scope="session")
def law_models(tmp_path_factory):
    """The distribution tests' tiny-vocabulary target and perturbed draft (tests/engine_law.py):
    (target_dir, draft_dir, target transformers model), built once per session."""
    from engine_law import build_law_models

    return build_law_models(tmp_path_factory)


@pytest.fixture(scope="session")
def exact_law(law_models):
    """P(t0, t1, t2 | PROMPT) of the law target at temperature 1, float64 (transformers)."""
    from engine_law import exact_law_of

    return exact_law_of(law_models[2])


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt for this test, however the suite was started: a shell's
    background job (a CI script's `cmd &`) starts with SIGINT ignored, and Python then installs no
    handler, so a test sending itself SIGINT would see nothing happen."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)

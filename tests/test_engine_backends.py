"""The whole engine through each attention backend on CPU: the Rust kernel (cpu_native), the Triton
kernels (TRITON_INTERPRET=1) and the Gaudi flat attention (hpu_flat) give exactly torch_ref's greedy tokens for plain decoding,
chunked prefill, preemption, both proposers and both scorers, and the same seeded samples.

The interpreter is slow (about 0.2 s per step on the tiny model): the default suite runs one
representative case per feature on few tokens; the full matrix is marked slow."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import pytest  # noqa: E402
import torch  # noqa: E402

from specinfer import Generator, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SEEDED = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def models(target_and_draft):
    target, draft = target_and_draft
    return str(target), str(draft)


def _prompts(n):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(base + base[:3] + base)  # repeats: the n-gram proposer finds matches
    return out


# (block size, token budget, KV blocks): chunked prefill with a pool small enough to preempt; roomy
TIGHT, ROOMY = (4, 16, 24), (16, 256, 64)


TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # a static token tree (Medusa-choices paths)


def _spec(method, draft, k, scorer, tree=None):
    if method is None:
        return None
    s = {"method": method, "num_speculative_tokens": k, "scorer": scorer}
    if tree is not None:
        s["token_tree"] = tree
    if method == "draft_model":
        s["model"] = draft
    else:
        s["prompt_lookup_min"], s["prompt_lookup_max"] = 1, 3
    return s


def _run(models, backend, setting, method=None, scorer="mqa", k=3, params=GREEDY, n=4, tree=None):
    target, draft = models
    bs, budget, blocks = setting
    gen = Generator(target, attention_backend=backend, block_size=bs, max_num_batched_tokens=budget,
                    num_kv_blocks=blocks, max_model_len=96, speculative=_spec(method, draft, k, scorer, tree))
    outs = gen.generate(_prompts(n), params, use_tqdm=False)
    core = gen.engine.core
    assert core.num_free_blocks() == core.num_total_blocks()
    return [o.token_ids for o in outs], gen


@pytest.fixture(scope="module")
def reference(models):
    return {s: _run(models, "torch_ref", s)[0] for s in (TIGHT, ROOMY)}


CASES = [  # (method, scorer, setting): the default suite's representative cases
    (None, "mqa", TIGHT),  # plain decoding, chunked prefill, preemption
    ("ngram", "mqa", TIGHT),
    ("draft_model", "batch_expansion", ROOMY),
]
SLOW_CASES = [(m, s, st) for m in ("ngram", "draft_model") for s in ("mqa", "batch_expansion")
              for st in (TIGHT, ROOMY) if (m, s, st) not in CASES]


def _check(models, reference, backend, method, scorer, setting):
    got, gen = _run(models, backend, setting, method, scorer)
    assert got == reference[setting], (backend, method, scorer, setting)
    if method is not None:
        assert gen.spec_metrics()["num_draft_tokens"] > 0
    return gen


@pytest.mark.parametrize("method,scorer,setting", CASES)
@pytest.mark.parametrize("backend", ["cpu_native", "triton", "hpu_flat"])
def test_greedy_equals_torch_ref(models, reference, backend, method, scorer, setting):
    gen = _check(models, reference, backend, method, scorer, setting)
    assert gen.engine.runner.backend.name == backend
    if setting == TIGHT and method is None:
        assert gen.engine.core.stats()["num_preemptions"] > 0, "the tight pool should preempt"


@pytest.mark.slow
@pytest.mark.parametrize("method,scorer,setting", SLOW_CASES)
@pytest.mark.parametrize("backend", ["cpu_native", "triton", "hpu_flat"])
def test_greedy_equals_torch_ref_full_matrix(models, reference, backend, method, scorer, setting):
    _check(models, reference, backend, method, scorer, setting)


@pytest.mark.parametrize("backend", ["cpu_native", "triton", "hpu_flat"])
def test_seeded_sampling_equals_torch_ref(models, backend):
    want, _ = _run(models, "torch_ref", ROOMY, "draft_model", params=SEEDED, n=3)
    got, _ = _run(models, backend, ROOMY, "draft_model", params=SEEDED, n=3)
    assert got == want


def test_unknown_or_unsupported_backend_is_refused(models):
    target, _ = models
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        Generator(target, attention_backend="flash", num_kv_blocks=16)
    with pytest.raises(ValueError, match="attention_backend='torch_ref' does not run on hpu-emulated"):
        Generator(target, device="hpu-emulated", attention_backend="torch_ref", num_kv_blocks=16)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from specinfer.platform import CpuPlatform

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        CpuPlatform().choose_attention_backend("triton")


@pytest.mark.parametrize("backend,scorer,setting", [
    ("cpu_native", "mqa", TIGHT), ("cpu_native", "batch_expansion", ROOMY), ("triton", "mqa", ROOMY),
    ("hpu_flat", "mqa", TIGHT), ("hpu_flat", "batch_expansion", ROOMY)])
def test_token_trees_greedy_equal_torch_ref(models, reference, backend, scorer, setting, monkeypatch):
    """Token trees (target and draft forwards with tree masks) through each backend: greedy tokens
    equal plain decoding's; the tight setting cuts trees by the token budget and preempts."""
    from specinfer.attention import get_backend

    cls, branching = type(get_backend(backend)), []
    prepare = cls.prepare

    def spy(self, meta):  # a chain's masks are 2^(i+1) - 1; a branching tree has others
        if meta.has_tree:
            branching.append(any(m and m & (m + 1) for m in meta.tree_mask.tolist()))
        return prepare(self, meta)

    monkeypatch.setattr(cls, "prepare", spy)
    got, gen = _run(models, backend, setting, "draft_model", scorer, tree=TREE)
    assert got == reference[setting], (backend, scorer, setting)
    assert gen.engine.runner.backend.name == backend
    assert any(branching), "no branching tree reached the backend"

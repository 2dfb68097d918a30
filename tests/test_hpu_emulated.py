"""The Gaudi execution model on CPU (`device="hpu-emulated"`): static token buckets padded by the
Rust packer, inert padded rows writing only the null block, all-flat block-list attention, a
warm-up plan after which serving meets no new shape, speculation length among warmed lengths only.
Outputs are token-for-token torch_ref's."""
import numpy as np
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer._core import SchedulerCore
from specinfer.attention import ForwardContext
from specinfer.platform import HpuEmulatedPlatform

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def models(target_and_draft):
    target, draft = target_and_draft
    return str(target), str(draft)


def _prompts(n, seed=5, longest=30):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(3, 256, (int(torch.randint(2, longest, (1,), generator=g)),), generator=g).tolist()
        out.append(base + base[:4] + base)
    return out


def _spec(method, draft, k=3, scorer="mqa"):
    if method is None:
        return None
    s = {"method": method, "num_speculative_tokens": k, "scorer": scorer}
    if method == "draft_model":
        s["model"] = draft
    else:
        s["prompt_lookup_min"], s["prompt_lookup_max"] = 1, 3
    return s


# chunked prefill (16-token budget), 4-token blocks, a pool small enough to preempt
ENGINE = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=28, max_model_len=96, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(models):
    target, _ = models
    gen = Generator(target, **ENGINE)
    return [o.token_ids for o in gen.generate(_prompts(8), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,scorer", [(None, "mqa"), ("ngram", "mqa"), ("ngram", "batch_expansion"),
                                           ("draft_model", "mqa"), ("draft_model", "batch_expansion")])
def test_greedy_equals_torch_ref(models, reference, method, scorer):
    target, draft = models
    gen = Generator(target, device="hpu-emulated", speculative=_spec(method, draft, scorer=scorer), **ENGINE)
    outs = gen.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    eng = gen.engine
    assert eng.platform.name == "hpu-emulated" and eng.runner.backend.multi_token_path == "flat"
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    assert eng.core.stats()["num_preemptions"] > 0
    assert [r.shapes.cold for r in eng.platform.runners] == [set()] * len(eng.platform.runners)  # all warmed
    assert eng.runner.device_ops.num_mark_steps > 0  # the Gaudi path's lazy-mode marks were issued
    if method is not None:
        assert gen.spec_metrics()["num_draft_tokens"] > 0
        assert eng.num_mixed_steps > 0, "no step mixed prefill chunks with verification runs"


def test_seeded_sampling_equals_torch_ref(models):
    target, draft = models
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    spec = _spec("draft_model", draft)
    want = Generator(target, speculative=spec, **ENGINE).generate(_prompts(4), params, use_tqdm=False)
    got = Generator(target, device="hpu-emulated", speculative=spec, **ENGINE).generate(_prompts(4), params,
                                                                                         use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def _shape_key(args) -> tuple:
    """Every tensor shape the model's forward receives: the ids, positions and attention metadata."""
    shapes = [tuple(args[0].shape), tuple(args[1].shape)]

    def walk(x):
        if isinstance(x, torch.Tensor):
            shapes.append(tuple(x.shape))
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name))
        elif isinstance(x, int):
            shapes.append(x)

    walk(args[2].metadata)
    return tuple(shapes)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_new_shapes_after_warmup_over_a_long_mixed_workload(models, method):
    """A hook on every module call (installed before the engine exists, so it sees the warm-up
    too) records the shapes each forward receives, target's and draft's; serving 40 requests of
    mixed lengths, with chunked prefill, verification and finishing requests, adds none to what
    the warm-up saw."""
    target, draft = models
    seen: list[tuple[int, tuple]] = []

    def hook(module, args):
        if len(args) == 3 and isinstance(args[2], ForwardContext):
            seen.append((id(module), _shape_key(args)))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        gen = Generator(target, device="hpu-emulated", block_size=4, max_num_batched_tokens=32, num_kv_blocks=200,
                        max_model_len=128, max_num_seqs=8, speculative=_spec(method, draft, k=4))
        warmed = set(seen)
        num_warm = len(seen)
        prompts = _prompts(40, seed=11, longest=50)
        params = [SamplingParams(max_tokens=4 + (7 * i) % 25, temperature=0.0, ignore_eos=True) for i in range(40)]
        for i in range(0, 40, 10):  # arrivals in waves: batches grow, shrink and mix phases
            gen.generate(prompts[i:i + 10], params[i:i + 10], use_tqdm=False)
    finally:
        handle.remove()
    served = seen[num_warm:]
    assert len(served) > 50 and len(set(served)) > 5  # a real workload over many shapes
    assert set(served) - warmed == set()
    models_seen = {mid for mid, _ in served}
    assert id(gen.engine.loaded.model) in models_seen and len(models_seen) == (2 if method == "draft_model" else 1)
    runner = gen.engine.runner
    assert runner.shapes.cold == set() and len(runner.shapes.served) > 5
    assert gen.engine.num_mixed_steps > 0
    assert 0 < runner.padding_waste() < 1.0  # padded / real tokens


def test_speculation_length_is_chosen_among_warmed_lengths(models, reference):
    """With k = 4 wanted but only 0, 1, 2 warmed, every proposal has at most 2 drafts, and the
    output is still exactly the target's."""
    target, draft = models
    platform = HpuEmulatedPlatform(spec_lengths=(1, 2))
    gen = Generator(target, device=platform, speculative=_spec("draft_model", draft, k=4), **ENGINE)
    assert platform.planner.config.spec_lengths == (0, 1, 2)
    most = []
    proposer = gen.engine.proposer
    propose, launch = proposer.propose, proposer.launch_proposal

    def spy(inp):
        prop = propose(inp)
        most.append(int(np.diff(prop.cu_num_draft).max(initial=0)))
        return prop

    def launch_spy(inp, job):  # (the overlapped loop launches the draft's forwards)
        prop = launch(inp, job)
        most.append(int(np.diff(prop.cu_num_draft).max(initial=0)))
        return prop

    proposer.propose, proposer.launch_proposal = spy, launch_spy
    outs = gen.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert max(most) == 2


def test_packer_pads_to_a_bucket_with_rows_that_touch_only_the_null_block():
    bs, num_blocks = 4, 20
    core = SchedulerCore(num_blocks, bs, 4, 64, 64)
    core.set_token_padding([8, 16, 64], num_blocks)
    core.add_request(0, np.arange(3, 14), 5)  # 11 tokens
    core.add_request(1, np.arange(3, 5), 5)  # 2 tokens
    out = core.schedule()
    T = out.total_num_scheduled_tokens
    assert T == 13 and len(out.input_ids) == 16  # padded to the bucket
    assert int(out.query_start_loc[-1]) == T  # padded rows belong to no sequence
    assert (np.asarray(out.slot_mapping[T:]) // bs == num_blocks).all()  # the null block, outside the pool
    assert (np.asarray(out.slot_mapping[:T]) // bs < num_blocks).all()
    assert (np.asarray(out.input_ids[T:]) == 0).all() and (np.asarray(out.positions[T:]) == 0).all()
    assert (np.asarray(out.logits_indices) < T).all()
    with pytest.raises(ValueError, match="null_block"):
        core.set_token_padding([8], num_blocks - 1)
    with pytest.raises(ValueError, match="token_buckets"):
        core.set_token_padding([8, 8], num_blocks)
    core.set_token_padding(None)
    core.update(np.array([7, 7]), np.array([0, 1, 2], dtype=np.int32))
    assert len(core.schedule().input_ids) == 2  # padding off again


def test_padding_waste_bench_reports_both_axes():
    from specinfer.bench.padding import Mix, padding_waste
    from specinfer.kernels.hpu.buckets import BucketConfig

    mix = Mix("tiny", 12, (5, 60), (5, 30), 3, 0.7)
    r = padding_waste(mix, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    assert r["steps"] > 10 and r["real_tokens"] > 0
    assert 0 < r["token_waste"] < 1 and 0 < r["block_waste"] < 1  # buckets at most double an axis
    # a bucket for every size wastes nothing: the measure can tell plans apart
    exact = BucketConfig(token_buckets=tuple(range(1, 65)), block_buckets=tuple(range(1, 64 * 32 + 1)),
                         spec_lengths=(0, 1, 2, 3))
    r0 = padding_waste(mix, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, bucket_config=exact)
    assert r0["token_waste"] == 0 and r0["block_waste"] == 0 and r0["real_tokens"] == r["real_tokens"]


def test_dense_multi_token_layout_with_a_coarse_plan(models, reference):
    """multi_token_path="dense" (prefill chunks and 1 + k runs as padded dense queries, decodes on
    the flat path): exact too, and a coarse explicit plan (tokens x flat x dense shapes) is warmed
    completely, so serving meets no cold shape."""
    from specinfer.kernels.hpu import BucketConfig

    target, _ = models
    cfg = BucketConfig(token_buckets=(16,), batch_buckets=(8,), block_buckets=(64,), context_block_buckets=(24,),
                       prefill_query_buckets=(16,), spec_lengths=(0, 1, 2, 3))
    platform = HpuEmulatedPlatform(bucket_config=cfg, multi_token_path="dense")
    gen = Generator(target, device=platform, speculative=_spec("ngram", None), **ENGINE)
    runner = gen.engine.runner
    assert len(runner.shapes.warmed) == 1 * (2 * 6 - 1) + 1  # forwards (flat | none) x (dense | none), logits
    outs = gen.generate(_prompts(8), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert runner.shapes.cold == set() and not platform.planner.cold_shapes
    assert any(len(key) == 4 for key in runner.shapes.served)  # some forward used both paths at once


@pytest.mark.hpu
def test_engine_on_gaudi_equals_the_emulation(models, reference):  # pragma: no cover - needs a Gaudi
    """The same path on a Gaudi (HPU graphs per bucket, mark_step): the emulation's tokens, fp32,
    and no shape outside the warm-up plan. Not yet run on a device."""
    import habana_frameworks.torch  # noqa: F401

    target, draft = models
    for method, scorer in [(None, "mqa"), ("ngram", "mqa"), ("draft_model", "batch_expansion")]:
        gen = Generator(target, device="hpu", dtype="float32", speculative=_spec(method, draft, scorer=scorer),
                        **ENGINE)
        outs = gen.generate(_prompts(8), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert [r.shapes.cold for r in gen.engine.platform.runners] == [set()] * len(gen.engine.platform.runners)

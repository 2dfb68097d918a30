"""batch_invariant=True (CPU): every token's logits are the same bits whatever its step holds, so
speculative output equals non-speculative output bit for bit, logprobs included (without the
option they agree only up to float noise: the logprobs differ), in float32 and bfloat16. Refused
where it cannot hold."""
import pytest
import torch

from specinfer import Generator, SamplingParams

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)


def _prompts():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 23, 31)]
    return [p + p[:6] + p if i % 2 else p for i, p in enumerate(prompts)]


def _run(path, batch_invariant, spec=None, dtype="float32"):
    gen = Generator(str(path), max_model_len=256, block_size=4, max_num_batched_tokens=32,
                    batch_invariant=batch_invariant, speculative=spec, dtype=dtype)
    outs = gen.generate(_prompts(), PARAMS, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs], gen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_logits_equal_non_speculative_bit_for_bit(tiny_dir, dtype):
    path, _ = tiny_dir("llama", False, seed=2, hidden=128, heads=4, kv_heads=2, layers=4, scale=3.0)  # head_dim 32
    want, base = _run(path, True, dtype=dtype)
    assert base.engine.runner.backend.batch_invariant
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
                 {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}):
        got, gen = _run(path, True, spec, dtype)
        assert got == want, spec["method"]  # token ids and every logprob, exactly
        assert gen.spec_metrics()["num_draft_tokens"] > 0
    # the test can fail: without the option the same runs agree in tokens but not in logprobs
    plain, _ = _run(path, False, dtype=dtype)
    plain_spec, _ = _run(path, False, {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}, dtype)
    assert [lp for _, lp in plain] != [lp for _, lp in plain_spec]


def test_refused_where_it_cannot_hold(tiny_dir):
    path, _ = tiny_dir("llama", False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Generator(str(path), batch_invariant=True, dtype="float16")
    with pytest.raises(ValueError, match="w8a8"):
        Generator(str(path), batch_invariant=True, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        Generator(str(path), batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="True or False"):
        Generator(str(path), batch_invariant="yes")
    from specinfer.cli import build_parser
    from specinfer.cli.options import engine_config

    args = build_parser().parse_args(["generate", str(path), "--prompt", "hi", "--batch-invariant"])
    assert engine_config(args, None).model.batch_invariant is True
    assert engine_config(build_parser().parse_args(["generate", str(path), "--prompt", "hi"]), None).model.batch_invariant is False

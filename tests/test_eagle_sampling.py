"""EAGLE / EAGLE-3 chains for temperature > 0 requests: each draft is sampled from the head's
distribution under the request's sampling parameters, and that distribution (q, over the target
vocabulary, zero outside EAGLE-3's draft vocabulary) goes to the rejection sampler; through the
whole engine the emitted tokens keep the target's law (chi-square, as test_engine_distribution)."""
import pytest
import torch

import head_checkpoints as hc
from eagle_reference import Eagle3Reference, EagleReference
from specinfer import Generator, SamplingParams
from spec_cases import prompts
from eagle_reference import PathLogits
from engine_law import NUM, sample_counts as _counts  # noqa: E402
from stats import ALPHA, chi_square_pvalue  # noqa: E402


def _record_q(gen):
    proposer, seen = gen.engine.proposer, []
    inner = proposer.propose

    def spy(inp):
        prop = inner(inp)
        by_id = {st.core_id: st for st in inp.requests}
        for j, cid in enumerate(prop.core_ids.tolist()):
            st = by_id[cid]
            q = None if prop.draft_probs is None else prop.draft_probs[j]
            seen.append((st.tokens_slice(0, st.num_tokens), st.params,
                         prop.draft_token_ids[prop.cu_num_draft[j]:prop.cu_num_draft[j + 1]].tolist(), q))
        return prop

    proposer.propose = spy
    return seen


def _want_q(logits, params):
    z = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(z, params.top_k).values[-1]
        z = torch.where(z < kth, torch.full_like(z, float("-inf")), z)
    return torch.softmax(z, -1)


@pytest.mark.parametrize("method", ["eagle", "eagle_draft_vocab", "eagle3"])
def test_sampled_eagle_drafts_carry_the_heads_q(tiny_dir, tmp_path, method):
    if method.startswith("eagle_") or method == "eagle":
        target = tiny_dir("llama", False)[0]
        path = hc.eagle1(tmp_path / "h", target, draft_vocab=64 if method == "eagle_draft_vocab" else None)
        method = "eagle"
        ref = EagleReference(target, path)
    else:
        target = tiny_dir("llama", False, layers=4)[0]
        path = hc.eagle3(tmp_path / "h", target, draft_vocab=96, aux_ids=[0, 1, 3])
        ref = Eagle3Reference(target, path)
    gen = Generator(str(target), block_size=4, max_model_len=128, num_kv_blocks=64, attention_backend="torch_ref",
                    speculative={"method": method, "model": str(path), "quantization": "none", "num_speculative_tokens": 3})
    seen = _record_q(gen)
    params = [SamplingParams(max_tokens=10, temperature=0.0), SamplingParams(max_tokens=10, temperature=0.7, seed=5),
              SamplingParams(max_tokens=10, temperature=1.3, top_k=7, seed=6)]
    gen.generate(prompts(5), params + params[1:], use_tqdm=False)
    sampled = [s for s in seen if s[3] is not None and s[1].temperature > 0]
    assert len(sampled) > 6
    for tokens, p, drafts, q in sampled[::4]:
        assert q.shape == (len(drafts), 256)
        for i, d in enumerate(drafts):
            want = _want_q(PathLogits(ref, tokens)(drafts[:i]), p)
            torch.testing.assert_close(q[i], want, atol=1e-5, rtol=1e-4)
            assert q[i][d] > 0
    # greedy requests in the same batches still draft the argmax (q rows one-hot for them are not needed)
    greedy = [s for s in seen if s[1].temperature == 0.0]
    for tokens, _, drafts, _ in greedy[::4]:
        assert drafts == ref.drafts(tokens, len(drafts))


@pytest.mark.slow  # ~30 s; the q test above holds the draft side exactly in the default suite
def test_sampled_eagle_keeps_the_target_distribution(law_models, exact_law, tmp_path):  # noqa: F811
    target, _, _ = law_models
    path = hc.eagle1(tmp_path / "eagle", target)
    counts, m = _counts(target, {"method": "eagle", "model": str(path), "num_speculative_tokens": 2})
    assert m["num_draft_tokens"] > NUM // 4 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert chi_square_pvalue(counts, exact_law) > ALPHA

"""logit_bias and the presence, frequency and repetition penalties: vLLM's semantics and order,
token for token against an independent reference (transformers logits, penalties applied by hand
in plain Python), with speculation on (n-gram and draft-model chains, draft-model trees, both
scorers) and through chunked prefill; sampled output keeps the penalized law (chi-square)."""
from __future__ import annotations

import pytest
import torch

from specinfer import Generator, SamplingParams
from stats import ALPHA, chi_square_pvalue

from engine_law import exact_law_of, sample_counts

PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.4,
                 logit_bias={5: 2.5, "17": -100, 40: 1.0})
N_NEW = 20


def penalize_by_hand(logits, prompt, output, p=PENALTIES):
    """The reference: OpenAI's/vLLM's definitions, one token at a time."""
    out = logits.clone().double()
    for t, b in p.get("logit_bias", {}).items():
        out[int(t)] += b
    r = p.get("repetition_penalty", 1.0)
    for t in set(prompt) | set(output):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= p.get("frequency_penalty", 0.0) * output.count(t) + p.get("presence_penalty", 0.0)
    return out


def hf_greedy_penalized(model, prompt, n, p=PENALTIES):
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(penalize_by_hand(logits, prompt, out, p).argmax()))
    return out


def _prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 23, 40, 5)]
    return [b + b[:6] + b for b in base]  # repeats: the n-gram proposer finds matches


@pytest.fixture(scope="module")
def reference(tiny_dir):
    path, hf = tiny_dir("llama", False)
    ps = _prompts()
    return path, ps, [hf_greedy_penalized(hf, p, N_NEW) for p in ps]


SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "policy": "fixed"},
    "draft_model": "draft",
    "draft_tree": "tree",
    "draft_batch_expansion": "expansion",
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_penalties_match_reference(reference, target_and_draft, name):
    path, ps, want = reference
    spec = SPECS[name]
    draft = target_and_draft[1]
    if spec == "draft":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "policy": "fixed"}
    elif spec == "tree":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                "token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}
    elif spec == "expansion":
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "policy": "fixed",
                "scorer": "batch_expansion"}
    # a 24-token budget and 4-token blocks: prompts are chunked beside verification runs
    gen = Generator(str(path), block_size=4, max_num_batched_tokens=24, max_model_len=256, speculative=spec)
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True, **PENALTIES)
    outs = gen.generate(ps, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(17 not in o.token_ids for o in outs)
    if spec is not None:  # (the penalties punish the repeats n-gram drafts bet on: few are accepted)
        m = gen.spec_metrics()
        assert m["num_draft_tokens"] > 0 and (name == "ngram" or m["num_accepted_tokens"] > 0), m


def test_penalties_change_the_output(reference, tiny_dir):
    """The reference is not the unpenalized output (the test above could not pass by accident)."""
    path, ps, want = reference
    plain = Generator(str(path), max_model_len=256).generate(
        ps, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert sum(o.token_ids != w for o, w in zip(plain, want)) >= 3


@pytest.mark.parametrize("one", ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"])
def test_each_penalty_alone(reference, one):
    path, ps, _ = reference
    p = {one: PENALTIES[one]}
    gen = Generator(str(path), max_model_len=256, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                                                "policy": "fixed"})
    outs = gen.generate(ps[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **p),
                        use_tqdm=False)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    assert [o.token_ids for o in outs] == [hf_greedy_penalized(hf, q, 12, p) for q in ps[:2]]


def test_sampled_penalties_keep_the_law(law_models):
    """Speculative sampling (draft model, sampled q) against the exact penalized law on V = 8."""
    target, draft, hf = law_models
    p = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.6, logit_bias={1: 1.5})
    law = exact_law_of(hf, lambda row, prompt, out: penalize_by_hand(row, prompt, out, p))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "policy": "fixed"}
    counts, m = sample_counts(target, spec, **p)
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0, m
    assert chi_square_pvalue(counts, law) > ALPHA
    plain = exact_law_of(hf)
    assert chi_square_pvalue(counts, plain) < ALPHA  # the penalties move the law: the test can fail


@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(n=0), "n"),
])
def test_bad_penalty_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_logit_bias_outside_the_vocabulary_is_refused(reference):
    path = reference[0]
    gen = Generator(str(path))
    with pytest.raises(ValueError, match="logit_bias.*vocabulary"):
        gen.generate([[5, 6]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_logit_bias_clamped():
    assert SamplingParams(logit_bias={3: 500, "4": -1e9}).logit_bias == {3: 100.0, 4: -100.0}

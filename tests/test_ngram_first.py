"""speculative.ngram_first: prompt lookup where a request's history repeats, the head's (or draft
model's) drafts elsewhere (spec_decode/ngram_first.py).

Exactness: greedy output equals the target's alone for EAGLE chains and trees, Medusa trees and
the MLP speculator with lookup first, through chunked prefill, mixed steps and preemption; every
lookup draft equals a naive prompt-lookup reference over the history and every head proposal is
for a history where that reference finds nothing; the EAGLE head's drafts still equal the HF
reference recomputed from the whole history (its draft KV takes in the steps lookup drafted);
sampling keeps the target's distribution (lookup's one-hot q beside the head's sampled q)."""
from __future__ import annotations

import pytest

import head_checkpoints as hc
from eagle_reference import EagleReference
from spec_cases import check_greedy_exact, prompts
from specinfer import Generator, SamplingParams
from specinfer.spec_decode.config import SpeculativeConfig
from specinfer.spec_decode.ngram_first import NgramFirstProposer
from engine_law import NUM, sample_counts as _counts  # noqa: E402
from stats import ALPHA, chi_square_pvalue  # noqa: E402

LOOKUP = {"ngram_first": True, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
TREE = [[0], [1], [0, 0], [0, 0, 0]]


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix n-gram."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[-n:]:
                return tokens[s + n:s + n + k]
    return []


@pytest.fixture
def lookup_proposers(monkeypatch):
    """Every NgramFirstProposer the test's engines build."""
    made = []
    init = NgramFirstProposer.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(NgramFirstProposer, "__init__", recording)
    return made


def _spec(case, tmp_path, target):
    if case.startswith("eagle"):
        spec = {"method": "eagle", "model": str(hc.eagle1(tmp_path / "eagle", target, repeat=True)),
                "num_speculative_tokens": 3}
        if case == "eagle_tree":
            spec["token_tree"] = TREE
    elif case == "medusa_tree":
        spec = {"method": "medusa", "model": str(hc.medusa_original(tmp_path / "medusa", target, num_heads=3)),
                "num_speculative_tokens": 3, "token_tree": TREE}
    else:
        spec = {"method": "mlp_speculator", "model": str(hc.mlp_speculator(tmp_path / "mlp", target, n_predict=3)),
                "num_speculative_tokens": 3}
    return {**spec, **LOOKUP}


@pytest.mark.parametrize("case", ["eagle_chain", "eagle_tree", "medusa_tree", "mlp_chain"])
def test_greedy_output_equals_the_target_alone(target, ref, tmp_path, lookup_proposers, case):
    tot = check_greedy_exact(target, _spec(case, tmp_path, target), ref)
    assert tot["num_accepted_tokens"] > 0, tot
    assert sum(p.num_lookup_proposals for p in lookup_proposers) > 0
    assert sum(p.num_model_proposals for p in lookup_proposers) > 0


def test_lookup_where_the_history_repeats_and_the_head_elsewhere(target, tmp_path):
    """Each proposal is lookup's (equal to the naive reference) or, where lookup finds nothing,
    the head's; the head's drafts equal the HF reference from the whole history, also after the
    steps lookup drafted, through chunked prefill, prefix hits and preemption."""
    path = hc.eagle1(tmp_path / "eagle", target)
    reference = EagleReference(target, path)
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=20, num_kv_blocks=40, max_model_len=128,
                    speculative={"method": "eagle", "model": str(path), "quantization": "none",
                                 "num_speculative_tokens": 3, "policy": "fixed", **LOOKUP})
    outer = gen.engine.proposer
    assert isinstance(outer, NgramFirstProposer)
    head_seen, all_seen = [], []

    def spy(proposer, seen):
        inner = proposer.propose

        def recording(inp):
            prop = inner(inp)
            by_id = {st.core_id: st for st in inp.requests}
            for j, cid in enumerate(prop.core_ids.tolist()):
                st = by_id[cid]
                seen.append((list(st.tokens_slice(0, st.num_tokens)),
                             prop.draft_token_ids[prop.cu_num_draft[j]:prop.cu_num_draft[j + 1]].tolist()))
            return prop

        proposer.propose = recording

    spy(outer.inner, head_seen)
    spy(outer, all_seen)
    ps = prompts(8)
    gen.generate(ps + ps, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    stats = gen.engine.core.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and gen.engine.num_mixed_steps > 0
    head_keys = {(tuple(t), tuple(d)) for t, d in head_seen}
    lookups = [(t, d) for t, d in all_seen if (tuple(t), tuple(d)) not in head_keys]
    # lookup fires where a prompt repeats its last 2-gram (half the prompts): about one proposal per such request
    assert len(lookups) > 4 and len(head_seen) > 10, (len(lookups), len(head_seen))
    for tokens, drafts in lookups:
        assert drafts and drafts == naive_lookup(tokens, 2, 4, 3)[:len(drafts)]
    for tokens, drafts in head_seen:
        if drafts:
            assert naive_lookup(tokens, 2, 4, 3) == []
            assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)


def test_sampling_keeps_the_target_distribution(law_models, exact_law, tmp_path, lookup_proposers):
    """V = 8 target (test_engine_distribution.py's harness): lookup drafts (q one-hot) and the MLP
    speculator's sampled drafts (its q) in the same batches keep the exact law of three tokens."""
    spec = {"method": "mlp_speculator", "model": str(hc.mlp_speculator(tmp_path / "mlp", law_models[0], n_predict=2)),
            "num_speculative_tokens": 2, "ngram_first": True, "prompt_lookup_min": 1}
    counts, m = _counts(law_models[0], spec)
    assert m["num_draft_tokens"] > NUM // 4 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert lookup_proposers[0].num_lookup_proposals > 0 and lookup_proposers[0].num_model_proposals > 0
    assert chi_square_pvalue(counts, exact_law) > ALPHA


@pytest.mark.parametrize("bad, match", [
    ({"method": "ngram", "ngram_first": True}, "prompt lookup alone"),
    ({"method": "eagle", "model": "x", "ngram_first": "yes"}, "true or false"),
])
def test_bad_ngram_first_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**bad)

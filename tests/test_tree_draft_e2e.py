"""Tree speculation end to end for the proposers with their own KV (draft_model, eagle, eagle3):
greedy output with static and dynamic token trees equals the target's alone, with both scorers,
through small token budgets (trees cut by the budget), mixed prefill/verification steps,
preemption and prefix-cache hits; every KV block is free at the end; the core really verified
branching trees (its batches carry non-chain draft_parents).

Needs the tree core (set_draft_tokens with draft_parents, tree runs, KV copy lists), the tree
verifier and the engine glue (KV copies applied to the draft caches, hidden rows reordered as a
chain)."""
import numpy as np
import pytest

import head_checkpoints as hc
from specinfer import Generator
from spec_cases import GREEDY, check_greedy_exact, check_prefix_hits, reference
from core_spy import BranchSpy

STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
DYNAMIC = {"dynamic": True, "num_nodes": 8, "top_k": 2, "depth": 3}


def _spec(method, path, tree, scorer):
    return {"method": method, "model": str(path), "num_speculative_tokens": 3, "token_tree": tree, "scorer": scorer}


@pytest.fixture(scope="module")
def heads(target, target_and_draft, tmp_path_factory):
    d = tmp_path_factory.mktemp("heads")
    return {"draft_model": target_and_draft[1], "eagle": hc.eagle1(d / "eagle", target, repeat=True)}


def _spied_generate(monkeypatch):
    """Every Generator built in the test gets a core spy; returns the list of spies."""
    spies = []
    init = Generator.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        spy = BranchSpy(self.engine.core)
        self.engine.core = spy
        spies.append(spy)

    monkeypatch.setattr(Generator, "__init__", patched)
    return spies


CASES = [("draft_model", "static", "mqa"), ("eagle", "dynamic", "batch_expansion"),
         pytest.param("draft_model", "dynamic", "batch_expansion", marks=pytest.mark.slow),
         pytest.param("eagle", "static", "batch_expansion", marks=pytest.mark.slow),
         pytest.param("draft_model", "static", "batch_expansion", marks=pytest.mark.slow),
         pytest.param("draft_model", "dynamic", "mqa", marks=pytest.mark.slow),
         pytest.param("eagle", "static", "mqa", marks=pytest.mark.slow),
         pytest.param("eagle", "dynamic", "mqa", marks=pytest.mark.slow)]


@pytest.mark.parametrize("method,kind,scorer", CASES)
def test_greedy_tree_speculation_is_exact(target, ref, heads, monkeypatch, method, kind, scorer):
    spies = _spied_generate(monkeypatch)
    tree = STATIC if kind == "static" else DYNAMIC
    tot = check_greedy_exact(target, _spec(method, heads[method], tree, scorer), ref)
    assert tot["num_accepted_tokens"] > 0
    assert sum(s.branching for s in spies) > 0, "no branching tree reached the core"


@pytest.mark.parametrize("method", ["draft_model", pytest.param("eagle", marks=pytest.mark.slow)])
def test_greedy_tree_speculation_with_prefix_hits(target, ref, heads, monkeypatch, method):
    spies = _spied_generate(monkeypatch)
    check_prefix_hits(target, _spec(method, heads[method], STATIC, "mqa"), ref)
    assert spies[0].branching > 0


@pytest.mark.parametrize("kind", ["static", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_eagle3_greedy_tree_speculation_is_exact(tiny_dir, tmp_path, monkeypatch, kind):
    target = tiny_dir("llama", False, layers=4)[0]
    path = hc.eagle3(tmp_path / "e3", target, draft_vocab=96, aux_ids=[0, 1, 3])
    spies = _spied_generate(monkeypatch)
    check_greedy_exact(target, _spec("eagle3", path, STATIC if kind == "static" else DYNAMIC, "mqa"),
                       reference(target))
    assert sum(s.branching for s in spies) > 0


def test_draft_equal_to_target_accepts_a_whole_tree_path(target):
    """Draft = target: the rank-0 path of a static tree is always accepted, so every verification
    of m nodes (the tree, or the first m nodes of it when cut) accepts the depth of those m nodes."""
    gen = Generator(str(target), block_size=4, max_model_len=128, speculative=_spec(
        "draft_model", target, STATIC, "mqa"))
    depth_of_first = [0] + [max(len(p) for p in STATIC[:m]) for m in range(1, len(STATIC) + 1)]
    proposer, checked = gen.engine.proposer, []
    inner = proposer.propose

    def spy(inp):
        for d, a in zip(inp.num_draft.tolist(), inp.num_accepted.tolist()):
            if d:
                checked.append((a, depth_of_first[d]))
        return inner(inp)

    proposer.propose = spy
    gen.generate(reference(target, 4)[0], GREEDY, use_tqdm=False)
    assert len(checked) > 10 and all(a == want for a, want in checked), checked
    assert any(want == 3 for _, want in checked)

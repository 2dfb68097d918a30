"""Greedy speculation with static token trees drafted by Medusa and MLP-speculator heads equals
the target's output alone, token for token (issue 9), with both scorers, small token budgets
(trees cut by the budget, mixed prefill/verification steps), tiny blocks and preemption.

A spy on the core checks that tree proposals (with parents that are not a chain) really reach
it: without that, an engine that drops the parents would verify the nodes as a chain and still
be exact, so the test could not fail.
"""
from __future__ import annotations

import numpy as np
import pytest

import head_checkpoints as hc
from specinfer import Generator
from spec_cases import GREEDY, SETTINGS
from specinfer.spec_decode.token_tree import is_chain

TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]


class CoreSpy:
    """Delegates to the engine's core; counts tree proposals handed to set_draft_tokens."""

    def __init__(self, core):
        self._core = core
        self.num_trees = 0

    def __getattr__(self, name):
        return getattr(self._core, name)

    def set_draft_tokens(self, req_ids, cu_num_draft, draft_token_ids, draft_parents=None):
        if draft_parents is None:
            return self._core.set_draft_tokens(req_ids, cu_num_draft, draft_token_ids)
        cu = np.asarray(cu_num_draft)
        parents = np.asarray(draft_parents)
        self.num_trees += sum(not is_chain(parents[cu[j]:cu[j + 1]]) for j in range(len(cu) - 1))
        return self._core.set_draft_tokens(req_ids, cu_num_draft, draft_token_ids, draft_parents)


HEADS = {"medusa": lambda p, t: hc.medusa_original(p, t, num_layers=1),
         "mlp_speculator": lambda p, t: hc.mlp_speculator(p, t)}


@pytest.mark.parametrize("method,scorer", [
    ("mlp_speculator", "mqa"), pytest.param("mlp_speculator", "batch_expansion", marks=pytest.mark.slow),
    ("medusa", "batch_expansion"), pytest.param("medusa", "mqa", marks=pytest.mark.slow)])
def test_tree_heads_greedy_is_exact(target, ref, tmp_path, method, scorer):
    path = HEADS[method](tmp_path / method, target)
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 3, "scorer": scorer,
            "token_tree": TREE}
    ps, want = ref
    trees = accepted = mixed = preempted = 0
    for block_size, budget, blocks, batch in SETTINGS:
        gen = Generator(str(target), block_size=block_size, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                        max_model_len=128, speculative=spec)
        spy = CoreSpy(gen.engine.core)
        gen.engine.core = spy
        outs = gen.generate(ps[:batch], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == want[:batch], (method, scorer, block_size, budget, batch)
        assert spy.num_free_blocks() == spy.num_total_blocks()
        spy.check_invariants()
        trees += spy.num_trees
        accepted += gen.spec_metrics()["num_accepted_tokens"]
        mixed += gen.engine.num_mixed_steps
        preempted += spy.stats()["num_preemptions"]
    assert trees > 0, "no tree proposal reached the core"
    assert accepted > 0 and mixed > 0 and preempted > 0

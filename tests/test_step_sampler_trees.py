"""StepSampler routes tree requests to tree verification and keeps chains on today's path.

The scheduler output is faked (a namespace with the fields the step sampler reads, including
``draft_parents``), so these tests pin the routing, the merge back into request order, the
counts, ``Emitted.tree_paths``, tree-aware min_tokens masking and logprobs rows.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from specinfer.engine.step_sampler import StepSampler
from specinfer.sample import RandomStreams, SamplingMetadata, compute_logprobs, probs_from_logits
from specinfer.sample.tree_layout import chain_parents
from specinfer.sample.tree_verify import tree_rejection_sample
from specinfer.sampling_params import SamplingParams

V = 7


def state(core_id, temperature=1.0, seed=None, out_len=3, **params):
    return SimpleNamespace(request_id=f"r{core_id}", core_id=core_id, seed=seed if seed is not None else 100 + core_id,
                           params=SamplingParams(temperature=temperature, **params),
                           output_token_ids=list(range(out_len)))


def sched(rows, drafts, parents):
    """rows: logits rows per request; drafts: list of draft lists; parents: list of parent lists."""
    return SimpleNamespace(cu_num_logits=np.concatenate([[0], np.cumsum(rows)]).astype(np.int32),
                           num_draft_tokens=np.array([len(d) for d in drafts], dtype=np.int32),
                           draft_token_ids=np.array(sum(drafts, []), dtype=np.int64),
                           draft_parents=np.array(sum(parents, []), dtype=np.int32))


def test_mixed_batch_routes_trees_and_chains():
    g = torch.Generator().manual_seed(0)
    tree_parents = [-1, -1, 0, 0, 1]
    drafts = [[], [1, 2, 3], [2, 4, 1, 5, 3], [0, 0, 1, 2, 3], [], [3, 6, 1, 2, 0]]
    parents = [[], [-1, 0, 1], tree_parents, tree_parents, [], tree_parents]
    rows = [1, 4, 6, 6, 0, 6]  # plain decode, chain, sampled tree, greedy tree, prefill chunk, top-k tree
    states = [state(0), state(1), state(2), state(3, temperature=0.0), state(4), state(5, top_k=4)]
    logits = 2 * torch.randn(sum(rows), V, generator=g, dtype=torch.float64)
    q = {1: torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64), -1),
         2: torch.softmax(torch.randn(5, V, generator=g, dtype=torch.float64), -1)}
    sch = sched(rows, drafts, parents)
    em = StepSampler(None)(logits, sch, states, q)

    assert sorted(em.tree_paths) == [2, 3, 5]
    counts = np.diff(em.cu_num_emitted)
    assert counts[4] == 0 and counts[0] == 1
    assert em.num_accepted.tolist() == (counts - (counts > 0)).tolist()
    # each tree request equals tree verification of that request alone, with its own params
    cu = sch.cu_num_logits
    for r in (2, 3, 5):
        st = states[r]
        meta = SamplingMetadata.build([st.params.temperature] * rows[r], top_k=[st.params.top_k] * rows[r])
        p = probs_from_logits(logits[cu[r]:cu[r + 1]], meta)
        want = tree_rejection_sample(torch.tensor(drafts[r]), torch.tensor(parents[r]), torch.tensor([0, 5]),
                                     q.get(r), p, torch.tensor([st.params.temperature == 0.0]),
                                     RandomStreams.build([st.seed], [len(st.output_token_ids)]),
                                     one_hot=torch.tensor([r not in q]))
        n = int(want.num_emitted[0])
        assert em.token_ids[em.cu_num_emitted[r]:em.cu_num_emitted[r + 1]].tolist() == want.token_ids[0, :n].tolist()
        assert em.tree_paths[r].tolist() == want.accepted_nodes[0, : n - 1].tolist()
        assert em.num_accepted[r] == n - 1
        # the path's tokens are the emitted tokens
        assert [drafts[r][i] for i in em.tree_paths[r]] == em.token_ids[em.cu_num_emitted[r]:][: n - 1].tolist()
    # the chain and the plain decode are exactly what a batch without trees gives them
    keep = [0, 1, 4]
    sub = sched([rows[i] for i in keep], [drafts[i] for i in keep], [parents[i] for i in keep])
    sel = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in keep])
    em_chain = StepSampler(None)(logits[sel], sub, [states[i] for i in keep], {1: q[1]})
    for k, r in enumerate(keep):
        assert (em.token_ids[em.cu_num_emitted[r]:em.cu_num_emitted[r + 1]].tolist()
                == em_chain.token_ids[em_chain.cu_num_emitted[k]:em_chain.cu_num_emitted[k + 1]].tolist())
        assert em.num_accepted[r] == em_chain.num_accepted[k]


def test_chain_batch_is_untouched_by_draft_parents():
    g = torch.Generator().manual_seed(1)
    drafts = [[1, 2], [3], [4, 5, 6]]
    rows = [3, 2, 3]  # the last one was split by the budget (no bonus row)
    states = [state(0), state(1, temperature=0.0), state(2)]
    logits = 2 * torch.randn(sum(rows), V, generator=g, dtype=torch.float64)
    q = {0: torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64), -1),
         2: torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64), -1)}
    with_parents = sched(rows, drafts, [chain_parents([len(d)]).tolist() for d in drafts])
    without = SimpleNamespace(**{k: v for k, v in vars(with_parents).items() if k != "draft_parents"})
    for seed in range(10):
        for st in states:
            st.seed = seed * 10 + st.core_id
        a = StepSampler(None)(logits, with_parents, states, q)
        b = StepSampler(None)(logits, without, states, q)
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.num_accepted.tolist() == b.num_accepted.tolist()
        assert a.tree_paths == {} and b.tree_paths == {}


def test_min_tokens_masks_tree_rows_by_depth():
    """Root -> nodes 0 (token 3), 1 (token 1); node 1 -> node 2 (token 2). EOS (6) is the argmax of
    every row; with min_tokens = 2 the rows deciding output offsets 0 and 1 (root, nodes 0 and 1)
    must not emit it, the row of node 2 (offset 2) may. Row 2 (node 1) is at offset 1, not 2."""
    eos = 6
    logits = torch.zeros(4, V, dtype=torch.float64)
    logits[:, eos] = 10.0
    logits[0, 1] = 5.0  # root's best non-EOS: token 1 (node 1)
    logits[2, 2] = 5.0  # node 1's best non-EOS: token 2 (node 2)
    st = state(0, temperature=0.0, out_len=0, min_tokens=2)
    em = StepSampler(None, eos_token_ids=(eos,))(logits, sched([4], [[3, 1, 2]], [[-1, -1, 1]]), [st], {})
    assert em.token_ids.tolist() == [1, 2, eos]
    assert em.tree_paths[0].tolist() == [1, 2]


def test_tree_logprobs_come_from_the_path_rows():
    g = torch.Generator().manual_seed(2)
    logits = 2 * torch.randn(6, V, generator=g, dtype=torch.float64)
    drafts, parents = [2, 4, 1, 5, 3], [-1, -1, 0, 1, 1]
    am = logits.argmax(-1)
    drafts[0] = int(am[0] + 1) % V
    drafts[1] = int(am[0])  # the greedy walk takes node 1, then node 3 (its token matches)
    drafts[3] = int(am[2])
    st = state(0, temperature=0.0, logprobs=2)
    em = StepSampler(None)(logits, sched([6], [drafts], [parents]), [st], {})
    path = em.tree_paths[0].tolist()
    assert path[:2] == [1, 3]
    rows = [0] + [1 + i for i in path]
    want = compute_logprobs(logits[torch.tensor(rows)], torch.from_numpy(em.token_ids), 2).entries(2)
    assert em.logprobs[0] == want


def test_typical_acceptance_method_routes_trees_to_tree_typical():
    from specinfer.sample.tree_typical_acceptance import tree_typical_acceptance_sample
    spec = SimpleNamespace(acceptance_method="typical_acceptance_sampler", posterior_threshold=0.09,
                           posterior_alpha=0.3, disable_logprobs=False)
    g = torch.Generator().manual_seed(3)
    drafts, parents = [[1, 2, 3, 4, 5], [0, 1]], [[-1, -1, 0, 0, 1], [-1, 0]]
    logits = 2 * torch.randn(9, V, generator=g, dtype=torch.float64)
    states = [state(0), state(1)]
    em = StepSampler(spec)(logits, sched([6, 3], drafts, parents), states, {})
    assert list(em.tree_paths) == [0]
    p = probs_from_logits(logits[:6], SamplingMetadata.build([1.0] * 6))
    want = tree_typical_acceptance_sample(torch.tensor(drafts[0]), torch.tensor(parents[0]), torch.tensor([0, 5]),
                                          None, p, torch.tensor([False]),
                                          RandomStreams.build([states[0].seed], [3]), posterior_threshold=0.09,
                                          posterior_alpha=0.3)
    n = int(want.num_emitted[0])
    assert em.token_ids[: em.cu_num_emitted[1]].tolist() == want.token_ids[0, :n].tolist()

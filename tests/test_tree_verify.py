"""Exact tests of specinfer.sample.tree_verify: a loop reference, chains, greedy, determinism.

The reference below is HEADS.md §4's VerifyStochastic written per request with Python loops and
numpy draws from the same counter streams (normalized residuals, one node at a time); the
vectorized verifier must agree with it token for token on random trees with duplicate sibling
tokens, zeros in p, greedy / one-hot / sampled requests mixed in one batch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specinfer.sample import RandomStreams, rejection_sample
from specinfer.sample.random_streams import SAMPLE, counter_uniform, sibling_accept_purpose
from specinfer.sample.tree_layout import TreeLayout, chain_parents, is_chain_request
from specinfer.sample.tree_typical_acceptance import tree_typical_acceptance_sample
from specinfer.sample.tree_verify import tree_rejection_sample, verify_tree
from specinfer.sample.typical_acceptance import typical_acceptance_sample


def reference_verify(p, tokens, parents, q, greedy, seed, position):
    """p float64[1 + m, V], tokens/parents [m], q float64[m, V] or None -> (emitted, nodes)."""
    m = len(tokens)
    kids = {u: [i for i in range(m) if parents[i] == u] for u in range(-1, m)}
    u, depth, emitted, nodes = -1, 0, [], []
    while True:
        dist = p[u + 1].copy()
        chosen = None
        for j, s in enumerate(kids[u]):
            x = tokens[s]
            if greedy:
                ok = x == int(np.argmax(p[u + 1]))
            else:
                qs = np.eye(p.shape[1])[x] if q is None else q[s]
                r = counter_uniform(np.array([seed], np.uint64), np.array([position + depth]),
                                    sibling_accept_purpose(j))[0]
                ok = r < dist[x] / qs[x]
                if not ok:
                    dist = np.maximum(dist - qs, 0)
                    dist = p[u + 1].copy() if dist.sum() <= 0 else dist / dist.sum()
            if ok:
                chosen = min(c for c in kids[u] if tokens[c] == x)  # lowest-index rule
                break
        if chosen is None:
            break
        emitted.append(tokens[chosen])
        nodes.append(chosen)
        u, depth = chosen, depth + 1
    if greedy:
        emitted.append(int(np.argmax(p[u + 1])))
    else:
        r = counter_uniform(np.array([seed], np.uint64), np.array([position + depth]), SAMPLE)[0]
        cdf = np.cumsum(dist)
        emitted.append(int(min(np.searchsorted(cdf, r * cdf[-1], side="right"), len(cdf) - 1)))
    return emitted, nodes


def random_tree(rng, m, max_children=3):
    parents = []
    for i in range(m):
        opts = [u for u in range(-1, i) if sum(1 for x in parents if x == u) < max_children]
        parents.append(int(rng.choice(opts)))
    return parents


def random_batch(rng, num, vocab, kinds=("greedy", "one_hot", "sampled")):
    """num trees of 0..9 nodes with tokens in a small vocabulary (duplicates are common)."""
    trees = []
    for _ in range(num):
        m = int(rng.integers(0, 10))
        parents = random_tree(rng, m)
        logits = rng.normal(size=(1 + m, vocab)) * 1.5
        logits[rng.random(logits.shape) < 0.2] = -np.inf
        logits[:, 0] = 0.0  # keep a token with mass on every row
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        q = rng.dirichlet(np.ones(vocab) * 0.7, size=m) if m else np.zeros((0, vocab))
        kind = kinds[int(rng.integers(0, len(kinds)))]
        if kind == "sampled":
            tokens = [int(rng.choice(vocab, p=q[i])) for i in range(m)]
        else:  # mostly the parent's likely tokens, so paths get deep
            tokens = [int(rng.choice(vocab, p=p[par + 1])) if rng.random() < 0.7 else int(rng.integers(vocab))
                      for par in parents]
        trees.append(dict(p=p, tokens=tokens, parents=parents, q=q, kind=kind,
                          seed=int(rng.integers(0, 2**63)), position=int(rng.integers(0, 1000))))
    return trees


def run_batch(trees, dtype=torch.float64):
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(t["tokens"]) for t in trees])]))
    tokens = torch.tensor(sum((t["tokens"] for t in trees), []), dtype=torch.int64)
    parents = torch.tensor(sum((t["parents"] for t in trees), []), dtype=torch.int64)
    q = torch.tensor(np.concatenate([t["q"] for t in trees]), dtype=dtype)
    p = torch.tensor(np.concatenate([t["p"] for t in trees]), dtype=dtype)
    greedy = torch.tensor([t["kind"] == "greedy" for t in trees])
    one_hot = torch.tensor([t["kind"] == "one_hot" for t in trees])
    st = RandomStreams.build([t["seed"] for t in trees], [t["position"] for t in trees])
    return tree_rejection_sample(tokens, parents, cu, q, p, greedy, st, one_hot=one_hot)


def test_matches_loop_reference_on_random_trees():
    rng = np.random.default_rng(0)
    trees = random_batch(rng, 600, vocab=4)
    out = run_batch(trees)
    deep = 0
    for r, t in enumerate(trees):
        n = int(out.num_emitted[r])
        got = (out.token_ids[r, :n].tolist(), out.accepted_nodes[r, : n - 1].tolist())
        want = reference_verify(t["p"], t["tokens"], t["parents"], None if t["kind"] == "one_hot" else t["q"],
                                t["kind"] == "greedy", t["seed"], t["position"])
        assert got == want, (r, t["kind"])
        assert bool((out.token_ids[r, n:] == -1).all())
        deep += n >= 3
    assert deep > 50  # paths of length >= 2 were exercised


def test_final_token_is_never_a_child_of_the_stop_node():
    """Rejected tokens keep no residual mass: the core may read the path off the emitted tokens."""
    rng = np.random.default_rng(1)
    trees = random_batch(rng, 800, vocab=3, kinds=("one_hot", "sampled"))
    out = run_batch(trees)
    for r, t in enumerate(trees):
        n = int(out.num_emitted[r])
        stop = out.accepted_nodes[r, n - 2].item() if n >= 2 else -1
        kids = [t["tokens"][i] for i in range(len(t["tokens"])) if t["parents"][i] == stop]
        assert out.token_ids[r, n - 1].item() not in kids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_q", [True, False])
def test_chain_is_exactly_the_chain_rejection_sampler(dtype, with_q):
    g = torch.Generator().manual_seed(5)
    R, V = 400, 6
    k = torch.randint(0, 5, (R,), generator=g)
    cu = torch.nn.functional.pad(k.cumsum(0), (1, 0))
    N = int(cu[-1])
    p = torch.softmax(2 * torch.randn(N + R, V, generator=g, dtype=torch.float64), -1).to(dtype)
    q = torch.softmax(2 * torch.randn(N, V, generator=g, dtype=torch.float64), -1).to(dtype)
    drafts = torch.multinomial(q.double(), 1, generator=g).squeeze(1)
    greedy = torch.rand(R, generator=g) < 0.2
    st = RandomStreams.build(np.arange(R) * 7 + 1, np.arange(R) % 13)
    want, n_want = rejection_sample(drafts, cu, q if with_q else None, p, greedy, st)
    got = tree_rejection_sample(drafts, torch.from_numpy(chain_parents(k.numpy())), cu, q if with_q else None,
                                p, greedy, st)
    assert torch.equal(got.num_emitted, n_want)
    assert torch.equal(got.token_ids, want[:, : got.token_ids.shape[1]])
    assert 0 < int((got.num_accepted < k).sum()) < R  # both rejections and full acceptance


def test_greedy_tree_walk_is_greedy_decoding():
    """Trees whose nodes mix the target's argmax continuation with other tokens: the walk emits
    the greedy continuation, as far as the tree holds it, plus the argmax at the stop node."""
    rng = np.random.default_rng(3)
    V, T = 6, 12
    P = rng.dirichlet(np.ones(V), size=(T, V))  # P[t, prev] = law of token t
    greedy_seq = [0]  # START
    for t in range(T):
        greedy_seq.append(int(np.argmax(P[t, greedy_seq[-1]])))
    for trial in range(300):
        m = int(rng.integers(1, 12))
        parents = random_tree(rng, m)
        depth = []
        for par in parents:
            depth.append(1 if par < 0 else depth[par] + 1)
        tokens = [greedy_seq[d] if rng.random() < 0.6 else int(rng.integers(V)) for d in depth]
        prev_of = lambda i: 0 if i < 0 else tokens[i]  # noqa: E731
        rows = [P[0, 0]] + [P[depth[i], tokens[i]] for i in range(m)]
        emitted, nodes = verify_tree(torch.tensor(np.stack(rows)), tokens, parents, None, True, trial, 0)
        assert emitted == greedy_seq[1: len(emitted) + 1]
        # the path is the lowest-index matching child at each step and cannot be extended
        u = -1
        for node in nodes:
            assert node == min(i for i in range(m) if parents[i] == u and tokens[i] == tokens[node])
            assert prev_of(u) == greedy_seq[depth[node] - 1]
            u = node
        assert all(tokens[i] != emitted[-1] for i in range(m) if parents[i] == u)


def test_duplicate_siblings_descend_into_lowest_index():
    # root children: node 0 (token 2, a leaf), node 1 (token 2, with child node 2 = token 1)
    p = torch.tensor([[0, 0, 1.0, 0], [0, 1.0, 0, 0], [0, 1.0, 0, 0], [0.25] * 4], dtype=torch.float64)
    for greedy in (True, False):
        for seed in range(20):
            emitted, nodes = verify_tree(p, [2, 2, 1], [-1, -1, 1], None, greedy, seed, 0)
            assert nodes == [0] and emitted == [2, 1]


def test_seeded_request_same_alone_and_in_any_batch():
    rng = np.random.default_rng(7)
    trees = random_batch(rng, 40, vocab=5, kinds=("one_hot", "sampled"))
    full = run_batch(trees)
    for r in (0, 17, 39):
        alone = run_batch([trees[r]])
        for _ in range(2):
            again = run_batch([trees[r]])
            assert torch.equal(again.token_ids, alone.token_ids)
        n = int(alone.num_emitted[0])
        assert int(full.num_emitted[r]) == n
        assert torch.equal(full.token_ids[r, :n], alone.token_ids[0, :n])
        assert torch.equal(full.accepted_nodes[r, : n - 1], alone.accepted_nodes[0, : n - 1])
    shuffled = [trees[i] for i in rng.permutation(len(trees))]
    assert run_batch(shuffled).num_emitted.sum() == full.num_emitted.sum()


def test_outputs_vary_with_seed_and_position():
    """Guards the determinism test: the draws really depend on (seed, position)."""
    p = torch.full((5, 4), 0.25, dtype=torch.float64)
    q = torch.softmax(torch.arange(16, dtype=torch.float64).reshape(4, 4), -1)
    args = ([3, 3, 3, 3], [-1, -1, 0, 0], q, False)
    by_seed = {tuple(verify_tree(p, *args, s, 0)[0]) for s in range(30)}
    by_pos = {tuple(verify_tree(p, *args, 1, t)[0]) for t in range(30)}
    assert len(by_seed) > 3 and len(by_pos) > 3


def test_is_chain_request():
    parents = np.array([-1, 0, 1, -1, -1, -1, 0, 0, -1], dtype=np.int32)
    cu = np.array([0, 3, 5, 5, 8, 9])
    assert is_chain_request(parents, cu).tolist() == [True, False, True, False, True]
    assert chain_parents([3, 0, 2]).tolist() == [-1, 0, 1, -1, 0]
    layout = TreeLayout.build(torch.zeros(9, dtype=torch.int64), torch.from_numpy(parents), torch.from_numpy(cu))
    assert layout.is_chain().tolist() == [True, False, True, False, True]
    assert layout.max_depth == 3 and layout.max_children == 2


@pytest.mark.parametrize("parents,message", [
    ([-1, 1, 0], "draft_parents\\[1\\]"),
    ([-2, 0], "draft_parents\\[0\\]"),
    ([0], "draft_parents\\[0\\]"),
])
def test_bad_parents_are_refused_naming_the_field(parents, message):
    n = len(parents)
    with pytest.raises(ValueError, match=message):
        tree_rejection_sample(torch.zeros(n, dtype=torch.int64), torch.tensor(parents), torch.tensor([0, n]),
                              None, torch.full((n + 1, 3), 1 / 3), torch.tensor([False]),
                              RandomStreams.build([0], [0]))


def test_too_many_nodes_and_bad_shapes_are_refused():
    n = 64
    with pytest.raises(ValueError, match="at most 63"):
        TreeLayout.build(torch.zeros(n, dtype=torch.int64), torch.arange(n) - 1, torch.tensor([0, n]))
    with pytest.raises(ValueError, match="target_probs"):
        tree_rejection_sample(torch.zeros(2, dtype=torch.int64), torch.tensor([-1, -1]), torch.tensor([0, 2]),
                              None, torch.full((2, 3), 1 / 3), torch.tensor([False]), RandomStreams.build([0], [0]))
    with pytest.raises(ValueError, match="one_hot"):
        tree_rejection_sample(torch.zeros(1, dtype=torch.int64), torch.tensor([-1]), torch.tensor([0, 1]),
                              None, torch.full((2, 3), 1 / 3), torch.tensor([False]), RandomStreams.build([0], [0]),
                              one_hot=torch.tensor([False]))


# --- typical acceptance over trees (Medusa; not distribution-preserving) ------------------------

def test_typical_on_chains_is_the_chain_typical_sampler():
    g = torch.Generator().manual_seed(11)
    R, V = 300, 6
    k = torch.randint(0, 5, (R,), generator=g)
    cu = torch.nn.functional.pad(k.cumsum(0), (1, 0))
    N = int(cu[-1])
    p = torch.softmax(2 * torch.randn(N + R, V, generator=g, dtype=torch.float64), -1)
    drafts = torch.randint(0, V, (N,), generator=g)
    greedy = torch.rand(R, generator=g) < 0.2
    st = RandomStreams.build(np.arange(R) * 3 + 5, np.arange(R) % 7)
    want, n_want = typical_acceptance_sample(drafts, cu, None, p, greedy, st)
    got = tree_typical_acceptance_sample(drafts, torch.from_numpy(chain_parents(k.numpy())), cu, None, p,
                                         greedy, st)
    assert torch.equal(got.num_emitted, n_want)
    assert torch.equal(got.token_ids, want[:, : got.token_ids.shape[1]])
    assert 0 < int((got.num_accepted < k).sum()) < R


def test_typical_takes_the_deepest_typical_path_then_the_likeliest():
    # root -> node 0 (tok 1), node 1 (tok 2); node 0 -> node 2 (tok 3); node 1 -> node 3 (tok 0)
    rows = torch.tensor([
        [0.05, 0.45, 0.45, 0.05],  # root: tokens 1 and 2 both typical
        [0.1, 0.1, 0.1, 0.7],  # after node 0: token 3 typical
        [0.6, 0.2, 0.1, 0.1],  # after node 1: token 0 typical, more likely than token 3 above
        [0.25] * 4, [0.25] * 4,
    ], dtype=torch.float64)
    tokens, parents = torch.tensor([1, 2, 3, 0]), torch.tensor([-1, -1, 0, 1])
    out = tree_typical_acceptance_sample(tokens, parents, torch.tensor([0, 4]), None, rows, torch.tensor([False]),
                                         RandomStreams.build([1], [0]))
    assert out.accepted_nodes[0].tolist() == [0, 2]  # 0.45 * 0.7 > 0.45 * 0.6
    assert out.num_emitted.tolist() == [3]  # node 2 is a leaf: a bonus token from its row
    rows[2, 0] = 0.8
    rows[2, 3] = 0.0
    out = tree_typical_acceptance_sample(tokens, parents, torch.tensor([0, 4]), None, rows, torch.tensor([False]),
                                         RandomStreams.build([1], [0]))
    assert out.accepted_nodes[0].tolist() == [1, 3]


def test_typical_greedy_is_the_greedy_walk_and_paths_are_canonical():
    rng = np.random.default_rng(4)
    trees = random_batch(rng, 300, vocab=3, kinds=("greedy", "one_hot"))
    exact = run_batch(trees)
    cu = torch.tensor(np.concatenate([[0], np.cumsum([len(t["tokens"]) for t in trees])]))
    tokens = torch.tensor(sum((t["tokens"] for t in trees), []), dtype=torch.int64)
    parents = torch.tensor(sum((t["parents"] for t in trees), []), dtype=torch.int64)
    p = torch.tensor(np.concatenate([t["p"] for t in trees]))
    greedy = torch.tensor([t["kind"] == "greedy" for t in trees])
    st = RandomStreams.build([t["seed"] for t in trees], [t["position"] for t in trees])
    out = tree_typical_acceptance_sample(tokens, parents, cu, None, p, greedy, st)
    assert torch.equal(out.token_ids[greedy], exact.token_ids[greedy])
    for r, t in enumerate(trees):  # every accepted node is the lowest-index sibling with its token
        n = int(out.num_emitted[r])
        u = -1
        for node in out.accepted_nodes[r, : n - 1].tolist():
            assert t["parents"][node] == u
            assert node == min(i for i in range(len(t["tokens"]))
                               if t["parents"][i] == u and t["tokens"][i] == t["tokens"][node])
            u = node

"""Token trees drafted by a draft model (spec_decode/tree_drafting.py through DraftModelProposer):
every tree the engine proposes equals the brute-force reference (HF transformers run on each
root-to-node path separately, top-k taken there), through chunked prefill, prefix-cache hits and
preemption; the draft KV written for the fed nodes equals the per-path recomputation; a chain
written as a tree drafts exactly the chain. Tree verification end to end: test_tree_draft_e2e.py."""
import numpy as np
import pytest
import torch
import transformers as tf

from specinfer import Generator, SamplingParams
from spec_cases import prompts
from tree_reference import dynamic_tree, record_tree_proposals, static_tree

# node [1] is a leaf between fed siblings: the fed nodes of a depth need not be contiguous
TREE = [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [0, 0, 1]]
PATHS = sorted(tuple(p) for p in TREE)
PATHS.sort(key=lambda p: (len(p), p))


class HFDraft:
    def __init__(self, path):
        self.model = tf.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def next_logits(self, tokens):
        return self.model(torch.tensor([list(tokens)])).logits[0, -1]

    @torch.no_grad()
    def kv(self, tokens):  # per layer (K, V) of the last token, [kv_heads, D] each
        out = self.model(torch.tensor([list(tokens)]), use_cache=True)
        return [(layer.keys[0, :, -1], layer.values[0, :, -1]) for layer in out.past_key_values.layers]


@pytest.fixture(scope="module")
def draft_ref(target_and_draft):
    return HFDraft(target_and_draft[1])


def _gen(models, tree, k, **kw):
    target, draft = models
    return Generator(str(target), block_size=4, max_num_batched_tokens=20, num_kv_blocks=36, max_model_len=128,
                     attention_backend="torch_ref",
                     speculative={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                                  "token_tree": tree, "policy": "fixed"}, **kw)


def test_static_tree_equals_brute_force_reference(target_and_draft, draft_ref):
    gen = _gen(target_and_draft, TREE, 8)
    seen = record_tree_proposals(gen)
    ps = prompts(8)
    params = [SamplingParams(max_tokens=16, temperature=0.0), SamplingParams(max_tokens=16, temperature=0.8, seed=3)]
    gen.generate(ps + ps, params * 8, use_tqdm=False)  # every prompt twice: prefix-cache hits
    stats = gen.engine.core.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    full = [s for s in seen if s[1] >= len(TREE)]
    assert len(full) > 10 and any(s[1] < len(TREE) for s in seen)
    for tokens, max_drafts, drafts, parents in seen[::2]:
        n = min(max_drafts, len(TREE))
        assert len(drafts) == n
        want_parents = [-1 if len(p) == 1 else PATHS.index(p[:-1]) for p in PATHS[:n]]
        assert parents == want_parents
        assert drafts == static_tree(PATHS, lambda path: draft_ref.next_logits(tokens + list(path)), n), len(tokens)


def test_chain_tree_drafts_the_chain(target_and_draft):
    chain = [[0] * d for d in range(1, 4)]
    runs = []
    for tree in (None, chain):
        gen = _gen(target_and_draft, tree, 3, overlap_steps=False)  # (chains through propose(), not launched)
        seen = record_tree_proposals(gen)
        gen.generate(prompts(4), SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
        runs.append([(t, d) for t, _, d, _ in seen])
    assert runs[0] == runs[1] and len(runs[0]) > 10


def test_fed_nodes_draft_kv_equals_per_path_recomputation(target_and_draft, draft_ref):
    gen = _gen(target_and_draft, TREE, 8)
    proposer = gen.engine.proposer
    inner, checked = proposer.propose, [0]
    has_child = {p[:-1] for p in PATHS if len(p) > 1}

    def spy(inp):
        prop = inner(inp)
        by_id = {st.core_id: (r, st) for r, st in enumerate(inp.requests)}
        caches = proposer.runner.kv_caches
        for j, cid in enumerate(prop.core_ids.tolist()):
            r, st = by_id[cid]
            drafts = prop.draft_token_ids[prop.cu_num_draft[j]:prop.cu_num_draft[j + 1]].tolist()
            if len(drafts) < len(TREE):
                continue
            tokens, root = st.tokens_slice(0, st.num_tokens), st.num_tokens - 1
            tok_of = dict(zip(PATHS, drafts))
            for n, path in enumerate(PATHS):
                if path not in has_child:
                    continue
                pos = root + 1 + n
                slot = int(inp.block_rows[r][pos // 4]) * 4 + pos % 4
                want = draft_ref.kv(tokens + [tok_of[path[:i]] for i in range(1, len(path) + 1)])
                for layer, (k, v) in zip(caches, want):
                    flat = layer.view(2, -1, *layer.shape[3:])
                    torch.testing.assert_close(flat[0, slot], k, atol=2e-5, rtol=1e-4)
                    torch.testing.assert_close(flat[1, slot], v, atol=2e-5, rtol=1e-4)
                checked[0] += 1
        return prop

    proposer.propose = spy
    gen.generate(prompts(3), SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert checked[0] > 10


DYN = {"dynamic": True, "num_nodes": 12, "top_k": 2, "depth": 4}


def test_dynamic_tree_equals_reference_selection(target_and_draft, draft_ref):
    gen = _gen(target_and_draft, DYN, 12)  # lookahead = max(12, 2 * 3 + 1) = 12 = k
    assert gen.engine.proposer.num_lookahead_tokens == 12
    seen = record_tree_proposals(gen)
    ps = prompts(6)
    gen.generate(ps + ps, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert gen.engine.core.stats()["prefix_cache_hits"] > 0
    deep = 0
    for tokens, max_drafts, drafts, parents in seen[::2]:
        want = dynamic_tree(12, 2, 4, lambda path: draft_ref.next_logits(tokens + list(path)),
                            node_cap=max_drafts, fed_cap=min(max_drafts, 12) - 1)
        assert (drafts, parents) == want, len(tokens)
        deep += max(_depths(parents)) >= 3
    assert deep > 5


def _depths(parents):
    d = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def test_tree_node_metadata_layout():
    from specinfer.attention.batch_metadata import attention_metadata_for_tree_nodes

    block_table = np.array([[5, 6, 7, 0], [1, 2, 3, 4]], np.int32)
    # sequence 0: root at 5, nodes at slots 0 and 2; sequence 1: root at 9, node at slot 1
    attn, pos = attention_metadata_for_tree_nodes(
        block_table, np.array([5, 9]), np.array([2, 1]), np.array([0, 2, 1]), np.array([1, 2, 2]),
        np.array([0b11, 0b1011, 0b101]), 4, torch.device("cpu"))
    assert pos.tolist() == [6, 7, 11]  # root + depth
    assert attn.slot_mapping.tolist() == [6 * 4 + 2, 7 * 4 + 0, 3 * 4 + 3]  # root + 1 + slot: 6, 8, 11
    assert attn.seq_lens.tolist() == [9, 12] and attn.query_start_loc.tolist() == [0, 2, 3]
    assert attn.tree_start.tolist() == [5, 9] and attn.tree_mask.tolist() == [0b11, 0b1011, 0b101]


def test_trees_near_max_model_len_stay_inside_their_slots(target_and_draft):
    """A dynamic tree whose fed nodes need more slots than it has nodes, in requests that reach
    max_model_len: scratch writes stay inside each request's reserved slots (a write past them would
    land in block 0 of the padded block table and corrupt another request), so greedy output stays
    the target's."""
    target, draft = target_and_draft
    ps = [p[:30] for p in prompts(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = [o.token_ids for o in Generator(str(target), max_model_len=40, block_size=4).generate(
        ps, params, use_tqdm=False)]
    tree = {"dynamic": True, "num_nodes": 4, "top_k": 3, "depth": 3}  # 6 fed nodes: lookahead 7
    gen = Generator(str(target), max_model_len=40, block_size=4, num_kv_blocks=48, attention_backend="torch_ref",
                    speculative={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 7,
                                 "token_tree": tree})
    assert gen.engine.proposer.num_lookahead_tokens == 7
    assert [o.token_ids for o in gen.generate(ps, params, use_tqdm=False)] == want
    assert gen.spec_metrics()["num_draft_tokens"] > 0

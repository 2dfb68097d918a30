"""Draft heads under tensor parallelism: each head is sharded over the target's 2 ranks (gloo on
CPU, worker processes): vocab-parallel lm_heads and embeddings (truncated vocabularies and
padded shards included), EAGLE's layer split by attention heads with its KV pool per rank,
EAGLE-3's features from the target's intermediate layers. Every run gives the tokens of the
unsharded engine, greedy and seeded sampling (the heads' q), with chunked prefill, preemption and
prefix-cache hits."""
from __future__ import annotations

import pytest

import head_checkpoints as hc
from tp_cases import check_same, run

HEADS = {
    # tied stages stay one tensor per rank
    "mlp_speculator": (dict(), "mlp_speculator", lambda p, t: hc.mlp_speculator(p, t, n_predict=3, tie=True)),
    # 97 of 256 rows: shards of 49 and 48 (+1 padding) rows, scattered back by token_map
    "medusa_truncated": (dict(), "medusa", lambda p, t: hc.medusa_vllm(p, t, num_heads=3, truncated=97)),
    # no lm_head of its own: the target's vocab-parallel lm_head
    "medusa_legacy": (dict(), "medusa", lambda p, t: hc.medusa_original(p, t, num_heads=3, legacy=True)),
    "eagle_own_embedding": (dict(), "eagle", lambda p, t: hc.eagle1(p, t, embed=True, repeat=True)),
    # specinfer's draft vocabulary: TP=1 scores the rows, TP=2 cuts the gathered logits
    "eagle_draft_vocab": (dict(), "eagle", lambda p, t: hc.eagle1(p, t, repeat=True, draft_vocab=128)),
    "eagle3_truncated": (dict(layers=4), "eagle3",
                         lambda p, t: hc.eagle3(p, t, draft_vocab=97, aux_ids=[0, 1, 3])),
}


@pytest.mark.parametrize("case", list(HEADS))
def test_tp2_head_equals_tp1(tiny_dir, tmp_path, case):
    model_kw, method, write = HEADS[case]
    target = tiny_dir("llama", False, **model_kw)[0]
    spec = {"method": method, "model": str(write(tmp_path / "head", target)), "quantization": "none", "num_speculative_tokens": 3, "policy": "fixed"}
    tp1, tp2 = run(target, 1, spec), run(target, 2, spec)
    check_same(tp1, tp2)
    if case != "eagle3_truncated":  # a random EAGLE-3 head rarely agrees with the tiny target
        assert tp2["metrics"]["num_accepted_tokens"] > 0
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert tp2["metrics"][key] == tp1["metrics"][key]


def test_tp2_eagle_token_tree(tiny_dir, tmp_path):
    """An EAGLE static tree drafted on both ranks' shards (tree masks in the draft layer's
    attention over each rank's pool), verified by the sharded target with KV compaction."""
    target = tiny_dir("llama", False)[0]
    spec = {"method": "eagle", "model": str(hc.eagle1(tmp_path / "e", target, repeat=True)),
            "num_speculative_tokens": 3, "token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}
    tp2 = run(target, 2, spec)
    check_same(run(target, 1, spec), tp2)
    assert tp2["metrics"]["num_accepted_tokens"] > 0


def test_tp2_heads_keep_only_their_shard(tiny_dir, tmp_path):
    """The driver's shard: half the vocab rows of each Medusa lm_head (97 -> 49, the last shard
    padded), and an EAGLE KV pool with one of the target's two KV heads per rank."""
    from specinfer import Generator
    from tp_cases import SETTINGS

    target = tiny_dir("llama", False)[0]
    medusa = hc.medusa_vllm(tmp_path / "m", target, num_heads=3, truncated=97)
    gen = Generator(str(target), tensor_parallel_size=2, distributed_timeout_s=60, **SETTINGS,
                    speculative={"method": "medusa", "model": str(medusa), "num_speculative_tokens": 3, "policy": "fixed"})
    try:
        heads = gen.engine.proposer.head.lm_heads
        assert [tuple(h.shape) for h in heads] == [(49, 64)] * 3
    finally:
        gen.close()
    eagle = hc.eagle1(tmp_path / "e", target, embed=True)
    gen = Generator(str(target), tensor_parallel_size=2, distributed_timeout_s=60, **SETTINGS,
                    speculative={"method": "eagle", "model": str(eagle), "num_speculative_tokens": 3, "policy": "fixed"})
    try:
        draft = gen.engine.proposer.draft
        assert draft.num_kv_heads == 1 and draft.kv_caches[0].shape[3] == 1
        assert draft.embed_tokens.shape[0] == 128 and draft.layer.num_heads == 2
    finally:
        gen.close()

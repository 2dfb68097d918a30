"""EAGLE's draft KV after prefix-cache hits. Pair position p holds (token p + 1, target feature p),
so the pair at the last cached position c - 1 depends on the token after the cached blocks: a
request that reuses another's blocks but continues differently must not read the other's pair
there, and must not overwrite it under a request still running on the shared block. Blocks whose
writer finished in the step that computed them must hold pairs too. Every draft is compared
with the HF reference recomputed from the whole history."""
import pytest

import head_checkpoints as hc
from eagle_reference import EagleReference
from specinfer import Generator, SamplingParams

from head_drafts import record_proposals

X = [(7 * i + 3) % 200 + 10 for i in range(16)]  # 4 full blocks of 4


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    target = tiny_dir("llama", False)[0]
    path = hc.eagle1(tmp_path_factory.mktemp("eagle") / "h", target)
    return target, path, EagleReference(target, path)


def _gen(target, path, tree=None):
    spec = {"method": "eagle", "model": str(path), "quantization": "none", "num_speculative_tokens": 3}
    if tree is not None:
        spec.update(token_tree=tree, num_speculative_tokens=4)
    return Generator(str(target), block_size=4, max_num_batched_tokens=64, num_kv_blocks=64, max_model_len=128,
                     attention_backend="torch_ref", speculative=spec)


def _check_all(seen, ref):
    assert seen
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)


def test_prefix_hit_with_a_different_next_token(setup):
    target, path, ref = setup
    gen = _gen(target, path)
    seen = record_proposals(gen)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    gen.generate([X + [50, 51, 52]], greedy, use_tqdm=False)
    for t in range(60, 68):  # each hits X's 4 blocks; token 16 differs
        gen.generate([X + [t, 51, 52]], greedy, use_tqdm=False)
    proposer = gen.engine.proposer
    assert proposer.num_private_copies == 8 and proposer.num_unknown_prefix_pairs == 0
    assert not proposer.private and len(proposer.free_private) == 32  # copies released at finish
    _check_all(seen, ref)


def test_prefix_hit_while_the_writer_still_runs(setup):
    target, path, ref = setup
    gen = _gen(target, path)
    seen = record_proposals(gen)
    eng = gen.engine
    eng.add_request("a", None, SamplingParams(max_tokens=30, temperature=0.0), prompt_token_ids=X + [50, 51])
    for _ in range(3):
        eng.step()
    eng.add_request("b", None, SamplingParams(max_tokens=30, temperature=0.0), prompt_token_ids=X + [60, 61])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.core.stats()["prefix_cache_hits"] > 0 and eng.proposer.num_private_copies == 1
    _check_all(seen, ref)


def test_blocks_of_a_request_that_finished_at_once_hold_its_pairs(setup):
    target, path, ref = setup
    gen = _gen(target, path)
    seen = record_proposals(gen)
    gen.generate([X + [50]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # no catch-up while alive
    gen.generate([X + [50, 70]], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert gen.engine.core.stats()["prefix_cache_hits"] > 0
    assert gen.engine.proposer.num_unknown_prefix_pairs == 0
    _check_all(seen, ref)

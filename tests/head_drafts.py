"""What a head proposer drafted, recorded from a running Generator, and the check that it equals
an independent reference's drafts: shared by the EAGLE and head-quantization tests."""
from specinfer import Generator, SamplingParams
from spec_cases import prompts


splits = [0]  # verification runs of a split proposal (no bonus row) seen by _record_proposals


def record_proposals(gen):
    proposer, seen = gen.engine.proposer, []
    inner = proposer.propose

    def spy(inp):
        prop = inner(inp)
        splits[0] += int(((inp.num_rows == inp.num_draft) & (inp.num_draft > 0)).sum())
        by_id = {st.core_id: st for st in inp.requests}
        for j, cid in enumerate(prop.core_ids.tolist()):
            st = by_id[cid]
            seen.append((st.tokens_slice(0, st.num_tokens),
                         prop.draft_token_ids[prop.cu_num_draft[j]:prop.cu_num_draft[j + 1]].tolist()))
        return prop

    proposer.propose = spy
    return seen


def check_drafts_equal_reference(target, path, reference, method, **spec):
    """Every third proposal the engine makes equals `reference.drafts` recomputed from the whole
    history, with tiny blocks and budget (chunked prefill, mixed steps), a pool that preempts and
    every prompt twice (prefix-cache hits). Returns (generator, proposals seen)."""
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=20, num_kv_blocks=40, max_model_len=128,
                    speculative={"method": method, "model": str(path), "quantization": "none", "num_speculative_tokens": 3,
                                 "policy": "fixed", **spec})
    seen = record_proposals(gen)
    ps = prompts(8)
    gen.generate(ps + ps, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    stats = gen.engine.core.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and gen.engine.num_mixed_steps > 0
    assert len(seen) > 40
    for tokens, drafts in seen[::3]:
        assert drafts == reference.drafts(tokens, len(drafts)), len(tokens)
    return gen, seen

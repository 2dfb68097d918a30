"""Greedy output equals HF transformers token for token, through chunked prefill, tiny blocks,
preemption and prefix caching; logprobs match HF's log-softmax; seeds are batch-invariant."""
import pytest
import torch

from specinfer import Generator, SamplingParams

ARCHS = [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("qwen2", True)]
MAX_NEW = 24


def _prompts():
    g = torch.Generator().manual_seed(123)
    lengths = [1, 3, 17, 50, 64, 99, 150, 200]
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    shared = torch.randint(3, 256, (100,), generator=g).tolist()
    prompts += [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 30, 1)]
    return prompts


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=2,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,tied", ARCHS)
def test_greedy_matches_transformers_under_pressure(tiny_dir, arch, tied):
    path, hf = tiny_dir(arch, tied)
    prompts = _prompts()
    want = [_hf_greedy(hf, p, MAX_NEW) for p in prompts]
    # block_size 4 and a 40-token budget: every long prompt is chunked; 100 blocks of 4 tokens
    # hold ~400 tokens while the batch needs ~1300: requests get preempted and recomputed.
    gen = Generator(str(path), block_size=4, max_num_batched_tokens=40, num_kv_blocks=100,
                    max_model_len=256, max_num_seqs=16)
    outs = gen.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)
    got = [o.token_ids for o in outs]
    assert got == want
    stats = gen.engine.core.stats()
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()
    for o, w in zip(outs, want):
        assert o.finish_reason == ("stop" if 2 in w else "length")


def test_logprobs_match_transformers(tiny_dir):
    path, hf = tiny_dir("llama", False)
    prompt = _prompts()[3]
    gen = Generator(str(path), block_size=4)
    out = gen.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        res = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=2, pad_token_id=0)
    ref = torch.stack(res.logits).squeeze(1).log_softmax(-1)  # [n, V]
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(entry[tok] - ref[j, tok].item()) < 1e-4
        top = ref[j].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < 1e-4


def test_seeded_sampling_is_batch_invariant(tiny_dir):
    path, _ = tiny_dir("qwen2", False)
    prompts = _prompts()
    gen = Generator(str(path), block_size=4, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    alone = gen.generate([prompts[2]], sp, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(3)] + \
             [SamplingParams(max_tokens=12, temperature=0.7), SamplingParams(max_tokens=5, temperature=0.0)]
    batch_prompts = [prompts[0], prompts[5], prompts[2], prompts[7], prompts[1], prompts[4]]
    params = others[:2] + [sp] + others[2:]
    outs = gen.generate(batch_prompts, params, use_tqdm=False)
    assert outs[2].token_ids == alone
    # and a different seed gives a different stream (the test could fail)
    other = gen.generate([prompts[2]], SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9,
                                                      seed=8), use_tqdm=False)[0].token_ids
    assert other != alone


def test_text_prompts_and_stop_strings(tiny_dir):
    path, _ = tiny_dir("llama", False)
    gen = Generator(str(path))
    full = gen.generate("t5 t9 t33", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert full.text == " ".join(f"t{i}" for i in full.token_ids)
    words = full.text.split(" ")
    stop = words[4]
    cut = gen.generate("t5 t9 t33", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop not in cut.text.split(" ")
    assert cut.token_ids == full.token_ids[: words.index(stop) + 1]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_min_tokens_blocks_stop_tokens_like_transformers(tiny_dir, spec):
    path, hf = tiny_dir("llama", False)
    prompt = _prompts()[2]
    free = _hf_greedy(hf, prompt, 8)
    stop = free[1]  # the token greedy decoding emits second: make it the stop token
    gen = Generator(str(path), speculative=spec)
    early = gen.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]),
                         use_tqdm=False)[0]
    assert early.token_ids == free[:2] and early.finish_reason == "stop" and early.stop_reason == stop
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=5, do_sample=False,
                          eos_token_id=stop, pad_token_id=0)[0, len(prompt):].tolist()
    out = gen.generate([prompt], SamplingParams(max_tokens=8, min_tokens=5, temperature=0.0,
                                                stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == ref and stop not in out.token_ids[:5]

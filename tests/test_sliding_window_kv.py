"""KV blocks out of a sliding window go back to the pool (SchedulerCore's sliding_window).

A model whose every layer slides (Mistral) never reads a key more than W - 1 positions behind its
query, so the engine asks the core to give back each request's blocks below num_computed_tokens
- W + 1 after every step: a long generation holds about W / block_size blocks, not its whole
context. Checked on a tiny Mistral (W = 16) against HF transformers, token for token, for contexts
of 5 to 20 windows under chunked prefill, n-gram speculation, preemption and prefix caching; the
blocks a long request holds stay bounded; nothing leaks. Models with full-attention layers (Gemma 2
alternates), or proposers with KV of their own (a draft model), keep every block as before."""
import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.engine import llm_engine
from specinfer.engine.llm_engine import kv_sliding_window

WINDOW = 16
BLOCK = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}
TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]


def _spec(method, path, tmp_path):
    """Proposers without KV of their own: the core frees under each of them."""
    if method is None:
        return None
    if method == "ngram":
        return NGRAM
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
                "policy": "fixed"}
    if method == "layer_skip":  # drafts with the target's first layer over the target's (windowed) KV
        return {"method": "layer_skip", "exit_layer": 1, "num_speculative_tokens": 3, "policy": "fixed"}
    if method == "medusa_tree":  # token trees: compaction copies into live blocks only
        import head_checkpoints as hc

        return {"method": "medusa", "model": str(hc.medusa_original(tmp_path / method, path)),
                "num_speculative_tokens": 3, "token_tree": TREE, "policy": "fixed"}
    raise ValueError(method)


@pytest.fixture(scope="module")
def mistral(tiny_dir):
    return tiny_dir("mistral", layers=2, window=WINDOW)


def _hf_greedy(hf, prompt, n, eos=2):
    """HF transformers' greedy continuation (eos=None: never stops early, like ignore_eos)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts():
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 20, 26)]
    shared = torch.randint(3, 256, (21,), generator=g).tolist()  # > a window: cached, then freed
    ps += [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 3, 5)]
    base = torch.randint(3, 256, (8,), generator=g).tolist()
    ps.append(base + base + base)  # repeats: n-gram drafts from the start
    return ps


@pytest.fixture(scope="module")
def mistral_ref(mistral):
    _, hf = mistral
    ps = _prompts()
    return ps, [_hf_greedy(hf, p, 70) for p in ps]  # contexts of 71 to 96 tokens: 4.4 to 6 windows


@pytest.mark.parametrize("method", [None, "ngram", "suffix", "layer_skip", "medusa_tree"])
def test_greedy_matches_transformers_with_the_window_freeing_blocks(mistral, mistral_ref, method, tmp_path):
    path, _ = mistral
    spec = _spec(method, path, tmp_path)
    ps, want = mistral_ref
    # 24-token budget: chunked prefill, mixed steps; 24 blocks of 4 for 10 requests: preemption
    gen = Generator(str(path), block_size=BLOCK, max_num_batched_tokens=24, num_kv_blocks=24, max_model_len=96,
                    speculative=spec)
    assert gen.engine.loaded.config.all_layers_slide
    outs = gen.generate(ps, SamplingParams(max_tokens=70, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    core = gen.engine.core
    stats = core.stats()
    assert stats["num_window_freed_blocks"] > 0, stats
    assert stats["num_preemptions"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    if spec is not None:
        assert gen.spec_metrics()["num_draft_tokens"] > 0
    assert core.num_free_blocks() == core.num_total_blocks()
    core.check_invariants()


def _blocks_held_by_one_long_request(path, prompt, max_tokens, spec):
    """(output, most blocks held after any step): one request alone, stepped by hand."""
    gen = Generator(str(path), block_size=BLOCK, max_num_batched_tokens=24, num_kv_blocks=96, max_model_len=384,
                    speculative=spec)
    eng, core = gen.engine, gen.engine.core
    eng.add_request("long", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    held, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out = o.token_ids
        core.check_invariants()
        held.append(core.num_total_blocks() - core.num_free_blocks())
    while out is None:  # the overlapped loop delivers the last step's outputs one call later
        out = next((o.token_ids for o in eng.step() if o.finished), None)
    assert core.num_free_blocks() == core.num_total_blocks()
    core.check_invariants()
    return out, max(held), core.stats()["num_window_freed_blocks"]


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_a_long_generation_holds_a_window_of_blocks(mistral, spec, monkeypatch):
    path, hf = mistral
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (20,), generator=g).tolist()
    n = 300  # 320 tokens of context: 20 windows
    want = _hf_greedy(hf, prompt, n, eos=None)
    assert len(want) == n
    out, held, freed = _blocks_held_by_one_long_request(path, prompt, n, spec)
    assert out == want
    k = 3 if spec else 0
    # live positions: the last W - 1 keys, the query (1 + k drafts), k lookahead slots, plus a
    # partial block at each end
    bound = (WINDOW - 1 + 1 + 2 * k) // BLOCK + 2
    assert held <= bound, (held, bound)
    assert freed >= (len(prompt) + n - WINDOW - 2 * k) // BLOCK - 2
    # the same run keeping every block (today's behaviour): the whole context
    monkeypatch.setattr(llm_engine, "kv_sliding_window", lambda kv_models: None)
    out_full, held_full, freed_full = _blocks_held_by_one_long_request(path, prompt, n, spec)
    assert out_full == want and freed_full == 0
    assert held_full >= (len(prompt) + n) // BLOCK
    print(f"\nblocks of {BLOCK} held by a 320-token request, W = {WINDOW}, {spec and 'ngram k=3' or 'no spec'}: "
          f"{held} freeing the window, {held_full} keeping every block")


def test_full_attention_layers_keep_every_block(tiny_dir):
    """Gemma 2 alternates sliding and full layers: no block is ever dead."""
    path, hf = tiny_dir("gemma2", layers=3, window=WINDOW)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (20, 50)]
    want = [_hf_greedy(hf, p, 60) for p in ps]
    gen = Generator(str(path), block_size=BLOCK, max_num_batched_tokens=24, num_kv_blocks=40, max_model_len=160)
    assert not gen.engine.loaded.config.all_layers_slide
    outs = gen.generate(ps, SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    core = gen.engine.core
    assert core.stats()["num_window_freed_blocks"] == 0
    assert core.num_free_blocks() == core.num_total_blocks()
    core.check_invariants()


class _Cfg:
    def __init__(self, window, all_slide):
        self.min_window, self.all_layers_slide = window, all_slide


class _Model:
    def __init__(self, cfg):
        self.config = cfg


def test_which_kv_users_let_the_core_free_blocks():
    sliding, full = _Model(_Cfg(16, True)), _Model(_Cfg(None, False))
    assert kv_sliding_window([sliding]) == 16
    assert kv_sliding_window([full]) is None
    # a proposer with KV of its own catches up from behind the target: keep every block
    assert kv_sliding_window([sliding, _Model(_Cfg(8, True))]) is None
    assert kv_sliding_window([sliding, full]) is None
    assert kv_sliding_window([sliding, object()]) is None  # a head without all_layers_slide
    assert kv_sliding_window([object()]) is None


def test_a_draft_model_keeps_every_block(mistral, tiny_dir):
    """A sliding draft model's catch-up queries sit below the target's computed tokens: the engine
    does not free (and greedy output is still the target's)."""
    path, hf = mistral
    draft, _ = tiny_dir("mistral", layers=1, window=WINDOW, seed=1)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (30,), generator=g).tolist()
    want = _hf_greedy(hf, prompt, 60)
    gen = Generator(str(path), block_size=BLOCK, max_num_batched_tokens=24, num_kv_blocks=40, max_model_len=160,
                    speculative={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                 "policy": "fixed"})
    out = gen.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)
    assert out[0].token_ids == want
    assert gen.engine.core.stats()["num_window_freed_blocks"] == 0

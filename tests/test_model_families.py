"""Every model family through the engine: greedy output equals HF transformers token for token
under chunked prefill, a KV pool small enough to preempt and prefix caching, on the CPU's
default attention backend and the torch reference; and greedy speculation with every proposer
(n-gram, suffix, a draft model of the same family, layer-skip, MLP speculator, Medusa, EAGLE,
EAGLE-3, a token tree) changes nothing on each family.

The tiny models (tests/tiny_models.py) have three layers and every feature of their family on:
sliding layers with a 16-token window (contexts here reach 100+ tokens), Gemma 2's soft-caps,
Gemma 3's local RoPE base, Phi-3's LongRoPE and fused tensors, MoE with top-2 of 4 experts, a
dense layer among Qwen3-MoE's and Qwen2-MoE's shared expert."""
import pytest
import torch

import head_checkpoints as hc
from spec_cases import GREEDY, check_greedy_exact, prompts
from specinfer import Generator, SamplingParams
from tiny_models import FAMILIES

WINDOW = 16
PRESSURE = [(4, 24, 40, 8)]  # block size, token budget, KV blocks, batch: chunked, mixed, preempting
TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_dir):
    path, hf = tiny_dir(request.param, layers=3, window=WINDOW)
    return request.param, path, hf


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def family_ref(family):
    """The family's greedy outputs for spec_cases' prompts, by HF transformers."""
    _, _, hf = family
    ps = prompts(8)
    return ps, [_hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]


@pytest.mark.parametrize("backend", ["cpu_native", "torch_ref"])
def test_greedy_matches_transformers_under_pressure(family, backend):
    arch, path, hf = family
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 256, (40,), generator=g).tolist()
    ps = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 9, 33, 70, 100)]
    ps += [shared + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 30)]
    want = [_hf_greedy(hf, p, 20) for p in ps]
    gen = Generator(str(path), block_size=4, max_num_batched_tokens=24, num_kv_blocks=60, max_model_len=160,
                    attention_backend=backend)
    outs = gen.generate(ps, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in outs] == want, arch
    stats = gen.engine.core.stats()
    # an all-sliding model (Mixtral, Phi-3) gives back the blocks out of its window: the pool may
    # then never run out (test_sliding_window_kv.py preempts one)
    assert stats["num_preemptions"] + stats["num_window_freed_blocks"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()


def _spec(method, path, tmp_path, target):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0}
    if method == "draft_model":  # a perturbed copy of the target: same family, agrees often
        return {"method": "draft_model", "model": str(target["draft"]), "num_speculative_tokens": 3}
    if method == "layer_skip":
        return {"method": "layer_skip", "exit_layer": 2, "num_speculative_tokens": 3}
    if method == "mlp_speculator":
        return {"method": method, "model": str(hc.mlp_speculator(tmp_path / method, path)), "num_speculative_tokens": 3}
    if method == "medusa":
        return {"method": method, "model": str(hc.medusa_original(tmp_path / method, path)), "num_speculative_tokens": 3}
    if method == "medusa_tree":
        return {"method": "medusa", "model": str(hc.medusa_original(tmp_path / method, path)),
                "num_speculative_tokens": 3, "token_tree": TREE}
    if method == "eagle":
        return {"method": "eagle", "model": str(hc.eagle1(tmp_path / method, path, repeat=True)),
                "num_speculative_tokens": 3}
    if method == "eagle3":
        return {"method": "eagle3", "model": str(hc.eagle3(tmp_path / method, path)), "num_speculative_tokens": 3}
    raise ValueError(method)


METHODS = ["ngram", "suffix", "draft_model", "layer_skip", "mlp_speculator", "medusa", "medusa_tree", "eagle", "eagle3"]


@pytest.fixture(scope="module")
def draft_of(family, tmp_path_factory):
    from tiny_models import build_tiny_model

    arch, path, _ = family
    draft = tmp_path_factory.mktemp(f"{arch}_draft")
    build_tiny_model(draft, arch, layers=3, window=WINDOW, base=path, perturb=0.004)
    return {"draft": draft}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_changes_nothing(family, family_ref, draft_of, tmp_path, method):
    arch, path, _ = family
    spec = _spec(method, path, tmp_path, draft_of)
    tot = check_greedy_exact(path, spec, family_ref, settings=PRESSURE)
    assert tot["num_draft_tokens"] > 0, (arch, method)


def test_trees_deeper_than_the_window_are_refused(tiny_dir):
    path, _ = tiny_dir("mixtral", layers=3, window=WINDOW)
    with pytest.raises(ValueError, match="narrowest window is 16"):
        Generator(str(path), speculative={"method": "suffix", "num_speculative_tokens": 16})
    Generator(str(path), speculative={"method": "suffix", "num_speculative_tokens": 15})  # shallower: fine

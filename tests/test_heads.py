"""MLP speculator and Medusa heads: checkpoints fabricated in each public layout load and drive
speculation; greedy output equals the target's alone (both scorers, chunked-prefill mixed batches,
preemption, prefix hits); save -> load gives identical proposals; malformed checkpoints are
refused with an error naming the tensor or field."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import head_checkpoints as hc
from specinfer import Generator
from spec_cases import check_greedy_exact, check_prefix_hits
from specinfer.spec_decode.medusa import MedusaHeads
from specinfer.spec_decode.mlp_speculator import MLPSpeculator


LAYOUTS = {
    "mlp_plain": ("mlp_speculator", lambda p, t: hc.mlp_speculator(p, t)),
    "mlp_tied_scaled_inner": ("mlp_speculator", lambda p, t: hc.mlp_speculator(p, t, inner_dim=32, tie=True,
                                                                               scale_input=True, prefix=False)),
    "medusa_original": ("medusa", lambda p, t: hc.medusa_original(p, t, num_layers=2)),
    "medusa_original_legacy_pt": ("medusa", lambda p, t: hc.medusa_original(p, t, legacy=True, pt=True)),
    "medusa_vllm_truncated": ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=160, prefix=True)),
    "medusa_vllm_shared_nobias": ("medusa", lambda p, t: hc.medusa_vllm(p, t, fc_bias=False, shared=True)),
}


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {name: (method, make(root / name, target)) for name, (method, make) in LAYOUTS.items()}


@pytest.mark.parametrize("name,scorer", [
    pytest.param("mlp_plain", "mqa", marks=pytest.mark.slow), ("mlp_tied_scaled_inner", "batch_expansion"),
    pytest.param("medusa_original", "batch_expansion", marks=pytest.mark.slow),
    pytest.param("medusa_original_legacy_pt", "mqa", marks=pytest.mark.slow), ("medusa_vllm_truncated", "mqa"),
    pytest.param("medusa_vllm_shared_nobias", "batch_expansion", marks=pytest.mark.slow)])
def test_head_greedy_is_exact(target, ref, heads, name, scorer):
    method, path = heads[name]
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 3, "scorer": scorer}
    tot = check_greedy_exact(target, spec, ref)
    assert 0 < tot["num_accepted_tokens"] < tot["num_draft_tokens"], tot


@pytest.mark.parametrize("name", [pytest.param("mlp_plain", marks=pytest.mark.slow), "medusa_vllm_truncated"])
def test_head_with_prefix_hits(target, ref, heads, name):
    method, path = heads[name]
    check_prefix_hits(target, {"method": method, "model": str(path), "num_speculative_tokens": 4}, ref)


def _load(method, path, target_logits=None):
    kw = dict(hidden_size=64, vocab_size=256, dtype=torch.float32, device=torch.device("cpu"))
    if method == "mlp_speculator":
        return MLPSpeculator.load(path, **kw)
    return MedusaHeads.load(path, target_logits=target_logits, **kw)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_save_load_round_trip_gives_identical_proposals(target, heads, name, tmp_path):
    method, path = heads[name]
    lm = hc.target_lm_head(target)
    logits = lambda h: h @ lm.T  # noqa: E731  the target's lm_head (legacy Medusa heads use it)
    a = _load(method, path, logits)
    a.save(tmp_path / "saved")
    b = _load(method, tmp_path / "saved", logits)
    g = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(16, 64, generator=g) * 3, torch.randint(0, 256, (16,), generator=g)
    da, db = a.draft(hidden, tokens, 4), b.draft(hidden, tokens, 4)
    assert torch.equal(da, db)
    assert len(set(da.flatten().tolist())) > 4  # proposals depend on the input


def test_mlp_speculator_follows_the_reference_math(heads):
    """The stage math written out independently (fms-extras generate_suffixes), on a tied,
    scale_input, inner_dim != emb_dim checkpoint that stores only untied keys for stage 0/proj.1."""
    import math

    import torch.nn.functional as F
    path = heads["mlp_tied_scaled_inner"][1]
    t = load_file(str(path / "model.safetensors"))
    head = _load("mlp_speculator", path)
    g = torch.Generator().manual_seed(1)
    h, y0 = torch.randn(5, 64, generator=g), torch.randint(0, 256, (5,), generator=g)
    n, D = 4, 32
    a = 0.5 ** (0.5 / n)
    b = math.sqrt((1 - a ** 2) * D / 2)
    s = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    y, want = y0, []
    for i in range(n):
        u = s @ t[f"proj.{i}.weight"].T + F.embedding(y, t[f"emb.{i}.weight"]) * (b / a)
        u = t[f"ln.{i}.weight"] * u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) + t[f"ln.{i}.bias"]
        s = F.gelu(u)
        y = (s @ t[f"head.{i}.weight"].T).argmax(-1)
        want.append(y)
    assert torch.equal(head.draft(h, y0, n), torch.stack(want, 1))


def test_heads_read_the_hidden_state_of_the_sampled_position(target, tmp_path):
    """Zero-initialised Medusa heads with the target's lm_head draft argmax(lm_head(h_t)), which is
    the newest token x_{t+1} itself: only the hidden state of the sampled row gives that, in
    prefill chunks, plain decodes, verifications with any number accepted and split proposals."""
    path = hc.medusa_original(tmp_path / "zero", target, legacy=True, scale=0.0)
    # a budget of 9 with k = 4 cuts many proposals (split runs, verified without a bonus row)
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=9, num_kv_blocks=40, max_model_len=128,
                    speculative={"method": "medusa", "model": str(path), "num_speculative_tokens": 4,
                                 "policy": "fixed"})
    proposer = gen.engine.proposer
    seen, splits = [], []
    inner = proposer.propose

    def spy(inp):
        prop = inner(inp)
        rows = [r for r in range(inp.num_requests) if inp.max_drafts[r] > 0]
        seen.append((inp.last_tokens(rows).tolist(), prop.draft_token_ids.tolist(), prop.cu_num_draft.tolist(),
                     inp.num_accepted[rows].tolist()))
        split = (inp.num_rows == inp.num_draft) & (inp.num_draft > 0) & (inp.num_accepted < inp.num_draft)
        splits.append(int((split & (inp.max_drafts > 0)).sum()))  # split, a rejection, and a new proposal
        return prop

    proposer.propose = spy
    from spec_cases import GREEDY, prompts
    gen.generate(prompts(12), GREEDY, use_tqdm=False)
    checked = accepted_runs = 0
    for last, drafts, cu, acc in seen:
        for j, tok in enumerate(last):
            d = drafts[cu[j]:cu[j + 1]]
            assert d == [tok] * len(d)
            checked += len(d) > 0
            accepted_runs += acc[j] > 0
    assert checked > 50 and accepted_runs > 0 and sum(splits) > 0  # split proposals (no bonus row) too


def _edit_tensors(path, file, edit):
    t = load_file(str(path / file))
    edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / file))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


MALFORMED = {
    # name: (method, fabricate, spoil, k, error must mention)
    "mlp_missing_tensor": ("mlp_speculator", hc.mlp_speculator,
                           lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.pop("speculator.proj.2.weight")),
                           3, "proj.2.weight"),
    "mlp_wrong_shape": ("mlp_speculator", hc.mlp_speculator,
                        lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.update(
                            {"speculator.head.1.weight": torch.zeros(256, 63)})), 3, "head.1.weight"),
    "mlp_hidden_size": ("mlp_speculator", hc.mlp_speculator, lambda p: _edit_config(p, emb_dim=32), 3, "emb_dim"),
    "mlp_vocabulary": ("mlp_speculator", hc.mlp_speculator, lambda p: _edit_config(p, vocab_size=300), 3,
                       "vocab_size"),
    "mlp_too_many_tokens": ("mlp_speculator", hc.mlp_speculator, lambda p: None, 5, "n_predict"),
    "mlp_unknown_tensor": ("mlp_speculator", hc.mlp_speculator,
                           lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.update(
                               {"speculator.ln0.weight": torch.ones(64)})), 3, "ln0.weight"),
    "mlp_topk_length": ("mlp_speculator", hc.mlp_speculator, lambda p: _edit_config(p, top_k_tokens_per_head=[1]),
                        3, "top_k_tokens_per_head"),
    "mlp_tied_copy_differs": ("mlp_speculator", lambda p, t: hc.mlp_speculator(p, t, tie=True),
                              lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.update(
                                  {"speculator.emb.2.weight": t["speculator.emb.2.weight"] + 1})), 3, "emb.2.weight"),
    "medusa_missing_bias": ("medusa", hc.medusa_original,
                            lambda p: _edit_tensors(p, "medusa_lm_head.safetensors",
                                                    lambda t: t.pop("1.0.linear.bias")), 3, "1.0.linear.bias"),
    "medusa_one_head_without_lm_head": ("medusa", hc.medusa_original,
                                        lambda p: _edit_tensors(p, "medusa_lm_head.safetensors",
                                                                lambda t: t.pop("2.1.weight")), 3, "2.1.weight"),
    "medusa_head_count": ("medusa", hc.medusa_original, lambda p: _edit_config(p, medusa_num_heads=2), 2,
                          "medusa_num_heads"),
    "medusa_too_many_tokens": ("medusa", hc.medusa_original, lambda p: None, 5, "number of heads"),
    "medusa_vllm_hidden_size": ("medusa", hc.medusa_vllm, lambda p: _edit_config(p, hidden_size=32), 3,
                                "hidden_size"),
    "medusa_vllm_vocabulary": ("medusa", hc.medusa_vllm, lambda p: _edit_config(p, vocab_size=32001), 3,
                               "vocab_size"),
    "medusa_vllm_missing_token_map": ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=100),
                                      lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.pop("token_map")),
                                      3, "token_map"),
    "medusa_vllm_token_map_range": ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=100),
                                    lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.update(
                                        {"token_map": t["token_map"] + 200})), 3, "token_map"),
    "medusa_vllm_wrong_shape": ("medusa", hc.medusa_vllm,
                                lambda p: _edit_tensors(p, "model.safetensors", lambda t: t.update(
                                    {"lm_heads.3.weight": torch.zeros(255, 64)})), 3, "lm_heads.3.weight"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_checkpoint_is_refused(target, tmp_path, name):
    method, make, spoil, k, match = MALFORMED[name]
    path = make(tmp_path / name, target)
    spoil(path)
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        Generator(str(target), speculative={"method": method, "model": str(path), "num_speculative_tokens": k})


def test_head_method_needs_a_checkpoint(target, tmp_path):
    with pytest.raises(ValueError, match="model"):
        Generator(str(target), speculative={"method": "medusa"})
    with pytest.raises(FileNotFoundError, match="config.json"):
        Generator(str(target), speculative={"method": "mlp_speculator", "model": str(tmp_path)})

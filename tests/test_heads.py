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
from spec_cases import check_greedy_exact, check_prefix_hits, reference
from specinfer.spec_decode.medusa import MedusaHeads
from specinfer.spec_decode.mlp_speculator import MLPSpeculator


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir("llama", False)[0]


@pytest.fixture(scope="module")
def ref(target):
    return reference(target)


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
    ("mlp_plain", "mqa"), ("mlp_tied_scaled_inner", "batch_expansion"), ("medusa_original", "batch_expansion"),
    ("medusa_original_legacy_pt", "mqa"), ("medusa_vllm_truncated", "mqa"),
    ("medusa_vllm_shared_nobias", "batch_expansion")])
def test_head_greedy_is_exact(target, ref, heads, name, scorer):
    method, path = heads[name]
    spec = {"method": method, "model": str(path), "num_speculative_tokens": 3, "scorer": scorer}
    tot = check_greedy_exact(target, spec, ref)
    assert 0 < tot["num_accepted_tokens"] < tot["num_draft_tokens"], tot


@pytest.mark.parametrize("name", ["mlp_plain", "medusa_vllm_truncated"])
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

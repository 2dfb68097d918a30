"""Weight-only int8 draft heads (`speculative.quantization`): a quantized head computes what the
dense head computes with its GEMM weights rounded to int8 (EAGLE-1 / EAGLE-3: the engine's drafts
equal the HF reference run on a checkpoint of rounded weights, through chunked prefill, prefix
hits and preemption; Medusa / MLP speculator: stage logits match), greedy output stays the
target's, the head follows the target's quantization unless told otherwise, and bad values,
methods without weights and saving a quantized head are refused."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import head_checkpoints as hc
from eagle_reference import Eagle3Reference, EagleReference
from specinfer import Generator
from specinfer.models.int8_linear import Int8Weight, quantize_rows
from specinfer.spec_decode.config import SpeculativeConfig
from specinfer.spec_decode.medusa import MedusaHeads
from specinfer.spec_decode.mlp_speculator import MLPSpeculator
from specinfer.spec_decode.head_quantization import apply_quantization
from spec_cases import check_greedy_exact
from head_drafts import check_drafts_equal_reference


def _rounded(w: torch.Tensor) -> torch.Tensor:
    """A weight as the int8 kernel sees it: per-32 absmax int8, dequantized."""
    q = quantize_rows(w)
    return (q.q.float().view(w.shape[0], -1, q.group) * q.scales.unsqueeze(-1)).view(w.shape)


def _rounded_checkpoint(src, dst, file="model.safetensors"):
    """src's checkpoint with every GEMM weight (2-D float, not an embedding) rounded to int8."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != file:
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(str(src / file))
    save_file({k: _rounded(v) if v.dim() == 2 and v.is_floating_point() and "emb" not in k else v
               for k, v in t.items()}, str(dst / file))
    return dst


def _head(gen):
    return gen.engine.proposer.draft if hasattr(gen.engine.proposer, "draft") else gen.engine.proposer.head


def _drafts_match_reference(target, path, reference, method):
    gen, _ = check_drafts_equal_reference(target, path, reference, method, quantization="int8")
    head = _head(gen)
    assert head.quantization == "int8"
    return head


def test_int8_eagle_drafts_equal_the_reference_over_rounded_weights(target, tmp_path):
    path = hc.eagle1(tmp_path / "eagle", target)
    head = _drafts_match_reference(target, path, EagleReference(target, _rounded_checkpoint(path, tmp_path / "r")),
                                   "eagle")
    assert isinstance(head.fc_w, Int8Weight) and isinstance(head.layer.qkv_weight, Int8Weight)
    # the rounding matters: the dense head's drafts differ from the rounded one's somewhere
    assert not torch.equal(load_file(str(path / "model.safetensors"))["fc.weight"],
                           load_file(str(tmp_path / "r" / "model.safetensors"))["fc.weight"])


def test_int8_eagle3_drafts_equal_the_reference_over_rounded_weights(tiny_dir, tmp_path):
    target = tiny_dir("llama", False, layers=8)[0]
    path = hc.eagle3(tmp_path / "e3", target, draft_vocab=96)
    head = _drafts_match_reference(target, path, Eagle3Reference(target, _rounded_checkpoint(path, tmp_path / "r")),
                                   "eagle3")
    assert all(isinstance(head.w[n], Int8Weight) for n in ("fc.weight", "lm_head.weight",
                                                            "midlayer.self_attn.q_proj.weight"))


@pytest.mark.parametrize("method,make", [
    ("mlp_speculator", lambda p, t: hc.mlp_speculator(p, t, inner_dim=32, tie=True, scale_input=True)),
    ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=160, prefix=True))])
def test_int8_head_stages_equal_the_dense_head_over_rounded_weights(target, tmp_path, method, make):
    path = make(tmp_path / "head", target)
    cls = MLPSpeculator if method == "mlp_speculator" else MedusaHeads
    kw = dict(hidden_size=64, vocab_size=256, dtype=torch.float32, device=torch.device("cpu"))
    if cls is MedusaHeads:
        kw["target_logits"] = None
    quant, rounded = cls.load(path, **kw), cls.load(_rounded_checkpoint(path, tmp_path / "r"), **kw)
    dense = cls.load(path, **kw)
    quant.quantize("int8")
    g = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(16, 64, generator=g) * 3, torch.randint(0, 256, (16,), generator=g)
    sq, sr, sd = quant.start(hidden, tokens), rounded.start(hidden, tokens), dense.start(hidden, tokens)
    for i in range(quant.num_stages):
        sq, lq = quant.stage(i, sq, tokens)
        sr, lr = rounded.stage(i, sr, tokens)
        sd, ld = dense.stage(i, sd, tokens)
        finite = torch.isfinite(lr)
        assert torch.equal(finite, torch.isfinite(lq))
        assert torch.allclose(lq[finite], lr[finite], atol=1e-4, rtol=1e-4), i
        assert not torch.allclose(ld[finite], lr[finite], atol=1e-6, rtol=0), i  # rounding changed something
    assert torch.equal(quant.draft(hidden, tokens, 4), rounded.draft(hidden, tokens, 4))
    with pytest.raises(ValueError, match="quantized for inference"):
        quant.save(tmp_path / "saved")


@pytest.mark.parametrize("method,make", [
    ("medusa", lambda p, t: hc.medusa_vllm(p, t, truncated=160, prefix=True)),
    pytest.param("eagle", lambda p, t: hc.eagle1(p, t, repeat=True), marks=pytest.mark.slow)])
def test_int8_head_greedy_is_exact(target, ref, tmp_path, method, make):
    path = make(tmp_path / "head", target)
    tot = check_greedy_exact(target, {"method": method, "model": str(path), "num_speculative_tokens": 3,
                                      "quantization": "int8"}, ref)
    assert 0 < tot["num_accepted_tokens"] < tot["num_draft_tokens"], tot


def test_head_follows_the_target_quantization_unless_told(target, tmp_path):
    path = hc.eagle1(tmp_path / "eagle", target, repeat=True)
    spec = {"method": "eagle", "model": str(path), "num_speculative_tokens": 2}
    kinds = {}
    cases = ((None, None, "float32"), (None, "none", "float32"), ("int8", None, "float32"),
             ("int8", "none", "float32"), (None, "int8", "float32"), (None, None, "bfloat16"))
    for quant, head_quant, dtype in cases:
        s = dict(spec, **({} if head_quant is None else {"quantization": head_quant}))
        gen = Generator(str(target), max_model_len=64, quantization=quant, dtype=dtype, speculative=s)
        kinds[(quant, head_quant, dtype)] = isinstance(_head(gen).fc_w, Int8Weight)
    # a float32 target on CPU: int8 heads by default ("auto"); otherwise the target's quantization
    assert kinds == {(None, None, "float32"): True, (None, "none", "float32"): False,
                     ("int8", None, "float32"): True, ("int8", "none", "float32"): False,
                     (None, "int8", "float32"): True, (None, None, "bfloat16"): False}


class _FakeHead:
    def __init__(self, *inputs):
        self.weights = [torch.zeros(8, k) for k in inputs]
        self.quantized_as = None

    def gemm_weights(self):
        return self.weights

    def quantize(self, quantization):
        self.quantized_as = quantization


def test_auto_quantizes_only_heads_whose_gemms_fit():
    fits, odd = _FakeHead(64, 96), _FakeHead(64, 48)  # 48 inputs: not a multiple of the group (32)
    for head in (fits, odd):
        apply_quantization(head, "auto")
    assert (fits.quantized_as, odd.quantized_as) == ("int8", None)
    apply_quantization(odd, None)
    assert odd.quantized_as is None
    apply_quantization(odd, "int8")  # asked for explicitly: the head's quantize() decides (and refuses)
    assert odd.quantized_as == "int8"


def test_draft_model_follows_speculative_quantization(target):
    gen = Generator(str(target), max_model_len=64, speculative={"method": "draft_model", "model": str(target),
                                                                "num_speculative_tokens": 2, "quantization": "int8"})
    assert gen.engine.loaded.model.quantization is None
    assert gen.engine.proposer.loaded.model.quantization == "int8"


def test_bad_head_quantization_is_refused():
    with pytest.raises(ValueError, match="speculative.quantization 'fp8' is unknown"):
        SpeculativeConfig(method="medusa", model="x", quantization="fp8")
    with pytest.raises(ValueError, match="no weights of its own"):
        SpeculativeConfig(method="ngram", quantization="int8")

"""GGUF files of every family llama.cpp defines (Qwen3, Qwen3-MoE, Qwen2-MoE, Gemma 2, Gemma 3,
Phi-3, Mixtral), written as llama.cpp's converter writes them (tests/gguf_writer.py), load into the
same model as their HF checkpoints: same configuration, logits equal over chunked prefill and
decodes. MoE experts stored as Q8_0 stay int8 under quantization="int8" (not re-rounded)."""
import pytest
import torch

from specinfer.attention import AttentionMetadata, ForwardContext, get_backend
from specinfer.loader import load_model
from gguf_writer import write_gguf

FAMILIES = ["qwen3", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3_text", "phi3", "mixtral"]
# the tiny models' parts llama.cpp's formats cannot express are left out: Qwen3-MoE's dense
# layers (one layer: none), Gemma 2's query_pre_attn_scalar other than head_dim (llama.cpp fixes it)
LAYERS = {"qwen3_moe": 1}


def _logits(model, ids, chunks, bs=4):
    backend = get_backend("torch_ref")
    caches = [torch.zeros(model.kv_cache_shape(32, bs)) for _ in range(model.num_layers)]
    out, done = [], 0
    for n in chunks:
        end = done + n
        pos = torch.arange(done, end)
        meta = AttentionMetadata(slot_mapping=pos.clone(), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                 seq_lens=torch.tensor([end], dtype=torch.int32),
                                 block_table=torch.arange(32, dtype=torch.int32).view(1, 32), block_size=bs,
                                 max_query_len=n, max_seq_len=end)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[done:end]), pos, ForwardContext(backend, backend.prepare(meta), caches))
            out.append(model.compute_logits(hidden))
        done = end
    return torch.cat(out)


def _tiny(tmp_path, arch):
    import json

    from tiny_models import build_tiny_model

    d = tmp_path / arch
    build_tiny_model(d, arch, layers=LAYERS.get(arch, 2), window=8)
    cfg = json.loads((d / "config.json").read_text())
    if arch == "gemma2":
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_equals_the_hf_checkpoint(tmp_path, arch):
    d = _tiny(tmp_path, arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(d, path)
    hf, gg = load_model(str(d)), load_model(str(path))
    a, b = hf.config, gg.config
    for field in ("architecture", "num_layers", "head_dim", "qk_norm", "hidden_act", "sandwich_norms",
                  "attn_softcap", "final_softcap", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "local_rope_theta", "rope_theta", "tie_word_embeddings", "norm_topk_prob",
                  "shared_expert_intermediate_size", "attention_bias"):
        assert getattr(a, field) == getattr(b, field), field
    assert [a.layer_window(i) for i in range(a.num_layers)] == [b.layer_window(i) for i in range(b.num_layers)]
    assert a.rope_scaling == b.rope_scaling or (a.rope_type == b.rope_type == "longrope")
    ids = [(7 * i + 3) % 250 + 3 for i in range(30)]
    torch.testing.assert_close(_logits(gg.model, ids, [13, 1, 1, 15]), _logits(hf.model, ids, [13, 1, 1, 15]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_q8_0_experts_stay_int8(tmp_path, arch):
    from specinfer.models.int8_linear import Int8Weight

    d = _tiny(tmp_path, arch)
    path = tmp_path / f"{arch}-q8.gguf"
    write_gguf(d, path, expert_type="q8_0")
    dense, int8 = load_model(str(path)), load_model(str(path), quantization="int8")
    moe = next(layer.moe for layer in int8.model.layers if layer.moe is not None)
    assert isinstance(moe.gate_up[0], Int8Weight)
    import gguf

    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    raw = t.data.reshape(t.data.shape[0], -1)[1].reshape(-1, 34)  # expert 1's Q8_0 blocks
    q = raw[:, 2:].copy().view("int8").reshape(-1)
    assert torch.equal(moe.down[1].q.reshape(-1).cpu(), torch.from_numpy(q))  # the stored int8 values, as stored
    ids = [(5 * i + 1) % 250 + 3 for i in range(20)]
    want = _logits(dense.model, ids, [20])  # the same Q8_0 values, dequantized to float32
    got = _logits(int8.model, ids, [20])
    assert (got - want).abs().max() < 0.05 * want.abs().max()

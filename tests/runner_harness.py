"""Model forwards driven through ModelRunner the way the engine drives them, and a model's int8
float twin, shared by the backend, packing and precision tests."""
import numpy as np
import torch

from specinfer.attention import AttentionMetadata, get_backend
from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.models.model_runner import ModelRunner
from specinfer.models.int8_linear import quantize_rows


def model_logits(tiny_dir, backend_name, block_size=4, dtype=torch.float32):
    """Two steps of a tiny llama through ModelRunner: a prefill chunk step, then a mixed step
    (prefill continuation, a decode, a 1 + 3 verification run). Returns both steps' logits."""
    from specinfer.attention.kv_cache import allocate_kv_caches
    from specinfer.loader import load_model

    path, _ = tiny_dir("llama", kv_heads=2)
    lm = load_model(path, dtype=dtype)
    caches = allocate_kv_caches(lm.model, 40, block_size, dtype, "cpu")
    runner = ModelRunner(lm.model, caches, get_backend(backend_name))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g) for n in (13, 6, 9)]
    tables = [[5, 17, 2, 30, 11, 8], [22, 3, 36, 14, 0, 0], [9, 25, 1, 33, 0, 0]]

    def step(spans):  # spans: (seq, start, end) token positions computed this step
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for s, a, b in spans:
            ids.append(prompts[s][a:b])
            pos += list(range(a, b))
            slots += [tables[s][p // block_size] * block_size + p % block_size for p in range(a, b)]
            qsl.append(qsl[-1] + b - a)
            lens.append(b)
        meta = AttentionMetadata(torch.tensor(slots), torch.tensor(qsl, dtype=torch.int32),
                                 torch.tensor(lens, dtype=torch.int32),
                                 torch.tensor([tables[s] for s, _, _ in spans], dtype=torch.int32),
                                 block_size, max(b - a for _, a, b in spans), max(lens))
        hidden, _ = runner.forward(torch.cat(ids), torch.tensor(pos), meta)
        return runner.logits(hidden)

    first = step([(0, 0, 8), (1, 0, 5), (2, 0, 5)])
    second = step([(0, 8, 13), (1, 5, 6), (2, 5, 9)])  # prefill chunk, decode, verification 1 + 3
    return torch.cat([first, second])


def two_run_logits(loaded, tokens):
    """Logits of two token runs (two sequences, one prefill each) of a loaded model, torch_ref attention."""
    m = loaded.model
    caches = [torch.zeros(m.kv_cache_shape(8, 16)) for _ in range(m.num_layers)]
    runner = ModelRunner(m, caches, get_backend("torch_ref"))
    rows = np.arange(8, dtype=np.int32).reshape(2, 4)
    attn, pos = attention_metadata_for_runs(rows, np.array([0, 0]), np.array([len(tokens[0]), len(tokens[1])]),
                                            16, torch.device("cpu"))
    hidden, _ = runner.forward(torch.tensor(tokens[0] + tokens[1]), torch.from_numpy(pos), attn)
    return runner.logits(hidden)


def int8_twin_dir(hf_dir, tmp_path):
    """An HF directory holding the float32 dequantization of hf_dir's int8-quantized GEMM weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                qt = quantize_rows(p)
                p.copy_((qt.q.float().view(p.shape[0], -1, 32) * qt.scales.unsqueeze(-1)).view(p.shape))
    out = tmp_path / "twin"
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    return out

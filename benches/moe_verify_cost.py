"""What verification costs on a mixture-of-experts model, against its dense equivalent.

A tiny random Mixtral (8 experts, top-2) and a Llama of the same attention and the same active
MLP width (2 x the expert width): the forward time of a batch of B requests each running 1 + k
tokens (a decode at k = 0, a verification of k drafts otherwise) over a 256-token context, as a
multiple of the decode step, and how many experts the step activates. On the dense model 1 + k
tokens cost little more than one (the weights are read once); on the MoE model more tokens route
to more experts, so verification reads more weights.

Then the goodput policy's choice on each (n-gram, k up to 7, default policy, greedy, a batch of
prompts): drafts per drafted step and acceptance — a dearer verification should draft fewer.

    python benches/moe_verify_cost.py [--batch 1] [--hidden 512] [--repeats 20]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from specinfer.attention import AttentionMetadata, ForwardContext, get_backend  # noqa: E402
from specinfer.loader import load_model  # noqa: E402


def _build(kind: str, hidden: int, layers: int, experts: int, path: Path):
    import transformers as tf

    common = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=1024)
    if kind == "moe":
        cfg = tf.MixtralConfig(**common, intermediate_size=2 * hidden, num_local_experts=experts,
                               num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(cfg)
    else:  # the same active parameters per token: 2 experts' width
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=4 * hidden))
    model.save_pretrained(path)
    from tiny_models import _tokenizer

    _tokenizer(1024).save(str(path / "tokenizer.json"))
    return load_model(str(path)).model


def _step_ms(model, B: int, q: int, ctx_len: int, repeats: int) -> tuple[float, int]:
    backend = get_backend("cpu_native")
    bs = 16
    blocks_per = (ctx_len + q + bs - 1) // bs
    caches = [torch.zeros(model.kv_cache_shape(B * blocks_per + 1, bs)) for _ in range(model.num_layers)]
    table = torch.arange(B * blocks_per, dtype=torch.int32).view(B, blocks_per)
    pos = torch.cat([torch.arange(ctx_len, ctx_len + q) for _ in range(B)])
    slots = torch.cat([table[b].to(torch.int64)[p // bs] * bs + p % bs for b, p in
                       enumerate(torch.arange(ctx_len, ctx_len + q).repeat(B, 1))])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(0, B * q + 1, q, dtype=torch.int32),
                             seq_lens=torch.full((B,), ctx_len + q, dtype=torch.int32), block_table=table,
                             block_size=bs, max_query_len=q, max_seq_len=ctx_len + q)
    ids = torch.randint(0, 1024, (B * q,), generator=torch.Generator().manual_seed(q))
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            ctx = ForwardContext(backend, backend.prepare(meta), caches)
            t = time.perf_counter()
            hidden = model(ids, pos, ctx)
            model.compute_logits(hidden[-B:])
            times.append(time.perf_counter() - t)
        h = model.embed(ids)
        moe = next((layer.moe for layer in model.layers if layer.moe is not None), None)
        active = moe.active_experts(h) if moe is not None else 0
    times.sort()
    return 1e3 * times[len(times) // 2], active


def _policy_choice(path: Path, batch: int) -> dict:
    from specinfer import Generator, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = []
    for _ in range(batch):
        base = torch.randint(3, 1024, (24,), generator=g).tolist()
        prompts.append(base + base[:8] + base)  # repeats: n-gram matches exist
    gen = Generator(str(path), speculative={"method": "ngram", "num_speculative_tokens": 7})
    sp = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    gen.generate(prompts, sp, use_tqdm=False)  # warm-up: the policy learns its step costs here too
    gen.reset_metrics()
    t = time.perf_counter()
    outs = gen.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    m = gen.spec_metrics()
    return dict(drafts_per_step=m["num_draft_tokens"] / max(1, m["num_drafts"]), acceptance=m["acceptance_rate"],
                tok_s=sum(len(o.token_ids) for o in outs) / wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        models = {k: _build(k, a.hidden, a.layers, a.experts, Path(d) / k) for k in ("dense", "moe")}
        print(f"batch {a.batch}, hidden {a.hidden}, {a.layers} layers, {a.experts} experts top-2, "
              f"context {a.context}, threads {torch.get_num_threads()}")
        print(f"{'k':>3} {'dense ms':>9} {'x decode':>9} {'moe ms':>9} {'x decode':>9} {'experts':>8}")
        base = {}
        for k in (0, 1, 2, 3, 4, 5, 7):
            row = [f"{k:>3}"]
            for kind in ("dense", "moe"):
                ms, active = _step_ms(models[kind], a.batch, 1 + k, a.context, a.repeats)
                base.setdefault(kind, ms)
                row += [f"{ms:9.2f}", f"{ms / base[kind]:9.2f}"]
            row.append(f"{active:>8}")
            print(" ".join(row))
        print("goodput policy, n-gram k <= 7, batch", a.batch)
        for kind in ("dense", "moe"):
            r = _policy_choice(Path(d) / kind, a.batch)
            print(f"  {kind:5}: {r['drafts_per_step']:.2f} drafts per drafted step, acceptance {r['acceptance']:.2f}, "
                  f"{r['tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()

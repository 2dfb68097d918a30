"""Device throughput check (CUDA): decode tokens/s of specinfer vs HF transformers `generate` on
the same random Llama model and prompts, CUDA graphs vs eager, and speculative speedups (ngram on
repetitive prompts; draft_model with the target as its own draft, which bounds the machinery's
cost: acceptance 1, c = 1). Writes one JSON; every measurement that fails is recorded with its
error instead of stopping the rest. Runs in a few minutes on one H200.

    python benches/device/throughput.py --out $OUT [--layers 16 --hidden 2048]

The model is built here with transformers (no downloads): random weights, a word-level tokenizer.
Random models are not real models: speculative acceptance here says little about real drafts,
but tokens/s of the engines (same shapes, same dtype) compare fairly.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

# --cpu-dry-run: the same code on CPU with a tiny model, to catch errors before a device is lent
DEVICE = "cuda"
DTYPE = torch.bfloat16


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):  # random init on the GPU: seconds, not a minute of CPU
        model = tf.LlamaForCausalLM(cfg).to(DTYPE)
    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "t2"}))


def prompts(n: int, length: int, vocab: int, repetitive: bool, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a phrase repeated: what prompt lookup (ngram) feeds on
            phrase = torch.randint(3, vocab, (16,), generator=g).tolist()
            out.append((phrase * (length // 16 + 1))[:length])
        else:
            out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def hf_generate(path: Path, batch: list[list[int]], new_tokens: int, repeats: int) -> dict:
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(path, torch_dtype=DTYPE).to(DEVICE).eval()
    L = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in batch], device=DEVICE)  # left padding
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch], device=DEVICE)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        t, _ = timed(lambda: model.generate(input_ids=ids, attention_mask=mask, **kw), repeats)
    del model
    _empty_cache()
    return {"seconds": t, "tokens_per_s": len(batch) * new_tokens / t}


class ForwardClock:
    """The target forwards' device time: CUDA events around each forward where it is issued (the
    engine's thread, or the forward thread with forward_thread="on"), all read at the end; on CPU
    the forward's own wall time."""

    def __init__(self, executor):
        self.total_s = 0.0
        self._events = []
        self._execute = executor.execute_model  # launch_model calls it wherever forwards run
        executor.execute_model = self

    def __call__(self, batch):
        if DEVICE != "cuda":
            t = time.perf_counter()
            out = self._execute(batch)
            self.total_s += time.perf_counter() - t
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._execute(batch)
        end.record()
        self._events.append((start, end))
        return out

    def flush(self) -> None:
        for start, end in self._events:
            end.synchronize()
            self.total_s += start.elapsed_time(end) * 1e-3
        self._events = []


def specinfer_generate(path: Path, batch: list[list[int]], new_tokens: int, repeats: int, *, spec=None,
                       cuda_graphs: bool = True, overlap: bool = True, forward_thread: str = "auto") -> dict:
    from specinfer import Generator, SamplingParams
    from specinfer.platform import CpuPlatform, CudaPlatform

    platform = CudaPlatform(torch.device("cuda"), cuda_graphs=cuda_graphs) if DEVICE == "cuda" else CpuPlatform()
    max_len = max(len(p) for p in batch) + new_tokens + 32
    t_build = time.perf_counter()
    blocks = len(batch) * (-(-max_len // 16) + 1) + 64  # sized for the batch, not 90% of the GPU
    gen = Generator(str(path), device=platform, dtype=DTYPE, max_model_len=max_len, block_size=16,
                    num_kv_blocks=blocks, max_num_seqs=max(8, len(batch)), max_num_batched_tokens=max(2048, max_len),
                    enable_prefix_caching=False, speculative=spec, overlap_steps=overlap,
                    forward_thread=forward_thread)
    build_s = time.perf_counter() - t_build
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen.generate(batch, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm
    gen.reset_metrics()
    clock = ForwardClock(gen.engine.executor)
    t, outs = timed(lambda: gen.generate(batch, params, use_tqdm=False), repeats)
    clock.flush()
    tokens = sum(len(o.token_ids) for o in outs)
    runner = gen.engine.runner
    row = {"seconds": t, "tokens_per_s": tokens / t, "engine_build_s": build_s,
           "graph_replays": getattr(runner, "num_replays", 0), "eager_forwards": getattr(runner, "num_eager", None),
           "num_kv_blocks": gen.engine.num_kv_blocks}
    # where a step's time goes (ms per step: packing + forward, verification, proposal + policy,
    # the rest): on a GPU the speculative step's host side is what to look at first
    m = gen.spec_metrics() if spec is not None else gen.engine.metrics.as_dict()
    steps = max(int(m.get("num_steps") or 0), 1)
    row["steps"] = m.get("num_steps")
    row.update({f"{k[:-2]}_ms_per_step": 1e3 * m[k] / steps for k in ("score_s", "verify_s", "propose_s", "overhead_s",
                                                                       "wait_s", "tail_s") if m.get(k) is not None})
    # the bubble: wall time per step the target's device did not spend on its forwards (host work
    # on the critical path, the draft's forwards, sampling); the steps of every timed repeat
    wall_per_step = 1e3 * t * repeats / steps if steps else 0.0  # (timed() reports the median repeat)
    row["device_ms_per_step"] = 1e3 * clock.total_s / steps
    row["wall_ms_per_step"] = wall_per_step
    row["bubble_ms_per_step"] = wall_per_step - row["device_ms_per_step"]
    row["overlap_steps"] = overlap
    row["forward_thread"] = gen.engine.executor.forward_thread is not None
    row["steps_scheduled_ahead"] = gen.engine.num_scheduled_ahead
    row["steps_launched_after_update"] = gen.engine.num_launched_next
    if spec is not None:
        row.update({k: m.get(k) for k in ("acceptance_rate", "mean_acceptance_length", "system_efficiency")})
    del gen
    _empty_cache()
    return row


def theory(alpha: float, k: int, c: float) -> float:
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU: checks the script, times nothing")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        global DEVICE, DTYPE
        DEVICE, DTYPE = "cpu", torch.float32
        args.layers, args.hidden, args.heads, args.kv_heads, args.vocab = 2, 64, 4, 2, 512
        args.prompt_len, args.new_tokens, args.batches, args.repeats = 24, 8, "1,3", 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "random_llama"
    build_model(model_dir, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                vocab=args.vocab)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)", "torch": torch.__version__, "config": vars(args), "rows": []}

    def record(name, batch_size, fn):
        row = {"name": name, "batch": batch_size}
        try:
            row.update(fn())
        except Exception as e:  # keep going: one failure must not hide the other numbers
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-4000:]
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        results["rows"].append(row)
        (out / "throughput.json").write_text(json.dumps(results, indent=1))
        return row

    for B in (int(b) for b in args.batches.split(",")):
        plain = prompts(B, args.prompt_len, args.vocab, repetitive=False)
        rep = prompts(B, args.prompt_len, args.vocab, repetitive=True)
        hf = record("hf_generate", B, lambda: hf_generate(model_dir, plain, args.new_tokens, args.repeats))
        ours = record("specinfer", B, lambda: specinfer_generate(model_dir, plain, args.new_tokens, args.repeats))
        eager = record("specinfer_no_cuda_graphs", B, lambda: specinfer_generate(
            model_dir, plain, args.new_tokens, args.repeats, cuda_graphs=False))
        base_rep = record("specinfer_repetitive", B, lambda: specinfer_generate(
            model_dir, rep, args.new_tokens, args.repeats))
        ngram = record("specinfer_ngram", B, lambda: specinfer_generate(
            model_dir, rep, args.new_tokens, args.repeats,
            spec={"method": "ngram", "num_speculative_tokens": args.k}))
        fixed = record("specinfer_ngram_fixed", B, lambda: specinfer_generate(  # the goodput policy's part
            model_dir, rep, args.new_tokens, args.repeats,
            spec={"method": "ngram", "num_speculative_tokens": args.k, "policy": "fixed"}))
        fixed_serial = record("specinfer_ngram_fixed_serial", B, lambda: specinfer_generate(  # the serial loop
            model_dir, rep, args.new_tokens, args.repeats, overlap=False,
            spec={"method": "ngram", "num_speculative_tokens": args.k, "policy": "fixed"}))
        serial = record("specinfer_serial", B, lambda: specinfer_generate(model_dir, plain, args.new_tokens,
                                                                          args.repeats, overlap=False))
        # forwards and sampling on a worker thread (issue 38): plain steps scheduled ahead on CUDA
        threaded = record("specinfer_forward_thread", B, lambda: specinfer_generate(
            model_dir, plain, args.new_tokens, args.repeats, forward_thread="on"))
        fixed_threaded = record("specinfer_ngram_fixed_forward_thread", B, lambda: specinfer_generate(
            model_dir, rep, args.new_tokens, args.repeats, forward_thread="on",
            spec={"method": "ngram", "num_speculative_tokens": args.k, "policy": "fixed"}))
        selfdraft = record("specinfer_self_draft", B, lambda: specinfer_generate(
            model_dir, plain, args.new_tokens, args.repeats,
            spec={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": args.k}))
        summary = {}
        if "tokens_per_s" in hf and "tokens_per_s" in ours:
            summary["specinfer_over_hf"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        if "tokens_per_s" in eager and "tokens_per_s" in ours:
            summary["cuda_graphs_speedup"] = ours["tokens_per_s"] / eager["tokens_per_s"]
        if "tokens_per_s" in ngram and "tokens_per_s" in base_rep:
            summary["ngram_speedup"] = ngram["tokens_per_s"] / base_rep["tokens_per_s"]
            if ngram.get("acceptance_rate") is not None:
                summary["ngram_theory_c0"] = theory(ngram["acceptance_rate"], args.k, 0.0)
        if "tokens_per_s" in selfdraft and "tokens_per_s" in ours:
            summary["self_draft_speedup"] = selfdraft["tokens_per_s"] / ours["tokens_per_s"]
            summary["self_draft_theory_c1"] = theory(1.0, args.k, 1.0)
        # the per-step split (ms): device time of the target's forwards and the bubble beside it
        for name, row in (("plain", ours), ("plain_serial", serial), ("plain_forward_thread", threaded),
                          ("ngram_fixed", fixed), ("ngram_fixed_serial", fixed_serial),
                          ("ngram_fixed_forward_thread", fixed_threaded), ("self_draft", selfdraft)):
            if "bubble_ms_per_step" in row:
                summary[f"{name}_device_ms"] = round(row["device_ms_per_step"], 3)
                summary[f"{name}_bubble_ms"] = round(row["bubble_ms_per_step"], 3)
        if "tokens_per_s" in fixed and "tokens_per_s" in base_rep:
            summary["ngram_fixed_speedup"] = fixed["tokens_per_s"] / base_rep["tokens_per_s"]
        if "tokens_per_s" in threaded and "tokens_per_s" in ours:
            summary["forward_thread_speedup"] = threaded["tokens_per_s"] / ours["tokens_per_s"]
        results.setdefault("summary", {})[f"batch_{B}"] = summary
        print(json.dumps({"batch": B, **summary}), flush=True)
    (out / "throughput.json").write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tensor parallelism on CPU: TP=N vs TP=1 throughput side by side (gloo, worker processes), and
the driver's per-step cost of sending the step's batch to the workers (pickle + asynchronous
broadcast of one ExecuteModel message, executor/control_channel.py), in microseconds.

    python benches/tp_cpu.py --model smollm2-135m --tp 2 --threads 1 --repeats 3 [--json out.json]
    python benches/tp_cpu.py --tiny --tp 2          # a random tiny model (needs transformers)

Each repeat runs TP=1 then TP=N on the same prompts (greedy, ignore_eos, fixed output length),
so the ratio is measured side by side; medians over repeats. The send overhead is the driver's
time in ControlChannel.send + flush per ExecuteModel during the TP=N runs, with pickling alone
and the pickled size. Every rank runs `--threads` torch threads: on a 2-core machine TP=2 with
1 thread each uses the same cores as TP=1 with 2 threads (compare both).
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_tiny(path: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_tiny_model

    build_tiny_model(path, "llama", layers=4, hidden=256, heads=8, kv_heads=4)
    return str(path)


class SendTimer:
    """Times the driver's side of sending each ExecuteModel: ControlChannel.send (pickle + start
    of the asynchronous broadcast) plus the flush after the driver's own forward (0 when the
    broadcast finished meanwhile); also pickling alone and the pickled size."""

    def __init__(self):
        self.us: list[float] = []
        self.pickle_us: list[float] = []
        self.bytes: list[int] = []

    def __enter__(self):
        from specinfer.executor.control_channel import ControlChannel
        from specinfer.executor.messages import ExecuteModel

        self._cls = ControlChannel
        self._send, self._flush = ControlChannel.send, ControlChannel.flush
        timer, send, flush = self, self._send, self._flush
        state = {"t": 0.0, "step": False}

        def timed_send(chan, msg):
            state["step"] = isinstance(msg, ExecuteModel)
            if state["step"]:
                t0 = time.perf_counter()
                blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
                timer.pickle_us.append((time.perf_counter() - t0) * 1e6)
                timer.bytes.append(len(blob))
            t0 = time.perf_counter()
            send(chan, msg)
            state["t"] = time.perf_counter() - t0
            return None

        def timed_flush(chan):
            t0 = time.perf_counter()
            flush(chan)
            if state["step"]:
                timer.us.append((state["t"] + time.perf_counter() - t0) * 1e6)
                state["step"] = False
            return None

        ControlChannel.send, ControlChannel.flush = timed_send, timed_flush
        return self

    def __exit__(self, *exc):
        self._cls.send, self._cls.flush = self._send, self._flush


def run(model: str, tp: int, prompts, params, args) -> float:
    from specinfer import Generator

    with Generator(model, tensor_parallel_size=tp, max_model_len=args.max_model_len,
                   num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.batch) as gen:
        gen.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = gen.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tiny", action="store_true", help="a random tiny llama instead of --model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import os

    os.environ["SPECINFER_WORKER_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from specinfer import SamplingParams

    tmp = tempfile.TemporaryDirectory()
    model = build_tiny(Path(tmp.name) / "tiny") if args.tiny else args.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tp1, tpn = [], []
    with SendTimer() as timer:
        for _ in range(args.repeats):
            tp1.append(run(model, 1, prompts, params, args))
            tpn.append(run(model, args.tp, prompts, params, args))
    ratios = [b / a for a, b in zip(tp1, tpn)]
    result = {
        "model": "tiny" if args.tiny else args.model, "tp": args.tp, "threads_per_rank": args.threads,
        "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "tp1_tok_s": statistics.median(tp1), f"tp{args.tp}_tok_s": statistics.median(tpn),
        "ratio_median": statistics.median(ratios),
        "send_us_median": statistics.median(timer.us) if timer.us else None,
        "send_us_p90": sorted(timer.us)[int(0.9 * (len(timer.us) - 1))] if timer.us else None,
        "pickle_us_median": statistics.median(timer.pickle_us) if timer.pickle_us else None,
        "message_bytes_median": statistics.median(timer.bytes) if timer.bytes else None,
        "num_steps_timed": len(timer.us),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

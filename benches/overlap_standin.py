"""The step's bubble with a stand-in for an asynchronous device, on CPU (issue 38).

The target is a one-layer, 32-wide random Llama (its real forward is ~0.1 ms); each forward's
result becomes readable a modeled device time D(T) = --device-ms + --per-token-us * T after its
launch (T = tokens in the step), and only through an explicit wait, as a CUDA launch and its sync
behave. The tiny model computes on the engine's forward thread in the overlapped loop (the
engine's own thread in the serial one), well inside D.
A draft model (the target's weights plus noise) stands in likewise: each of its forwards takes
--draft-ms + --per-token-us * T of modeled device time on the same device queue as the target's.
In the overlapped loops the engine launches a proposal's forwards as one job where the forwards
run (spec_decode/launched_proposal.py): its modeled time queues at launch, the tiny draft computes
on the forward thread (on the engine's thread in the cuda loop, standing in for the launches' host
cost), and the step verifying it is scheduled and launched behind it before its tokens exist. The
serial loop drafts on the host: with --draft-sync end (the default) a draft forward queues its
modeled time and returns and the host waits once, when the proposal is done; with --draft-sync
each the host waits for every draft forward. Its LM head's real compute counts as device time
there (the target's runs inside its forward).

Per engine step (medians over repeats, loops and methods interleaved): wall, device (target
forward + draft forwards), bubble = wall - device (the time the device would sit idle: host
work on the critical path), wall / device, and the output work that ran beside the forward.
Targets (issue 38): wall <= 1.05 x device; a speculative step's bubble <= 1.2 x a plain step's.

    python benches/overlap_standin.py --batch 32 --repeats 5
    python benches/overlap_standin.py --batch 1 --repeats 5
    python benches/overlap_standin.py --batch 32 --repeats 5 --policy goodput --methods plain,ngram
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_bench_setup import add_workload_arguments, build_tiny_llama, repetitive_prompts  # noqa: E402
from specinfer import Generator, SamplingParams  # noqa: E402


def _sleep_until(t_end: float) -> None:
    """Sleep until shortly before t_end, then spin the last stretch, yielding the GIL with
    sched_yield (a host thread waiting on a CUDA sync spins and wakes within microseconds): a sleep,
    even time.sleep(0), overshoots by Linux's timer slack (~50 us) and would count as bubble."""
    while True:
        left = t_end - time.perf_counter()
        if left <= 0:
            return
        if left > 3e-4:
            time.sleep(left - 2e-4)
        else:
            os.sched_yield()


class ModeledForward:
    """Wraps a synchronous forward callable: compute, then hold the thread until the modeled
    time passed (a draft model's forwards: the engine needs their drafts before it goes on)."""

    def __init__(self, fn, base_s: float, per_token_s: float):
        self.fn, self.base_s, self.per_token_s = fn, base_s, per_token_s
        self.total_s = 0.0  # modeled device time spent

    def __call__(self, x, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(x, *args, **kwargs)
        d = self.base_s + self.per_token_s * x.shape[0]  # x: input ids [T], or hidden rows [T, H]
        _sleep_until(t + d)
        self.total_s += time.perf_counter() - t
        return out


class QueuedForward:
    """Wraps a draft forward as an asynchronous launch: compute (the host's launch work), then its
    modeled device time queues on the device behind what was launched before, and the call returns;
    the host waits for it only at SyncAfter (the proposal's one copy back)."""

    def __init__(self, fn, base_s: float, per_token_s: float, device: "ModeledLaunch"):
        self.fn, self.base_s, self.per_token_s, self.device = fn, base_s, per_token_s, device
        self.total_s = 0.0

    def __call__(self, x, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(x, *args, **kwargs)
        d = self.base_s + self.per_token_s * x.shape[0]
        self.device.free_at = max(t, self.device.free_at) + d
        self.total_s += d
        return out


class SyncAfter:
    """Wraps the proposer's propose(): once it returns, the host waits for the device queue (the
    drafted tokens' copy back)."""

    def __init__(self, fn, device: "ModeledLaunch"):
        self.fn, self.device = fn, device

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        _sleep_until(self.device.free_at)
        return out


class ModeledJob:
    """Wraps the executor's launch_job (a draft model's proposal launched where the forwards run:
    its catch-up and draft steps back to back): its modeled device time, --draft-ms + --per-token-us
    x T per forward, queues on the device at launch behind what was launched before, and its
    tokens are readable (PendingForward.wait) once that time passed; the tiny draft computes where
    the job runs (the forward thread, or the engine's thread in the cuda loop: a launch's host cost)."""

    def __init__(self, launch_job, base_s: float, per_token_s: float, device: "ModeledLaunch"):
        self.launch_job, self.base_s, self.per_token_s, self.device = launch_job, base_s, per_token_s, device
        self.total_s = 0.0

    def __call__(self, fn, forward_tokens=()):
        t = time.perf_counter()
        d = sum(self.base_s + self.per_token_s * n for n in forward_tokens)
        self.device.free_at = max(t, self.device.free_at) + d
        self.total_s += d
        return _Modeled(self.launch_job(fn, forward_tokens), self.device.free_at, d)


class _Both:
    """The draft's modeled forwards and LM heads, one device-time total."""

    def __init__(self, *parts):
        self.parts = parts

    @property
    def total_s(self) -> float:
        return sum(p.total_s for p in self.parts)


class ModeledLaunch:
    """Wraps the executor's launch_model: the device starts the forward at launch and its result
    is readable D(T) later, through the PendingForward's wait() only (as a CUDA launch and sync
    behave). The tiny model itself computes wherever the engine runs forwards (its forward thread
    in the overlapped loop, the engine's thread in the serial one), well inside D."""

    def __init__(self, launch, base_s: float, per_token_s: float):
        self.launch, self.base_s, self.per_token_s = launch, base_s, per_token_s
        self.free_at = 0.0  # when the device finishes what was launched before (a stream runs in order)

    def __call__(self, batch, *args):
        t = time.perf_counter()
        d = self.base_s + self.per_token_s * batch.input_ids.numel()
        self.free_at = max(t, self.free_at) + d  # a step launched ahead starts when the one before ends
        return _Modeled(self.launch(batch, *args), self.free_at, d)


class _Modeled:
    """A PendingForward whose result is readable at ready_at, and whose device time is d."""

    def __init__(self, pending, ready_at: float, d: float):
        self._pending, self._ready_at, self.device_s = pending, ready_at, d

    def wait(self):
        out = self._pending.wait()
        _sleep_until(self._ready_at)
        return out

    def settle(self):
        self._pending.settle()

    def done_result(self):
        return self._pending.done_result()


def build(method: str, loop: str, models: Path, args) -> tuple[Generator, "_Both | None"]:
    """loop: serial, overlap (each step scheduled after the previous one's update, once the Python
    states took its tokens and the call returned) or ahead (the default: a plain step scheduled and
    launched before the previous one's tokens exist; an n-gram step scheduled and launched right
    after the previous one's update, its drafts made by the core) or cuda (CUDA's flow: no forward
    thread, forwards launched from the engine's thread, a plain step sampled as device work and the
    next one scheduled ahead on the device; the tiny model's compute, on the engine's thread, stands
    in for CUDA's host-side launch cost: the graph replay and its copies)."""
    spec = None
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "policy": args.policy}
    elif method == "draft_model":
        spec = {"method": "draft_model", "model": str(models / "draft"), "num_speculative_tokens": args.k,
                "policy": args.policy}
    gen = Generator(str(models / "target"), speculative=spec, overlap_steps=loop != "serial",
                    schedule_ahead=loop in ("ahead", "cuda"), forward_thread="off" if loop == "cuda" else "auto",
                    max_model_len=args.prompt_len + args.new_tokens + 16, num_kv_blocks=args.batch * 16 + 64,
                    enable_prefix_caching=False)
    ex = gen.engine.executor
    ex.launch_model = device = ModeledLaunch(ex.launch_model, args.device_ms * 1e-3, args.per_token_us * 1e-6)
    draft = None
    if method == "draft_model" and gen.engine.proposing.launch_job is not None:
        # (overlapped loops) the proposal's forwards launched as one job, the next step scheduled meanwhile
        draft = gen.engine.proposing.launch_job = ModeledJob(ex.launch_job, args.draft_ms * 1e-3,
                                                             args.per_token_us * 1e-6, device)
    elif method == "draft_model":
        proposer = gen.engine.proposer
        runner = proposer.runner
        if args.draft_sync == "end":
            draft = runner.forward = QueuedForward(runner.forward, args.draft_ms * 1e-3, args.per_token_us * 1e-6,
                                                   device)
            proposer.propose = SyncAfter(proposer.propose, device)
        else:
            draft = runner.forward = ModeledForward(runner.forward, args.draft_ms * 1e-3,
                                                    args.per_token_us * 1e-6)
        # its LM head is device work too (the target's runs inside its modeled forward): its real
        # compute counts as device time, with nothing modeled on top
        logits = runner.logits = ModeledForward(runner.logits, 0.0, 0.0)
        draft = _Both(draft, logits)
    return gen, draft


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(ap, repeats=5)
    ap.add_argument("--device-ms", type=float, default=2.5, help="modeled target forward: fixed part")
    ap.add_argument("--per-token-us", type=float, default=4.0, help="modeled forward: per query token")
    ap.add_argument("--draft-ms", type=float, default=0.25, help="modeled draft forward: fixed part")
    ap.add_argument("--methods", default="plain,ngram,draft_model")
    ap.add_argument("--draft-sync", choices=("end", "each"), default="end",
                    help="the host waits for the draft's forwards once per proposal (end: the proposer's launches "
                         "back to back) or after each one (each)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--policy", default="fixed", help="speculation policy: fixed (k every step) or goodput (the "
                    "engine's default, its per-step choice on the critical path)")
    ap.add_argument("--json", default=None, help="write the medians here")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="Python's thread switch interval (default 5 ms): the stand-in's forward thread runs "
                         "Python between its kernels and waits up to this long for the GIL while the engine's "
                         "thread works beside it, which a device never does")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms * 1e-3)
    models = Path(tempfile.mkdtemp())
    build_tiny_llama(models / "target")
    # the draft: the target's weights plus a little noise (it agrees with the target most of the time)
    build_tiny_llama(models / "draft", base=models / "target", perturb=0.02)
    prompts = repetitive_prompts(args.batch, args.prompt_len)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    methods = args.methods.split(",")
    loops = {m: ("serial", "overlap", "ahead", "cuda") if m != "draft_model" else ("serial", "overlap", "cuda")
             for m in methods}
    rows = {(m, loop): [] for m in methods for loop in loops[m]}
    gens = {key: build(key[0], key[1], models, args) for key in rows}
    outputs = {}
    for key, (gen, _) in gens.items():  # warm, and the loops must agree token for token
        outputs[key] = [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)]
    for m in methods:
        for loop in loops[m][1:]:
            assert outputs[(m, "serial")] == outputs[(m, loop)], f"{m}: the loops disagree"
    for _ in range(args.repeats):
        for key, (gen, draft) in gens.items():
            gen.engine.reset_metrics()
            d0 = draft.total_s if draft else 0.0
            t = time.perf_counter()
            gen.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            mt = gen.engine.metrics.as_dict()
            steps = mt["num_steps"]
            device = mt["device_s"] + ((draft.total_s - d0) if draft else 0.0)
            rows[key].append({"steps": steps, "wall_ms": wall / steps * 1e3, "device_ms": device / steps * 1e3,
                              "bubble_ms": (wall - device) / steps * 1e3, "tail_ms": mt["tail_s"] / steps * 1e3,
                              "wall_over_device": wall / device, "tokens_per_s": args.batch * args.new_tokens / wall,
                              "mean_acceptance_length": mt["mean_acceptance_length"]})
    print(f"batch {args.batch}, prompts {args.prompt_len}, new tokens {args.new_tokens}, k {args.k}; modeled device "
          f"D(T) = {args.device_ms} ms + {args.per_token_us} us x T (draft {args.draft_ms} ms + same, synced "
          f"{args.draft_sync}); per step, "
          f"median of {args.repeats}; policy {args.policy}; switch interval {sys.getswitchinterval() * 1e3:g} ms")
    print("| method | loop | steps | wall ms | device ms | bubble ms | wall / device | output work beside ms |"
          " tokens/s | acc. len |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for (m, loop), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[f"{m}/{loop}"] = med
        print(f"| {m} | {loop} | {med['steps']:.0f} | {med['wall_ms']:.3f} | {med['device_ms']:.3f} | "
              f"{med['bubble_ms']:.3f} | {med['wall_over_device']:.3f} | {med['tail_ms']:.3f} | "
              f"{med['tokens_per_s']:.0f} | {med['mean_acceptance_length']:.2f} |")
    for loop in ("serial", "overlap", "ahead", "cuda"):
        plain = summary.get(f"plain/{loop}")
        for m in methods:
            if m != "plain" and plain and f"{m}/{loop}" in summary:
                s = summary[f"{m}/{loop}"]
                print(f"{loop}: {m} bubble / plain bubble = {s['bubble_ms'] / plain['bubble_ms']:.2f}; "
                      f"speedup vs plain {s['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

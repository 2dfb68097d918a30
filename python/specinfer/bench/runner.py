"""The benchmark runner: methods measured interleaved (A B C A B C ...) over repeats, per task
and batch size; wall and process CPU time per run; the generated token ids of the first repeat
(greedy agreement between methods); results.json, plots and a table."""
from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path

import torch

from specinfer.bench.agreement import greedy_agreement
from specinfer.bench.aggregate import build_rows
from specinfer.bench.config import BenchConfig, load_config
from specinfer.bench.engines import make_engine
from specinfer.bench.peers import PeerUnavailable
from specinfer.bench.machine import load_average, machine_info
from specinfer.bench.prompting import batches_for
from specinfer.prompt_sets import load_task, prompt_encoder
from specinfer.loader.model_loading import shared_models


def _merge_metrics(acc: dict | None, m: dict | None) -> dict | None:
    """Pool speculation counts over the generate() calls of one run."""
    if m is None:
        return acc
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in m.items()}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "max_emittable_tokens",
                "propose_s", "score_s", "verify_s", "overhead_s", "num_steps"):
        acc[key] = acc.get(key, 0) + m.get(key, 0)
    for key in ("drafts_at", "accepted_at"):
        acc[key] = [a + b for a, b in zip(acc[key], m[key])]
    return acc


def interleaved_schedule(cfg: BenchConfig):
    """The order of the timed runs: (repeat, batch size, task, method). Every method runs once
    per (repeat, batch size, task) before the next one, so slow drifts of a shared machine fall
    on every method alike."""
    for rep in range(cfg.repeats):
        for b in cfg.batch_sizes:
            for task in cfg.tasks:
                for m in cfg.methods:
                    yield rep, b, task, m


def run_benchmark(config, out_dir, *, log=print) -> dict:
    """Run `config` (BenchConfig, preset name, JSON path or dict); write results.json and plots
    under out_dir; return the results dict."""
    cfg = config if isinstance(config, BenchConfig) else load_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    machine = machine_info()
    started = time.time()

    # the baseline is built first: its tokenizer and chat template make every method's prompt ids
    baseline = cfg.baseline
    # peers before specinfer engines: transformers' GGUF conversion has a large transient peak
    order = [baseline] + [m for m in cfg.methods if m.engine != "specinfer"] + [
        m for m in cfg.methods if m.engine == "specinfer" and m is not baseline]
    tasks = {t: load_task(t, cfg.prompt_dir) for t in cfg.tasks}
    # every specinfer method reads one loaded copy of each model (loader/model_loading.py)
    with shared_models():
        engines, unavailable, prompt_ids = _load_engines(cfg, order, tasks, log)
        try:
            if cfg.warmup:
                _warm_up(cfg, engines, prompt_ids, unavailable)
            runs = list(_timed_runs(cfg, engines, prompt_ids, log))
        finally:
            for eng in engines.values():
                eng.close()
    from specinfer.bench.peers.hf import release_hf_models

    release_hf_models()
    rows, costs = build_rows(cfg, runs)
    results = {
        "schema": "specinfer-bench/1",
        "name": cfg.name,
        "machine": {**machine, "load_average_end": load_average()},
        "config": cfg.to_dict(),
        "started_unix": started,
        "duration_s": time.time() - started,
        "baseline": baseline.name,
        "unavailable": unavailable,
        "cost_ratio": costs,
        "prompts": {t: {"num_available": len(s), "prompt_tokens": [len(p) for p in prompt_ids[t]]}
                    for t, s in tasks.items()},
        "rows": rows,
        "agreement": greedy_agreement(cfg, runs),
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default), encoding="utf-8")
    if cfg.plots:
        try:
            from specinfer.bench.plots import write_plots

            results["plots"] = write_plots(results, out)
        except ImportError as e:
            results["plots_error"] = f"matplotlib is not installed ({e})"
        except Exception:  # noqa: BLE001 - a plotting failure must not lose the numbers
            results["plots_error"] = traceback.format_exc(limit=3)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default), encoding="utf-8")
    return results


def _load_engines(cfg: BenchConfig, order, tasks, log):
    """-> (engines by method name, unavailable {name: why}, prompt token ids by task)."""
    engines, unavailable = {}, {}
    prompt_ids = None
    for m in order:
        log(f"[bench] loading {m.name} ({m.engine})")
        try:
            if prompt_ids is None:
                # load the target once without a KV pool: tokenizer, chat template, prompt lengths
                from specinfer.loader.model_loading import load_any

                loaded = load_any(m.model or cfg.model, dtype=getattr(torch, cfg.dtype), device=torch.device("cpu"))
                encode = prompt_encoder(loaded, cfg.use_chat_template)
                need = max(cfg.num_prompts, max(cfg.batch_sizes))
                prompt_ids = {t: [encode(p) for p in s.prompts[:need]] for t, s in tasks.items()}
                max_len = max(len(p) for ps in prompt_ids.values() for p in ps)
                eos = tuple(loaded.eos_token_ids)
                limit = int(loaded.config.max_position_embeddings)
                del loaded
                gc.collect()
            engines[m.name] = make_engine(cfg, m, max_prompt_len=max_len, eos_token_ids=eos,
                                          model_limit=limit if m.model is None else None, log=log)
        except PeerUnavailable as e:
            unavailable[m.name] = str(e)
            log(f"[bench] {m.name}: unavailable: {e}")
    return engines, unavailable, prompt_ids


def _warm_up(cfg: BenchConfig, engines, prompt_ids, unavailable) -> None:
    """One short call per batch size: first-call costs (buffers sized for b) stay untimed."""
    warm = BenchConfig.from_dict({**cfg.to_dict(), "max_tokens": min(8, cfg.max_tokens)})
    first = next(iter(prompt_ids.values()))
    for name, eng in list(engines.items()):
        for b in sorted(cfg.batch_sizes):
            try:
                eng.run(batches_for(first, b, 1)[0], warm)
            except PeerUnavailable as e:
                if b == 1:
                    unavailable[name] = str(e)
                # b > 1: the timed runs record the error for that batch size


def _timed_runs(cfg: BenchConfig, engines, prompt_ids, log):
    """Yield one run record per (repeat, batch size, task, method), methods interleaved."""
    for rep, b, task, m in interleaved_schedule(cfg):
        eng = engines.get(m.name)
        if eng is None:
            continue
        calls = batches_for(prompt_ids[task], b, cfg.num_prompts)
        load = load_average()
        tokens, metrics, error, child_cpu, token_ids = 0, None, None, 0.0, []
        # a peer that times itself (llama_cpp_native: llama.cpp's own timers, without process start
        # and model load) sets last_elapsed_s per call; its sum replaces the runner's clock
        own_s, own_clock, peer_stats = 0.0, True, []
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            for i, call in enumerate(calls):
                n, mm = eng.run(call, cfg, seed=rep * 1000 + i)
                child_cpu += getattr(eng, "last_child_cpu_s", 0.0)  # a peer in its own process
                elapsed = getattr(eng, "last_elapsed_s", None)
                own_clock = own_clock and elapsed is not None
                own_s += elapsed or 0.0
                if getattr(eng, "last_stats", None) is not None:
                    peer_stats.append(eng.last_stats)
                tokens += n
                metrics = _merge_metrics(metrics, mm)
                if rep == 0:
                    token_ids += getattr(eng, "last_token_ids", [])
        except PeerUnavailable as e:
            error = str(e)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0 + child_cpu
        runner_wall = wall
        if own_clock and calls:
            wall = own_s
        if error is not None:
            yield dict(method=m.name, task=task, batch_size=b, repeat=rep, error=error)
            continue
        run = dict(method=m.name, task=task, batch_size=b, repeat=rep, num_requests=sum(map(len, calls)),
                   tokens=tokens, wall_s=wall, cpu_s=cpu, tokens_per_s=tokens / wall if wall else None,
                   load_average=load, metrics=metrics)
        if own_clock and calls:
            run.update(timed_by="engine", runner_wall_s=runner_wall, peer_stats=peer_stats)
        if rep == 0:
            run["token_ids"] = token_ids
        yield run
        log(f"[bench] rep {rep} b={b} {task:16s} {m.name:20s} {tokens:5d} tok {wall:7.2f} s wall "
            f"{cpu:7.2f} s cpu  {tokens / wall:7.2f} tok/s  load {load[0] if load else '?'}")


def reaggregate(results_path, *, plots: bool = True) -> dict:
    """Rebuild rows (and plots) of an existing results.json from its runs, with this version's
    aggregation; the runs themselves are unchanged."""
    path = Path(results_path)
    results = json.loads(path.read_text(encoding="utf-8"))
    cfg = BenchConfig.from_dict(results["config"])
    results["rows"], results["cost_ratio"] = build_rows(cfg, results["runs"])
    results["agreement"] = greedy_agreement(cfg, results["runs"])
    if plots:
        from specinfer.bench.plots import write_plots

        results["plots"] = write_plots(results, path.parent)
    path.write_text(json.dumps(results, indent=2, default=_json_default), encoding="utf-8")
    return results


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)

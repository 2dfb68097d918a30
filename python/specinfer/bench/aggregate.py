"""From timed runs to result rows: per method x batch size x task (and "all" tasks pooled):
tokens/s median/min/max, CPU time per token, speedup vs the baseline (median of the ratios
paired by repeat), pooled acceptance statistics, cost ratio c and theoretical speedup."""
from __future__ import annotations

from collections import defaultdict

from specinfer.bench.config import BenchConfig
from specinfer.bench.theory import median, ratio, theoretical_speedup

ALL = "all"


def _pool(metrics_list: list[dict]) -> dict | None:
    ms = [m for m in metrics_list if m]
    if not ms:
        return None
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "max_emittable_tokens",
            "propose_s", "score_s", "verify_s", "overhead_s", "num_steps")
    p = {k: sum(m.get(k, 0) for m in ms) for k in keys}
    k = len(ms[0]["drafts_at"])
    drafts_at = [sum(m["drafts_at"][j] for m in ms) for j in range(k)]
    accepted_at = [sum(m["accepted_at"][j] for m in ms) for j in range(k)]
    return {
        "acceptance_rate": p["num_accepted_tokens"] / p["num_draft_tokens"] if p["num_draft_tokens"] else 0.0,
        "mean_acceptance_length": p["num_emitted_tokens"] / p["num_drafts"] if p["num_drafts"] else 0.0,
        "accepted_per_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafts_at)],
        "system_efficiency": p["num_emitted_tokens"] / p["max_emittable_tokens"] if p["max_emittable_tokens"] else 0.0,
        **p,
    }


def _per_repeat(runs, method, b, task):
    """{repeat: (tokens, wall, cpu, metrics list)} for one row; task ALL pools the tasks."""
    out = {}
    for r in runs:
        if r["method"] != method or r["batch_size"] != b or "error" in r or (task != ALL and r["task"] != task):
            continue
        t, w, c, ms = out.get(r["repeat"], (0, 0.0, 0.0, []))
        out[r["repeat"]] = (t + r["tokens"], w + r["wall_s"], c + r["cpu_s"], ms + [r["metrics"]])
    return out


def build_rows(cfg: BenchConfig, runs: list[dict]) -> tuple[list[dict], dict]:
    base = cfg.baseline.name
    cost = cfg.cost_method
    tasks = list(cfg.tasks) + ([ALL] if len(cfg.tasks) > 1 else [])
    rows = []
    # c from the draft alone vs the target alone: per-token wall time ratio, paired by repeat
    costs = {}
    if cost is not None:
        for b in cfg.batch_sizes:
            d, t = _per_repeat(runs, cost.name, b, ALL), _per_repeat(runs, base, b, ALL)
            rs = [(d[r][1] / d[r][0]) / (t[r][1] / t[r][0]) for r in d if r in t and d[r][0] and t[r][0]]
            costs[b] = {"c": median(rs), "per_repeat": rs,
                        "source": f"wall time per token of {cost.name!r} alone / {base!r}, batch {b}, same run"}
    errors = defaultdict(set)
    for r in runs:
        if "error" in r:
            errors[(r["method"], r["batch_size"])].add(r["error"])
    for m in cfg.methods:
        for b in cfg.batch_sizes:
            if errors.get((m.name, b)):
                rows.append({"method": m.name, "engine": m.engine, "batch_size": b, "task": ALL,
                             "error": "; ".join(sorted(errors[(m.name, b)]))})
                continue
            for task in tasks:
                reps = _per_repeat(runs, m.name, b, task)
                if not reps:
                    continue
                baseline = _per_repeat(runs, base, b, task)
                tps = {r: v[0] / v[1] for r, v in reps.items() if v[1] > 0}
                base_tps = {r: v[0] / v[1] for r, v in baseline.items() if v[1] > 0}
                paired = [tps[r] / base_tps[r] for r in tps if r in base_tps and base_tps[r]]
                # the same ratio on process CPU time: steadier than wall time on a shared machine
                # (peers in their own process report that process's CPU time)
                cps = {r: v[0] / v[2] for r, v in reps.items() if v[2] > 0}
                base_cps = {r: v[0] / v[2] for r, v in baseline.items() if v[2] > 0}
                paired_cpu = [cps[r] / base_cps[r] for r in cps if r in base_cps and base_cps[r]]
                tokens = sum(v[0] for v in reps.values())
                cpu = sum(v[2] for v in reps.values())
                row = {
                    "method": m.name, "engine": m.engine, "batch_size": b, "task": task, "k": m.k,
                    "repeats": len(reps), "tokens": [v[0] for v in reps.values()],
                    "wall_s": [v[1] for v in reps.values()], "cpu_s": [v[2] for v in reps.values()],
                    "tokens_per_s": list(tps.values()),
                    "tokens_per_s_median": median(tps.values()),
                    "tokens_per_s_min": min(tps.values()) if tps else None,
                    "tokens_per_s_max": max(tps.values()) if tps else None,
                    "cpu_s_per_token": cpu / tokens if tokens else None,
                    "cpu_over_wall": cpu / sum(v[1] for v in reps.values()) if reps else None,
                    "speedup_per_repeat": paired,
                    "speedup": median(paired),
                    "speedup_of_medians": ratio(median(tps.values()), median(base_tps.values())),
                    "speedup_cpu_per_repeat": paired_cpu,
                    "speedup_cpu": median(paired_cpu),
                }
                spec = _pool([x for v in reps.values() for x in v[3]])
                base_pool = _pool([x for v in baseline.values() for x in v[3]])
                if spec is not None and spec["num_steps"]:
                    # target forward (+ schedule + logits) time per engine step: a verification step
                    # of 1 + k tokens against a plain decode step of the baseline
                    row["score_s_per_step"] = spec["score_s"] / spec["num_steps"]
                    if base_pool is not None and base_pool["num_steps"] and base_pool["score_s"]:
                        row["verify_step_cost"] = row["score_s_per_step"] / (base_pool["score_s"] / base_pool["num_steps"])
                if spec is not None and m.k:
                    k = m.k
                    if costs.get(b, {}).get("c") is not None and (m.speculative or {}).get("method") == "draft_model":
                        c, c_src = costs[b]["c"], costs[b]["source"]
                    else:  # model-free proposers: the measured proposal time per draft token vs scoring
                        c = spec["propose_s"] / (k * spec["score_s"]) if spec["score_s"] else 0.0
                        c_src = "propose_s / (k * score_s) from the engine's time split"
                    alpha = min(max(spec["acceptance_rate"], 0.0), 1.0)
                    theory = theoretical_speedup(alpha, k, c)
                    v = row.get("verify_step_cost")
                    if v:  # the same model with the measured cost of a verification step instead of 1
                        row["theoretical_speedup_with_verify_cost"] = theory * (k * c + 1.0) / (k * c + v)
                    row.update(spec=spec, acceptance_rate=spec["acceptance_rate"],
                               mean_acceptance_length=spec["mean_acceptance_length"],
                               accepted_per_position=spec["accepted_per_position"],
                               system_efficiency=spec["system_efficiency"], c=c, c_source=c_src,
                               theoretical_speedup=theory,
                               achieved_over_theoretical=ratio(row["speedup"], theory))
                rows.append(row)
    return rows, {str(b): v for b, v in costs.items()}

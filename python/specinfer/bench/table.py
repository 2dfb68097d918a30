"""The printed summary table of a results dict (the tables of docs/benchmarks.md and docs/lab/)."""
from __future__ import annotations


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def format_table(results: dict, markdown: bool = False) -> str:
    head = ["method", "batch", "task", "tok/s med [min-max]", "cpu ms/tok", "speedup", "cpu speedup", "alpha", "acc len",
            "k", "c", "theory", "ach/theory", "verify/step", "theory(v)"]
    lines = []
    for r in results["rows"]:
        if "error" in r:
            lines.append([r["method"], str(r["batch_size"]), r["task"], "unavailable: " + r["error"][:60]]
                         + [""] * (len(head) - 4))
            continue
        lines.append([
            r["method"], str(r["batch_size"]), r["task"],
            f"{_f(r['tokens_per_s_median'])} [{_f(r['tokens_per_s_min'])}-{_f(r['tokens_per_s_max'])}]",
            _f(r["cpu_s_per_token"] and r["cpu_s_per_token"] * 1e3, "{:.1f}"),
            _f(r["speedup"]) + ("x" if r["speedup"] is not None else ""),
            _f(r.get("speedup_cpu")) + ("x" if r.get("speedup_cpu") is not None else ""),
            _f(r.get("acceptance_rate")), _f(r.get("mean_acceptance_length")),
            str(r["k"]) if r.get("k") else "-", _f(r.get("c"), "{:.3f}"),
            _f(r.get("theoretical_speedup")), _f(r.get("achieved_over_theoretical")),
            _f(r.get("verify_step_cost")) if r.get("k") else "-", _f(r.get("theoretical_speedup_with_verify_cost")),
        ])
    for name, why in results.get("unavailable", {}).items():
        lines.append([name, "-", "-", "unavailable: " + why[:80]] + [""] * (len(head) - 4))
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*line) for line in lines])


def format_agreement(results: dict, markdown: bool = False) -> str:
    """Greedy agreement with the baseline, per method x batch x task (results["agreement"])."""
    head = ["method", "batch", "task", "identical seqs", "mean common prefix", "first divergence"]
    lines = [[a["method"], str(a["batch_size"]), a["task"], f"{a['identical']}/{a['sequences']}",
              _f(a["mean_common_prefix"], "{:.1f}"),
              "-" if a["first_divergence"] is None else str(a["first_divergence"])]
             for a in results.get("agreement", [])]
    if not lines:
        return ""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    title = f"greedy agreement with {results.get('baseline')} (first repeat, token ids):"
    return "\n".join([title, fmt.format(*head), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*line) for line in lines])

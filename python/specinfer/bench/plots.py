"""PNG plots of a results dict (matplotlib, Agg backend): acceptance per draft position,
tokens/s per method with min/max whiskers, achieved vs theoretical speedup."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _summary_rows(results: dict) -> list[dict]:
    """One row per method x batch: the pooled "all" row when there are several tasks."""
    rows = [r for r in results["rows"] if "error" not in r]
    tasks = results["config"]["tasks"]
    want = "all" if len(tasks) > 1 else tasks[0]
    return [r for r in rows if r["task"] == want]


def plot_acceptance(results: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    rows = [r for r in results["rows"] if r.get("accepted_per_position")]
    tasks = results["config"]["tasks"]
    for r in rows:
        if len(tasks) > 1 and r["task"] == "all":
            continue
        pos = list(range(1, len(r["accepted_per_position"]) + 1))
        ax.plot(pos, r["accepted_per_position"], marker="o", label=f"{r['method']} b={r['batch_size']} {r['task']}")
    if rows:
        ax.set_xticks(range(1, max(len(r["accepted_per_position"]) for r in rows) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{results['name']}: acceptance per draft position")
    if rows:
        ax.legend(fontsize=6, ncol=2)
    else:
        ax.text(0.5, 0.5, "no speculative method", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_throughput(results: dict, path: Path) -> Path:
    plt = _plt()
    rows = _summary_rows(results)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    labels = [f"{r['method']}\nb={r['batch_size']}" for r in rows]
    med = [r["tokens_per_s_median"] or 0 for r in rows]
    lo = [m - (r["tokens_per_s_min"] or m) for m, r in zip(med, rows)]
    hi = [(r["tokens_per_s_max"] or m) - m for m, r in zip(med, rows)]
    ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4, color="tab:blue")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("tokens/s (median, min/max whiskers)")
    ax.set_title(f"{results['name']}: throughput")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_speedup(results: dict, path: Path) -> Path:
    plt = _plt()
    rows = [r for r in _summary_rows(results) if r.get("theoretical_speedup") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["speedup"] or 0 for r in rows], width=0.4, label="achieved")
    ax.bar([i + 0.2 for i in x], [r["theoretical_speedup"] for r in rows], width=0.4, label="theoretical")
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['method']}\nb={r['batch_size']}" for r in rows], fontsize=7)
    ax.set_ylabel("speedup vs no speculation")
    ax.set_title(f"{results['name']}: achieved vs theoretical speedup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir) -> list[str]:
    out = Path(out_dir)
    return [str(p) for p in (plot_acceptance(results, out / "acceptance_per_position.png"),
                             plot_throughput(results, out / "tokens_per_s.png"),
                             plot_speedup(results, out / "speedup.png"))]

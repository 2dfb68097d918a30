"""The serving load benchmark (`specinfer bench serve-load`): its preset and config checks, and a
smoke run of the whole thing at tiny sizes (tiny model, 1 and 3 clients, a few tokens): servers
started and stopped per method, every request accounted for (ok or refused with a status, none
lost), no block leaked, ratios against the no-speculation baseline. No timing is asserted."""
from __future__ import annotations

import json

import pytest

from specinfer.bench.load_client import RequestResult, summarize
from specinfer.bench.load_config import LOAD_PRESETS, is_load_config, load_load_config


def test_the_preset_is_what_the_issue_asks_for():
    cfg = load_load_config("serve-load")
    assert cfg.model == "smollm2-135m" and cfg.concurrency == (1, 8, 32)
    assert cfg.baseline.name == "no-spec" and any(m.speculative for m in cfg.methods)
    assert is_load_config("serve-load") and not is_load_config("smoke") and "serve-load" in LOAD_PRESETS


@pytest.mark.parametrize("override,fragment", [
    ({"concurrency": [0]}, "concurrency"), ({"requests_per_client": 0}, "requests_per_client"),
    ({"methods": []}, "methods"), ({"bogus": 1}, "bogus"), ({"prompts": [""]}, "prompts"),
    ({"methods": [{"name": "a"}, {"name": "a"}]}, "duplicate")])
def test_bad_configs_name_the_field(override, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_load_config({**LOAD_PRESETS["serve-load"], **override})


def test_summary_counts_every_outcome_and_percentiles():
    results = [RequestResult("ok", ttft_s=t, tpot_s=t / 10, e2e_s=t * 2, completion_tokens=10, num_draft_tokens=4,
                             num_accepted_tokens=3) for t in (0.1, 0.2, 0.3, 0.4)]
    results += [RequestResult("refused", status=429), RequestResult("lost", error="cut")]
    s = summarize(results, wall_s=2.0, concurrency=3)
    assert (s["num_requests"], s["num_ok"], s["refused"], s["num_lost"]) == (6, 4, {"429": 1}, 1)
    assert s["output_tokens_per_s"] == 20.0 and s["requests_per_s"] == 2.0 and s["acceptance_rate"] == 0.75
    assert s["ttft_s"]["p50"] == pytest.approx(0.25) and s["ttft_s"]["p99"] == pytest.approx(0.397)


def _run(level_method, rep, c, tok_s, tpot):
    pct = {"p50": tpot, "p90": tpot, "p99": tpot}
    return {"method": level_method, "repeat": rep, "concurrency": c, "num_requests": 4, "num_ok": 4, "refused": {},
            "num_lost": 0, "blocks_used_after": 0, "requests_per_s": 1.0, "output_tokens_per_s": tok_s,
            "acceptance_rate": None, "ttft_s": pct, "tpot_s": pct, "e2e_s": pct}


def test_rows_pair_each_repeat_with_the_baselines():
    from specinfer.bench.load_runner import build_load_rows, format_load_table

    cfg = load_load_config("serve-load", concurrency=[4], repeats=3)
    runs = [_run("no-spec", 0, 4, 100.0, 0.02), _run("ngram-k4", 0, 4, 150.0, 0.01),
            _run("no-spec", 1, 4, 50.0, 0.04), _run("ngram-k4", 1, 4, 100.0, 0.02),  # a slow repeat: same ratio
            _run("no-spec", 2, 4, 100.0, 0.02), _run("ngram-k4", 2, 4, 300.0, 0.005)]
    rows = {r["method"]: r for r in build_load_rows(cfg, runs)}
    assert rows["ngram-k4"]["speedup_output_tokens_per_s"] == pytest.approx(2.0)  # median of 1.5, 2, 3
    assert rows["ngram-k4"]["speedup_tpot_p50"] == pytest.approx(2.0)  # median of 2, 2, 4
    assert rows["ngram-k4"]["output_tokens_per_s"] == 150.0 and "speedup_output_tokens_per_s" not in rows["no-spec"]
    assert rows["no-spec"]["requests"] == 12 and rows["no-spec"]["tpot_s_p50"] == pytest.approx(0.02)
    table = format_load_table({"rows": list(rows.values())}, markdown=True)
    assert table.splitlines()[0].startswith("| method | clients") and "| 2.00 | 2.00 |" in table


def _smoke_config(path, methods):
    return {**LOAD_PRESETS["serve-load"], "kind": "serve_load", "name": "smoke", "model": str(path),
            "methods": methods, "concurrency": [1, 3], "requests_per_client": 2, "max_tokens": 6, "repeats": 1,
            "warmup": False, "prompts": ["t5 t6 t7 t5 t6 t7 t5", "t9 t8 t9 t8 t9"], "temperature": 0.0,
            "threads": 1,
            # capacity 2 for 3 clients: the third may be refused (429), never lost
            "server_args": ["--num-kv-blocks", "64", "--block-size", "8", "--max-model-len", "256",
                            "--max-num-seqs", "2", "--max-waiting-requests", "0"]}


def _check_results(results):
    for r in results["rows"]:
        assert r["requests"] == 2 * r["concurrency"] and r["ok"] + r["refused"] == r["requests"]
        assert r["lost"] == 0 and r["leaked_blocks"] == 0 and r["ok"] >= 1
        assert r["ttft_s_p50"] > 0 and r["output_tokens_per_s"] > 0
    for run in results["runs"]:
        assert run["server_exit_code"] == 0 and run["running_after"] == 0 and run["waiting_after"] == 0
        assert set(run["refused"]) <= {"429"}
        drafts = sum(q["num_draft_tokens"] for q in run["requests"])
        assert run["server_draft_tokens"] == drafts  # the clients' usage agrees with the server's /metrics


def test_load_benchmark_smoke_run_through_the_cli(tiny_dir, tmp_path, capsys):
    """One speculative server (one process start) at 1 and 3 clients, through `specinfer bench`."""
    from specinfer.cli import main

    path, _ = tiny_dir("llama", seed=3)
    # policy fixed: the goodput policy may measure drafting as not paying on a loaded 2-core
    # machine and draft nothing, and this test asserts that drafts were made
    methods = [dict(m, speculative=dict(m["speculative"], policy="fixed"))
               for m in LOAD_PRESETS["serve-load"]["methods"] if m.get("speculative")]
    cfg_path = tmp_path / "load.json"
    cfg_path.write_text(json.dumps(_smoke_config(path, methods)))
    assert main(["bench", str(cfg_path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "ngram-k4" in capsys.readouterr().out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {(r["method"], r["concurrency"]) for r in results["rows"]} == {("ngram-k4", 1), ("ngram-k4", 3)}
    _check_results(results)
    assert all(r["acceptance_rate"] is not None for r in results["rows"])  # repetitive prompts: drafts made


@pytest.mark.slow
def test_load_benchmark_smoke_run_of_the_preset_methods(tiny_dir, tmp_path):
    """The preset's methods side by side (two process starts per repeat)."""
    from specinfer.bench.load_runner import run_load_benchmark

    path, _ = tiny_dir("llama", seed=3)
    results = run_load_benchmark(load_load_config(_smoke_config(path, LOAD_PRESETS["serve-load"]["methods"])),
                                 tmp_path, log=lambda msg: None)
    rows = {(r["method"], r["concurrency"]): r for r in results["rows"]}
    assert set(rows) == {("no-spec", 1), ("no-spec", 3), ("ngram-k4", 1), ("ngram-k4", 3)}
    _check_results(results)
    assert rows[("no-spec", 1)]["acceptance_rate"] is None and rows[("ngram-k4", 1)]["acceptance_rate"] is not None
    assert rows[("ngram-k4", 1)]["speedup_output_tokens_per_s"] > 0

"""The benchmark suite's runner, prompt sets, formula and outputs (tiny random models; fast)."""
from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from specinfer.bench import PRESETS, load_config, load_prompt_sets, theoretical_speedup
from specinfer.bench.aggregate import build_rows
from specinfer.bench.config import BenchConfig
from specinfer.prompt_sets import INPUT_GROUNDED, TASKS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the formula
@pytest.mark.parametrize("alpha,k,c,expected", [
    (0.5, 1, 0.0, 1.5),  # (1 - .25) / .5
    (0.8, 4, 0.1, (1 - 0.8 ** 5) / (0.2 * 1.4)),  # 2.4011...
    (0.0, 3, 0.2, 1 / 1.6),  # nothing accepted: pure cost
    (1.0, 4, 0.0, 5.0),  # limit alpha -> 1: k + 1
    (1.0, 2, 0.5, 1.5),  # 3 / 2
    (0.6, 2, 0.05, (1 + 0.6 + 0.36) / 1.1),
])
def test_theoretical_speedup_hand_values(alpha, k, c, expected):
    assert theoretical_speedup(alpha, k, c) == pytest.approx(expected, rel=1e-12)


def test_theoretical_speedup_is_continuous_at_alpha_one():
    assert theoretical_speedup(1 - 1e-9, 4, 0.1) == pytest.approx(theoretical_speedup(1.0, 4, 0.1), rel=1e-6)


@pytest.mark.parametrize("alpha,k,c", [(-0.1, 1, 0), (1.1, 1, 0), (0.5, 0, 0), (0.5, 1.5, 0), (0.5, 2, -1)])
def test_theoretical_speedup_refuses_bad_input(alpha, k, c):
    with pytest.raises(ValueError):
        theoretical_speedup(alpha, k, c)


# ---------------------------------------------------------------- prompt sets
def test_prompt_sets_load_and_are_non_empty_per_task():
    sets = load_prompt_sets()
    assert set(sets) == set(TASKS)
    for task, s in sets.items():
        assert len(s) >= 20, task
        assert len(set(s.ids)) == len(s), f"{task}: duplicate ids"
        assert all(isinstance(p, str) and len(p) >= 15 for p in s.prompts), task
    assert all("```python" in p for p in sets["code_completion"].prompts)
    assert all("def " in p for p in sets["code_editing"].prompts)
    assert all("Passage:" in p for p in sets["qa"].prompts)


def test_input_grounded_tasks_carry_their_source_text():
    """An editing / summarizing prompt embeds a long passage the answer can copy from."""
    sets = load_prompt_sets(INPUT_GROUNDED)
    for task, s in sets.items():
        assert min(len(p) for p in s.prompts) > 300, task


def test_prompt_set_errors_name_the_file(tmp_path):
    from specinfer.prompt_sets import load_prompt_set

    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_prompt_set("bad", tmp_path)
    with pytest.raises(ValueError, match="not found"):
        load_prompt_set("missing", tmp_path)


# ---------------------------------------------------------------- configs
def test_every_preset_is_a_valid_config():
    for name in PRESETS:
        cfg = load_config(name)
        assert cfg.baseline is not None and cfg.baseline.speculative is None
    assert load_config("qwen-draft").cost_method.name == "draft-alone"


def test_bad_configs_are_refused_with_the_field_named(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        load_config({"name": "x", "model": "m", "methods": [{"name": "a"}], "repeat": 3})
    with pytest.raises(ValueError, match="baseline"):
        load_config({"name": "x", "model": "m", "methods": [{"name": "a", "speculative": {"method": "ngram"}}]})
    with pytest.raises(ValueError, match="duplicate"):
        load_config({"name": "x", "model": "m", "methods": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValueError, match="batch_sizes"):
        load_config({"name": "x", "model": "m", "methods": [{"name": "a"}], "batch_sizes": [0]})
    with pytest.raises(ValueError, match="draft_model"):
        load_config({"name": "x", "model": "m", "methods": [{"name": "a"}, {"name": "b", "engine": "hf",
                                                                           "mode": "assisted"}]})
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="neither a preset"):
        load_config(str(tmp_path / "nope.json"))


# ---------------------------------------------------------------- aggregation on known numbers
def _run(method, rep, tokens, wall, task="t", b=1, metrics=None):
    return dict(method=method, task=task, batch_size=b, repeat=rep, tokens=tokens, wall_s=wall, cpu_s=wall / 2,
                tokens_per_s=tokens / wall, metrics=metrics)


def _metrics(drafts, draft_tokens, accepted, emitted, propose_s=0.0, score_s=1.0, k=2):
    return dict(num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted,
                num_emitted_tokens=emitted, max_emittable_tokens=draft_tokens + drafts, propose_s=propose_s,
                score_s=score_s, verify_s=0.0, overhead_s=0.0, num_steps=drafts,
                drafts_at=[drafts] * k, accepted_at=[accepted // 2 + accepted % 2, accepted // 2])


def test_rows_speedup_is_the_median_of_ratios_paired_by_repeat():
    cfg = BenchConfig.from_dict({"name": "x", "model": "m", "tasks": ["t"], "repeats": 3, "methods": [
        {"name": "base"}, {"name": "spec", "speculative": {"method": "ngram", "num_speculative_tokens": 2}}]})
    runs = [_run("base", 0, 100, 10.0), _run("spec", 0, 100, 5.0),  # 2.0x
            _run("base", 1, 100, 20.0), _run("spec", 1, 100, 5.0),  # 4.0x (a noisy baseline repeat)
            _run("base", 2, 100, 10.0), _run("spec", 2, 100, 4.0)]  # 2.5x
    for r, m in zip(runs[1::2], [_metrics(10, 20, 10, 20, 0.2), _metrics(10, 20, 10, 20, 0.2),
                                 _metrics(10, 20, 10, 20, 0.2)]):
        r["metrics"] = m
    rows, _ = build_rows(cfg, runs)
    spec = next(r for r in rows if r["method"] == "spec")
    base = next(r for r in rows if r["method"] == "base")
    assert sorted(spec["speedup_per_repeat"]) == pytest.approx([2.0, 2.5, 4.0])
    assert spec["speedup"] == pytest.approx(2.5)
    assert base["speedup"] == pytest.approx(1.0)
    assert spec["tokens_per_s_median"] == pytest.approx(20.0) and spec["tokens_per_s_max"] == pytest.approx(25.0)
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["mean_acceptance_length"] == pytest.approx(2.0)
    assert spec["accepted_per_position"] == pytest.approx([0.5, 0.5])
    assert spec["c"] == pytest.approx(0.6 / (2 * 3.0))  # propose_s / (k * score_s), pooled
    assert spec["theoretical_speedup"] == pytest.approx(theoretical_speedup(0.5, 2, 0.1))
    assert spec["achieved_over_theoretical"] == pytest.approx(2.5 / theoretical_speedup(0.5, 2, 0.1))
    assert spec["cpu_s_per_token"] == pytest.approx(7.0 / 300)
    assert spec["speedup_cpu"] == pytest.approx(2.5)  # cpu_s = wall_s / 2 in these runs


def test_reaggregate_rebuilds_rows_from_runs(tiny_results, tmp_path):
    from specinfer.bench.runner import reaggregate

    results, _ = tiny_results
    stale = {**json.loads(json.dumps(results)), "rows": []}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(stale))
    rebuilt = reaggregate(path, plots=False)
    assert rebuilt["rows"] == json.loads(json.dumps(results["rows"]))
    assert json.loads(path.read_text())["rows"] == rebuilt["rows"]


def test_rows_take_c_from_the_draft_alone_when_measured():
    cfg = BenchConfig.from_dict({"name": "x", "model": "m", "tasks": ["t"], "repeats": 1, "methods": [
        {"name": "base"}, {"name": "draft", "speculative": {"method": "draft_model", "model": "d",
                                                            "num_speculative_tokens": 2}},
        {"name": "alone", "model": "d", "role": "cost"}]})
    runs = [_run("base", 0, 100, 10.0), _run("draft", 0, 100, 8.0, metrics=_metrics(10, 20, 20, 30)),
            _run("alone", 0, 100, 2.5)]
    rows, costs = build_rows(cfg, runs)
    assert costs["1"]["c"] == pytest.approx(0.25)
    draft = next(r for r in rows if r["method"] == "draft")
    assert draft["c"] == pytest.approx(0.25) and "alone" in draft["c_source"]
    assert draft["theoretical_speedup"] == pytest.approx(3 / 1.5)


# ---------------------------------------------------------------- end to end on tiny models
@pytest.fixture(scope="module")
def tiny_prompt_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    for task, n in (("code_editing", 3), ("chat", 2)):
        with open(d / f"{task}.jsonl", "w") as f:
            for i in range(n):
                words = " ".join(f"t{(7 * i + j) % 200 + 3}" for j in range(6 + 5 * i))
                f.write(json.dumps({"task": task, "id": f"{task}-{i}", "prompt": words + " " + words}) + "\n")
    return d


def _tiny_config(model_dir, prompt_dir, **kw):
    d = {"name": "tiny", "model": str(model_dir), "tasks": ["code_editing", "chat"], "num_prompts": 2,
         "batch_sizes": [1, 3], "max_tokens": 6, "repeats": 2, "ignore_eos": True, "prompt_dir": str(prompt_dir),
         "methods": [
             {"name": "no-spec"},
             {"name": "ngram-k2", "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
             {"name": "self-draft-k3", "speculative": {"method": "draft_model", "model": str(model_dir),
                                                       "num_speculative_tokens": 3, "policy": "fixed"}},
             {"name": "draft-alone", "model": str(model_dir), "role": "cost"},
             {"name": "hf-generate", "engine": "hf"},
             {"name": "hf-assisted", "engine": "hf", "mode": "assisted", "draft_model": str(model_dir),
              "num_speculative_tokens": 3},
             {"name": "vllm", "engine": "vllm"},
         ]}
    d.update(kw)
    return d


@pytest.fixture(scope="module")
def tiny_results(tiny_dir, tiny_prompt_dir, tmp_path_factory):
    from specinfer.bench.runner import run_benchmark

    model_dir, _ = tiny_dir("llama", scale=4.0)
    out = tmp_path_factory.mktemp("bench_out")
    saved = sys.modules.get("vllm")
    sys.modules["vllm"] = None  # vLLM is absent: the peer must be reported unavailable, not faked
    try:
        results = run_benchmark(_tiny_config(model_dir, tiny_prompt_dir), out, log=lambda *_: None)
    finally:
        if saved is None:
            sys.modules.pop("vllm", None)
        else:
            sys.modules["vllm"] = saved
    return results, out


def test_runner_writes_valid_results_json(tiny_results):
    results, out = tiny_results
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(results["rows"]))
    for key in ("machine", "config", "rows", "runs", "baseline", "unavailable", "cost_ratio", "prompts"):
        assert key in on_disk, key
    m = on_disk["machine"]
    assert isinstance(m["cpu_model"], str) and isinstance(m["cpu_count"], int) and isinstance(m["torch"], str)
    assert m["torch_threads"] == on_disk["config"]["threads"] == 1
    assert on_disk["baseline"] == "no-spec"
    assert "vllm" in on_disk["unavailable"] and "not importable" in on_disk["unavailable"]["vllm"]
    # interleaved: within each (repeat, batch, task) every available method ran once, in config order
    runs = on_disk["runs"]
    order = [r["method"] for r in runs if r["repeat"] == 0 and r["batch_size"] == 1 and r["task"] == "chat"]
    assert order == ["no-spec", "ngram-k2", "self-draft-k3", "draft-alone", "hf-generate", "hf-assisted"]
    assert [r["repeat"] for r in runs] == sorted(r["repeat"] for r in runs)
    for r in runs:
        if "error" in r:
            continue
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and isinstance(r["load_average"], list)
        assert r["tokens"] == r["num_requests"] * 6  # ignore_eos: exactly max_tokens each


def test_runner_rows_hold_speedups_and_acceptance(tiny_results):
    results, _ = tiny_results
    rows = {(r["method"], r["batch_size"], r["task"]): r for r in results["rows"]}
    for b in (1, 3):
        for task in ("code_editing", "chat", "all"):
            base = rows[("no-spec", b, task)]
            assert base["speedup"] == pytest.approx(1.0)
            assert len(base["tokens_per_s"]) == 2
            assert base["tokens_per_s_min"] <= base["tokens_per_s_median"] <= base["tokens_per_s_max"]
            self_draft = rows[("self-draft-k3", b, task)]
            # the target drafting for itself (greedy): everything accepted, k + 1 per verification
            assert self_draft["acceptance_rate"] == pytest.approx(1.0)
            assert self_draft["accepted_per_position"] == pytest.approx([1.0, 1.0, 1.0])
            assert self_draft["c"] > 0 and math.isfinite(self_draft["theoretical_speedup"])
            assert self_draft["verify_step_cost"] > 0 and base["verify_step_cost"] == pytest.approx(1.0)
            v, k, c = self_draft["verify_step_cost"], 3, self_draft["c"]
            assert self_draft["theoretical_speedup_with_verify_cost"] == pytest.approx(
                theoretical_speedup(1.0, k, c) * (k * c + 1) / (k * c + v))
            assert isinstance(self_draft["speedup"], float)
            ng = rows[("ngram-k2", b, task)]
            assert 0.0 <= ng["acceptance_rate"] <= 1.0 and len(ng["accepted_per_position"]) == 2
            assert rows[("hf-generate", b, task)]["speedup"] > 0
    assert rows[("hf-assisted", 1, "all")]["speedup"] > 0
    assert "batch size 1 only" in rows[("hf-assisted", 3, "all")]["error"]
    assert results["cost_ratio"]["1"]["c"] > 0


def test_runner_writes_png_plots(tiny_results):
    import matplotlib.image as mpimg

    results, out = tiny_results
    names = {"acceptance_per_position.png", "tokens_per_s.png", "speedup.png"}
    assert {p.split("/")[-1] for p in results["plots"]} == names
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        img = mpimg.imread(out / name)
        assert img.shape[:2] == (450, 700), (name, img.shape)
        assert img.std() > 0.01, f"{name} is blank"


def test_table_lists_every_method(tiny_results):
    from specinfer.bench.table import format_table

    results, _ = tiny_results
    text = format_table(results)
    for name in ("no-spec", "ngram-k2", "self-draft-k3", "hf-generate", "hf-assisted", "vllm"):
        assert name in text
    md = format_table(results, markdown=True)
    assert md.splitlines()[0].startswith("| method |") and md.count("\n") == text.count("\n")


def test_cli_runs_a_json_config_and_refuses_bad_arguments(tiny_dir, tiny_prompt_dir, tmp_path, capsys):
    from specinfer.bench import cli

    model_dir, _ = tiny_dir("llama", scale=4.0)
    cfg = _tiny_config(model_dir, tiny_prompt_dir, batch_sizes=[1], repeats=1, tasks=["chat"], num_prompts=1,
                       methods=[{"name": "no-spec"}, {"name": "ngram-k2", "speculative": {"method": "ngram",
                                                                                           "num_speculative_tokens": 2}}])
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args([str(path), "--out", str(tmp_path / "o"), "--no-plots", "--quiet"])) == 0
    out = capsys.readouterr().out
    assert "ngram-k2" in out and "results.json" in out
    assert json.loads((tmp_path / "o" / "results.json").read_text())["config"]["plots"] is False
    assert not list((tmp_path / "o").glob("*.png"))
    # bad arguments: one-line errors, exit status 2
    assert cli.run(p.parse_args(["no-such-preset", "--out", str(tmp_path / "x")])) == 2
    assert "neither a preset" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.run(p.parse_args([str(path), "--out", str(blocker / "sub")])) == 2
    assert "cannot write" in capsys.readouterr().err
    assert cli.HELP and callable(cli.add_arguments)

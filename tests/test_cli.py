"""The `specinfer` command line end to end: every subcommand in a subprocess on a tiny model (the
demo on the real SmolLM2), and every kind of bad input as one line on stderr, never a traceback."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, stdin: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "specinfer", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def assert_one_line_error(proc, command: str, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"specinfer {command}: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama", seed=3)
    return path


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy target-only decoding in process: what the CLI must reproduce token for token."""
    from specinfer import Generator, SamplingParams

    gen = Generator(str(tiny))

    def decode(prompt, max_tokens):
        return gen.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)[0].token_ids

    return decode


# ------------------------------------------------------------------ help and dispatch
@pytest.mark.parametrize("command", ["generate", "chat", "bench", "demo", "models"])
def test_every_subcommand_has_help(command, capsys):
    from specinfer.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: specinfer {command}")
    assert "--" in out


def test_console_script_entry_point_resolves(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["specinfer"].split(":")
    import importlib

    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "chat", "bench", "demo", "models"):
        assert command in out


def test_top_level_help_does_not_import_bench():
    code = ("import sys\nfrom specinfer.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert not any(m.startswith('specinfer.bench') for m in sys.modules), 'bench imported eagerly'\n"
            "assert 'torch' not in sys.modules, 'torch imported for --help'\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_bench_missing_module_is_one_line_error(monkeypatch, capsys):
    from specinfer.cli import main

    monkeypatch.setitem(sys.modules, "specinfer.bench", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "specinfer.bench.cli", raising=False)
    assert main(["bench", "preset", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specinfer bench: error: ") and "specinfer.bench" in err[0]


def test_bench_forwards_its_arguments_to_the_bench_module(monkeypatch, capsys):
    from specinfer.cli import main

    seen = {}
    fake = types.ModuleType("specinfer.bench.cli")
    fake.HELP = "fake bench"
    fake.add_arguments = lambda p: (p.add_argument("config"), p.add_argument("--out", required=True))
    fake.run = lambda args: seen.update(vars(args)) or 7
    pkg = types.ModuleType("specinfer.bench")
    pkg.cli = fake
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "specinfer.bench", pkg)
    monkeypatch.setitem(sys.modules, "specinfer.bench.cli", fake)
    assert main(["bench", "quick", "--out", "results"]) == 7
    assert seen == {"config": "quick", "out": "results"}
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0 and "fake bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # the bench parser's own usage error: one line, status 2
        main(["bench", "quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specinfer bench: error: ")


def test_internal_error_is_one_line_without_traceback(monkeypatch, capsys):
    from specinfer import cli

    def boom(args):
        raise RuntimeError("kaput\nsecond line")

    monkeypatch.setattr(cli.models, "run", boom)
    assert cli.main(["models"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specinfer models: error: internal error (RuntimeError: kaput second line); rerun with "
                   "SPECINFER_TRACEBACK=1 for the traceback"]


# ------------------------------------------------------------------ generate
def test_generate_single_prompt_streams_the_greedy_text(tiny, reference):
    proc = run_cli("generate", tiny, "--prompt", "t5 t6 t7 t5 t6", "--max-tokens", 7, "--ignore-eos", "-k", 3)
    assert proc.returncode == 0, proc.stderr
    expected = " ".join(f"t{i}" for i in reference("t5 t6 t7 t5 t6", 7))
    assert proc.stdout == expected + "\n"
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("summary: 1 request, 5 prompt tokens, 7 generated tokens")
    assert "tokens/s" in summary and "(ngram, k=3)" in summary and "acceptance rate" in summary


def test_generate_batch_reports_bad_lines_and_completes_the_others(tiny, reference, tmp_path):
    lines = [
        json.dumps({"prompt": "t5 t6 t7 t5 t6 t7", "id": "first"}),
        '{"prompt": "t1 t2", "max_tokens": 5',  # malformed JSON
        json.dumps({"prompt_token_ids": [9, 8, 7, 9, 8], "max_tokens": 3}),
        "",  # blank lines are skipped, not requests
        json.dumps({"prompt": "t4", "temperature": -1}),  # a bad override
        json.dumps({"prompt_token_ids": [3, 999]}),  # outside the vocabulary: found after loading
        json.dumps({"messages": [{"role": "user", "content": "t8 t9"}], "max_tokens": 2}),
        json.dumps({"messages": [{"role": "user", "content": ["t8"]}]}),  # content not a string
    ]
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = run_cli("generate", tiny, "--input", src, "--output", out, "--max-tokens", 6, "--ignore-eos",
                   "--method", "ngram", "-k", 4, "--progress")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.splitlines()
    assert f"specinfer generate: error: {src}:2: invalid JSON (Expecting ',' delimiter at column 36)" in err
    assert any(e.startswith(f"specinfer generate: error: {src}:5: SamplingParams.temperature") for e in err)
    assert any(e.startswith(f"specinfer generate: error: {src}:6: prompt token id 999") for e in err)
    assert f"specinfer generate: error: {src}:8: messages[0].content must be a string (got list)" in err
    assert re.search(r"generate: +100%\|[^\n\r]*\| 3/3 \[", proc.stderr), proc.stderr  # the progress bar
    assert any(e.startswith("summary: 3 requests (4 failed)") for e in err)

    results = [json.loads(s) for s in out.read_text().splitlines()]
    assert [r["line"] for r in results] == [1, 2, 3, 5, 6, 7, 8]
    assert [("error" in r) for r in results] == [False, True, False, True, True, False, True]
    first, third, chat = results[0], results[2], results[5]
    assert first["id"] == "first" and first["prompt"] == "t5 t6 t7 t5 t6 t7"
    assert first["token_ids"] == reference("t5 t6 t7 t5 t6 t7", 6)
    assert first["text"] == " ".join(f"t{i}" for i in first["token_ids"])
    assert third["prompt"] is None and third["prompt_token_ids"] == [9, 8, 7, 9, 8]
    assert third["token_ids"] == reference([9, 8, 7, 9, 8], 3) and third["finish_reason"] == "length"
    assert chat["prompt"].startswith("<|im_start|>user\nt8 t9<|im_end|>") and len(chat["token_ids"]) == 2
    for r in (first, third, chat):
        assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate"} <= set(r)
        assert 0 <= r["num_accepted_tokens"] <= r["num_draft_tokens"]
    assert not list(tmp_path.glob(".*partial"))  # the temporary output was renamed into place


def test_generate_with_the_target_as_its_own_draft_accepts_everything(tiny, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": p}) for p in ["t1 t2 t3", "t7 t7", "t100 t3 t9 t4"]))
    proc = run_cli("generate", tiny, "--input", src, "--draft-model", tiny, "-k", 3, "--max-tokens", 9, "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(s) for s in proc.stdout.splitlines()]  # no --output: JSONL on stdout
    assert [len(r["token_ids"]) for r in results] == [9, 9, 9]
    assert all(r["num_accepted_tokens"] == r["num_draft_tokens"] > 0 for r in results)
    assert "acceptance rate: 1.000" in proc.stderr and "(draft_model, k=3)" in proc.stderr


@pytest.mark.parametrize("args, fragments", [
    (["nosuch-model", "--prompt", "hi"], ["'nosuch-model'", "smollm2-135m"]),
    (["{tiny}", "--prompt", "hi", "-k", "0"], ["num_speculative_tokens", "got 0"]),
    (["{tiny}", "--prompt", "hi", "--draft-model", "no/such/draft"], ["draft model 'no/such/draft'"]),
    (["{tiny}", "--prompt", "hi", "--method", "draft_model"], ["--draft-model"]),
    # llama.cpp's --draft is a token count: ours is refused by name, never taken as --draft-model
    (["{tiny}", "--prompt", "hi", "--draft", "{tiny}"], ["--draft is now --draft-model"]),
    (["{tiny}", "--prompt", "hi", "--top-p", "0"], ["top_p"]),
    (["{tiny}", "--prompt", "hi", "--temperature", "warm"], ["--temperature", "invalid float value"]),
    (["{tiny}", "--input", "{tmp}/missing.jsonl"], ["missing.jsonl", "no such file"]),
    (["{tiny}", "--input", "{tmp}/ok.jsonl", "--output", "{tmp}/no/such/dir/out.jsonl"], ["cannot write", "does not exist"]),
    (["{tiny}", "--input", "{tmp}/ok.jsonl", "--out", "{tmp}"], ["cannot write", "is a directory"]),
])
def test_generate_bad_arguments_are_one_line_errors(tiny, tmp_path, args, fragments):
    (tmp_path / "ok.jsonl").write_text('{"prompt": "t1"}\n{"prompt": broken\n')
    args = [a.format(tiny=tiny, tmp=tmp_path) for a in args]
    proc = run_cli("generate", *args, timeout=60)
    assert_one_line_error(proc, "generate", *fragments)
    assert proc.stdout == ""


# ------------------------------------------------------------------ chat
def test_chat_through_a_pipe(tiny):
    proc = run_cli("chat", tiny, "--max-tokens", 5, "--ignore-eos", "-k", 2, "--system", "t3",
                   stdin="t5 t6 t7\n\n/reset\nt8 t9\n/exit\nt1 never answered\n")
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.splitlines()
    assert len(answers) == 2  # blank line skipped, nothing after /exit
    assert all(len(a.split()) == 5 and all(w.startswith("t") for w in a.split()) for a in answers)
    stats = [s for s in proc.stderr.splitlines() if s.startswith("[")]
    assert len(stats) == 2 and all("5 tokens" in s and "finish: length" in s for s in stats)


def test_chat_session_keeps_history_and_uses_the_template(tiny_dir):
    from specinfer import Generator, SamplingParams
    from specinfer.chat_template import ChatTemplate
    from specinfer.cli.chat import ChatSession

    path, _ = tiny_dir("llama", seed=3)
    gen = Generator(str(path))
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                            "{% if add_generation_prompt %}assistant: {% endif %}")
    session = ChatSession(gen, template, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), system="t1")
    import io

    buf = io.StringIO()
    session.turn("t5 t6", buf)
    first_answer = session.messages[-1]["content"]
    session.turn("t7", buf)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    rendered = template.render(session.messages[:4])
    assert rendered == f"system: t1 user: t5 t6 assistant: {first_answer} user: t7 assistant: "
    session.reset()
    assert session.messages == [{"role": "system", "content": "t1"}]


# ------------------------------------------------------------------ models
def test_models_table_and_verify():
    proc = run_cli("models", timeout=60)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:5] == ["PACK", "ARCH", "INSTALLED", "SIZE", "HASH"]
    smol = next(r for r in rows if r.startswith("smollm2-135m "))
    assert smol.split()[1:4] == ["llama", "yes", "94"]
    proc = run_cli("models", "smollm2-135m", "--verify", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    (entry,) = json.loads(proc.stdout)
    assert entry["name"] == "smollm2-135m" and entry["hash_status"] == "ok" and entry["installed"]
    assert_one_line_error(run_cli("models", "no-such-pack", timeout=60), "models", "no-such-pack")


# ------------------------------------------------------------------ demo (the real SmolLM2-135M)
def test_demo_on_smollm2_gives_identical_greedy_text():
    proc = run_cli("demo", "--max-tokens", 24, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "greedy outputs identical with and without speculation: True" in out
    assert "acceptance rate=" in out and "mean acceptance length=" in out and "speedup:" in out
    assert out.count("--- answer (") == 3


def test_demo_bad_arguments():
    assert_one_line_error(run_cli("demo", "-k", 0, timeout=60), "demo", "num_speculative_tokens")
    assert_one_line_error(run_cli("demo", "--model", "nope", timeout=60), "demo", "'nope'")


def test_demo_threads_flag_is_checked_before_loading():
    assert_one_line_error(run_cli("demo", "--threads", "two", timeout=60), "demo", "--threads")


def test_spec_policy_flag_reaches_the_speculative_config():
    import argparse

    from specinfer.cli.errors import CliError
    from specinfer.cli.options import add_speculative_arguments, speculative_config

    p = argparse.ArgumentParser()
    add_speculative_arguments(p)
    assert speculative_config(p.parse_args(["-k", "3"])).policy == "auto"
    for policy in ("fixed", "goodput", "auto"):
        assert speculative_config(p.parse_args(["-k", "3", "--spec-policy", policy])).policy == policy
    with pytest.raises(CliError, match="--spec-policy"):
        speculative_config(p.parse_args(["--speculative-config", '{"method": "ngram"}', "--spec-policy", "fixed"]))
    with pytest.raises(SystemExit):
        p.parse_args(["-k", "3", "--spec-policy", "fastest"])


def test_draft_quantization_flag_reaches_the_speculative_config(tmp_path):
    import argparse

    from specinfer.cli.errors import CliError
    from specinfer.cli.options import add_speculative_arguments, speculative_config

    p = argparse.ArgumentParser()
    add_speculative_arguments(p)
    head = ["--method", "medusa", "--head", str(tmp_path)]
    assert speculative_config(p.parse_args(head)).quantization is None  # as the target
    for q in ("int8", "none"):
        assert speculative_config(p.parse_args(head + ["--draft-quantization", q])).quantization == q
    with pytest.raises(CliError, match="--draft-quantization applies to a draft model or head"):
        speculative_config(p.parse_args(["-k", "3", "--draft-quantization", "int8"]))
    with pytest.raises(CliError, match="--draft-quantization"):
        speculative_config(p.parse_args(["--speculative-config", '{"method": "ngram"}', "--draft-quantization",
                                         "int8"]))
    with pytest.raises(SystemExit):
        p.parse_args(head + ["--draft-quantization", "fp8"])


def test_ngram_first_flag_reaches_the_speculative_config(tmp_path):
    import argparse

    from specinfer.cli.errors import CliError
    from specinfer.cli.options import add_speculative_arguments, speculative_config

    p = argparse.ArgumentParser()
    add_speculative_arguments(p)
    head = ["--method", "eagle", "--head", str(tmp_path)]
    plain = speculative_config(p.parse_args(head))
    assert not plain.ngram_first and plain.prompt_lookup_min == 1
    cfg = speculative_config(p.parse_args(head + ["--ngram-first"]))
    assert cfg.ngram_first and cfg.prompt_lookup_min == 2  # a lone repeated token is weak evidence
    assert speculative_config(p.parse_args(head + ["--ngram-first", "--prompt-lookup-min", "3"])).prompt_lookup_min == 3
    assert speculative_config(p.parse_args(["-k", "3"])).prompt_lookup_min == 1  # ngram's default unchanged
    with pytest.raises((CliError, ValueError), match="prompt lookup alone"):
        speculative_config(p.parse_args(["-k", "3", "--ngram-first"]))
    with pytest.raises(CliError, match="--ngram-first needs"):
        speculative_config(p.parse_args(["--method", "none", "--ngram-first"]))
    with pytest.raises(CliError, match="--ngram-first"):
        speculative_config(p.parse_args(["--speculative-config", '{"method": "ngram"}', "--ngram-first"]))


def test_python_m_specinfer_from_the_checkout_keeps_its_root_off_sys_path():
    """`python -m specinfer` run in the repository root: the checkout's kernels/ must not shadow
    the PyPI package `kernels` that transformers imports (bench peers load HF models)."""
    code = ("import runpy, sys\n"
            "sys.argv = ['specinfer', '--help']\n"
            "try:\n    runpy.run_module('specinfer', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "from transformers import LlamaConfig  # imports the PyPI `kernels` where installed\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_generate_keeps_finished_lines_when_interrupted(tiny, tmp_path, monkeypatch):
    """Ctrl-C during `generate --input ... --output ...`: every request that had finished is in the
    output (each result names its input line), the unfinished ones are not."""
    from specinfer.cli import main
    from specinfer.engine.llm_engine import LLMEngine

    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lengths = [60, 2, 60, 3, 60]  # the short ones finish, then Ctrl-C lands while the long ones run
    src.write_text("".join(json.dumps({"prompt": f"t{5 + i} t6", "max_tokens": n}) + "\n"
                           for i, n in enumerate(lengths)))
    real_step, calls = LLMEngine.step, {"n": 0}

    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(LLMEngine, "step", step)
    assert main(["generate", str(tiny), "--input", str(src), "--output", str(out), "--ignore-eos",
                 "--temperature", "0"]) == 130
    results = [json.loads(s) for s in out.read_text().splitlines()]
    assert sorted(r["line"] for r in results) == [2, 4]
    assert [len(r["token_ids"]) for r in sorted(results, key=lambda r: r["line"])] == [2, 3]

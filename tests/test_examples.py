"""Every script in examples/ runs as a user would run it (a subprocess), here on a tiny model."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args, stdin: str | None = None) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama", seed=3)
    return path


SMALL = ("--max-model-len", 256)


def test_every_example_is_tested():
    tested = {"offline_ngram.py", "offline_draft_model.py", "streaming.py", "chat.py", "spec_metrics.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_offline_ngram(tiny):
    out = run_example("offline_ngram.py", "--model", tiny, "--max-tokens", 6, *SMALL)
    assert out.count("### ") == 3
    runs = re.findall(r"\((\d+) tokens, (\d+)/(\d+) draft tokens accepted, finish: (length|stop)\)", out)
    assert len(runs) == 3
    for n, accepted, drafted, finish in runs:
        assert int(n) == 6 if finish == "length" else 1 <= int(n) <= 6
        assert int(accepted) <= int(drafted)
    assert re.search(r"acceptance rate \d\.\d{3}, mean acceptance length \d\.\d{2}", out)


def test_offline_draft_model_with_the_target_as_draft(tiny):
    out = run_example("offline_draft_model.py", "--model", tiny, "--draft", tiny, "-k", 3, "--max-tokens", 7, *SMALL)
    assert out.count("# (") == 3
    assert "acceptance rate 1.000" in out  # a draft equal to the target is always accepted


def test_streaming(tiny):
    out = run_example("streaming.py", "--model", tiny, "--max-tokens", 8, "--show-steps", "--prompt", "t5 t6 t5 t6",
                      *SMALL)
    bursts = [int(n) for n in re.findall(r"\[(\d+)\]", out)]
    summary = re.search(r"(\d+) tokens in (\d+) steps", out)
    assert summary, out
    assert sum(bursts) == int(summary.group(1)) and len(bursts) == int(summary.group(2))


def test_chat_through_a_pipe(tiny):
    out = run_example("chat.py", "--model", tiny, "--max-tokens", 4, *SMALL, stdin="t1 t2\n\nt3\n/exit\nt4\n")
    replies = out.splitlines()
    assert len(replies) == 2  # the blank line is skipped and nothing after /exit is answered
    assert all(r.split() and all(w.startswith("t") for w in r.split()) for r in replies)


def test_spec_metrics(tiny):
    out = run_example("spec_metrics.py", "--model", tiny, "--max-tokens", 8, "-k", 3, *SMALL)
    for key in ("num_drafts", "acceptance_rate", "mean_acceptance_length", "system_efficiency",
                "accepted per position", "time split", "theoretical speedup"):
        assert key in out
    positions = re.search(r"accepted per position\s+([\d. ]+)", out).group(1).split()
    assert len(positions) == 3

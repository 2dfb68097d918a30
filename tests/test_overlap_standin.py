"""The stand-in for an asynchronous device (benches/overlap_standin.py), small: every loop
(serial, overlapped, scheduled ahead / launched after the update) of every method gives the same
tokens under modeled launches (the script asserts it), and the table and JSON come out whole."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benches" / "overlap_standin.py"


def _load():
    import sys

    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("overlap_standin", BENCH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH.parent))


@pytest.mark.parametrize("draft_sync", ["end", "each"])
def test_standin_loops_agree_and_report(tmp_path, capsys, draft_sync):
    out = tmp_path / "standin.json"
    rc = _load().main(["--batch", "3", "--prompt-len", "24", "--new-tokens", "10", "--repeats", "1",
                       "--device-ms", "0.5", "--draft-ms", "0.1", "--draft-sync", draft_sync, "--json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    loops = ("serial", "overlap", "ahead", "cuda")
    want = {f"{m}/{loop}" for m in ("plain", "ngram") for loop in loops}
    assert set(summary) == want | {"draft_model/serial", "draft_model/overlap", "draft_model/cuda"}
    for key, row in summary.items():
        assert row["steps"] > 0 and row["device_ms"] > 0 and row["wall_ms"] >= row["device_ms"] * 0.9, key
    assert summary["draft_model/overlap"]["mean_acceptance_length"] > 0
    assert "| draft_model | overlap |" in capsys.readouterr().out

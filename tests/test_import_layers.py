"""The runtime never imports what sits above it: nothing in engine/, spec_decode/, executor/,
sample/, models/, attention/, platform/ or loader/ imports training, bench, cli, serve or the
Generator; and inside the runtime the layers point down only (DESIGN §2: engine -> (spec_decode,
sample, executor) -> (models, attention, platform, loader) -> kernels/_core): nothing below the
engine imports engine/, nothing at the bottom imports spec_decode/, sample/ or executor/ — not
even from inside a function. Read with `ast`, so a function-local import counts like a
module-level one."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import specinfer

ROOT = Path(specinfer.__file__).parent
RUNTIME = ("engine", "spec_decode", "executor", "sample", "models", "attention", "platform", "loader", "structured")
ABOVE = ("specinfer.training", "specinfer.bench", "specinfer.cli", "specinfer.serve", "specinfer.generator")


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def violations(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """file -> the modules it imports that start with one of `forbidden`."""
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = sorted(m for m in imported_modules(path) if m.startswith(forbidden))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    return bad


@pytest.mark.parametrize("package", RUNTIME)
def test_the_runtime_imports_nothing_above_it(package):
    assert not violations(package, ABOVE)


# each runtime layer and the packages above it that it may never import
MIDDLE = ("spec_decode", "sample", "executor")
BOTTOM = ("models", "attention", "platform", "loader", "structured")
NOT_FROM = {**{p: ("specinfer.engine",) for p in MIDDLE},
            **{p: ("specinfer.engine",) + tuple(f"specinfer.{m}" for m in MIDDLE) for p in BOTTOM}}


@pytest.mark.parametrize("package", sorted(NOT_FROM))
def test_runtime_layers_point_down_only(package):
    """The engine is a sink: the model runner, KV caches, batch and sampling metadata live in the
    layers that use them (models/, attention/, sample/), so nothing below imports the engine."""
    assert not violations(package, NOT_FROM[package])


def test_the_layer_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The negative control: a bottom-layer file importing the engine is reported."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "bad.py").write_text("def f():\n    from specinfer.engine.llm_engine import LLMEngine\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("models", NOT_FROM["models"]) == {"models/bad.py": ["specinfer.engine.llm_engine",
                                                                          "specinfer.engine.llm_engine.LLMEngine"]}


def test_the_checker_sees_function_local_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from specinfer.training import head_training\n    import specinfer.bench.runner\n")
    assert {"specinfer.training", "specinfer.bench.runner"} <= imported_modules(f)


def test_an_engine_given_a_head_name_says_how_to_get_one(target):
    from specinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="resolve_head"):
        LLMEngine(str(target), speculative={"method": "eagle", "model": "smollm2-135m-eagle"})

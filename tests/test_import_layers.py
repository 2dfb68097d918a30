"""The runtime never imports what sits above it: nothing in engine/, spec_decode/, executor/,
sample/, models/, attention/, platform/ or loader/ imports training, bench, cli, serve or the
Generator, not even from inside a function (DESIGN §2's direction of imports). Read with `ast`,
so a function-local import counts like a module-level one."""
from __future__ import annotations

import ast
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


@pytest.mark.parametrize("package", RUNTIME)
def test_the_runtime_imports_nothing_above_it(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = sorted(m for m in imported_modules(path) if m.startswith(ABOVE))
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad


def test_the_checker_sees_function_local_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from specinfer.training import head_training\n    import specinfer.bench.runner\n")
    assert {"specinfer.training", "specinfer.bench.runner"} <= imported_modules(f)


def test_an_engine_given_a_head_name_says_how_to_get_one(target):
    from specinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="resolve_head"):
        LLMEngine(str(target), speculative={"method": "eagle", "model": "smollm2-135m-eagle"})

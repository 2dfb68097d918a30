"""python/specinfer/_core.pyi describes the built extension exactly: the same classes, functions,
methods and attributes, and each callable's parameters in the same order (read from the stub with
`ast`, from the module with `inspect`)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import specinfer
import specinfer._core as core

STUB = Path(specinfer.__file__).parent / "_core.pyi"


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n != "self"]


def stub_api() -> dict:
    tree = ast.parse(STUB.read_text())
    api = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            api[node.name] = ("function", _params(node))
        elif isinstance(node, ast.ClassDef):
            members = {}
            for m in node.body:
                if isinstance(m, ast.FunctionDef) and not m.name.startswith("_"):
                    prop = any(isinstance(d, ast.Name) and d.id == "property" for d in m.decorator_list)
                    members[m.name] = None if prop else _params(m)
                elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                    members[m.target.id] = None
            init = next((m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None)
            api[node.name] = ("class", members, _params(init) if init else None)
    return api


def _signature(obj) -> list[str] | None:
    try:
        return [p for p in inspect.signature(obj).parameters if p != "self"]
    except (TypeError, ValueError):
        return None


def test_the_stub_names_exactly_what_the_module_has():
    api = stub_api()
    public = {n for n in dir(core) if not n.startswith("_")}
    assert set(api) == public


@pytest.mark.parametrize("name", sorted(n for n in dir(core) if not n.startswith("_")))
def test_each_name_matches_the_stub(name):
    obj = getattr(core, name)
    entry = stub_api()[name]
    if entry[0] == "function":
        assert _signature(obj) == entry[1], name
        return
    _, members, init = entry
    runtime = {m for m in dir(obj) if not m.startswith("_")}
    assert set(members) == runtime, name
    for m, params in members.items():
        attr = getattr(obj, m)
        if params is None:
            assert not callable(attr) or isinstance(attr, property), f"{name}.{m} is a method, not an attribute"
        else:
            assert _signature(attr) == params, f"{name}.{m}"
    if init is not None:
        assert _signature(obj) == init, f"{name}()"

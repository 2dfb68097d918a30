"""Regenerate the shipped prompt sets (`data/*.jsonl`) from the Python standard library.

    python -m specinfer.prompt_sets.build [--out DIR]

Deterministic for a given Python version: modules are visited in sorted order and the same
functions and docstrings are picked. The committed files are what the benchmarks use; this
script documents how they were derived (code and docstrings of the standard library, PSF
license) and lets anyone rebuild them. The chat prompts are written by hand.
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

NUM_PER_TASK = 24
# modules whose sources are plain, readable Python (no generated tables, no platform code)
MODULES = ["abc", "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "contextlib",
           "copy", "csv", "dataclasses", "difflib", "dis", "enum", "filecmp", "fnmatch", "fractions",
           "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac",
           "imghdr", "inspect", "ipaddress", "keyword", "linecache", "locale", "mimetypes", "netrc",
           "numbers", "operator", "optparse", "pathlib", "pprint", "queue", "quopri", "random", "reprlib",
           "sched", "secrets", "selectors", "shlex", "shutil", "statistics", "string", "textwrap",
           "tokenize", "tomllib", "trace", "typing", "uuid", "warnings", "weakref", "zipfile"]

EDITS = [
    "Rename the parameter `{p}` to `{p}_value` everywhere in the function, and change nothing else.",
    "Add Python type hints to the signature of this function, and keep the body exactly as it is.",
    "Add a one-line comment above each `return` statement explaining what is returned. Keep the rest unchanged.",
    "Rewrite the function with its name changed to `{n}_v2`. Keep the body exactly the same.",
]
QUESTIONS = [
    "According to the passage, what is the main purpose of the module? Quote the sentence that says so.",
    "List every function, class or constant that the passage mentions by name.",
    "Which limitations or caveats does the passage mention? Answer using only the passage.",
]
CHAT = [
    "What are three good habits for writing maintainable Python code?",
    "Explain the difference between a list and a tuple in Python.",
    "Give me a short recipe for a quick vegetable soup.",
    "Write a haiku about autumn leaves.",
    "What is the capital of Australia, and why is it not Sydney?",
    "How do I politely decline a meeting invitation? Write a short email.",
    "Explain recursion to a ten-year-old.",
    "What are the pros and cons of working from home?",
    "Suggest five names for a small bakery.",
    "Why is the sky blue?",
    "Write a short story opening about a lighthouse keeper.",
    "How does a hash table work?",
    "What should I pack for a weekend hiking trip?",
    "Give me three tips for learning a new language.",
    "Explain what an API is in simple terms.",
    "Write a limerick about a cat who loves coffee.",
    "What is the difference between weather and climate?",
    "How can I improve my sleep?",
    "Describe the water cycle in a few sentences.",
    "What is a good way to start learning to play the guitar?",
    "Compare cats and dogs as pets.",
    "Explain what version control is and why developers use it.",
    "Write a motivational message for someone starting a new job.",
    "What are prime numbers? Give some examples.",
]


def _stdlib_sources():
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in MODULES:
        path = root / f"{name}.py"
        if path.is_file():
            yield name, path.read_text(encoding="utf-8", errors="replace")


def functions_of(name: str, source: str):
    """Top-level and method functions of 8..40 lines, with their source."""
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 40:
            body = lines[node.lineno - 1:node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            yield node, "\n".join(line[indent:] for line in body)


def docstrings_of(name: str, source: str):
    doc = ast.get_docstring(ast.parse(source))
    if doc and 400 <= len(doc) <= 3000:
        yield doc.strip()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            d = ast.get_docstring(node)
            if d and 500 <= len(d) <= 3000:
                yield d.strip()


def build() -> dict[str, list[dict]]:
    funcs, passages = [], []
    for name, src in _stdlib_sources():
        picked = [f for f in functions_of(name, src) if not f[0].name.startswith("__")][:2]
        funcs += [(name, node, code) for node, code in picked]
        passages += [(name, d) for d in list(docstrings_of(name, src))[:1]]
    sets: dict[str, list[dict]] = {"code_completion": [], "code_editing": [], "summarization": [], "qa": [],
                                   "chat": []}
    for i, (mod, node, code) in enumerate(funcs[0::2][:NUM_PER_TASK]):
        lines = code.splitlines()
        head = "\n".join(lines[:max(3, len(lines) // 2)])
        sets["code_completion"].append({
            "id": f"cc-{i:02d}", "source": f"stdlib:{mod}.{node.name}",
            "prompt": "Continue this Python function from where it stops. Output only the code.\n\n"
                      f"```python\n{head}\n"})
    for i, (mod, node, code) in enumerate(funcs[1::2][:NUM_PER_TASK]):
        params = [a.arg for a in node.args.args if a.arg != "self"]
        template = EDITS[i % len(EDITS)] if params else EDITS[3]  # nothing to rename: rename the function
        edit = template.format(p=params[0] if params else "", n=node.name)
        sets["code_editing"].append({
            "id": f"ce-{i:02d}", "source": f"stdlib:{mod}.{node.name}",
            "prompt": f"{edit}\n\n```python\n{code}\n```"})
    for i, (mod, doc) in enumerate(passages[:NUM_PER_TASK]):
        sets["summarization"].append({
            "id": f"sum-{i:02d}", "source": f"stdlib:{mod} docstring",
            "prompt": f"Summarize the following text in three sentences, reusing its wording.\n\n{doc}"})
        sets["qa"].append({
            "id": f"qa-{i:02d}", "source": f"stdlib:{mod} docstring",
            "prompt": f"Read the passage and answer the question.\n\nPassage:\n{doc}\n\n"
                      f"Question: {QUESTIONS[i % len(QUESTIONS)]}"})
    for i, text in enumerate(CHAT):
        sets["chat"].append({"id": f"chat-{i:02d}", "source": "written for specinfer", "prompt": text})
    return sets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task, rows in build().items():
        with open(out / f"{task}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"task": task, **row}, ensure_ascii=False) + "\n")
        print(f"{task}: {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prompt sets shipped as JSONL (`data/<task>.jsonl`, one {"task", "id", "source", "prompt"} per
line). See build.py for how they were derived."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
TASKS = ("code_completion", "code_editing", "summarization", "qa", "chat")
# tasks whose answer copies from the prompt: where prompt lookup (ngram) can shine
INPUT_GROUNDED = ("code_editing", "summarization", "qa")


@dataclass(frozen=True)
class PromptSet:
    task: str
    ids: tuple[str, ...]
    prompts: tuple[str, ...]  # user messages (the runner applies the model's chat template)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompt_set(task: str, data_dir: str | Path | None = None, limit: int | None = None) -> PromptSet:
    path = Path(data_dir or DATA_DIR) / f"{task}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in Path(data_dir or DATA_DIR).glob("*.jsonl"))
        raise ValueError(f"prompt set {task!r} not found at {path}; known: {known}")
    ids, prompts = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a prompt record ({e})") from None
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            ids.append(str(row.get("id", f"{task}-{lineno}")))
            prompts.append(text)
    if not prompts:
        raise ValueError(f"prompt set {path} is empty")
    if limit is not None:
        ids, prompts = ids[:limit], prompts[:limit]
    return PromptSet(task, tuple(ids), tuple(prompts))


def load_prompt_sets(tasks=TASKS, data_dir=None, limit=None) -> dict[str, PromptSet]:
    return {t: load_prompt_set(t, data_dir, limit) for t in tasks}


def load_task(task: str, data_dir=None) -> PromptSet:
    """A shipped prompt set; "mixed" interleaves all of them (mixed prompt lengths)."""
    if task != "mixed":
        return load_prompt_set(task, data_dir)
    sets = [load_prompt_set(t, data_dir) for t in TASKS]
    ids, prompts = [], []
    for i in range(max(len(s) for s in sets)):
        for s in sets:
            if i < len(s):
                ids.append(s.ids[i])
                prompts.append(s.prompts[i])
    return PromptSet("mixed", tuple(ids), tuple(prompts))

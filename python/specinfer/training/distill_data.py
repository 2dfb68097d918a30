"""Self-distillation data for draft heads: the target's own greedy continuations of prompts, and
the target's hidden states over them (final post-norm states; aux layers' inputs for EAGLE-3).

Heads learn to predict what the target itself would emit next, so training sequences are
prompt + the target's greedy continuation, and only positions inside the continuation are labels.
Prompts come from specinfer's bench prompt sets (minus the ones the bench measures) and from the
Python standard library's sources (chunks of files, sorted by path: deterministic) wrapped in
task-shaped instructions through the target's chat template, or are given as token ids (tests).
"""
from __future__ import annotations

import json
import math
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specinfer.attention.batch_metadata import attention_metadata_for_runs
from specinfer.attention.kv_cache import allocate_kv_caches
from specinfer.models.model_runner import ModelRunner


@dataclass(frozen=True)
class DistillSequence:
    tokens: torch.Tensor  # int64[N] prompt + the target's greedy continuation
    prompt_len: int  # positions >= prompt_len hold the target's own predictions
    final: torch.Tensor  # [N, H] target's post-norm hidden state per position
    aux: torch.Tensor | None  # [N, 3H] inputs of the aux layers (EAGLE-3), or None


EVAL_PROMPTS_PER_TASK = 8  # the bench measures the first prompts of each task: never trained on

# Instructions wrapped around standard-library chunks, in the shape of the bench's tasks, so the head
# learns the target's assistant answers (what the bench, the demo and chat measure), not only raw
# text continuation.
INSTRUCTIONS = (
    "Continue this Python code from where it stops. Output only the code.\n\n```python\n{}\n```",
    "Explain what this Python code does.\n\n```python\n{}\n```",
    "Summarize the following text in three sentences, reusing its wording.\n\n{}",
    "Rewrite this code with clearer variable names, and change nothing else.\n\n```python\n{}\n```",
    "Read the code and answer the question: which names does it define, and what are they for?\n\n{}",
)


# Everyday assistant questions (templates x topics), so the head also learns the target's chat
# answers: the bench's chat and qa tasks are this kind of text, and stdlib chunks are not.
CHAT_TEMPLATES = (
    "Explain {} in simple terms.",
    "Give me three practical tips about {}.",
    "What are the most common mistakes people make with {}?",
    "Write a short paragraph about {} for a beginner.",
    "What is {}, and why does it matter?",
    "Write a haiku about {}.",
    "List the pros and cons of {}.",
    "How would you teach {} to a ten-year-old?",
)
CHAT_TOPICS = (
    "cooking pasta", "saving money", "learning a new language", "public speaking", "gardening",
    "sleep", "running", "time management", "photography", "writing a resume", "recursion",
    "version control with git", "unit testing", "the water cycle", "photosynthesis", "climate",
    "the solar system", "volcanoes", "healthy breakfasts", "baking bread", "team meetings",
    "remote work", "reading more books", "chess", "playing the guitar", "travel packing",
    "job interviews", "email etiquette", "houseplants", "coffee", "bicycles", "first aid",
    "databases", "spreadsheets", "password security", "the history of the internet", "rainbows",
    "birds", "the ocean", "friendship",
)


def chat_prompts() -> list[str]:
    """Every template over every topic, interleaved by topic (deterministic)."""
    return [t.format(topic) for topic in CHAT_TOPICS for t in CHAT_TEMPLATES]


# Self-instructed questions (Magpie, arXiv 2406.08464): an instruction-tuned target, given its chat
# template only up to where a user's message begins, writes a user's message itself. Sampled, so
# the questions are as varied as the target's own idea of a user, and need no corpus.
SELF_INSTRUCT_TEMPERATURE = 1.0
SELF_INSTRUCT_TOP_P = 0.95
SELF_INSTRUCT_MAX_TOKENS = 64
_SENTINEL = "\x00specinfer-user-message\x00"


def user_turn_prefix(loaded) -> list[int]:
    """Token ids of the chat template's text up to where a user's (first) message begins."""
    from specinfer.chat_template import ChatTemplate

    text = ChatTemplate.for_model(loaded).render([{"role": "user", "content": _SENTINEL}])
    if _SENTINEL not in text:
        raise ValueError("self-instructed questions: the chat template does not show the user's message")
    return loaded.tokenizer.encode(text[:text.index(_SENTINEL)], add_special_tokens=False).ids


def self_instruct_questions(generator, n: int, *, seed: int = 0, min_tokens: int = 6) -> list[str]:
    """n user questions written by the target (see above), deterministic for a seed: request i
    samples with seed (seed, i); a question is kept when the target ended the message itself
    (an end-of-turn token within SELF_INSTRUCT_MAX_TOKENS), it has at least min_tokens tokens and
    it was not written before; more are drawn until n are kept (at most 8 n draws)."""
    from specinfer.sampling_params import SamplingParams

    loaded = generator.engine.loaded
    if not loaded.chat_template:
        raise ValueError("self-instructed questions need a target with a chat template")
    prefix, tok = user_turn_prefix(loaded), loaded.tokenizer
    eos = set(loaded.eos_token_ids or ())
    kept: list[str] = []
    seen: set[str] = set()
    drawn = 0
    while len(kept) < n and drawn < 8 * n:
        batch = min(max(n - len(kept), 16) * 5 // 4, 8 * n - drawn)
        params = [SamplingParams(max_tokens=SELF_INSTRUCT_MAX_TOKENS, temperature=SELF_INSTRUCT_TEMPERATURE,
                                 top_p=SELF_INSTRUCT_TOP_P, seed=seed * 1_000_003 + drawn + i) for i in range(batch)]
        outs = generator.generate([prefix] * batch, params, use_tqdm=False)
        drawn += batch
        for o in outs:
            ids = list(o.token_ids)
            if not ids or ids[-1] not in eos or len(ids) - 1 < min_tokens:
                continue
            q = tok.decode(ids[:-1]).strip()
            if q and q not in seen and len(kept) < n:
                seen.add(q)
                kept.append(q)
    if len(kept) < n:
        raise ValueError(f"self-instructed questions: only {len(kept)} of {n} usable in {drawn} draws")
    return kept


def _bench_rows() -> list[dict]:
    from specinfer.prompt_sets import DATA_DIR

    rows = []
    for f in sorted(DATA_DIR.glob("*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


# task-shaped prompts over standard-library modules the bench does not use: the bench's task formats
# (prompt_sets/build.py) on other functions and docstrings, with other questions beside its own
TASK_QUESTIONS = (
    "What does the passage say the code is for? Answer in two sentences.",
    "Which names does the passage define or mention, and what is each one for?",
    "What should a user be careful about, according to the passage?",
    "Explain the passage to a beginner, in plain words.",
)


def task_shaped_texts(held_modules: set[str], per_task: int) -> list[tuple[str, bool]]:
    """(text, chat) pairs, deterministic: up to per_task prompts of each bench task shape (code
    completion, code editing, summarization, qa) cut from the standard library's modules in sorted
    order, skipping held_modules (those the bench prompts come from), interleaved by task."""
    from specinfer.prompt_sets.build import EDITS, QUESTIONS, docstrings_of, functions_of

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tasks: dict[str, list[str]] = {"cc": [], "ce": [], "sum": [], "qa": []}
    for f in sorted(stdlib.glob("*.py")):
        if f.stem in held_modules or f.stem.startswith("_"):
            continue
        try:
            src = f.read_text(encoding="utf-8")
            funcs = [x for x in functions_of(f.stem, src) if not x[0].name.startswith("__")][:4]
            docs = list(docstrings_of(f.stem, src))[:2]
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        for j, (node, code) in enumerate(funcs):
            if j % 2 == 0:
                lines = code.splitlines()
                head = "\n".join(lines[:max(3, len(lines) // 2)])
                tasks["cc"].append("Continue this Python function from where it stops. Output only the code.\n\n"
                                   f"```python\n{head}\n")
            else:
                params = [a.arg for a in node.args.args if a.arg != "self"]
                i = len(tasks["ce"])
                template = EDITS[i % len(EDITS)] if params else EDITS[3]
                edit = template.format(p=params[0] if params else "", n=node.name)
                tasks["ce"].append(f"{edit}\n\n```python\n{code}\n```")
        for doc in docs:
            tasks["sum"].append(f"Summarize the following text in three sentences, reusing its wording.\n\n{doc}")
            questions = [*QUESTIONS, *TASK_QUESTIONS]
            q = questions[len(tasks["qa"]) % len(questions)]
            tasks["qa"].append(f"Read the passage and answer the question.\n\nPassage:\n{doc}\n\nQuestion: {q}")
    picked = [t[:per_task] for t in tasks.values()]
    return [(p, True) for group in zip(*[g + [None] * (per_task - len(g)) for g in picked]) for p in group
            if p is not None]


def held_out_modules() -> set[str]:
    """The standard-library modules the bench prompts are cut from (never trained on)."""
    return {re.split(r"[. ]", row["source"][len("stdlib:"):])[0] for row in _bench_rows()
            if row.get("source", "").startswith("stdlib:")}


def training_texts(max_prompts: int, stdlib_chunk_chars: int = 600, chunks_per_file: int = 8,
                   task_shaped_per_task: int = 0, chat_questions: list[str] | None = None) -> list[tuple[str, bool]]:
    """(text, chat) pairs, deterministic: the bench prompts past each task's first
    EVAL_PROMPTS_PER_TASK (chat), everyday questions (chat_prompts, or chat_questions when given:
    self_instruct_questions), then chunks of the standard library's sources (skipping the modules
    the bench prompts are cut from) each wrapped in one of INSTRUCTIONS (chat), every fifth one
    left as raw text to continue: max_prompts in all. Then, with task_shaped_per_task > 0, that
    many task-shaped prompts per bench task (task_shaped_texts)."""
    out, per_task = [], {}
    held_modules = held_out_modules()
    for row in _bench_rows():
        i = per_task[row["task"]] = per_task.get(row["task"], -1) + 1
        if i >= EVAL_PROMPTS_PER_TASK:
            out.append((row["prompt"], True))
    bench_prompts = {row["prompt"] for row in _bench_rows()}
    questions = chat_prompts() if chat_questions is None else chat_questions
    out += [(q, True) for q in questions if q not in bench_prompts]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    n = 0
    for f in sorted(stdlib.glob("*.py")):
        if len(out) >= max_prompts:
            break
        if f.stem in held_modules:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(0, min(len(text), chunks_per_file * stdlib_chunk_chars), stdlib_chunk_chars):
            chunk = text[i:i + stdlib_chunk_chars]
            out.append((chunk, False) if n % 5 == 4 else (INSTRUCTIONS[n % 5].format(chunk), True))
            n += 1
    out = out[:max_prompts]
    return out + (task_shaped_texts(held_modules, task_shaped_per_task) if task_shaped_per_task > 0 else [])


def training_prompts(loaded, max_prompts: int, task_shaped_per_task: int = 0,
                     chat_questions: list[str] | None = None) -> list[list[int]]:
    """training_texts as token ids: chat ones through the target's chat template (as the bench
    encodes its prompts), raw ones plainly."""
    from specinfer.prompt_sets import prompt_encoder

    chat, raw = prompt_encoder(loaded, True), prompt_encoder(loaded, False)
    return [list(chat(t) if is_chat else raw(t)) for t, is_chat in training_texts(
        max_prompts, task_shaped_per_task=task_shaped_per_task, chat_questions=chat_questions)]


def continuations(generator, prompts: list, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation token ids, prompt length) per prompt, via the engine."""
    from specinfer.sampling_params import SamplingParams

    outs = generator.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    return [(list(o.prompt_token_ids) + list(o.token_ids), len(o.prompt_token_ids)) for o in outs]


@torch.inference_mode()
def target_states(model, backend, token_ids: list[int], aux_layers: tuple[int, ...] = (), block_size: int = 16,
                  device=torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One dense forward of the target over a whole sequence (its own throwaway paged KV)."""
    (final, aux), = packed_target_states(model, backend, [token_ids], aux_layers, block_size, device)
    return final, aux


@torch.inference_mode()
def packed_target_states(model, backend, sequences: list[list[int]], aux_layers: tuple[int, ...] = (),
                         block_size: int = 16, device=torch.device("cpu")) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The states of several whole sequences from one forward of them packed end to end (each
    attends to itself alone, through its own rows of a throwaway paged KV): the linears see all
    their tokens at once, which is faster on CPU than a forward per sequence."""
    lens = np.array([len(t) for t in sequences], dtype=np.int64)
    per_seq = -(-lens // block_size)  # blocks each sequence needs
    width = int(per_seq.max())
    rows = np.zeros((len(sequences), width), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(per_seq)[:-1]])
    for i, (f, b) in enumerate(zip(first, per_seq)):
        rows[i, :b] = np.arange(f, f + b)
    dtype = model.norm.dtype
    runner = ModelRunner(model, allocate_kv_caches(model, int(per_seq.sum()), block_size, dtype, device), backend,
                         aux_layers)
    attn, pos = attention_metadata_for_runs(rows, np.zeros(len(sequences), np.int64), lens, block_size, device)
    ids = torch.tensor([t for seq in sequences for t in seq], device=device)
    hidden, _ = runner.forward(ids, torch.from_numpy(pos).to(device), attn)
    finals = hidden.float().split(lens.tolist())
    auxes = runner.last_aux.float().split(lens.tolist()) if aux_layers else [None] * len(sequences)
    return list(zip(finals, auxes))


PACKED_TOKENS = 4096  # about how many tokens one packed forward of build_sequences holds (2048: 1.5x, 4096: 1.9x the
# states per second of a forward per sequence, bf16 SmolLM2-135M on 2 Zen 5 cores)


def build_sequences(generator, prompts: list, max_tokens: int, aux_layers: tuple[int, ...] = ()) -> list[DistillSequence]:
    engine = generator.engine
    backend = engine.runner.backend
    out, group = [], []

    def flush():
        states = packed_target_states(engine.loaded.model, backend, [ids for ids, _ in group], aux_layers,
                                      device=engine.device)
        out.extend(DistillSequence(torch.tensor(ids), p, final, aux) for (ids, p), (final, aux) in zip(group, states))
        group.clear()

    for ids, p in continuations(generator, prompts, max_tokens):
        if group and sum(len(i) for i, _ in group) + len(ids) > PACKED_TOKENS:
            flush()
        group.append((ids, p))
    if group:
        flush()
    return out


def cached_sequences(path: Path, key: dict, build) -> list[DistillSequence]:
    """The distillation data of an earlier run with the same key (resuming, or another head of
    the same target; data built with EAGLE-3's aux states also serves a head that reads none),
    else build() and keep it at path."""
    import sys

    if path.exists():
        saved = torch.load(path, weights_only=False)
        have = saved.get("key") or {}
        if have == key or (not key["aux"] and {**have, "aux": []} == key):  # aux states kept: not needed here
            print(f"reusing the distillation data in {path}", file=sys.stderr)
            return [DistillSequence(**{**s, "aux": s["aux"] if key["aux"] else None}) for s in saved["seqs"]]
    seqs = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save({"key": key, "seqs": [vars(s) for s in seqs]}, tmp)
    tmp.replace(path)  # never a half-written file at path
    return seqs


def label_vocabulary(seqs: list[DistillSequence], vocab_size: int) -> torch.Tensor:
    """int64[n] ascending: every token that is a training label (a continuation token past the prompt)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for s in seqs:
        seen[s.tokens[s.prompt_len:]] = True
    return torch.nonzero(seen).flatten()


class LabelSoftmax:
    """Cross-entropy of hidden states through lm_head rows restricted to the label vocabulary.

    Every training label is a token the target emitted in a continuation, so the softmax over those
    tokens (a few thousand) stands in for the full one: on CPU the full lm_head's forward and
    backward (V x H per row) would cost several times the head being trained. Drafting still
    scores the whole vocabulary."""

    def __init__(self, lm_head: torch.Tensor, seqs: list[DistillSequence], ids: torch.Tensor | None = None):
        """ids: the rows to use instead of the label vocabulary (e.g. a head's draft vocabulary)."""
        self.ids = label_vocabulary(seqs, lm_head.shape[0]) if ids is None else ids
        self.weight = lm_head[self.ids]  # [n, H]
        self.index = torch.full((lm_head.shape[0],), -100, dtype=torch.int64)
        self.index[self.ids] = torch.arange(len(self.ids))

    def loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """h [N, H], labels int64[N] target ids (-100: ignored)."""
        y = torch.where(labels >= 0, self.index[labels.clamp(min=0)], labels)
        return F.cross_entropy(h @ self.weight.T, y, ignore_index=-100)

    def soft_loss(self, h: torch.Tensor, target_states: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of h [N, H] against the target's own next-token distribution read off its
        states [N, H] through the same rows (soft labels, as EAGLE trains: every position, also in
        the prompt, where no continuation token is a label)."""
        with torch.no_grad():
            p = torch.softmax((target_states @ self.weight.T).float(), -1)
        # cross_entropy with probability targets: one fused pass (the same value as
        # -(p * log_softmax(logits)).sum(-1).mean(), without the [N, n] temporaries)
        return F.cross_entropy((h @ self.weight.T).float(), p, reduction=reduction)

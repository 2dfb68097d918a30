"""Does more chat-shaped distillation data raise the EAGLE head's chat acceptance? (issue 8)

Builds greedy continuations of 640 more chat prompts (16 templates x 40 topics, none in the bench's
prompts) with SmolLM2-135M, adds them to the named head's cached distillation data, trains an EAGLE
head by the named head's recipe (its steps, schedule and draft vocabulary) into OUT, prints the training
report. Bench it beside the named head with `speculative.model` = OUT (docs/lab/2026-12-notebook.md, "More
chat data for the EAGLE head").

    python benches/experiments/eagle_more_chat_data.py bench_out/eagle_chat
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from specinfer.prompt_sets import prompt_encoder
from specinfer.generator import Generator
from specinfer.training import head_training
from specinfer.training.distill_data import DistillSequence, build_sequences
from specinfer.training.trained_heads import TRAINED_HEADS, heads_cache_dir, resolve_head
from specinfer.platform.cpu import bf16_matmul_is_native

TEMPLATES = (
    "Can you explain how {} works?", "Write a short email to a friend about {}.",
    "What should a beginner know about {}?", "Give me a step-by-step guide to {}.",
    "Describe {} in one paragraph.", "What are five interesting facts about {}?",
    "Compare {} with something similar and explain the differences.", "Why do people enjoy {}?",
    "Write a short poem about {}.", "What are the benefits of {}?",
    "Suggest a plan for getting better at {}.", "Tell me a short story that involves {}.",
    "What questions should I ask before starting {}?", "Summarize the history of {} in a few sentences.",
    "How can I explain {} to my grandmother?", "What is a common misconception about {}?",
)
TOPICS = (
    "meditation", "electric cars", "recycling", "the stock market", "machine learning", "yoga",
    "making friends in a new city", "studying for exams", "camping", "dogs", "cats", "tea",
    "budget travel", "renting an apartment", "cloud computing", "smartphones", "video games",
    "learning to swim", "painting with watercolors", "the moon", "earthquakes", "honey bees",
    "vaccines", "the human heart", "compound interest", "negotiating a salary", "writing a novel",
    "home workouts", "composting", "solar panels", "open source software", "the French revolution",
    "ancient Rome", "jazz music", "podcasts", "knitting", "online privacy", "fixing a flat tire",
    "drinking enough water", "procrastination",
)


def main(out: str) -> None:
    recipe = TRAINED_HEADS["smollm2-135m-eagle"]
    resolve_head(recipe.name, "eagle", recipe.target)  # makes sure the cached distillation data exists
    native = "bfloat16" if bf16_matmul_is_native() else "float32"
    with Generator(recipe.target, max_num_seqs=64, dtype=native) as gen:  # the data's precision, as the named data
        enc = prompt_encoder(gen.engine.loaded, True)
        extra = build_sequences(gen, [list(enc(t.format(x))) for x in TOPICS for t in TEMPLATES], recipe.max_tokens)
    suffix = "" if native == "float32" else f"-{native}"
    saved = torch.load(heads_cache_dir() / f"distill-smollm2-135m{suffix}.pt", weights_only=False)
    seqs = [DistillSequence(**{**s, "aux": None}) for s in saved["seqs"]]
    cfg = head_training.TrainConfig("eagle", num_heads=recipe.num_heads, steps=recipe.steps, seed=recipe.seed,
                                    draft_vocab_size=recipe.draft_vocab_size, ttt_steps=recipe.ttt_steps,
                                    lr_schedule=recipe.lr_schedule, train_dtype=native)
    target = Generator(recipe.target, max_num_seqs=4).engine.loaded
    print(head_training.train(target, seqs + extra, Path(out), cfg, progress=False))


if __name__ == "__main__":
    main(sys.argv[1])

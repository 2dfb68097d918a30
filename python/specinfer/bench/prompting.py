"""Turning prompt sets into the token ids every method receives: the target's chat template
(rendered once, by specinfer's tokenizer), so peers see exactly the same prompt tokens."""
from __future__ import annotations

from specinfer.bench.prompts import TASKS, PromptSet, load_prompt_set


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


def prompt_encoder(loaded, use_chat_template: bool):
    """callable(text) -> token ids, with the model's chat template when it has one."""
    tok = loaded.tokenizer
    template = loaded.chat_template if use_chat_template else None
    if not template:
        return lambda text: tok.encode(text).ids
    try:
        from specinfer.chat_template import ChatTemplate

        ct = ChatTemplate.for_model(loaded)
        return lambda text: ct.encode(tok, [{"role": "user", "content": text}])
    except ImportError:  # fall back to a plain sandboxed render, as transformers does it
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        compiled = env.from_string(template)

        def encode(text):
            rendered = compiled.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                                       bos_token="", eos_token="")
            return tok.encode(rendered, add_special_tokens=False).ids

        return encode


def batches_for(prompt_ids: list[list[int]], batch_size: int, num_prompts: int) -> list[list[list[int]]]:
    """The generate() calls of one timed run. Batch 1: the first `num_prompts` prompts one by
    one. Batch b > 1: one call with b prompts (cycling through the set if it has fewer)."""
    if batch_size == 1:
        return [[p] for p in prompt_ids[:num_prompts]]
    return [[prompt_ids[i % len(prompt_ids)] for i in range(batch_size)]]

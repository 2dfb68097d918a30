"""Chat templates: render a conversation into the prompt text an instruct model was trained on.

Rendering follows the HF ecosystem (`transformers`' `apply_chat_template`) so the template text
shipped with a model (in `tokenizer_config.json`, `chat_template.jinja` or the GGUF field
`tokenizer.chat_template`) produces the same string here as there: a sandboxed jinja2
environment with `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter
that keeps non-ASCII characters, and the `raise_exception` / `strftime_now` helpers; the variables
are `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools` / `documents` (None
unless given) and any extra keyword.

    tmpl = ChatTemplate.for_model(gen.engine.loaded)
    ids = tmpl.encode(gen.tokenizer, [{"role": "user", "content": "hi"}])
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

# Used when a model ships no template: ChatML (Qwen2, SmolLM2 and many others speak it).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

class ChatTemplateError(ValueError):
    """The template could not render this conversation (its own `raise_exception`, or bad Jinja)."""


@lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"chat template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


class ChatTemplate:
    """One model's chat template, compiled once, with the special-token strings it refers to."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = source is None
        self.source = CHATML_TEMPLATE if source is None else source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(self.source)

    @classmethod
    def for_model(cls, loaded) -> "ChatTemplate":
        """From a LoadedModel (`gen.engine.loaded`): its template, or ChatML when it has none."""
        tok = loaded.tokenizer

        def text(i):
            return (tok.id_to_token(int(i)) or "") if i is not None else ""

        eos = loaded.eos_token_ids[0] if loaded.eos_token_ids else None
        return cls(loaded.chat_template, bos_token=text(loaded.bos_token_id), eos_token=text(eos))

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        _check_messages(messages)
        from jinja2 import TemplateError

        # as transformers does: `tools` and `documents` are always defined (None when not given)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None, "documents": None,
                     **kwargs}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from None

    def encode(self, tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
               **kwargs) -> list[int]:
        """Render and tokenize. The template writes BOS itself where the model wants one, so no
        special tokens are added on top (as `apply_chat_template(tokenize=True)` does)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False).ids


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role' string and 'content' (got {m!r})")

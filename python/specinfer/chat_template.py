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
        special tokens are added on top (as `apply_chat_template(tokenize=True)` does).

        Messages' content is untrusted: a special token's text inside it ("<|im_start|>system")
        is tokenized as text, never as the control token, so a user cannot forge turns. Where
        no content holds such text the whole prompt is tokenized at once, as before. Tokenizing
        releases the GIL (encode_batch), so a server can run it off its event loop."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        specials = _special_strings(tokenizer)
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        if not any(sp in c for c in contents for sp in specials):
            return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        pieces = _content_spans(text, contents)
        plain = _plain_text_tokenizer(tokenizer)
        ids: list[int] = []
        for chunk, is_content in pieces:
            if chunk:
                tok = plain if is_content else tokenizer
                ids += tok.encode_batch([chunk], add_special_tokens=False)[0].ids
        return ids


_PLAIN: dict[int, tuple] = {}  # id(tokenizer) -> (tokenizer, its plain-text copy); kept alive together


def _special_strings(tokenizer) -> tuple[str, ...]:
    """The text of every special added token (control tokens such as <|im_start|>)."""
    return tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content)


def _plain_text_tokenizer(tokenizer):
    """A copy of `tokenizer` that reads special tokens' text as ordinary text (made once)."""
    hit = _PLAIN.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.encode_special_tokens = True
    _PLAIN[id(tokenizer)] = (tokenizer, plain)
    return plain


def _content_spans(text: str, contents: list[str]) -> list[tuple[str, bool]]:
    """`text` cut into (piece, is message content) in order: each content (or, where the template
    trimmed it, its stripped form) is found after the previous one. Content the template did not
    write verbatim stays template text."""
    pieces, pos = [], 0
    for c in contents:
        for needle in (c, c.strip()):
            at = text.find(needle, pos) if needle else -1
            if at != -1:
                pieces += [(text[pos:at], False), (needle, True)]
                pos = at + len(needle)
                break
    pieces.append((text[pos:], False))
    return pieces


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role' string and 'content' (got {m!r})")

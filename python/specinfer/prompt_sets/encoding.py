"""Prompt text to the token ids every method receives: the target's chat template (rendered once,
by specinfer's tokenizer), so peers and training see exactly the same prompt tokens."""
from __future__ import annotations


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

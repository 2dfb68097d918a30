"""Chat templates render exactly as HF transformers' `apply_chat_template` renders them (the
ecosystem's reference), for the real SmolLM2 template and for templates that use the features
real ones do: bos/eos variables, whitespace control, loop controls, tojson, raise_exception."""
from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from specinfer.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

LLAMA3_LIKE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{% set loop_messages = messages[1:] %}{% set system = messages[0]['content'] %}
{% else %}{% set loop_messages = messages %}{% set system = '' %}{% endif %}
{% if system %}<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{% endif %}
{% for message in loop_messages %}
{% if message['role'] == 'tool' %}{% continue %}{% endif %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TOOLS_LIKE = """{% for m in messages %}{{ m | tojson }}
{% if loop.last and m.role == 'user' %}{{ '[' + ((tools or []) | length | string) + ' tools]' }}{% endif %}
{% endfor %}{{ eos_token if not add_generation_prompt else '>>>' }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! ünïcödé"}, {"role": "user", "content": "Bye"}],
]


def _hf_tokenizer(template: str):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    return hf


@functools.lru_cache(maxsize=1)
def _smollm2_template() -> str:
    import gguf

    from specinfer.packs import resolve_pack

    reader = gguf.GGUFReader(resolve_pack("smollm2-135m"))
    field = reader.fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")


@pytest.mark.parametrize("name", ["smollm2", "llama3_like", "tools_like", "chatml"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(name, conversation, add_generation_prompt):
    source = {"smollm2": _smollm2_template, "llama3_like": lambda: LLAMA3_LIKE, "tools_like": lambda: TOOLS_LIKE,
              "chatml": lambda: CHATML_TEMPLATE}[name]()
    ours = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        conversation, add_generation_prompt=add_generation_prompt)
    theirs = _hf_tokenizer(source).apply_chat_template(conversation, tokenize=False,
                                                        add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert conversation[-1]["content"].strip() in ours


def test_smollm2_template_text():
    out = ChatTemplate(_smollm2_template()).render([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_raise_exception_becomes_a_chat_template_error():
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(LLAMA3_LIKE).render(bad)


def test_missing_template_falls_back_to_chatml():
    t = ChatTemplate(None)
    assert t.is_fallback
    assert t.render([{"role": "user", "content": "a"}]) == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    assert t.render([{"role": "user", "content": "a"}], add_generation_prompt=False) == "<|im_start|>user\na<|im_end|>\n"


@pytest.mark.parametrize("messages, match", [
    ("hello", "list"),
    ([{"content": "no role"}], r"messages\[0\]"),
    ([{"role": "user", "content": "ok"}, {"role": "user"}], r"messages\[1\]"),
])
def test_bad_messages_name_the_message(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(None).render(messages)


def test_bad_jinja_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_encode_adds_no_special_tokens_on_top_of_the_template():
    vocab = {"<s>": 0, "</s>": 1, "hi": 2, "<|im_start|>user": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="hi"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert tok.encode("hi").ids == [0, 2]  # the tokenizer itself would add BOS
    t = ChatTemplate("{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}", bos_token="<s>")
    assert t.encode(tok, [{"role": "user", "content": "hi"}]) == [0, 2]  # one BOS, from the template

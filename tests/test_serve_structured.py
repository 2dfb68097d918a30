"""Structured outputs through `specinfer serve` and the real openai client: response_format
(json_object, json_schema strict), vLLM's guided_json / guided_regex / guided_choice /
guided_grammar and structured_outputs in extra_body, with n-gram speculation on; the answer equals
the engine's own constrained output; a bad schema/regex/grammar, two constraints at once or a
malformed response_format is a 400 naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from serve_harness import request, start_server
from specinfer import Generator, SamplingParams, StructuredOutputsParams as S

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50}},
          "required": ["kind", "n"], "additionalProperties": False}
PROMPT = "list: a b c a b c a b"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tiny_models import build_tiny_model

    path = tmp_path_factory.mktemp("bytes_serve")
    build_tiny_model(path, "llama", tokenizer="bytes", scale=2.0, seed=8)
    gen = Generator(str(path), max_model_len=512, speculative={"method": "ngram", "num_speculative_tokens": 3})
    srv = start_server(gen.engine)
    ref = Generator(str(path), max_model_len=512)
    yield srv, ref
    srv.stop()


def _ref(ref, so, max_tokens=400):
    return ref.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so),
                        use_tqdm=False)[0].text


def test_response_format_json_schema(setup):
    srv, ref = setup
    client = srv.client()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=400, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=300,
                                       temperature=0.0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    assert text.lstrip().startswith("{")


@pytest.mark.parametrize("field,value,so,check", [
    ("guided_json", SCHEMA, S(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_regex", "[a-c]{3}-[0-9]{2}", S(regex="[a-c]{3}-[0-9]{2}"),
     lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t) or pytest.fail(t)),
    ("guided_choice", ["yes", "no", "maybe"], S(choice=["yes", "no", "maybe"]),
     lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
    ("guided_grammar", 'root ::= "<" [xy]+ ">"', S(grammar='root ::= "<" [xy]+ ">"'),
     lambda t: re.fullmatch("<[xy]+>", t) or pytest.fail(t)),
    ("structured_outputs", {"regex": "z{2,5}"}, S(regex="z{2,5}"), lambda t: re.fullmatch("z{2,5}", t) or pytest.fail(t)),
])
def test_vllm_fields(setup, field, value, so, check):
    srv, ref = setup
    r = srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0.0,
                                        extra_body={field: value})
    text = r.choices[0].text
    check(text)
    assert text == _ref(ref, so)


def test_sampled_with_n(setup):
    srv, _ = setup
    r = srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=1.0, n=4, seed=3,
                                        extra_body={"guided_json": SCHEMA})
    assert len(r.choices) == 4
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("body,param", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "guided_json"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_bad_constraints_are_400s_naming_the_field(setup, body, param):
    srv, _ = setup
    status, _, raw = request(srv.port, "POST", "/v1/completions", {"prompt": PROMPT, **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param, raw
    status, _, raw = request(srv.port, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}], **body})
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw

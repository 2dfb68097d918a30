"""Structured outputs (llguidance): every emitted token is allowed by the request's grammar, the
outputs parse and validate (JSON schema with nested objects, arrays, enums, bounds; regex;
choice; Lark and GBNF grammars) at temperature 0 and 1; greedy constrained speculation equals
constrained plain decoding (n-gram, draft-model chains and trees, batch expansion, chunked
prefill, preemption); the sampled law is the target's masked, renormalized law (chi-square on a
character vocabulary, with a mutant masking only the first row of a verification, which the test
must catch); grammar-forced tokens are drafted and accepted; logprobs are the constrained
distribution; bad schemas, regexes and grammars are refused naming the field."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from specinfer import Generator, SamplingParams, StructuredOutputsParams as S
from stats import ALPHA, chi_square_pvalue

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["id", "kind", "tags", "owner", "score"],
}
STRICT = S(json=SCHEMA, disable_additional_properties=True, disable_any_whitespace=True)
REGEX = r"(ab|ba)[0-9]{2,4}-[a-z]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = 'start: item ("," item)*\nitem: "x" | "yy" | NUMBER\nNUMBER: /[0-9]{1,2}/'
GBNF = 'root ::= "(" [a-c]+ ")"'
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100 + i for i in range(30)], [7] * 12]


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    """A tiny random model with a byte-level tokenizer (any text), and a perturbed draft of it."""
    from tiny_models import build_tiny_model

    target = tmp_path_factory.mktemp("bytes_target")
    build_tiny_model(target, "llama", tokenizer="bytes", scale=2.0, seed=4)
    draft = tmp_path_factory.mktemp("bytes_draft")
    build_tiny_model(draft, "llama", tokenizer="bytes", base=target, perturb=0.02)
    return target, draft


@pytest.fixture(scope="module")
def gen(byte_models):
    return Generator(str(byte_models[0]), block_size=4, max_model_len=512)


def _check(kind, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        assert set(json.loads(text)) <= set(SCHEMA["properties"])
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "lark":
        assert re.fullmatch(r"(x|yy|[0-9]{1,2})(,(x|yy|[0-9]{1,2}))*", text), text
    elif kind == "gbnf":
        assert re.fullmatch(r"\([a-c]+\)", text), text


CASES = {"json": STRICT, "regex": S(regex=REGEX), "choice": S(choice=CHOICES), "lark": S(grammar=LARK),
         "gbnf": S(grammar=GBNF)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", list(CASES))
def test_outputs_match_their_grammar(gen, kind, temperature):
    params = SamplingParams(max_tokens=400, temperature=temperature, seed=1, structured_outputs=CASES[kind])
    outs = gen.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        _check(kind, o.text)


def test_unconstrained_output_does_not_match(gen):
    """The model left alone does not produce these (the test above is not passing by chance)."""
    outs = gen.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    assert not any(re.fullmatch(REGEX, o.text) for o in outs)


def _valid_prefix(gen, so, token_ids) -> bool:
    """A fresh matcher takes every token (an output cut by max_tokens is a prefix of the language)."""
    return gen.engine.grammars.matcher(so).consume(token_ids)


def test_json_object_and_flexible_whitespace(gen):
    """With whitespace allowed (the default) a random model may pad forever: outputs that end parse,
    outputs cut by max_tokens are prefixes the grammar accepts."""
    for so in (S(json=SCHEMA, disable_additional_properties=True), S(json_object=True)):
        outs = gen.generate(PROMPTS, SamplingParams(max_tokens=300, temperature=1.0, seed=2, structured_outputs=so),
                            use_tqdm=False)
        for o in outs:
            assert _valid_prefix(gen, so, o.token_ids)
            if o.finish_reason == "stop":
                obj = json.loads(o.text)
                if so.json is not None:
                    jsonschema.validate(obj, SCHEMA)
                assert isinstance(obj, dict)
        assert any(o.finish_reason == "stop" for o in outs)


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "policy": "fixed"},
    "draft": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"},
    "draft_tree": {"method": "draft_model", "num_speculative_tokens": 3,
                   "token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]},
    "draft_expansion": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed",
                        "scorer": "batch_expansion"},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_constrained_speculation_equals_plain(byte_models, gen, name):
    target, draft = byte_models
    spec = dict(SPECS[name])
    if spec["method"] == "draft_model":
        spec["model"] = str(draft)
    prompts = PROMPTS * 2
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=CASES[k])
              for k in ("json", "regex", "lark", "gbnf")] * 2
    want = gen.generate(prompts, params, use_tqdm=False)
    # 4-token blocks, a 24-token budget and a small pool: chunked prefill beside verification, preemption
    sgen = Generator(str(target), block_size=4, max_num_batched_tokens=24, num_kv_blocks=40, max_model_len=160,
                     speculative=spec)
    got = sgen.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    m = sgen.spec_metrics()
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0, m
    assert sgen.engine.core.stats()["num_preemptions"] > 0
    assert sgen.engine.core.num_free_blocks() == sgen.engine.core.num_total_blocks()


def test_forced_tokens_are_drafted_and_accepted(byte_models):
    """A fully forced output (a single choice): every draft is a forced token and is accepted;
    a schema's keys and punctuation are forced drafts beside the proposer's."""
    gen = Generator(str(byte_models[0]), max_model_len=512,
                    speculative={"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    o = gen.generate([PROMPTS[1]], SamplingParams(max_tokens=50, temperature=0.0,
                                                  structured_outputs=S(choice=["forced-text-here"])),
                     use_tqdm=False)[0]
    assert o.text == "forced-text-here"
    forced = gen.engine.proposing.num_forced_drafts
    # (llguidance holds back the span's last token or two: it might merge with what follows)
    assert forced >= 12 and o.num_accepted_tokens >= forced, (forced, o)
    p = SamplingParams(max_tokens=200, temperature=1.0, seed=5, structured_outputs=STRICT)
    before = gen.engine.proposing.num_forced_drafts
    o = gen.generate([PROMPTS[0]], p, use_tqdm=False)[0]
    _check("json", o.text)
    assert gen.engine.proposing.num_forced_drafts - before >= 10  # '"kind":"', '"owner":{"name":"', ...
    assert len(o.token_ids) < o.num_accepted_tokens * 3  # forced spans shorten the run


def test_logprobs_are_the_constrained_distribution(gen):
    o = gen.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0, logprobs=5,
                                                  structured_outputs=S(choice=CHOICES)), use_tqdm=False)[0]
    first = o.logprobs[0]
    allowed = {gen.tokenizer.token_to_id(c) for c in ("a", "b", "g")}
    finite = {t: lp for t, lp in first.items() if lp > -math.inf}
    assert set(finite) <= allowed  # nothing else has probability
    assert abs(sum(math.exp(lp) for lp in finite.values()) - 1.0) < 1e-4  # 'a' and 'g' share all the mass


@pytest.mark.parametrize("so,field", [
    (S(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
    (S(json="{not json"), "structured_outputs.json"),
    (S(regex="(unclosed"), "structured_outputs.regex"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_naming_the_field(gen, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        gen.generate([PROMPTS[0]], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not gen.engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="choice"):
        S(choice="abc")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == S(regex="a+")


# ---- the law: speculative sampling under a grammar keeps the target's masked law ------------------
CHARS = "abcde"
LAW_REGEX = "[ab][abc]c"  # three characters, then EOS (id 2)
LAW_PROMPT = [3, 4, 5, 6, 4]
NUM = 12_000


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    from tiny_models import build_tiny_model

    target = tmp_path_factory.mktemp("chars_target")
    hf = build_tiny_model(target, "llama", tokenizer=f"chars:{CHARS}", scale=2.0, seed=3)
    draft = tmp_path_factory.mktemp("chars_draft")
    build_tiny_model(draft, "llama", tokenizer=f"chars:{CHARS}", base=target, perturb=0.3)
    return target, draft, hf


def _allowed(prefix: str) -> list[int]:
    """Token ids the regex allows after `prefix` (by enumeration: an independent reference)."""
    words = [a + b + "c" for a in "ab" for b in "abc"]
    ids = [3 + CHARS.index(c) for c in CHARS if any(w.startswith(prefix + c) for w in words)]
    return ids + ([2] if prefix in words else [])


def _masked_law(hf) -> torch.Tensor:
    """P(t0, t1, t2) under the mask, float64 [V ** 3] (t3 is then EOS, forced)."""
    V = 3 + len(CHARS)
    hf = hf.double()

    def probs(tokens, prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([LAW_PROMPT + tokens])).logits[0, -1]
        mask = torch.full((V,), float("-inf"), dtype=torch.float64)
        mask[_allowed(prefix)] = 0
        return torch.softmax(logits + mask, -1)

    law = torch.zeros(V, V, V, dtype=torch.float64)
    text = {3 + i: c for i, c in enumerate(CHARS)}
    p0 = probs([], "")
    for a in _allowed(""):
        p1 = probs([a], text[a])
        for b in _allowed(text[a]):
            law[a, b] = p0[a] * p1[b] * probs([a, b], text[a] + text[b])
    return law.reshape(-1)


def _counts(target, draft, monkeypatch=None):
    V = 3 + len(CHARS)
    gen = Generator(str(target), block_size=4, max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=32,
                    speculative={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2,
                                 "policy": "fixed"}, seed=11)
    params = SamplingParams(max_tokens=6, temperature=1.0, structured_outputs=S(regex=LAW_REGEX))
    outs = gen.generate([LAW_PROMPT] * NUM, params, use_tqdm=False)
    assert all(o.token_ids[3] == 2 and len(o.token_ids) == 4 for o in outs)
    codes = torch.tensor([(o.token_ids[0] * V + o.token_ids[1]) * V + o.token_ids[2] for o in outs])
    return torch.bincount(codes, minlength=V ** 3), gen.spec_metrics()


def test_constrained_speculative_sampling_keeps_the_masked_law(char_models):
    target, draft, hf = char_models
    counts, m = _counts(target, draft)
    assert m["num_draft_tokens"] > NUM // 2 and 0.05 < m["acceptance_rate"] < 0.97, m
    assert chi_square_pvalue(counts, _masked_law(hf)) > ALPHA


def test_law_test_catches_a_mask_on_the_first_row_only(char_models, monkeypatch):
    """The mutant masks only each request's first row of a verification (drafts are then judged
    by the unconstrained target): its outputs still obey the grammar often, but the law moves."""
    from specinfer.engine import step_grammar

    real = step_grammar.StepGrammar.masks

    def first_row_only(self, sched, states, trees):
        out = real(self, sched, states, trees)
        if out is not None:
            cu = sched.cu_num_logits
            first = set(int(cu[i]) for i in range(len(states)))
            for k, r in enumerate(out.rows.tolist()):
                if r not in first:
                    out.bitmask[k] = -1
        return out

    monkeypatch.setattr(step_grammar.StepGrammar, "masks", first_row_only)
    target, draft, hf = char_models
    try:
        counts, _ = _counts(target, draft)
    except AssertionError:
        return  # the mutant broke the grammar outright: caught
    assert chi_square_pvalue(counts, _masked_law(hf)) < ALPHA


def test_refused_drafts_are_cut_only_where_that_keeps_the_law(gen):
    """Chains are cut before the first draft the grammar refuses for greedy requests and one-hot
    drafts; drafts sampled from a q are never cut (the law test above fails if they are)."""
    from types import SimpleNamespace

    import numpy as np

    from specinfer.engine.propose_step import grammar_valid_prefixes
    from specinfer.spec_decode.proposer import Proposal

    tok = gen.tokenizer
    ids = [tok.token_to_id(c) for c in "abXab"]  # "ab" valid under (ab|ba)[0-9]..., then "X" is not
    def state(cid, temperature):
        return SimpleNamespace(core_id=cid, grammar=gen.engine.grammars.matcher(S(regex=REGEX)),
                               params=SamplingParams(temperature=temperature))
    states = {0: state(0, 0.0), 1: state(1, 1.0), 2: state(2, 1.0)}
    q = torch.full((5, tok.get_vocab_size()), 1.0 / tok.get_vocab_size())
    prop = Proposal(np.array([0, 1, 2], np.uint64), np.array([0, 5, 10, 15], np.int32),
                    np.array(ids * 3, np.int64), [None, None, q])
    out = grammar_valid_prefixes(prop, states)
    assert out.cu_num_draft.tolist() == [0, 2, 4, 9]  # greedy cut, one-hot cut, sampled q kept whole
    assert out.draft_token_ids.tolist() == ids[:2] * 2 + ids
    assert torch.equal(out.draft_probs[2], q)

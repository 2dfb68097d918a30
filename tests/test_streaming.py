"""Streaming is exact: the `new_text` pieces of a stream add up to its final `text` (and every
intermediate output's `text` is the sum so far), also when a stop string spans steps or sits
inside a run of several tokens appended at once (accepted ngram drafts)."""
from __future__ import annotations

import pytest

from specinfer import Generator, SamplingParams

PROMPT = [20, 21, 22, 23, 24] * 5  # repetitive: ngram drafts get accepted, several tokens per step
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def gens(tiny_dir):
    path, _ = tiny_dir("llama", False)
    kw = dict(max_model_len=128, block_size=4, num_kv_blocks=64)
    return {"plain": Generator(str(path), **kw),
            "ngram": Generator(str(path), speculative={"method": "ngram", "num_speculative_tokens": 4}, **kw)}


def stream(gen, stop=None):
    """-> (outputs of the stream, checking the invariant at every output)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    outs, sent = [], ""
    for out in gen.stream([PROMPT], params):
        sent += out.new_text
        assert out.text == sent, (out.text, sent)  # each output's text is exactly what was sent
        outs.append(out)
    assert outs[-1].finished
    return outs


@pytest.fixture(scope="module")
def free_runs(gens):
    """Per generator: the full text and, per step, the (start, end) of the characters it added."""
    runs = {}
    for name, gen in gens.items():
        outs = stream(gen)
        spans, at = [], 0
        for o in outs:
            spans.append((at, at + len(o.new_text), len(o.new_token_ids)))
            at += len(o.new_text)
        runs[name] = (outs[-1].text, spans)
    assert runs["plain"][0] == runs["ngram"][0]  # greedy speculation is exact
    assert max(n for _, _, n in runs["ngram"][1]) >= 3, "no step appended several tokens"
    return runs


def _stop_string(text, spans, min_tokens: int, inside: bool) -> tuple[str, int]:
    """A stop string whose first occurrence ends inside a step that appended >= min_tokens tokens:
    starting 2 characters before that step (so it spans steps), or inside it (`inside`)."""
    for j, (start, end, n) in enumerate(spans):
        if n < min_tokens or j == 0:
            continue
        for a in (range(start + 1, end - 4) if inside else [start - 2]):
            for length in range(5, end - a + 1):  # the shortest whose first occurrence is here
                s = text[a:a + length]
                if " " in s.strip() and text.find(s) == a:
                    return s, a
    raise AssertionError("no candidate stop string")


@pytest.mark.parametrize("name,inside", [("plain", False), ("ngram", False), ("ngram", True)])
def test_stop_string_across_steps_and_inside_multi_token_appends(gens, free_runs, name, inside):
    text, spans = free_runs[name]
    stop, at = _stop_string(text, spans, 3 if name == "ngram" else 1, inside)
    outs = stream(gens[name], stop=[stop, "never-seen"])
    final = outs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:at]
    assert "".join(o.new_text for o in outs) == final.text


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_stop_string_that_never_matches_holds_back_then_flushes(gens, free_runs, name):
    text, _ = free_runs[name]
    outs = stream(gens[name], stop=["t999 t999"])
    assert outs[-1].finish_reason == "length" and outs[-1].text == text
    # while running, the last len(stop) - 1 = 8 characters stay back: they could start the stop
    for o in outs[:-1]:
        so_far = " ".join(f"t{t}" for t in o.token_ids)  # the test tokenizer's decoding
        assert o.text == so_far[:max(0, len(so_far) - 8)]


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_every_prefix_stop_string_streams_exactly(gens, free_runs, name):
    """Stop strings that begin at several places of the text (some a prefix of what follows)."""
    text, _ = free_runs[name]
    for a in range(3, len(text) - 8, max(1, len(text) // 5)):
        stop = text[a:a + 7]
        outs = stream(gens[name], stop=[stop])
        assert outs[-1].text == text[:text.find(stop)]
        assert "".join(o.new_text for o in outs) == outs[-1].text

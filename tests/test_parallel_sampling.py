"""n > 1 parallel sampling: the n samples of a prompt are independent requests with seeds
seed + j (vLLM's rule), returned together (Generator: `outputs`; server: choices n by n, usage
counting each prompt once), with speculation on; penalties and logit_bias through the server
equal the engine's own output."""
from __future__ import annotations

import pytest

from specinfer import Generator, SamplingParams
from serve_harness import start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module")
def gen(tiny_dir):
    path, _ = tiny_dir("llama", False)
    return Generator(str(path), block_size=4, max_model_len=128, speculative=SPEC)


def test_n_samples_equal_seeded_single_requests(gen):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=40, n=4, ignore_eos=True)
    out = gen.generate([PROMPT, PROMPT[:5]], params, use_tqdm=False)
    assert len(out) == 2 and all(len(o.outputs) == 4 for o in out)
    for o, prompt in zip(out, [PROMPT, PROMPT[:5]]):
        singles = gen.generate([prompt] * 4, [params.sample_params(j) for j in range(4)], use_tqdm=False)
        assert [s.token_ids for s in o.outputs] == [s.token_ids for s in singles]
        assert len({tuple(s.token_ids) for s in o.outputs}) > 1  # the samples differ
        assert o.token_ids == o.outputs[0].token_ids
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()


def test_n_one_has_outputs_of_itself(gen):
    o = gen.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert o.outputs == [o]


def test_engine_request_is_one_sample(gen):
    with pytest.raises(ValueError, match="SamplingParams.n=3"):
        gen.engine.add_request("x", PROMPT, SamplingParams(n=3))


def test_sample_params_seeds():
    p = SamplingParams(seed=2**64 - 1, n=3)
    assert [p.sample_params(j).seed for j in range(3)] == [2**64 - 1, 0, 1]
    assert SamplingParams(n=2).sample_params(1).seed is None


@pytest.fixture(scope="module")
def server(gen):
    srv = start_server(gen.engine)
    yield srv
    srv.stop()


def test_server_n_choices(server, gen):
    client = server.client()
    r = client.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:5]], max_tokens=8, temperature=0.9, seed=11,
                                  n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == list(range(6))
    by_index = {c.index: c.text for c in r.choices}
    want = gen.generate([PROMPT] * 3 + [PROMPT[:5]] * 3,
                        [SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True).sample_params(j)
                         for j in (0, 1, 2, 0, 1, 2)], use_tqdm=False)
    assert [by_index[i] for i in range(6)] == [w.text for w in want]
    assert r.usage.prompt_tokens == len(PROMPT) + 5  # each prompt once
    assert r.usage.completion_tokens == 6 * 8
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t5 t6"}],
                                          max_tokens=5, n=2, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_server_n_streams(server):
    stream = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=2, stream=True,
                                                temperature=0.0, extra_body={"ignore_eos": True})
    text = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
    assert text[0] == text[1] != ""  # greedy: both samples agree


def test_server_penalties_equal_engine(server, gen):
    kw = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={"9": 5.0})
    r = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0,
                                           presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"9": 5.0},
                                           extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    want = gen.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **kw),
                        use_tqdm=False)[0]
    plain = gen.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0]
    assert r.choices[0].text == want.text != plain.text


def test_samples_share_the_prompt_blocks(tiny_dir):
    """Samples 1..n-1 enter the core once sample 0's prompt is computed: they find its full blocks
    in the prefix cache (7 x 10 blocks of a 41-token prompt, 4-token blocks), with the same tokens
    as without sharing."""
    path, _ = tiny_dir("llama", False)
    prompt = list(range(3, 44))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=8, ignore_eos=True)
    gen = Generator(str(path), block_size=4, max_model_len=128)
    out = gen.generate([prompt], params, use_tqdm=False)[0]
    stats = gen.engine.core.stats()
    assert stats["prefix_cache_hits"] >= 7 * 10, stats
    assert [o.num_cached_tokens for o in out.outputs] == [0] + [40] * 7
    off = Generator(str(path), block_size=4, max_model_len=128, enable_prefix_caching=False)
    want = off.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()


def test_aborting_a_held_sample_or_its_leader(tiny_dir):
    path, _ = tiny_dir("llama", False)
    gen = Generator(str(path), block_size=4, max_model_len=128)
    eng = gen.engine
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(3, 30)), p)
    eng.add_request("b", list(range(3, 30)), p, share_prompt_with="a")
    eng.add_request("c", list(range(3, 30)), p, share_prompt_with="a")
    assert eng.core.num_waiting() == 1  # b and c wait outside the core
    assert eng.abort("b").finish_reason == "abort"
    eng.abort("a")  # c enters on its own
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"c"} and len(done["c"].token_ids) == 5
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()

"""A request's parameters never fail a step for others (issue 41, isolation): values are checked
in the dtype the step computes in, and a per-request failure that still reaches a step ends only
that request (RequestError), in the engine and through the server."""
from __future__ import annotations

import concurrent.futures as cf
import copy
import json

import pytest
import torch

from serve_harness import idle_and_free, request, start_server, wait_for
from specinfer import Generator, SamplingParams
from specinfer.request_error import RequestError
from specinfer.serve import ServeConfig


def _poisoned(params: SamplingParams, **fields) -> SamplingParams:
    """A copy whose fields slipped past validation (as a value valid in float64 but not in the
    step's float32 once did)."""
    bad = copy.copy(params)
    for k, v in fields.items():
        object.__setattr__(bad, k, v)
    return bad


@pytest.mark.parametrize("value", [1e-300, 1e-46])
def test_top_p_that_underflows_float32_is_refused_when_added(value):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.8, top_p=value)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e300)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}],
                         ids=["plain", "ngram"])
def test_a_poisoned_request_fails_alone_in_the_engine(target, spec, overlap):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (16,), generator=g)]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=50 + i) for i in range(16)]
    clean = Generator(str(target), speculative=spec, block_size=4, max_model_len=128)
    want = [o.token_ids for o in clean.generate(prompts[1:], params[1:], use_tqdm=False)]

    gen = Generator(str(target), speculative=spec, block_size=4, max_model_len=128, overlap_steps=overlap)
    eng = gen.engine
    eng.add_request("bad", prompts[0], _poisoned(params[0], top_p=0.0))
    for i in range(1, 16):
        eng.add_request(f"r{i}", prompts[i], params[i])
    done, errors = {}, []
    while eng.has_unfinished_requests():
        try:
            outs = eng.step(final_only=True)
        except RequestError as e:
            errors.append(e)
            assert eng.last_failed_request_ids == ["bad"]  # the culprit only
            continue
        for o in outs:
            done[o.request_id] = o
    assert len(errors) == 1 and "top_p" in str(errors[0])
    assert done["bad"].finished and done["bad"].finish_reason == "error"
    assert [done[f"r{i}"].token_ids for i in range(1, 16)] == want
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()


def test_one_poisoned_request_among_16_through_the_server(tiny_dir, monkeypatch):
    """16 concurrent clients; the engine is handed one request whose top_p slipped through (the
    server's own validation refuses such a value: that is checked too). The 15 others complete
    exactly; the poisoned one gets an error naming its parameter; nothing leaks."""
    path, _ = tiny_dir("llama", seed=3)
    gen = Generator(str(path), num_kv_blocks=128, block_size=8, max_model_len=256)
    eng = gen.engine
    real_add = eng.add_request

    def add_request(rid, prompt, params, **kw):
        if prompt == "t7 t7 t7 poison":
            params = _poisoned(params, top_p=0.0)
        return real_add(rid, prompt, params, **kw)

    monkeypatch.setattr(eng, "add_request", add_request)
    srv = start_server(eng, ServeConfig("tiny"))
    try:
        prompts = [f"t{5 + i} t{9 + i} t{5 + i} t{40 + i}" for i in range(15)]
        expected = Generator(str(path), num_kv_blocks=128, block_size=8).generate(
            prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
        bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True} for p in prompts]
        bodies.insert(7, {"prompt": "t7 t7 t7 poison", "max_tokens": 10, "temperature": 0.8, "ignore_eos": True})
        with cf.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda b: request(srv.port, "POST", "/v1/completions", b), bodies))
        bad_status, _, bad_raw = results.pop(7)
        assert bad_status == 400 and "top_p" in json.loads(bad_raw)["error"]["message"]  # its own value
        assert all(status == 200 for status, _, _ in results)
        assert [json.loads(raw)["choices"][0]["text"] for _, _, raw in results] == [o.text for o in expected]
        # the server's own validation: a top_p that is 0 in float32 is a 400 naming the field
        status, _, raw = request(srv.port, "POST", "/v1/completions",
                                 {"prompt": "t5 t6", "max_tokens": 4, "temperature": 0.8, "top_p": 1e-300})
        assert status == 400 and json.loads(raw)["error"]["param"] == "top_p"
        wait_for(lambda: idle_and_free(srv.port), what="all blocks free")
    finally:
        srv.stop()

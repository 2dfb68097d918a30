"""`specinfer serve` through the real `openai` client (and raw HTTP where the client hides the wire):
a server on a tiny random model with n-gram speculation, one per module, on 127.0.0.1.

The reference for every text is a separate in-process Generator on the same model without
speculation: greedy speculative output equals greedy target-only output token for token, so the
server must reproduce it exactly."""
from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest

from serve_harness import idle_and_free, open_stream, read_events, request, scrape, start_server, wait_for
from specinfer import Generator, SamplingParams
from specinfer.serve import ServeConfig

PROMPT = "t5 t6 t7 t8 t5 t6 t7 t8 t5 t6"  # repetitive: the n-gram proposer finds drafts
MODEL = "tiny"
ENGINE_KW = dict(num_kv_blocks=96, block_size=8, max_num_seqs=4, max_model_len=256)
CAPACITY = 8  # max requests in flight: 4 running + 4 waiting


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    path, _ = tiny_dir("llama", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny):
    # policy "fixed": the metrics tests count drafts of short requests (the goodput policy may draft none)
    gen = Generator(tiny, speculative={"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
                    **ENGINE_KW)
    srv = start_server(gen.engine, ServeConfig(MODEL, max_requests_in_flight=CAPACITY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def ref(tiny):
    """Target-only decoding in process: what the server must reproduce."""
    gen = Generator(tiny, **ENGINE_KW)

    def run(prompt, **params):
        params.setdefault("temperature", 0.0)
        return gen.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]

    run.gen = gen
    return run


def chat_ids(ref, messages):
    from specinfer.chat_template import ChatTemplate

    return ChatTemplate.for_model(ref.gen.engine.loaded).encode(ref.gen.tokenizer, messages)


# ------------------------------------------------------------------ endpoints
def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    status, _, body = request(server.port, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = request(server.port, "GET", "/v1/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_completion_equals_target_only_greedy(client, ref):
    expected = ref(PROMPT, max_tokens=12, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    spec = r.usage.model_extra["speculative"]
    assert spec["num_draft_tokens"] > 0, "the repetitive prompt must give the n-gram proposer drafts"
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])


def test_completion_of_token_ids_and_several_prompts(client, ref):
    expected = [ref(p, max_tokens=6, ignore_eos=True) for p in (PROMPT, "t9 t10 t11")]
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "t9 t10 t11"], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [e.text for e in expected]
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt=[PROMPT, "t9 t10 t11"], max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    for i, e in enumerate(expected):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == e.text and mine[-1].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=expected[0].prompt_token_ids, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected[0].text


def test_chat_uses_the_models_chat_template(client, ref):
    messages = [{"role": "system", "content": "t3 t4"}, {"role": "user", "content": PROMPT}]
    expected = ref(chat_ids(ref, messages), max_tokens=10, ignore_eos=True)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 10
    # max_completion_tokens is the newer name of max_tokens
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


# ------------------------------------------------------------------ streaming
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=1234)


def test_completion_stream_concatenates_to_the_non_streamed_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, **SAMPLED)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stream=True, **SAMPLED))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # usage on the final chunk


def test_chat_stream_concatenates_to_the_non_streamed_text(client):
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, **SAMPLED)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, stream=True,
                                                 **SAMPLED))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_stream_wire_format_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, headers, raw = request(server.port, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    from specinfer.serve import sse

    events = sse.parse(raw)
    assert events[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 5
    # stream_options.include_usage: OpenAI's separate usage chunk with no choices
    status, _, raw = request(server.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse.parse(raw)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "usage" not in events[-3]


def test_stop_string_spanning_two_steps_is_cut_in_stream_and_body(client, ref):
    full = ref(PROMPT, max_tokens=12, ignore_eos=True)
    words = full.text.split()
    stop = f"{words[4]} {words[5]}"  # two tokens: the stream must not send the first half
    expected = full.text[:full.text.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ sampling fields reach the engine
def test_sampling_fields_reach_the_engine(client, ref):
    greedy = ref(PROMPT, max_tokens=16, ignore_eos=True).text

    def text(**kw):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                      extra_body={"ignore_eos": True, **kw.pop("extra", {})}, **kw)
        return r.choices[0].text

    assert text(temperature=1.0, seed=5, extra={"top_k": 1}) == greedy  # top_k=1 is greedy
    assert text(temperature=1.0, seed=5, top_p=1e-6) == greedy  # so is a tiny top_p
    assert text(temperature=1.0, seed=5, extra={"min_p": 1.0}) == greedy  # and min_p=1
    a, b, c = text(temperature=1.0, seed=11), text(temperature=1.0, seed=11), text(temperature=1.0, seed=12)
    assert a == b != c and a != greedy
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_completion_logprobs_equal_the_engines(client, ref):
    expected = ref(PROMPT, max_tokens=8, ignore_eos=True, logprobs=3)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens[:1]) == r.choices[0].text.split()[0]
    for tok_id, got, top, entry in zip(expected.token_ids, lp.token_logprobs, lp.top_logprobs, expected.logprobs):
        assert got == pytest.approx(entry[tok_id], abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-4)  # greedy: chosen is the top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content).replace("t", " t").split() == \
        r.choices[0].message.content.split()
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(c.bytes).decode() == c.token


# ------------------------------------------------------------------ load and bad clients
def test_concurrent_clients_each_get_their_own_answer(client, ref):
    prompts = [f"t{10 + i} t{20 + i} t{30 + i} t{10 + i} t{20 + i}" for i in range(6)]
    expected = [ref(p, max_tokens=10, ignore_eos=True).text for p in prompts]

    def ask(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def ask_streaming(p):
        stream = client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in stream)

    with cf.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda ip: (ask if ip[0] % 2 else ask_streaming)(ip[1]), enumerate(prompts)))
    assert got == expected


def test_disconnect_mid_stream_aborts_and_frees_every_block(server):
    before = scrape(server.port)
    conn, resp = open_stream(server.port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 240, "temperature": 0,
                                                               "ignore_eos": True})
    assert resp.status == 200
    events = read_events(resp, 3)
    assert len(events) == 3 and all(e["choices"][0]["finish_reason"] is None for e in events)
    assert scrape(server.port)["specinfer_kv_blocks_used"] > 0
    conn.close()  # the client leaves mid-stream
    wait_for(lambda: idle_and_free(server.port), what="the aborted request's blocks to be freed")
    after = scrape(server.port)
    key = 'specinfer_requests_finished_total{finish_reason="abort"}'
    assert after[key] == before.get(key, 0) + 1
    assert not server.engine.has_unfinished_requests()


def test_disconnect_while_waiting_for_a_plain_response_aborts(server):
    import http.client

    before = scrape(server.port)
    key = 'specinfer_requests_finished_total{finish_reason="abort"}'
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 240, "temperature": 0,
                                                              "ignore_eos": True}).encode(),
                 headers={"Content-Type": "application/json"})
    wait_for(lambda: scrape(server.port)["specinfer_num_requests_running"] == 1, what="the request to run")
    conn.close()  # gone before the answer
    wait_for(lambda: scrape(server.port).get(key, 0) == before.get(key, 0) + 1, what="the abort")
    assert idle_and_free(server.port)
    assert scrape(server.port)["specinfer_generation_tokens_total"] - before["specinfer_generation_tokens_total"] < 240


def finished_total(metrics: dict) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("specinfer_requests_finished_total"))


def test_full_queue_answers_429_and_recovers(server, client):
    body = {"prompt": "t5 t6", "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    finished_before = finished_total(scrape(server.port))
    streams = [open_stream(server.port, "/v1/completions", body) for _ in range(CAPACITY)]
    try:
        assert [resp.status for _, resp in streams] == [200] * CAPACITY  # admitted: headers are out
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        m = scrape(server.port)
        # every admitted stream is running, waiting or (on a loaded machine) already finished
        in_flight = m["specinfer_num_requests_running"] + m["specinfer_num_requests_waiting"]
        assert in_flight + finished_total(m) - finished_before == CAPACITY
        assert m['specinfer_requests_rejected_total{reason="queue_full"}'] >= 1
    finally:
        for conn, _ in streams:
            conn.close()
    wait_for(lambda: idle_and_free(server.port), what="all blocks free after the clients left")
    assert client.completions.create(model=MODEL, prompt="t5", max_tokens=2).usage.completion_tokens >= 1


BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": PROMPT, "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": PROMPT, "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": 10_000}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": PROMPT, "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": PROMPT, "seed": "x"}, 400, "seed"),
    ("completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": PROMPT, "stop_token_ids": [10_000]}, 400, "stop_token_ids"),
    ("completions", {"prompt": PROMPT, "n": 0}, 400, "n"),
    ("completions", {"prompt": PROMPT, "n": 17}, 400, "n"),
    ("completions", {"prompt": PROMPT, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": PROMPT, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": PROMPT, "guided_regexx": "a+"}, 400, "guided_regexx"),
    ("chat/completions", {"messages": [{"role": "user", "content": "t5"}], "frequency_penality": 1}, 400,
     "frequency_penality"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [99_999]}, 400, "prompt"),
    ("completions", {"prompt": " ".join(["t5"] * 300)}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "t5"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "t5"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "t5"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, _, p) in enumerate(BAD)])
def test_each_bad_request_gets_an_error_naming_the_field(server, endpoint, body, status, param):
    got, _, raw = request(server.port, "POST", f"/v1/{endpoint}", body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and err["message"] and err["type"] in ("invalid_request_error", "not_found_error")
    assert param.split(".")[0] in err["message"] or status == 404


def test_malformed_json_and_the_openai_client_error(server, client):
    got, _, raw = request(server.port, "POST", "/v1/completions", b'{"prompt": "t5", ')
    assert got == 400 and json.loads(raw)["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    assert idle_and_free(server.port)


# ------------------------------------------------------------------ metrics
def test_metrics_move_with_a_request(server, client):
    before = scrape(server.port)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True})
    wait_for(lambda: scrape(server.port)["specinfer_e2e_request_latency_seconds_count"]
             == before["specinfer_e2e_request_latency_seconds_count"] + 1, what="metrics of the request")
    after = scrape(server.port)

    def delta(name):
        return after[name] - before.get(name, 0)

    assert delta("specinfer_generation_tokens_total") == 20
    assert delta("specinfer_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta('specinfer_requests_finished_total{finish_reason="length"}') == 1
    for h in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert delta(f"specinfer_{h}_seconds_count") == 1 and delta(f"specinfer_{h}_seconds_sum") > 0
    spec = r.usage.model_extra["speculative"]
    assert delta("specinfer_spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"] > 0
    assert delta("specinfer_spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    assert after["specinfer_spec_decode_acceptance_rate"] == pytest.approx(
        after["specinfer_spec_decode_num_accepted_tokens_total"] / after["specinfer_spec_decode_num_draft_tokens_total"])
    assert 1.0 <= after["specinfer_spec_decode_mean_acceptance_length"] <= 4.0  # k = 3: at most k + 1
    assert after["specinfer_spec_decode_enabled"] == 1
    assert after["specinfer_kv_blocks_total"] == ENGINE_KW["num_kv_blocks"] and after["specinfer_kv_blocks_used"] == 0

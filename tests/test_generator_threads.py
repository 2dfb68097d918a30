"""A Generator shared by threads: steps are serialized, each call gets only its own requests'
outputs (a generate() never swallows another consumer's results), and a stream() whose
requests vanished raises instead of spinning."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specinfer import Generator, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def target(tiny_dir):
    return tiny_dir("llama", False)[0]


def test_threads_share_a_generator(target):
    gen = Generator(str(target), block_size=4, max_num_batched_tokens=32,
                    speculative={"method": "ngram", "num_speculative_tokens": 3})
    sets = [_prompts(5, seed) for seed in range(4)]
    want = [[o.token_ids for o in gen.generate(p, GREEDY, use_tqdm=False)] for p in sets]
    streamed_want = "".join(o.text for o in gen.generate(sets[3][:1], GREEDY, use_tqdm=False))
    results: dict[int, object] = {}
    errors = []

    def run_generate(i):
        try:
            results[i] = [o.token_ids for o in gen.generate(sets[i], GREEDY, use_tqdm=False)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def run_stream():
        try:
            text = ""
            for out in gen.stream(sets[3][:1], GREEDY):
                text += out.new_text
            results["stream"] = text
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run_generate, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=run_stream))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and all(not t.is_alive() for t in threads)
    assert [results[i] for i in range(3)] == want[:3]
    assert results["stream"] == streamed_want
    core = gen.engine.core
    assert core.num_free_blocks() == core.num_total_blocks()
    assert not gen._mailboxes


def test_outputs_reach_their_own_caller_when_another_thread_steps(target):
    """Thread B's request finishes during steps run by thread A: A must not take it."""
    gen = Generator(str(target), block_size=4)
    short, long = _prompts(2, seed=9)
    b_out = {}
    b_added, a_done = threading.Event(), threading.Event()
    real_next = gen._next_outputs

    def next_outputs(names):
        if threading.current_thread().name == "B" and not a_done.is_set():
            b_added.set()  # B's request is in the engine; let A run it to the end first
            a_done.wait(timeout=120)
        return real_next(names)

    gen._next_outputs = next_outputs

    def run_b():
        b_out["r"] = gen.generate([short], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)

    tb = threading.Thread(target=run_b, name="B")
    tb.start()
    assert b_added.wait(timeout=60)
    a = gen.generate([long], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert gen.engine.core.num_running() + gen.engine.core.num_waiting() == 0  # A's steps finished B's too
    a_done.set()
    tb.join(timeout=120)
    assert len(a) == 1 and len(a[0].token_ids) == 20
    assert len(b_out["r"]) == 1 and b_out["r"][0].finished and len(b_out["r"][0].token_ids) == 2


def test_stream_whose_requests_vanished_raises_instead_of_spinning(target):
    gen = Generator(str(target), block_size=4)
    it = gen.stream(_prompts(1, seed=5), SamplingParams(max_tokens=50, temperature=0.0))
    first = next(it)
    assert not first.finished
    gen.engine.abort(first.request_id)  # someone else aborts it behind the stream's back
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="stopped with requests unfinished"):
        next(it)
    assert time.perf_counter() - t0 < 5


def test_outputs_reach_the_generator_when_a_foreign_loop_steps_the_engine(target):
    """A server loop sharing the engine (serve's EngineLoop) steps it and drops outputs of
    requests it does not track: a Generator's outputs go to the Generator's mailboxes instead
    (add_request sink=), whoever steps. (Under load, the server's loop once took a Generator
    request's last output: "the engine stopped with requests unfinished".)"""
    gen = Generator(str(target), block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = gen.generate(_prompts(2, seed=3), params, use_tqdm=False)
    groups = gen._add_all(_prompts(2, seed=3), params, stream=False)
    names = {n for g in groups for n in g}
    while gen.engine.has_unfinished_requests():
        assert gen.engine.step() == []  # the foreign stepper sees none of the Generator's outputs
    got = {o.request_id: o for o in gen._next_outputs(names) if o.finished}
    assert set(got) == names
    assert [got[g[0]].token_ids for g in groups] == [o.token_ids for o in want]

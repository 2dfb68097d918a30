"""The overlapped step loop (overlap_steps=True, the default) gives what the serial loop gives:
the same tokens, text, finish reasons and logprobs for greedy and seeded requests, stop strings
found one step late still cut exactly, streams add up, no KV block leaks, and a Ctrl-C while the
engine waits on a forward cancels the step only once that forward has ended."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from specinfer import Generator, SamplingParams
from specinfer.executor.forward_thread import ForwardThread, PendingForward

METHODS = [None, "ngram", "draft_model"]


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(3, 256, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(base * 3 if i % 2 else base)  # half repeat themselves: prompt lookup finds matches
    return out


def _generator(models, method, overlap, **kw):
    target, draft = models
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": 3, "policy": "fixed"}
        if method == "draft_model":
            spec["model"] = str(draft)
    settings = dict(block_size=4, max_num_batched_tokens=32, num_kv_blocks=96, max_model_len=160)
    settings.update(kw)
    return Generator(str(target), speculative=spec, overlap_steps=overlap, **settings)


def _summary(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [sorted(d) for d in o.logprobs]) for o in outs]


def _params(stops):
    """Greedy and seeded sampling requests, with stop strings, min_tokens and logprobs mixed in."""
    ps = []
    for i, stop in enumerate(stops):
        ps.append(SamplingParams(max_tokens=24, temperature=0.0 if i % 3 else 0.8, seed=100 + i,
                                 stop=stop, min_tokens=2 if i % 4 == 1 else 0,
                                 logprobs=2 if i % 5 == 0 else None))
    return ps


@pytest.fixture(scope="module")
def stop_cases(target_and_draft):
    """Prompts and stop strings cut from the middle of each serial output (so they do match)."""
    prompts = _prompts(8)
    gen = _generator(target_and_draft, None, overlap=False)
    outs = gen.generate(prompts, _params([None] * len(prompts)), use_tqdm=False)
    stops = []
    for i, o in enumerate(outs):
        words = o.text.split()
        stops.append(None if i % 4 == 3 or len(words) < 6 else (" " + words[len(words) // 2],))
    assert sum(s is not None for s in stops) >= 4
    return prompts, stops, outs, gen.tokenizer


@pytest.mark.parametrize("method", METHODS)
def test_overlapped_loop_equals_the_serial_loop(target_and_draft, stop_cases, method):
    prompts, stops, _, tokenizer = stop_cases
    params = _params(stops)
    serial = _generator(target_and_draft, method, overlap=False)
    overlapped = _generator(target_and_draft, method, overlap=True)
    free = serial.generate(prompts, _params([None] * len(prompts)), use_tqdm=False)  # no stop strings
    want = serial.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    assert sum(o.finish_reason == "stop" and isinstance(o.stop_reason, str) for o in got) >= 3
    cut = 0    # an independent oracle for the cut: the tokens up to the first one whose text completes the
    # stop string, and the text before the stop string
    for o, f, stop in zip(got, free, stops):
        if stop is None:
            assert o.token_ids == f.token_ids
            continue
        if stop[0] not in f.text:
            assert o.token_ids == f.token_ids  # (sampled requests may take another path)
            continue
        j = next(j for j in range(len(f.token_ids)) if stop[0] in tokenizer.decode(f.token_ids[:j + 1]))
        assert o.token_ids == f.token_ids[:j + 1]
        assert o.text == f.text[:f.text.index(stop[0])]
        cut += 1
    assert cut >= 3
    if method is not None:
        assert overlapped.spec_metrics()["num_accepted_tokens"] > 0
    m = overlapped.engine.metrics
    assert m.device_s > 0 and m.tail_s > 0  # output work ran beside the forwards
    for g in (serial, overlapped):
        core = g.engine.core
        assert core.num_free_blocks() == core.num_total_blocks()
        core.check_invariants()
        assert not g.engine.has_unfinished_requests()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_overlapped_streams_add_up_and_equal_serial(target_and_draft, stop_cases, method):
    prompts, stops, _, _ = stop_cases
    params = _params(stops)
    final = {}
    for overlap in (False, True):
        gen = _generator(target_and_draft, method, overlap=overlap)
        pieces, last = {}, {}
        for out in gen.stream(prompts, params):
            pieces.setdefault(out.request_id, []).append(out.new_text)
            last[out.request_id] = out
        assert all(o.finished for o in last.values())
        assert all("".join(pieces[r]) == o.text for r, o in last.items())
        final[overlap] = _summary([last[r] for r in sorted(last, key=lambda n: int(n.split("-")[1]))])
    assert final[True] == final[False]


def test_engine_step_outputs_arrive_one_call_later_and_all_arrive(target_and_draft):
    """Driven as a server drives it: the overlapped engine returns a step's outputs from the next
    step() call, and keeps reporting unfinished requests until the last output is out."""
    gen = _generator(target_and_draft, "ngram", overlap=True)
    eng = gen.engine
    eng.add_request("a", _prompts(1)[0], SamplingParams(max_tokens=6, temperature=0.0))
    first = eng.step()
    assert first == []  # the first step's outputs come with the next call
    seen = []
    while eng.has_unfinished_requests():
        seen += eng.step()
    assert seen and seen[-1].finished and len(seen[-1].token_ids) == 6
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()


def test_abort_between_overlapped_steps_frees_everything(target_and_draft):
    gen = _generator(target_and_draft, "draft_model", overlap=True)
    eng = gen.engine
    prompts = _prompts(4, seed=9)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0))
    for _ in range(4):
        eng.step()
    out = eng.abort("r1")
    assert out is not None and out.finished and out.finish_reason == "abort"
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert sorted(done) == ["r0", "r2", "r3"]
    want = _generator(target_and_draft, "draft_model", overlap=False).generate(
        [prompts[0], prompts[2], prompts[3]], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    assert [done["r0"], done["r2"], done["r3"]] == [o.token_ids for o in want]
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()


def test_forward_thread_hands_back_results_and_errors():
    ft = ForwardThread()
    try:
        assert ft.launch(lambda x: x * 2, 21).wait() == 42
        for exc in (RuntimeError("boom"), KeyboardInterrupt()):
            def fail(e=exc):
                raise e
            p = ft.launch(fail)
            with pytest.raises(type(exc)):
                p.wait()
        # the thread survives its callers' errors
        slow = ft.launch(lambda: (time.sleep(0.05), "done")[1])
        assert slow.wait() == "done" and slow.device_s >= 0.04
    finally:
        ft.close()
    with pytest.raises(RuntimeError, match="closed"):
        ft.launch(lambda: None)
    p = PendingForward.completed(lambda: 7)
    assert p.wait() == 7


def test_ctrl_c_while_waiting_cancels_only_after_the_forward_ended(target_and_draft, sigint_raises):
    """A real SIGINT lands while the engine's thread waits on the forward thread: the step is
    cancelled only once the forward stopped writing KV, and the engine goes on exactly."""
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signals reach the main thread only")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = _prompts(3, seed=13)
    want = [o.token_ids for o in _generator(target_and_draft, "ngram", overlap=False).generate(
        prompts, params, use_tqdm=False)]
    gen = _generator(target_and_draft, "ngram", overlap=True)
    eng = gen.engine
    ended = []
    real_forward = eng.runner.forward
    calls = {"n": 0}

    def slow_forward(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
            time.sleep(0.3)
            out = real_forward(*a, **k)
            ended.append(time.perf_counter())
            return out
        return real_forward(*a, **k)

    eng.runner.forward = slow_forward
    with pytest.raises(KeyboardInterrupt):
        gen.generate(prompts, params, use_tqdm=False)
    raised_at = time.perf_counter()
    assert ended and ended[0] <= raised_at  # the forward had ended before the step unwound
    assert not eng.has_unfinished_requests()
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    assert [o.token_ids for o in gen.generate(prompts, params, use_tqdm=False)] == want


def test_overlap_steps_is_validated_and_the_cli_can_turn_it_off(target_and_draft):
    import argparse

    from specinfer.cli.options import add_engine_arguments, engine_config

    with pytest.raises(ValueError, match="overlap_steps"):
        Generator(str(target_and_draft[0]), overlap_steps="yes")
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    m = argparse.Namespace(model="m")
    assert engine_config(p.parse_args([], m), None).scheduler.overlap_steps is True
    assert engine_config(p.parse_args(["--no-overlap-steps"], m), None).scheduler.overlap_steps is False


def test_engine_options_the_cli_lacked_now_reach_the_engine():
    import argparse

    from specinfer.cli.options import add_engine_arguments, engine_config

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_config(p.parse_args([], argparse.Namespace(model="m")), None).options()
    assert kw["enable_prefix_caching"] is True and kw["max_logprobs"] == 20
    kw = engine_config(p.parse_args(["--no-enable-prefix-caching", "--max-logprobs", "5"],
                                    argparse.Namespace(model="m")), None).options()
    assert kw["enable_prefix_caching"] is False and kw["max_logprobs"] == 5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serial"])
def test_ctrl_c_held_through_the_commit_loses_no_output(target_and_draft, overlap, sigint_raises):
    """A SIGINT that arrives while a step commits is raised right after the commit: the step's
    output work still runs (next call), so every request finishes and is delivered."""
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signals reach the main thread only")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = _prompts(4, seed=21)
    want = [o.token_ids for o in _generator(target_and_draft, "ngram", overlap=False).generate(
        prompts, params, use_tqdm=False)]
    gen = _generator(target_and_draft, "ngram", overlap=overlap)
    eng = gen.engine
    real = eng._record_spec
    calls = {"n": 0}

    def record(*a):
        calls["n"] += 1
        if calls["n"] in (3, 6):
            signal.raise_signal(signal.SIGINT)  # held by the commit's deferred_keyboard_interrupt
        return real(*a)

    eng._record_spec = record
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done, interrupts = {}, 0
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        try:
            outs = eng.step(final_only=True)
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for o in outs:
            if o.finished:
                done[o.request_id] = o.token_ids
    assert interrupts == 2 and not eng.has_unfinished_requests()
    assert [done[f"r{i}"] for i in range(4)] == want
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()

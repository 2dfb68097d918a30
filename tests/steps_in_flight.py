"""A server's pattern against an engine with steps in flight (scheduled ahead, launched after the
update, sampled on the device): requests streamed, stop strings ending some mid-text, one aborted
while a step holds it. Shared by the tests of each way a step gets ahead of the host."""
from __future__ import annotations

from specinfer import SamplingParams


def with_stop_strings(probe, params, seeds) -> list[SamplingParams]:
    """params with a stop string cut from the middle of every other probe output's text."""
    stops = [None if i % 2 else [o.text[len(o.text) // 2:][:3]] for i, o in enumerate(probe)]
    return [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=s, ignore_eos=True, stop=stop)
            for p, s, stop in zip(params, seeds, stops)]


def drive_with_abort(gen, prompts, params, abort: str = "r1", at_step: int = 4) -> dict:
    """Add the requests as r0.., step until done, abort `abort` after `at_step` steps;
    -> {request id: (token ids, text, finish reason)} of the finished ones."""
    eng = gen.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    final, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = (o.token_ids, o.text, o.finish_reason)
        steps += 1
        if steps == at_step:
            eng.abort(abort)  # held by a step in flight
    return final


def stop_strings_and_abort_match_serial(make, prompts, params_of):
    """`make(**kw)` -> a Generator, `params_of(n)` -> n SamplingParams (EOS ignored): stop strings cut
    from a probe's texts (with_stop_strings), r1 aborted while a step holds it (drive_with_abort);
    the engine under test (make()) must give the serial loop's outputs for every other request and
    free every KV block. -> that engine, for the caller's own counters."""
    n = len(prompts)
    probe = make(overlap_steps=False).generate(prompts, params_of(n), use_tqdm=False)
    params = with_stop_strings(probe, params_of(n), [40 + i for i in range(n)])
    serial, gen = make(overlap_steps=False), make()
    want, got = drive_with_abort(serial, prompts, params), drive_with_abort(gen, prompts, params)
    assert "r1" not in got and got == {k: v for k, v in want.items() if k != "r1"}
    assert sum(v[2] == "stop" for v in got.values()) >= 2
    assert gen.engine.core.num_free_blocks() == gen.engine.core.num_total_blocks()
    return gen.engine


def faults_leave_outputs_exact(serial, gen, prompts, params, inject, min_faults: int):
    """Run the prompts on the serial loop (no faults), then on `gen` with `inject(engine)` (-> an
    Injector it installed) raising; the outputs must be equal, the faults all seen, every KV block
    free and the core's invariants hold; once the injector stops, `gen` keeps serving. -> the
    engine, for the caller's own counters."""
    from fault_injection import run_engine

    want, faults = run_engine(serial, prompts, params)
    assert faults == 0 and len(want) == len(prompts)
    eng = gen.engine
    inj = inject(eng)
    got, faults = run_engine(gen, prompts, params)
    assert inj.raised >= min_faults and faults == inj.raised
    assert got == want
    assert eng.core.num_free_blocks() == eng.core.num_total_blocks()
    eng.core.check_invariants()
    inj.fail_at.clear()
    again = gen.generate(prompts[:3], params, use_tqdm=False)  # and it keeps serving
    assert [o.token_ids for o in again] == [want[f"r{i}"] for i in range(3)]
    return eng


def runs_with_sampling_params(make, prompts, extras, max_tokens: int):
    """For each dict of extra sampling parameters (penalties, min_tokens, logprobs...): greedy
    requests run on `make()` and on `make(overlap_steps=False)` (the serial loop) ->
    yields (extra, outputs, serial outputs, the engine under test)."""
    for extra in extras:
        params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)] * len(prompts)
        serial, gen = make(overlap_steps=False), make()
        yield (extra, gen.generate(prompts, params, use_tqdm=False), serial.generate(prompts, params, use_tqdm=False),
               gen.engine)

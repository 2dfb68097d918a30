"""One engine step as a transaction (DESIGN §3): its phases, and what undoing each one means.

`LLMEngine._step` runs the phases in order inside `with engine.lock, StepTransaction(...)`:
schedule (the core's runs, Rust), launch (the target forward over the mixed batch), overlap (the
previous step's output work and the grammar masks while the forward runs), sample (sample /
verify), commit (update, Rust; the Python states take the same tokens), propose (drafts for the
next step); `step.outputs` is what the call returns.

Leaving the block by an exception (BaseException: Ctrl-C too) undoes what the phase reached:
- before the commit, the core cancels the pending step (computed counts, drafts, reserved slots
  back where they were; no forward may still write KV) and every request stands where it stood,
  so a retry replays it exactly (randomness is counter-based); the outputs already built and the
  output work not yet run wait for the next step() call;
- once `update()` has committed (Ctrl-C is held back through the commit, executor/interrupts.py),
  the Python states hold the same tokens; only the output work of the step is deferred;
- if the proposer fails, the step's outputs are kept for the next call and the proposer forgets
  the step's requests (it rebuilds its state from their confirmed tokens).
A `RequestError` (a failure that is some requests' own, request_error.py) also ends those
requests with finish_reason "error"; the others go on. A request whose own output work fails
(its detokenizer, say) is finished with "error" and that error is raised once the step is whole.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from specinfer.engine.device_sampling import SampledOnDevice, sample_on_device, samples_on_device
from specinfer.engine.launched_drafts import DraftFill, verify_filled
from specinfer.engine.step_sampler import tree_requests
from specinfer.executor.forward_thread import fill_ahead_inputs
from specinfer.executor.interrupts import deferred_keyboard_interrupt
from specinfer.request_error import RequestError

# how far a step got: what leaving it by an exception must undo
SCHEDULING, RUNNING, COMMITTING, COMMITTED, PROPOSING = range(5)


class StepTransaction:
    def __init__(self, engine, final_only: bool):
        self.engine = engine
        self.final_only = final_only
        self.phase = SCHEDULING
        self.outputs, engine._undelivered = engine._undelivered, []
        self.tail, engine._tail = engine._tail, None  # the previous step's output work, if deferred
        self.sched = self.states = self.pending = self.touched = None
        self.ahead = None  # (sched, states, pending) of the step launched ahead of this one's result
        self.sampled_behind = False  # the step's sampling runs behind its forward (launch)
        self.proposed = False  # the core proposed right after the update (_launch_next)
        self.fill = None  # DraftFill: the step verifies a launched proposal (engine/launched_drafts.py)
        self.hidden = self.logits = self.masks = self.emitted = None
        self.error: Exception | None = None  # a request's failure in its output work: raised at the end
        self.t: dict[str, float] = {}

    def __enter__(self) -> "StepTransaction":
        return self

    # ------------------------------------------------------------------ the phases
    def schedule(self) -> bool:
        """The core's runs for this step; False (the previous step's output work done) when there
        are none."""
        e = self.engine
        if e._held:  # samples whose leader's prompt is now in the cache (or who lost their leader)
            e._admit_held()
        self.t["start"] = time.perf_counter()
        if e._ahead is not None:  # scheduled and launched by the previous call: adopted
            (self.sched, self.states, self.pending, self.sampled_behind), e._ahead = e._ahead, None
            self.phase = RUNNING
            return True
        self.sched = sched = e.core.schedule()
        if len(sched.preempted_req_ids) and e.proposer is not None:
            e.proposer.forget(sched.preempted_req_ids.tolist())  # their proposal stays; the proposer's KV does not
        if len(sched.req_ids) == 0:
            if e.proposing is not None:
                e.proposing.settle_launched()  # (a catch-up alone, say: nothing verifies it)
            self._finish_tail(step_pending=False)
            return False
        self.states = [e._requests[i] for i in sched.req_ids.tolist()]
        self.phase = RUNNING
        return True

    def launch(self) -> None:
        """Pack the batch and launch the target forward (executor PendingForward), with the step's
        sampling queued behind it where forwards run on the forward thread and no request of the
        step is constrained (its grammar masks are built beside the forward): the sampler then
        runs as device work, and the engine's thread waits only for the emitted tokens."""
        e = self.engine
        if self.pending is not None:  # adopted: launched by the previous call (sampled behind where
            self.t["launched"] = time.perf_counter()  # forwards run on the forward thread)
            return
        then = before = None
        if e.proposing is not None and e.proposing.launched is not None:  # its drafts: placeholders, filled there
            fill = DraftFill(self.sched, e.proposing.launched, e.device)
            if not fill.empty:
                self.fill, before = fill, fill.fill_inputs
        if e.executor.forward_thread is not None and not any(st.grammar is not None for st in self.states):
            if self.fill is None:
                then = partial(e.step_sampler, sched=self.sched, states=self.states, draft_probs=e._draft_probs)
            else:
                then = partial(verify_filled, e.step_sampler, self.fill, sched=self.sched, states=self.states,
                               draft_probs=e._draft_probs)
        elif e.device_sampling and samples_on_device(self.sched, self.states, e):  # (CUDA: queued behind it)
            then = partial(sample_on_device, e.step_sampler, sched=self.sched, states=self.states)
        self.pending = e._launch(self.sched, self.states, then, before)
        self.sampled_behind = then is not None
        self.t["launched"] = time.perf_counter()

    def launch_ahead(self) -> None:
        """Where it can be (engine.schedule_ahead: overlapped loop, forwards on the forward thread,
        no proposer), schedule the next step now and launch it behind this one: the core assumes each
        sampled run emits one token and goes on (SchedulerCore.schedule_ahead), the forward thread
        takes this step's tokens into its input ids (fill_ahead_inputs), and its sampler runs behind
        its forward with the output positions known now. A step whose requests' sampling reads their
        token history (penalties, min_tokens still ahead, grammars) is not scheduled ahead."""
        e = self.engine
        if not (e.schedule_ahead and self.sampled_behind):  # this step's tokens must be readable there
            return
        sched = e.core.schedule_ahead()
        if sched is None:
            return
        states = [e._requests[i] for i in sched.req_ids.tolist()]
        on_device = e.executor.forward_thread is None  # (CUDA) sampled as device work, or not at all
        if reads_history(e, states) or (on_device and not samples_on_device(sched, states, e)):
            e.core.cancel_ahead()
            return
        positions = None  # (all greedy: no draw reads a position)
        if e._random_ids:
            positions = np.fromiter((len(st.output_token_ids) for st in states), np.int64, len(states))
            if len(sched.ahead_input_pos):  # runs that decode from this step's token: one position on
                positions[np.searchsorted(sched.query_start_loc[:-1], sched.ahead_input_pos)] += 1
        if on_device:
            then = partial(sample_on_device, e.step_sampler, sched=sched, states=states, positions=positions)
        else:
            then = partial(e.step_sampler, sched=sched, states=states, draft_probs=e._draft_probs,
                           positions=positions)
        before = partial(fill_ahead_inputs, self.pending, sched.ahead_input_pos, sched.ahead_src)
        self.ahead = (sched, states, e._launch(sched, states, then, before), True)
        e.num_scheduled_ahead += 1

    def overlap(self) -> None:
        """While the forward runs: the previous step's output work, the grammar masks of this
        step's logits rows, and what the next proposal's choice reads (the policy's tables)."""
        self._finish_tail(step_pending=True)
        self.masks = self.engine.step_grammar.masks(self.sched, self.states, tree_requests(self.sched))
        if self.engine.proposing is not None:
            self.engine.proposing.prepare_core_proposal(self.states)  # what the core's proposal reads of them
            self.engine.proposing.prepare_proposal(self.sched, self.states)  # and a launched one's
            self.engine.proposing.prepare(len(self.states))  # the policy's cost tables for the next proposal
            self.engine.proposing.plan(self.sched, self.states)  # and its choice, where made beside the forward
        self.t["overlapped"] = time.perf_counter()
        if self.engine.proposing is not None:  # a launched proposal's tokens (this step's forward is
            self.engine.proposing.settle_launched()  # queued behind its forwards): the core's now

    def sample(self) -> None:
        """Wait for the forward; sample or verify its logits rows."""
        e = self.engine
        result = self.pending.wait()
        if len(result) == 3:  # sampled behind the forward (launch)
            self.hidden, self.logits, self.emitted = result
            if isinstance(self.emitted, SampledOnDevice):  # (CUDA) wait for the tokens' copy back only
                self.emitted = self.emitted.emitted()
            self.t["forward_done"] = time.perf_counter()
        else:
            self.t["forward_done"] = time.perf_counter()
            self.hidden, self.logits = result
            if self.fill is not None:
                self.emitted = verify_filled(e.step_sampler, self.fill, self.logits, self.sched, self.states,
                                             e._draft_probs, self.masks)
            else:
                self.emitted = e.step_sampler(self.logits, self.sched, self.states, e._draft_probs, self.masks)
        self.t["sampled"] = time.perf_counter()

    def commit(self) -> None:
        """The core commits (update), the Python states take the same tokens, with Ctrl-C held back;
        the step's output work runs now (serial loop) or beside the next forward (overlapped)."""
        e, sched, states, emitted = self.engine, self.sched, self.states, self.emitted
        with deferred_keyboard_interrupt():
            upd = e.core.update(emitted.token_ids, emitted.cu_num_emitted)
            self.phase = COMMITTING
            e._ahead, self.ahead = self.ahead, None  # the core's pending step now: the next call's
            if len(upd.kv_copy_src):  # accepted tree paths (docs/trees.md)
                e.executor.apply_kv_copies(upd.kv_copy_src, upd.kv_copy_dst)
            next_error = self._launch_next(upd)  # the next step, before the Python states take the tokens
            e.num_mixed_steps += bool(sched.num_verify_requests and sched.num_prefill_requests)
            if e.proposing is None or not e.proposing.plans_beside_forward:  # (else with the output work)
                e._observe_verification(states, emitted)
            self.touched = e._commit_tokens(sched, states, emitted, upd)
            e._release_stopped()  # requests a stop string ended while this step ran
        self.phase = COMMITTED
        m, t = e.metrics, self.t
        m.device_s += self.pending.device_s  # the forward, where it ran
        m.wait_s += t["forward_done"] - t["overlapped"]  # blocked on the forward's result
        m.tail_s += t["overlapped"] - t["launched"]  # the previous step's output work, beside the forward
        if e.overlap_steps:
            e._tail = self.touched
        else:
            self.tail, self.touched = self.touched, None
            self._finish_tail(step_pending=False)
        t["committed"] = time.perf_counter()
        if next_error is not None:  # the committed step stands; its proposal is forgotten (__exit__)
            self.phase = PROPOSING
            raise next_error

    def _launch_next(self, upd) -> BaseException | None:
        """Right after update(), where nothing of it needs the Python states (engine.launches_next:
        overlapped loop; no step already launched ahead; the proposal, if any, the core's own:
        StepProposing.propose_in_core): the core proposes, schedules the next step, and it is packed
        and launched — before the states take this step's tokens and the call returns, so that work
        and the caller's leave the critical path; the next call adopts it. On the forward thread its
        sampler runs behind its forward with output positions fixed now, so a next step whose
        sampling reads token history (penalties, min_tokens ahead, grammars) is cancelled and
        scheduled by the next call as usual; without the thread (CUDA) only its kernels are queued
        now and it samples in the next call. -> the exception that undid the next step (the caller
        raises it once this step's commit is whole), or None."""
        e = self.engine
        if not e.launches_next or e._ahead is not None:
            return None
        behind = e.executor.forward_thread is not None  # the sampler runs behind the forward, there
        if behind and reads_history(e, self.states):  # (likely the next step's requests too)
            return None
        scheduled = False
        try:
            if e.proposing is not None:
                if not e.proposing.propose_in_core(self.sched, self.states, self.emitted):
                    return None  # the general path proposes after the commit
                self.proposed = True
            sched = e.core.schedule()
            scheduled = True
            if len(sched.preempted_req_ids) and e.proposer is not None:
                e.proposer.forget(sched.preempted_req_ids.tolist())
            if len(sched.req_ids) == 0:
                return None
            states = [e._requests[i] for i in sched.req_ids.tolist()]
            on_device = not behind and e.device_sampling and samples_on_device(sched, states, e)
            if not behind and not on_device:  # (CUDA) the kernels queue now; it samples in the next call
                e._ahead = (sched, states, e._launch(sched, states), False)
                e.num_launched_next += 1
                return None
            if behind and reads_history(e, states):
                e.core.cancel_step()
                return None
            positions = None  # (all greedy: no draw reads a position)
            if e._random_ids:
                new = dict(zip(upd.req_ids.tolist(), np.diff(upd.cu_num_new).tolist()))  # tokens not yet taken
                positions = np.fromiter((len(st.output_token_ids) + new.get(st.core_id, 0) for st in states),
                                        np.int64, len(states))
            if on_device:  # (CUDA, a plain step) sampled as device work queued behind its forward
                then = partial(sample_on_device, e.step_sampler, sched=sched, states=states, positions=positions)
            else:
                then = partial(e.step_sampler, sched=sched, states=states, draft_probs=e._draft_probs,
                               positions=positions)
            e._ahead = (sched, states, e._launch(sched, states, then), True)
            e.num_launched_next += 1
            return None
        except BaseException as err:  # noqa: BLE001 - undone here, raised once the commit is whole
            if scheduled and e._ahead is None:
                e.core.cancel_step()
            return err

    def propose(self) -> None:
        """Drafts for the next step (the proposing side owns its state), and the step's timings."""
        e, t = self.engine, self.t
        self.phase = PROPOSING
        if e.proposing is not None and not self.proposed:
            e.proposing.propose(self.sched, self.states, self.emitted, self.hidden)
        t["proposed"] = time.perf_counter()
        m = e.metrics
        m.score_s += t["forward_done"] - t["start"]
        m.verify_s += t["sampled"] - t["forward_done"]
        m.propose_s += t["proposed"] - t["committed"]
        m.total_s += t["proposed"] - t["start"]
        m.num_steps += 1
        if e.proposing is not None:
            e.proposing.observe_step(int(self.sched.total_num_scheduled_tokens), t["committed"] - t["start"],
                                     t["proposed"] - t["committed"])
        self.phase = None  # whole

    # ------------------------------------------------------------------ the end
    def __exit__(self, exc_type, exc, tb) -> bool:
        e = self.engine
        if exc is None:
            if self.error is not None:  # one request's output work failed; the step is whole
                e._undelivered = self.outputs
                raise self.error
            return False
        if self.phase == SCHEDULING:
            e.core.cancel_step()  # the step is pending if only its packing failed
            e._tail, e._undelivered = self.tail, self.outputs + e._undelivered
            if e.proposing is not None:
                e.proposing.discard_launched()
            return False
        if self.phase == PROPOSING:
            e._undelivered = self.outputs + e._undelivered
            if e.proposer is not None:
                e.proposer.forget([st.core_id for st in self.states])
        else:
            if self.pending is not None:
                self.pending.settle()  # no forward may still write KV once the step is undone
            if self.ahead is not None:
                self.ahead[2].settle()  # the step launched ahead: undone with this one (cancel_step)
                self.ahead = None
            if self.phase == RUNNING:
                e.core.cancel_step()
                e.last_failed_request_ids = [st.request_id for st in self.states]
                e._release_stopped()
            # output work that did not run yet runs next call: the previous step's, or this
            # committed step's (a Ctrl-C held back through the commit lands after it)
            committed_work = self.touched if self.phase == COMMITTED else None
            if self.phase == COMMITTING and self.touched is not None:
                committed_work = self.touched
            e._tail = committed_work if committed_work is not None else self.tail
            e._undelivered = self.outputs + e._undelivered
        if e.proposing is not None:  # a launched proposal not yet settled (the core holds no pending step now)
            e.proposing.discard_launched()
        if isinstance(exc, RequestError):  # the step is not at fault: only these requests
            e.last_failed_request_ids = e._end_with_error(exc)
        return False

    def _finish_tail(self, step_pending: bool) -> None:
        """Run the deferred output work held in self.tail (once), keeping its outputs and the first
        request's error."""
        if self.tail is None:
            return
        done, error = self.engine._finish_tail(self.tail, self.final_only, step_pending=step_pending)
        self.tail = None
        self.outputs += done
        self.error = self.error or error


def reads_history(engine, states) -> bool:
    """Some request's sampling reads its token history (a grammar, penalties, min_tokens still
    ahead): its step cannot be launched before the states hold the previous step's tokens."""
    readers = engine._history_readers
    return bool(readers) and any(st.core_id in readers and (
        st.grammar is not None or st.params.penalized or st.params.min_tokens > len(st.output_token_ids))
        for st in states)

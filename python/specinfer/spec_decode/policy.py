"""Speculation policy: how many tokens each request drafts this step (0 .. k), chosen to
maximize goodput (expected emitted tokens per second of step time).

Model. Request i's draft at position j (0-based within its proposal) is accepted with
probability a_ij given that the drafts before it were; so with d_i drafts it emits in
expectation E_i(d_i) = sum_{j=0..d_i} prod_{m<j} a_im tokens (the accepted drafts plus the
recovered or bonus token). Drafting n tokens in all costs C(n) = S(B + n) + D(n) seconds:
S(T) the measured time of a step whose target forward holds T tokens (B without drafts: the
decodes and prefill chunks), D(n) the proposer's measured time when it drafts n tokens. The goodput of
a choice is sum_i E_i(d_i) / C(sum_i d_i).

Choice. Adding the (d_i + 1)-th draft to request i adds g = prod_{m<=d_i} a_im expected tokens
(its marginal gain, which only shrinks as d_i grows since every a <= 1). So for a given total n
the best allocation takes the n largest marginal gains (a greedy merge of the per-request
decreasing sequences is exact), and the policy evaluates the goodput of every n = 0 .. sum of
max drafts and keeps the best. No shape is assumed for S: on a CPU a verification of 1 + k
tokens costs about as much as a decode up to some k and then grows, on a GPU it stays flat far
longer; a request whose first draft does not pay gets none (k = 0).

Estimates. a_ij: a per-request exponentially weighted estimate per position, starting from the
engine-wide estimate for that position (itself an EWMA, starting from a prior). Exploration: a
request that gets no draft is never observed, so a low estimate would stick for good although
the text may have turned repetitive; so a request held at zero drafts for ``probe_after`` steps
gets one draft (a probe), if a draft accepted with the prior probability (``probe_accept``, the
optimism of a fresh request) would pay at this step's marginal cost: on a CPU at batch 1 a probe
costs a few percent of a step and always goes, at batch 64 it costs about what a decode token
costs and only goes where speculation could pay at all (probing every held request every few
steps cost 5 % of throughput there). A probe that fails doubles the wait (up to
``max_probe_after``); any accepted draft resets it; failed drafts of a request that was drafting
anyway do not change it. The cost of exploring a request whose
drafts keep failing is thus at most one draft every ``max_probe_after`` steps. Costs (StepCostModel): S(T) and D(n) are tables
of exponentially averaged times per token count, interpolated between the counts seen and
extended beyond them with the slope of a least-squares line through the table (TimeTable). (A single linear fit of step time
on target and drafted tokens, the first design, cannot separate the two when every step drafts
k: it then put most of the cost on drafting and stopped speculating where it paid.) Until
enough steps are measured the policy uses the configured k. The engine uses it with
``speculative={"policy": "goodput"}``; seeded requests keep the configured k (their tokens must
not depend on timing).

Whole batches. Goodput per step is the right value where a finished request's slot is refilled
(a server, or a queue of waiting requests). When the caller waits for a whole batch
(``Generator.generate``) and nothing is waiting, the run ends when its last request does: a
request that finishes early saves nothing unless it was the last, so its accepted drafts buy
nothing and its rejected ones cost target tokens (measured at batch 64 on CPU: 2362 drafts, 52
steps against 53 without speculation, 0.93x). There the policy is told each request's tokens
left (R_r, an upper bound: EOS may come first) and projects the run's length in steps as
M = max_r R_r / E_r(d_r) (E_r: the expected tokens per step of the drafts chosen; 1 with none,
and for requests it does not choose for); a request that would finish within M even at one
token per step (R_r <= M) gets no drafts (``drafts_that_shorten_the_run``). The request that
sets M keeps its drafts, so a lone request (batch 1, the tail of a batch) drafts as before.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def expected_emitted(accept: np.ndarray, d: int) -> float:
    """E(d) for acceptance probabilities accept[j] (j < d): 1 + a0 + a0 a1 + ..."""
    return float(1.0 + np.cumprod(accept[:d]).sum()) if d else 1.0


def expected_emitted_rows(accept: np.ndarray, d: np.ndarray) -> np.ndarray:
    """E_r(d_r) for every row r of accept [R, K] at once (expected_emitted per row)."""
    accept = np.asarray(accept, dtype=np.float64)
    upto = np.arange(accept.shape[1]) < np.asarray(d).reshape(-1, 1)
    return 1.0 + np.where(upto, np.cumprod(accept, axis=1), 0.0).sum(axis=1)


def linear_cost(c0: float, c_t: float, c_d: float, base_tokens: int) -> Callable[[np.ndarray], np.ndarray]:
    """C(n) = c0 + c_t (base_tokens + n) + c_d n: a step cost linear in its tokens."""
    return lambda n: c0 + c_t * (base_tokens + n) + c_d * n


def choose_num_drafts(
    accept: np.ndarray,  # float[R, K] conditional acceptance per request and position
    max_drafts: np.ndarray,  # int[R] the most drafts each request may take
    seconds: Callable[[np.ndarray], np.ndarray],  # C(n): step seconds when n tokens are drafted in all
) -> np.ndarray:  # int64[R] drafts per request
    """The goodput-maximizing number of drafts per request (see the module doc).

    The greedy merge of the per-request gain sequences g_ij = a_i0 ... a_ij (each non-increasing
    in j) is one stable sort of every allowed g_ij, largest first: ties go to the lower request,
    then the lower position, as a heap merge would take them (the heap merge is the test's
    reference, tests/test_speculation_policy.py). One numpy sort instead of a Python heap loop:
    this runs every step."""
    accept = np.asarray(accept, dtype=np.float64)
    R = accept.shape[0]
    d = np.zeros(R, dtype=np.int64)
    if R == 0:
        return d
    max_drafts = np.minimum(np.asarray(max_drafts, dtype=np.int64), accept.shape[1])
    gain = np.cumprod(accept, axis=1)  # [R, K]: the marginal gain of each request's (j+1)-th draft
    allowed = np.arange(accept.shape[1]) < max_drafts.reshape(-1, 1)
    flat = np.flatnonzero(allowed.ravel())  # row-major: request, then position
    if len(flat) == 0:
        return d
    g = gain.ravel()[flat]
    order = flat[np.argsort(-g, kind="stable")]
    gains = gain.ravel()[order]
    n = np.arange(len(gains) + 1)
    emitted = R + np.concatenate([[0.0], np.cumsum(gains)])
    cost = np.asarray(seconds(n), dtype=np.float64)
    goodput = emitted / np.maximum(cost, 1e-12)
    best = int(np.flatnonzero(goodput >= goodput.max() * (1 - 1e-12))[0])  # fewest drafts among ties
    return np.bincount(order[:best] // accept.shape[1], minlength=R).astype(np.int64)


def drafts_that_shorten_the_run(accept: np.ndarray, chosen: np.ndarray, tokens_left: np.ndarray,
                                horizon: float = 0.0) -> np.ndarray:
    """For a batch whose caller waits for its last request: keep a request's drafts only if
    without them it would finish after the run's projected end, M = max(horizon,
    max_r tokens_left_r / E_r(chosen_r)) steps (horizon: the steps of the requests not chosen
    for, at one token per step). Returns a copy of `chosen`."""
    out = np.asarray(chosen, dtype=np.int64).copy()
    if len(out) == 0:
        return out
    left = np.asarray(tokens_left, dtype=np.float64)
    rate = expected_emitted_rows(accept, out)
    end = max(float(horizon), float((left / rate).max()))
    out[left <= end] = 0
    return out


class TimeTable:
    """Seconds by a count (tokens in a step), exponentially averaged per count; read back
    interpolated between the counts seen and, beyond them, from the nearest seen count plus the
    slope of a least-squares line through the table (>= 0). With a single count c seen: time
    proportional to the count (constant if c = 0).

    The first time of a count is provisional: the second replaces it (not averaged in), and while
    at least two counts have been seen twice the provisional ones are left out of the table. A
    first step of a new shape pays one-off costs (oneDNN builds a primitive per row count, first
    allocations): averaged in at rate 0.2 such a time stayed inflated for many steps, and if it
    made a count look too dear the policy never chose that count again to correct it (measured:
    a warm-up step held a run at zero drafts where k = 4 made it 1.6x faster)."""

    def __init__(self, rate: float):
        self.rate = rate
        self._by_count: dict[int, float] = {}
        self._times_seen: dict[int, int] = {}
        self._table = None  # (keys, vals, slope), sorted by key; rebuilt after a record

    def __len__(self) -> int:
        return len(self._by_count)

    def record(self, count: int, seconds: float) -> None:
        count = int(count)
        seen = self._times_seen.get(count, 0)
        if seen < 2:  # the first time is provisional, the second replaces it
            self._by_count[count] = seconds
        else:
            old = self._by_count[count]
            self._by_count[count] = old + self.rate * (seconds - old)
        self._times_seen[count] = seen + 1
        self._table = None

    def _sorted(self):
        if self._table is None:
            table = self._by_count
            confirmed = {c: v for c, v in table.items() if self._times_seen[c] >= 2}
            if len(confirmed) >= 2:
                table = confirmed
            keys = np.fromiter(table.keys(), dtype=np.float64, count=len(table))
            vals = np.fromiter(table.values(), dtype=np.float64, count=len(table))
            order = np.argsort(keys)
            keys, vals = keys[order], vals[order]
            slope = 0.0
            if len(keys) > 1:  # least squares in closed form (np.polyfit's SVD cost more than the rest)
                dk = keys - keys.mean()
                slope = max(float((dk * (vals - vals.mean())).sum() / (dk * dk).sum()), 0.0)
            self._table = (keys, vals, slope)
        return self._table

    def at(self, counts) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.float64)
        keys, vals, slope = self._sorted()
        if len(keys) == 1:
            return np.full_like(counts, vals[0]) if keys[0] == 0 else vals[0] * counts / keys[0]
        out = np.interp(counts, keys, vals)
        lo, hi = counts < keys[0], counts > keys[-1]
        out[lo] = np.maximum(vals[0] - slope * (keys[0] - counts[lo]), 0.0)
        out[hi] = vals[-1] + slope * (counts[hi] - keys[-1])
        return out


class StepCostModel:
    """Measured step cost: S(T), the seconds of a step's target part (schedule, forward,
    verification, update) by its number of target tokens T, and D(n), the proposer's seconds by
    the number of tokens it drafts in the step (TimeTables). D is a table, not a cost per drafted
    token: a proposer may pay a fixed part every step (EAGLE runs its head over the step's
    confirmed tokens before the first draft), and divided by the drafts that part made each draft
    look dearer the fewer were drafted, pushing the policy towards drafting nothing."""

    def __init__(self, rate: float = 0.2, min_steps: int = 8):
        self.rate, self.min_steps = rate, min_steps
        self._target, self._draft = TimeTable(rate), TimeTable(rate)
        self.num_steps = 0
        self._curve = (None, -1, None)  # (base_tokens, max drafts, C(0 .. max)) built by prepare

    def record(self, target_tokens: int, target_seconds: float, draft_tokens: int = 0,
               draft_seconds: float = 0.0) -> None:
        self._target.record(target_tokens, target_seconds)
        self._draft.record(draft_tokens, draft_seconds)
        self.num_steps += 1
        self._curve = (None, -1, None)

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def prepare(self, base_tokens: int | None = None, max_drafts: int = 0) -> None:
        """Build both tables' sorted arrays now (a record invalidates them), and with base_tokens
        the curve C(0 .. max_drafts) of a step of that many target tokens: the engine calls this
        beside the forward with the step's batch, so the next choice reads them ready (~0.2 ms
        off the critical path at batch 32)."""
        if not len(self._target):
            return  # nothing measured yet
        self._target._sorted()
        if len(self._draft):
            self._draft._sorted()
        if base_tokens is not None and (base_tokens, max_drafts) != self._curve[:2]:
            n = np.arange(max_drafts + 1)
            self._curve = (base_tokens, max_drafts, self.target_seconds(base_tokens + n) + self.draft_seconds(n))

    def target_seconds(self, tokens) -> np.ndarray:
        """S(T) for each T."""
        return self._target.at(tokens)

    def draft_seconds(self, drafts) -> np.ndarray:
        """D(n) for each n (zero until a step is recorded)."""
        return self._draft.at(drafts) if len(self._draft) else np.zeros(np.shape(drafts))

    def step_seconds(self, base_tokens: int) -> Callable[[np.ndarray], np.ndarray]:
        """C(n) for a step of base_tokens target tokens plus n drafted ones (n ascending from >= 0:
        read from the prepared curve where it covers them; the same values either way, element
        by element)."""
        base, top, curve = self._curve

        def seconds(n):
            n = np.asarray(n)
            if base == base_tokens and n.size and int(n[-1]) <= top and int(n[0]) >= 0:
                return curve[n]
            return self.target_seconds(base_tokens + n) + self.draft_seconds(n)

        return seconds


class AcceptanceEstimates:
    """Conditional acceptance per draft position: engine-wide and per request (EWMA). A position
    never observed takes the estimate of the nearest observed position before it (so a request
    that accepts everything is not held at the prior for positions it has not drafted yet).
    The engine-wide estimate, which pools every request's verifications, is the running mean of
    its observations (the prior counting as one) until it has 1 / `engine_rate` of them, then
    an EWMA at that slow rate: at a fast rate it only reflected the last few verifications
    (measured: 0.02 against a true 0.11 at position 0 on chat text)."""

    def __init__(self, k: int, prior: float = 0.6, rate: float = 0.2, engine_rate: float = 0.03):
        self.k, self.rate, self.engine_rate = k, rate, engine_rate
        # Python floats and lists: a record touches <= k positions, and it runs for every verified
        # request of every step (numpy temporaries made it ~15 us a request)
        self._engine = [float(prior)] * k
        self._engine_seen = [False] * k
        self._engine_count = [0] * k  # observations per position
        self._per_request: dict[int, tuple[list, list]] = {}  # core id -> (est, seen)
        # of() per request, as last computed (read every step, changed only by record)
        self._of: dict[int, np.ndarray] = {}
        self._engine_of: np.ndarray | None = None

    @property
    def engine(self) -> np.ndarray:
        """float[k] the engine-wide estimate (a copy)."""
        return np.array(self._engine)

    @staticmethod
    def _filled(est, seen) -> np.ndarray:
        """est with each unseen position after a seen one replaced by the last seen one's value."""
        out, last = list(est), None
        for j, s in enumerate(seen):
            if s:
                last = est[j]
            elif last is not None:
                out[j] = last
        return np.array(out, dtype=np.float64)

    def of(self, core_id: int) -> np.ndarray:  # float[k], read-only (cached until the next record)
        out = self._of.get(core_id)
        if out is not None:
            return out
        own = self._per_request.get(core_id)
        if own is None:
            if self._engine_of is None:
                self._engine_of = self._filled(self._engine, self._engine_seen)
                self._engine_of.flags.writeable = False
            return self._engine_of
        out = self._of[core_id] = self._filled(*own)
        out.flags.writeable = False
        return out

    def record(self, core_id: int, num_verified: int, num_accepted: int) -> None:
        """A verification of `num_verified` drafts accepted the first `num_accepted`: positions
        < num_accepted were accepted, position num_accepted (if verified) was rejected; later
        positions were not observed."""
        n = min(num_verified, self.k)
        if n <= 0:
            return
        own = self._per_request.get(core_id)
        if own is None:
            own = self._per_request[core_id] = (self.of(core_id).tolist(), list(self._engine_seen))
        est, seen = own
        eng, count = self._engine, self._engine_count
        rate, engine_rate = self.rate, self.engine_rate
        for j in range(min(n, num_accepted + 1)):
            hit = 1.0 if j < num_accepted else 0.0
            est[j] += rate * (hit - est[j])
            seen[j] = True
            count[j] += 1
            eng[j] += max(1.0 / (count[j] + 1), engine_rate) * (hit - eng[j])
            self._engine_seen[j] = True
        self._of.pop(core_id, None)
        self._engine_of = None

    def forget(self, core_id: int) -> None:
        self._per_request.pop(core_id, None)
        self._of.pop(core_id, None)


class GoodputPolicy:
    """What the engine holds: acceptance estimates, the step-cost fit, and the choice."""

    def __init__(self, k: int, probe_after: int = 8, max_probe_after: int = 64, prior: float = 0.6):
        self.acceptance = AcceptanceEstimates(k, prior=prior)
        self.probe_accept = prior
        self.cost = StepCostModel()
        self.probe_after, self.max_probe_after = probe_after, max_probe_after
        self._wait: dict[int, int] = {}  # core id -> steps held at zero drafts before the next probe
        self._held: dict[int, int] = {}  # core id -> steps held at zero drafts so far
        self._probing: set[int] = set()  # core ids whose drafts this step are a probe

    def observe_verification(self, core_ids, num_verified, num_accepted) -> None:
        """An accepted draft resets a request's probe wait; a failed probe doubles it (a failed
        draft of a request that was drafting anyway leaves it: backing off there held requests of
        middling acceptance at zero for the rest of their run)."""
        for cid, d, a in zip(core_ids, num_verified, num_accepted):
            if d:
                cid = int(cid)
                self.acceptance.record(cid, int(d), int(a))
                if a:
                    self._wait[cid] = self.probe_after
                elif cid in self._probing:
                    self._wait[cid] = min(2 * self._wait.get(cid, self.probe_after), self.max_probe_after)
                self._probing.discard(cid)

    def observe_step(self, target_tokens: int, target_seconds: float, draft_tokens: int,
                     draft_seconds: float) -> None:
        self.cost.record(target_tokens, target_seconds, draft_tokens, draft_seconds)

    def prepare(self, base_tokens: int | None = None, max_drafts: int = 0) -> None:
        """What the next choice reads and the last step's records changed, built ahead (beside
        the forward): the step-cost tables, and the cost curve of a step of base_tokens target
        tokens (the engine passes its batch's requests: the next choice's base when none ends)."""
        if self.cost.ready:
            self.cost.prepare(base_tokens, max_drafts)

    def num_drafts(self, core_ids, max_drafts: np.ndarray, base_tokens: int,
                   tokens_left: np.ndarray | None = None, horizon: float = 0.0) -> np.ndarray:
        """Drafts per request (at most max_drafts); max_drafts itself until costs are known.
        With `tokens_left` (a whole batch, nothing waiting; see the module doc) only drafts that
        can shorten the run are kept; `horizon`: the steps left of the requests not chosen for."""
        if len(core_ids) == 0:
            return max_drafts
        self._probing.difference_update(int(c) for c in core_ids)  # a probe left unverified (no proposal)
        if not self.cost.ready:
            if tokens_left is None:
                return max_drafts
            accept = np.stack([self.acceptance.of(int(c)) for c in core_ids])
            return drafts_that_shorten_the_run(accept, max_drafts, tokens_left, horizon)
        accept = np.stack([self.acceptance.of(int(c)) for c in core_ids])
        seconds = self.cost.step_seconds(base_tokens)
        chosen = choose_num_drafts(accept, max_drafts, seconds)
        due = []
        for i, c in enumerate(core_ids):
            c = int(c)
            if chosen[i] or not max_drafts[i]:
                self._held.pop(c, None)
                continue
            self._held[c] = self._held.get(c, 0) + 1
            if self._held[c] >= self._wait.get(c, self.probe_after):
                due.append(i)
        if due:
            self._probe(due, core_ids, accept, chosen, seconds)
        if tokens_left is not None:
            chosen = drafts_that_shorten_the_run(accept, chosen, tokens_left, horizon)
        return chosen

    def _probe(self, due, core_ids, accept, chosen, seconds) -> None:
        """One draft for each request due a probe while one more draft, accepted with the prior
        probability, still raises the step's goodput (a held request stays due otherwise)."""
        emitted = float(expected_emitted_rows(accept, chosen).sum())
        n = int(chosen.sum())
        costs = np.asarray(seconds(np.arange(n, n + len(due) + 1)), dtype=np.float64)
        for j, i in enumerate(due):
            if (emitted + self.probe_accept) / max(costs[j + 1], 1e-12) < emitted / max(costs[j], 1e-12):
                break
            chosen[i] = 1
            emitted += self.probe_accept
            self._held[int(core_ids[i])] = 0
            self._probing.add(int(core_ids[i]))

    def forget(self, core_ids) -> None:
        for c in core_ids:
            self.acceptance.forget(int(c))
            self._wait.pop(int(c), None)
            self._held.pop(int(c), None)
            self._probing.discard(int(c))

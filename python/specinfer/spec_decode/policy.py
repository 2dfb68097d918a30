"""Speculation policy: how many tokens each request drafts this step (0 .. k), chosen to
maximize goodput (expected emitted tokens per second of step time).

Model. Request i's draft at position j (0-based within its proposal) is accepted with
probability a_ij given that the drafts before it were; so with d_i drafts it emits in
expectation E_i(d_i) = sum_{j=0..d_i} prod_{m<j} a_im tokens (the accepted drafts plus the
recovered or bonus token). A step costs C(T, D) = c0 + c_t * T + c_d * D seconds for T target
tokens and D drafted tokens. The goodput of a choice is sum_i E_i(d_i) / C.

Choice. Adding the (d_i + 1)-th draft to request i adds g = prod_{m<=d_i} a_im expected tokens
(its marginal gain, which only shrinks as d_i grows) and c_t + c_d seconds. For a fixed number of
drafts, the best allocation takes the largest marginal gains (the gains of each request are
decreasing, so a greedy merge is exact); and goodput as a function of that number is unimodal
(the total gain is concave), so adding drafts in order of gain while a draft's gain exceeds the
current goodput times its cost, then stopping, is optimal. A request whose first draft does not
pay gets none (k = 0).

Estimates. a_ij: a per-request exponentially weighted estimate per position, starting from the
engine-wide estimate for that position (itself an EWMA, starting from a prior). Exploration: a
request that gets no draft is never observed, so a low estimate would stick for good although
the text may have turned repetitive; so a request held at zero drafts for ``probe_after`` steps
gets one draft (a probe). A probe that fails doubles the wait (up to ``max_probe_after``); one
that is accepted resets it. The cost of exploring a request whose drafts keep failing is thus at
most one draft every ``max_probe_after`` steps. Costs: an online
least-squares fit of the measured step times with exponential forgetting. Until enough steps
are measured the policy uses the configured k. The engine uses it with
``speculative={"policy": "goodput"}``; seeded requests keep the configured k (their tokens must
not depend on timing).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


def expected_emitted(accept: np.ndarray, d: int) -> float:
    """E(d) for acceptance probabilities accept[j] (j < d): 1 + a0 + a0 a1 + ..."""
    return float(1.0 + np.cumprod(accept[:d]).sum()) if d else 1.0


def choose_num_drafts(
    accept: np.ndarray,  # float[R, K] conditional acceptance per request and position
    max_drafts: np.ndarray,  # int[R] the most drafts each request may take
    base_tokens: int,  # target tokens of the step without any draft (prefill chunks, decodes)
    cost: tuple[float, float, float],  # (c0, c_t, c_d) seconds
) -> np.ndarray:  # int64[R] drafts per request
    """The goodput-maximizing number of drafts per request (see the module doc)."""
    c0, c_t, c_d = cost
    R = accept.shape[0]
    d = np.zeros(R, dtype=np.int64)
    gain_so_far = np.ones(R)  # prod of acceptances of the drafts taken so far
    emitted = float(R)  # every sampled request emits at least one token
    seconds = c0 + c_t * base_tokens
    per_draft = c_t + c_d
    heap = [(-float(accept[i, 0]), i) for i in range(R) if max_drafts[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain * seconds <= emitted * per_draft:  # gain / per_draft <= emitted / seconds
            break
        emitted += gain
        seconds += per_draft
        gain_so_far[i] = gain
        d[i] += 1
        if d[i] < max_drafts[i]:
            heapq.heappush(heap, (-gain * float(accept[i, d[i]]), i))
    return d


@dataclass
class StepCostModel:
    """Online least squares of step seconds on (1, target tokens, drafted tokens), forgetting
    old steps at rate `decay` per step."""

    decay: float = 0.98
    min_steps: int = 8
    _xtx: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    _xty: np.ndarray = field(default_factory=lambda: np.zeros(3))
    num_steps: int = 0

    def record(self, target_tokens: int, draft_tokens: int, seconds: float) -> None:
        x = np.array([1.0, float(target_tokens), float(draft_tokens)])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float] | None:
        """(c0, c_t, c_d), or None until enough steps were seen."""
        if self.num_steps < self.min_steps:
            return None
        ridge = 1e-9 * np.eye(3) * max(1.0, float(np.trace(self._xtx)))
        c = np.linalg.solve(self._xtx + ridge, self._xty)
        return float(max(c[0], 0.0)), float(max(c[1], 1e-9)), float(max(c[2], 0.0))


class AcceptanceEstimates:
    """Conditional acceptance per draft position: engine-wide and per request (EWMA). A position
    never observed takes the estimate of the nearest observed position before it (so a request
    that accepts everything is not held at the prior for positions it has not drafted yet)."""

    def __init__(self, k: int, prior: float = 0.6, rate: float = 0.2):
        self.k, self.rate = k, rate
        self.engine = np.full(k, prior)
        self._engine_seen = np.zeros(k, dtype=bool)
        self._per_request: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # core id -> (est, seen)

    @staticmethod
    def _filled(est: np.ndarray, seen: np.ndarray) -> np.ndarray:
        out = est.copy()
        for j in range(1, len(out)):
            if not seen[j] and seen[:j].any():
                out[j] = out[j - 1]
        return out

    def of(self, core_id: int) -> np.ndarray:  # float[k]
        own = self._per_request.get(core_id)
        if own is None:
            return self._filled(self.engine, self._engine_seen)
        return self._filled(*own)

    def record(self, core_id: int, num_verified: int, num_accepted: int) -> None:
        """A verification of `num_verified` drafts accepted the first `num_accepted`: positions
        < num_accepted were accepted, position num_accepted (if verified) was rejected; later
        positions were not observed."""
        n = min(num_verified, self.k)
        if n <= 0:
            return
        if core_id not in self._per_request:
            self._per_request[core_id] = (self.of(core_id).copy(), self._engine_seen.copy())
        seen = slice(0, min(n, num_accepted + 1))
        hit = (np.arange(n) < num_accepted).astype(np.float64)[seen]
        for est, mask in (self._per_request[core_id], (self.engine, self._engine_seen)):
            est[seen] += self.rate * (hit - est[seen])
            mask[seen] = True

    def forget(self, core_id: int) -> None:
        self._per_request.pop(core_id, None)


class GoodputPolicy:
    """What the engine holds: acceptance estimates, the step-cost fit, and the choice."""

    def __init__(self, k: int, probe_after: int = 8, max_probe_after: int = 64):
        self.acceptance = AcceptanceEstimates(k)
        self.cost = StepCostModel()
        self.probe_after, self.max_probe_after = probe_after, max_probe_after
        self._wait: dict[int, int] = {}  # core id -> steps held at zero drafts before the next probe
        self._held: dict[int, int] = {}  # core id -> steps held at zero drafts so far

    def observe_verification(self, core_ids, num_verified, num_accepted) -> None:
        for cid, d, a in zip(core_ids, num_verified, num_accepted):
            if d:
                cid = int(cid)
                self.acceptance.record(cid, int(d), int(a))
                wait = self._wait.get(cid, self.probe_after)
                self._wait[cid] = self.probe_after if a else min(2 * wait, self.max_probe_after)

    def observe_step(self, target_tokens: int, draft_tokens: int, seconds: float) -> None:
        self.cost.record(target_tokens, draft_tokens, seconds)

    def num_drafts(self, core_ids, max_drafts: np.ndarray, base_tokens: int) -> np.ndarray:
        """Drafts per request (at most max_drafts); max_drafts itself until costs are known."""
        cost = self.cost.coefficients()
        if cost is None or len(core_ids) == 0:
            return max_drafts
        accept = np.stack([self.acceptance.of(int(c)) for c in core_ids])
        chosen = choose_num_drafts(accept, max_drafts, base_tokens, cost)
        for i, c in enumerate(core_ids):
            c = int(c)
            if chosen[i] or not max_drafts[i]:
                self._held.pop(c, None)
                continue
            held = self._held.get(c, 0) + 1
            if held >= self._wait.get(c, self.probe_after):
                chosen[i], held = 1, 0  # a probe: one draft
            self._held[c] = held
        return chosen

    def forget(self, core_ids) -> None:
        for c in core_ids:
            self.acceptance.forget(int(c))
            self._wait.pop(int(c), None)
            self._held.pop(int(c), None)

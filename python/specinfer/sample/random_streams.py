"""Counter-based random streams: every random draw is a pure function of
``(seed, output position, purpose)``.

Why counters: a request's tokens must not depend on what else is in the batch, on how the
token budget split its verification, on a preemption and recompute, on a failed step that was
cancelled and run again, or on how many draws other code made before. A shared generator's
draw count depends on all of those; a counter does not. So each request has a 64-bit seed
(its ``SamplingParams.seed``, or one drawn from the engine's seed when it has none) and every
draw is addressed by the output position it decides and what it is for:

- ``SAMPLE``: the token emitted at an output position (a plain sample, or the recovered or
  bonus token of a verification);
- ``ACCEPT``: the acceptance test of the draft at an output position;
- ``DRAFT``: a proposer's random choice of its draft at an output position;
- tree verification (:mod:`.tree_verify`): the j-th sibling tried under a node whose children
  decide output position t is tested against ``U(seed, t, sibling_accept_purpose(j))``;
  sibling 0 uses ``ACCEPT`` (so a chain verified as a tree meets the chain's draws) and
  sibling j >= 1 the purpose ``SIBLING_ACCEPT_BASE + j``.

Soundness under speculation: a verification step decides positions ``P .. P + m`` (m
accepted drafts, then the recovered or bonus token at ``P + m``) and its outcome depends only
on the draws at those positions; draws past ``P + m`` did not influence it, and positions
``<= P + m`` are never decided again. Each decided position therefore consumes fresh,
independent uniforms, which is all the losslessness proofs need.

One draw is one uniform in (0, 1) (float64, 53 bits, from the splitmix64 finalizer over 64-bit
arithmetic), computed on the device of the tensors it feeds (torch int64 ops with wrap-around
products and masked logical shifts; :func:`counter_uniform` is the numpy reference the tests
hold it to, bit for bit). A token is drawn from weights by inverse CDF with one uniform
(:func:`sample_from_weights`), so sampling costs one draw per row, not one per vocabulary
entry.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE, ACCEPT, DRAFT = 1, 2, 3
SIBLING_ACCEPT_BASE = 1 << 16  # + j: the acceptance test of the j-th sibling (j >= 1) of a tree node


def sibling_accept_purpose(j: int) -> int:
    """Purpose of the acceptance draw of the j-th child tried under a tree node (j >= 0)."""
    if j < 0:
        raise ValueError(f"sibling index must be >= 0, got {j}")
    return ACCEPT if j == 0 else SIBLING_ACCEPT_BASE + j

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MAX_SEED = 2**64


def _mix(x: np.ndarray) -> np.ndarray:  # uint64[...] -> uint64[...], splitmix64 finalizer
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def counter_uniform(
    seeds: np.ndarray,  # uint64[R]
    positions: np.ndarray,  # int64[R, W] (or [R]) output positions, >= 0
    purpose: int,
) -> np.ndarray:  # float64 like positions, in (0, 1)
    positions = np.asarray(positions, dtype=np.int64)
    seeds = np.asarray(seeds, dtype=np.uint64).reshape((-1,) + (1,) * (positions.ndim - 1))
    with np.errstate(over="ignore"):
        key = _mix(seeds + _GOLDEN * np.uint64(purpose))
        h = _mix(key ^ (positions.astype(np.uint64) * _GOLDEN + np.uint64(purpose)))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 2.0**53)


def _as_signed(c) -> int:  # the int64 with the bits of the uint64 c (taken mod 2**64)
    c = int(c) % 2**64
    return c - 2**64 if c >= 2**63 else c


_GOLDEN_S, _M1_S, _M2_S = _as_signed(_GOLDEN), _as_signed(_M1), _as_signed(_M2)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:  # logical right shift of int64 bits
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix_t(x: torch.Tensor) -> torch.Tensor:  # int64[...] holding uint64 bits; splitmix64
    x = (x ^ _srl(x, 30)) * _M1_S
    x = (x ^ _srl(x, 27)) * _M2_S
    return x ^ _srl(x, 31)


def counter_uniform_torch(
    seeds: torch.Tensor,  # int64[R] holding the uint64 seeds' bits
    positions: torch.Tensor,  # int64[R, W] output positions
    purpose: int,
) -> torch.Tensor:  # float64[R, W] in (0, 1), on the tensors' device; equals counter_uniform
    key = _mix_t(seeds + _as_signed(int(_GOLDEN) * purpose))
    h = _mix_t(key.unsqueeze(1) ^ (positions * _GOLDEN_S + purpose))
    return (_srl(h, 11).to(torch.float64) + 0.5) * (1.0 / 2.0**53)


def check_seed(seed) -> int:
    """A seed must be an int in [0, 2**64); raises ValueError naming the field."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"SamplingParams.seed must be an int (got {type(seed).__name__})")
    if not 0 <= int(seed) < _MAX_SEED:
        raise ValueError(f"SamplingParams.seed = {seed} is outside [0, 2**64)")
    return int(seed)


@dataclass(frozen=True)
class RandomStreams:
    """The random streams of R rows: row i draws at output positions ``positions[i] + j``."""

    seeds: np.ndarray  # uint64[R]
    positions: np.ndarray  # int64[R] output position of the first token the row decides

    @classmethod
    def build(cls, seeds, positions) -> "RandomStreams":
        if isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64:
            seeds = seeds.reshape(-1)  # in range by construction
        else:  # python ints (numpy would turn ints >= 2**63 into floats): check each
            seeds = np.asarray([check_seed(s) for s in np.asarray(seeds, dtype=object).reshape(-1)],
                               dtype=np.uint64)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if seeds.shape != positions.shape:
            raise ValueError(f"streams: {len(seeds)} seeds for {len(positions)} positions")
        if (positions < 0).any():
            raise ValueError("streams: output positions must be >= 0")
        return cls(seeds, positions)

    def __len__(self) -> int:
        return len(self.seeds)

    def take(self, rows) -> "RandomStreams":
        rows = np.asarray(rows, dtype=np.int64)
        return RandomStreams(self.seeds[rows], self.positions[rows])

    def expand(self, counts) -> "RandomStreams":
        """Row i becomes ``counts[i]`` rows at positions ``positions[i] + 0 .. counts[i] - 1``
        (the rows of a verification: one per draft position, then the bonus row)."""
        counts = np.asarray(counts, dtype=np.int64)
        seeds = np.repeat(self.seeds, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return RandomStreams(seeds, np.repeat(self.positions, counts) + offsets)

    def uniform(
        self,
        purpose: int,
        width: int = 1,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:  # float64[R, width]: U(seed_i, positions_i + j, purpose)
        # (asynchronous copies: a blocking one would wait for every kernel queued on the stream)
        seeds = torch.from_numpy(self.seeds.view(np.int64)).to(device, non_blocking=True)
        pos = (torch.from_numpy(self.positions).to(device, non_blocking=True).unsqueeze(1)
               + torch.arange(width, device=seeds.device))
        return counter_uniform_torch(seeds, pos, purpose)


def sample_from_weights(
    weights: torch.Tensor,  # float[R, V] >= 0, each row with positive mass; need not be normalized
    uniform: torch.Tensor,  # float64[R] in (0, 1)
) -> torch.Tensor:  # int64[R]
    """Inverse-CDF sampling: the first v with cumsum(w)[v] > u * sum(w).

    Exact in law up to float64 rounding of the cumulative sum; a weight of 0 is never chosen
    (its cumulative sum equals its predecessor's, which is already > or <= the target).
    """
    cdf = weights.to(torch.float64).cumsum(dim=-1)  # [R, V]
    target = uniform.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return idx.clamp_(max=weights.shape[1] - 1)

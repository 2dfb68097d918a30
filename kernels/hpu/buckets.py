"""Shape buckets for static-shape devices (Gaudi), and bucket-aware speculation length.

A graph compiled for one shape is reused only for that shape, so every forward is padded up to
a bucket: (batch, query length, blocks). Warmup compiles each bucket once; a shape outside the
buckets would trigger a recompile at serving time, which the planner counts as a cold shape.

Speculation length k changes the shapes: with the `mqa` scorer a verification run is a 1 + k
token query; with `batch_expansion` each request becomes k + 1 single-token decodes. So the k
values are warmed up explicitly (`spec_lengths`), and `speculation_length` answers with the
largest warmed-up k <= the wanted one that keeps the batch inside the warmed buckets — never a k
that was not warmed up.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def bucket_range(bmin: int, step: int, bmax: int) -> tuple[int, ...]:
    """Powers of two from bmin up to step, then multiples of step up to bmax (vllm-hpu's ramp)."""
    assert 1 <= bmin <= bmax and step >= 1, f"bad bucket range ({bmin}, {step}, {bmax})"
    out, v = [], bmin
    while v < step and v <= bmax:
        out.append(v)
        v *= 2
    v = max(step, -(-bmin // step) * step)
    while v <= bmax:
        out.append(v)
        v += step
    out.append(bmax)
    return tuple(sorted(set(out)))


def geometric_range(bmin: int, bmax: int, per_octave: int = 1) -> tuple[int, ...]:
    """bmin * 2**(i / per_octave) (rounded) below bmax, and bmax itself: per_octave buckets per
    doubling, so padding wastes less than 2**(1 / per_octave) - 1 of the axis (1: < 100 %,
    2: < 41 %)."""
    assert 1 <= bmin <= bmax and per_octave >= 1, f"bad bucket range ({bmin}, {bmax}, {per_octave})"
    out, i = set(), 0
    while (v := int(round(bmin * 2 ** (i / per_octave)))) < bmax:
        out.add(v)
        i += 1
    out.add(bmax)
    return tuple(sorted(out))


@dataclass(frozen=True)
class BucketConfig:
    token_buckets: tuple[int, ...] = bucket_range(8, 256, 2048)  # tokens of one forward (the packer pads T)
    batch_buckets: tuple[int, ...] = bucket_range(1, 32, 256)  # decode sequences per forward
    prefill_query_buckets: tuple[int, ...] = bucket_range(16, 128, 1024)  # prefill chunk query lengths
    block_buckets: tuple[int, ...] = bucket_range(8, 128, 4096)  # total KV blocks of a flat decode batch
    context_block_buckets: tuple[int, ...] = bucket_range(1, 32, 512)  # KV blocks per sequence (dense path)
    spec_lengths: tuple[int, ...] = (0, 1, 2, 3, 4)  # speculation lengths k that are warmed up

    def __post_init__(self):
        for name in ("token_buckets", "batch_buckets", "prefill_query_buckets", "block_buckets", "context_block_buckets",
                     "spec_lengths"):
            v = getattr(self, name)
            if not v or list(v) != sorted(set(v)) or min(v) < (0 if name == "spec_lengths" else 1):
                raise ValueError(f"{name}={v!r} must be a non-empty strictly increasing tuple of "
                                 f"{'non-negative' if name == 'spec_lengths' else 'positive'} ints")
        if 0 not in self.spec_lengths:
            raise ValueError(f"spec_lengths={self.spec_lengths!r} must contain 0 (plain decode)")

    @property
    def query_buckets(self) -> tuple[int, ...]:
        """Query lengths of the multi-token path: verification runs 1 + k, then prefill chunks."""
        return tuple(sorted({1 + k for k in self.spec_lengths} | set(self.prefill_query_buckets)))


@dataclass
class BucketPlanner:
    config: BucketConfig = field(default_factory=BucketConfig)
    cold_shapes: set = field(default_factory=set)  # (axis, padded size) pairs outside the warmed buckets

    def pad(self, value: int, axis: str) -> int:
        """The smallest bucket of `axis` ("tokens" | "batch" | "query" | "blocks" | "context_blocks") >= value.

        Past the largest bucket the value is rounded up to a multiple of it and recorded in
        cold_shapes (it works, but compiles a new graph on a static-shape device).
        """
        buckets = self._buckets(axis)
        i = bisect.bisect_left(buckets, value)
        if i < len(buckets):
            return buckets[i]
        top = buckets[-1]
        padded = -(-value // top) * top
        self.cold_shapes.add((axis, padded))
        return padded

    def _buckets(self, axis: str) -> tuple[int, ...]:
        c = self.config
        table = {"tokens": c.token_buckets, "batch": c.batch_buckets, "query": c.query_buckets, "blocks": c.block_buckets,
                 "context_blocks": c.context_block_buckets}
        try:
            return table[axis]
        except KeyError:
            raise ValueError(f"axis={axis!r} is not a bucket axis; use one of {sorted(table)}") from None

    def warmed_speculation_lengths(self) -> tuple[int, ...]:
        return self.config.spec_lengths

    def speculation_length(self, wanted_k: int, num_seqs: int, scorer: str = "mqa") -> int:
        """The largest warmed-up k <= wanted_k whose verification batch fits the warmed buckets.

        mqa: each of num_seqs requests is one 1 + k query (query bucket 1 + k is warmed for every
        warmed k; the batch must fit the largest batch bucket). batch_expansion: the batch is
        num_seqs * (k + 1) single-token decodes, which must fit the largest batch bucket.
        Returns 0 (plain decode) when no positive k fits.
        """
        if wanted_k < 0 or num_seqs < 0:
            raise ValueError(f"wanted_k={wanted_k} and num_seqs={num_seqs} must be >= 0")
        if scorer not in ("mqa", "batch_expansion"):
            raise ValueError(f"scorer={scorer!r}; use 'mqa' or 'batch_expansion'")
        max_batch = self.config.batch_buckets[-1]
        for k in sorted(self.config.spec_lengths, reverse=True):
            if k > wanted_k:
                continue
            rows = num_seqs * (k + 1) if scorer == "batch_expansion" else num_seqs
            if rows <= max_batch:
                return k
        return 0

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every (batch, blocks) bucket pair the flat decode path is warmed up for."""
        return [(b, n) for b in self.config.batch_buckets for n in self.config.block_buckets]

    def multi_token_shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, query, context_blocks) bucket triple the dense multi-token path is warmed up for."""
        c = self.config
        return [(b, q, n) for b in c.batch_buckets for q in c.query_buckets for n in c.context_block_buckets]

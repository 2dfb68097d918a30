"""Per-row sampling parameters for one batch of logits rows.

A *row* is one row of the logits tensor that is sampled or verified. In a plain decode a
request owns one row; in a verification it owns ``1 + k`` rows (one per draft position plus
the bonus row), all carrying the request's parameters (see :meth:`SamplingMetadata.expand`).

Conventions (the same as vLLM / HF):
- ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5; 0 is the canonical value) means greedy:
  the row takes the argmax of the raw logits and consumes no randomness.
- ``top_k`` 0 or -1 means off; ``top_p`` 1.0 means off; ``min_p`` 0.0 means off.
- ``streams`` holds each row's random stream (its request's seed and the output position the
  row decides; see :mod:`.random_streams`); ``None`` when no row samples randomly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .random_streams import RandomStreams

GREEDY_TEMPERATURE = 1e-5


def _as_tensor(name: str, values, dtype: torch.dtype, num_rows: int | None,
               device: torch.device | str | None) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=dtype, device=device)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one value per row), got shape {tuple(t.shape)}")
    if num_rows is not None and t.shape[0] != num_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, temperature has {num_rows}")
    return t


class RowParameterError(ValueError):
    """A per-row sampling parameter out of its range: `row` says which (the caller maps it to a
    request)."""

    def __init__(self, name: str, row: int, message: str):
        super().__init__(message)
        self.field, self.row = name, row


def _check(name: str, ok: torch.Tensor, t: torch.Tensor, rule: str) -> None:
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        raise RowParameterError(name, i, f"{name}[{i}] = {t[i].item()} must be {rule}")


@dataclass(frozen=True)
class SamplingMetadata:
    """Sampling parameters of L logits rows; build with :meth:`build`, which validates."""

    temperature: torch.Tensor  # float32[L]; < GREEDY_TEMPERATURE = greedy
    top_k: torch.Tensor  # int64[L]; 0 or -1 = off
    top_p: torch.Tensor  # float32[L]; in (0, 1], 1 = off
    min_p: torch.Tensor  # float32[L]; in [0, 1], 0 = off
    streams: RandomStreams | None  # L rows; None = no randomness (only processing, or greedy)
    all_greedy: bool  # every row greedy: no processing, no randomness
    all_random: bool  # no row greedy
    no_top_k: bool  # no random row uses top-k
    no_top_p: bool  # no random row uses top-p
    no_min_p: bool  # no random row uses min-p
    # the four per-row tensors on the host, where they were built there for another device: take()
    # and expand() then select and validate on the host (a check on the device would wait for the
    # stream: every kernel queued before it)
    host: tuple | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> torch.Tensor:  # bool[L]
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def build(
        cls,
        temperature: Sequence[float] | torch.Tensor,
        top_k: Sequence[int] | torch.Tensor | None = None,
        top_p: Sequence[float] | torch.Tensor | None = None,
        min_p: Sequence[float] | torch.Tensor | None = None,
        streams: RandomStreams | None = None,
        device: torch.device | str | None = None,
    ) -> "SamplingMetadata":
        """Validate per-row parameters (errors name the field and row) and set the flags. Host
        values for another device are validated on the host and copied asynchronously."""
        values = (temperature, top_k, top_p, min_p)
        if device is not None and torch.device(device).type != "cpu" and not any(
                isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values):
            return cls.built_on_host(*values, streams, device=device)
        temp = _as_tensor("temperature", temperature, torch.float32, None, device)
        n = temp.shape[0]
        k = _as_tensor("top_k", [0] * n if top_k is None else top_k, torch.int64, n, device)
        p = _as_tensor("top_p", [1.0] * n if top_p is None else top_p, torch.float32, n, device)
        m = _as_tensor("min_p", [0.0] * n if min_p is None else min_p, torch.float32, n, device)
        if streams is not None and len(streams) != n:
            raise ValueError(f"streams has {len(streams)} rows, temperature has {n}")
        _check("temperature", temp >= 0, temp, ">= 0 (0 = greedy)")  # NaN fails too
        _check("top_k", k >= -1, k, ">= -1 (0 or -1 = off)")
        _check("top_p", (p > 0) & (p <= 1), p, "in (0, 1]")
        _check("min_p", (m >= 0) & (m <= 1), m, "in [0, 1]")
        random = temp >= GREEDY_TEMPERATURE
        return cls(
            temperature=temp, top_k=k, top_p=p, min_p=m, streams=streams,
            all_greedy=not bool(random.any()),
            all_random=bool(random.all()),
            no_top_k=not bool((random & (k > 0)).any()),
            no_top_p=not bool((random & (p < 1)).any()),
            no_min_p=not bool((random & (m > 0)).any()),
        )

    @classmethod
    def built_on_host(cls, temperature, top_k=None, top_p=None, min_p=None, streams=None, *,
                      device) -> "SamplingMetadata":
        """build() on the host (validation and flags there), the tensors then copied to `device`
        asynchronously; the host's copies are kept (`host`) for take() and expand()."""
        cpu = cls.build(temperature, top_k, top_p, min_p, streams)
        host = (cpu.temperature, cpu.top_k, cpu.top_p, cpu.min_p)
        t = tuple(x.to(device, non_blocking=True) for x in host)
        return dataclasses.replace(cpu, temperature=t[0], top_k=t[1], top_p=t[2], min_p=t[3], host=host)

    def expand(self, num_rows_per_request: Sequence[int]) -> "SamplingMetadata":
        """Repeat row i ``num_rows_per_request[i]`` times (e.g. ``1 + k`` verification rows);
        the j-th copy decides output position ``positions[i] + j``."""
        counts = list(num_rows_per_request)
        if len(counts) != self.num_rows:
            raise ValueError(
                f"num_rows_per_request has {len(counts)} entries, metadata has {self.num_rows} rows")
        streams = None if self.streams is None else self.streams.expand(counts)
        if self.host is not None:
            rep = torch.as_tensor(counts, dtype=torch.int64)
            return SamplingMetadata.built_on_host(*(x.repeat_interleave(rep) for x in self.host), streams,
                                                  device=self.temperature.device)
        rep = torch.as_tensor(counts, dtype=torch.int64, device=self.temperature.device)
        return SamplingMetadata.build(
            self.temperature.repeat_interleave(rep), self.top_k.repeat_interleave(rep),
            self.top_p.repeat_interleave(rep), self.min_p.repeat_interleave(rep), streams)

    def take(self, rows: Sequence[int]) -> "SamplingMetadata":
        """The metadata of a subset of rows, in the given order."""
        streams = None if self.streams is None else self.streams.take(list(rows))
        if self.host is not None:
            idx = torch.as_tensor(list(rows), dtype=torch.int64)
            return SamplingMetadata.built_on_host(*(x[idx] for x in self.host), streams,
                                                  device=self.temperature.device)
        idx = torch.as_tensor(list(rows), dtype=torch.int64, device=self.temperature.device)
        return SamplingMetadata.build(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                                      self.min_p[idx], streams)

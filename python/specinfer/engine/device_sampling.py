"""A plain step's sampling as device work queued behind its forward, where launches are
asynchronous by themselves (CUDA; any engine without a forward thread): the emitted tokens stay a
device tensor — the next step scheduled ahead gathers its input ids from it on the device
(fill_ahead_inputs) — and one non-blocking copy into pinned host memory, with an event recorded
behind it, is all the host ever waits for (`SampledOnDevice.emitted()`).

Only plain steps whose sampling needs nothing of the host between the forward and the tokens
take this path (`samples_on_device`): no drafts to verify, no grammar masks, no penalties or
min_tokens still ahead (they read the token history), no logprobs. Greedy rows take the argmax;
sampled rows the step's sampler with the requests' counter-based streams at their output
positions (given where the states may not hold the previous step's tokens yet)."""
from __future__ import annotations

import numpy as np
import torch

from specinfer.sample.argmax import argmax_last
from specinfer.sample.request_rows import sampling_metadata


def samples_on_device(sched, states, engine=None) -> bool:
    """The step is plain and its sampling reads nothing but its logits and the requests'
    parameters (see the module's docstring). `engine`: its id sets of the requests that read their
    history or want logprobs, which skip the per-request pass when both are empty."""
    if np.asarray(sched.num_draft_tokens).any():
        return False
    if engine is not None and not engine._history_readers and not engine._logprob_ids:
        return True
    for st in states:
        p = st.params
        if (st.grammar is not None or p.logprobs is not None or p.penalized
                or p.min_tokens > len(st.output_token_ids)):
            return False
    return True


class SampledOnDevice:
    """A plain step's emitted tokens on the device, their copy back in flight."""

    __slots__ = ("tokens", "_host", "_event", "_sampling", "_rows", "_num_draft")

    def __init__(self, tokens: torch.Tensor, sampling: np.ndarray, rows: np.ndarray, num_draft: np.ndarray):
        self.tokens = tokens  # int64[len(sampling)] on the device: one per sampled request
        self._sampling, self._rows, self._num_draft = sampling, rows, num_draft
        self._event = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens  # (CPU: the tensor itself; another device: copied at emitted())

    def emitted(self):
        """The step's Emitted (host arrays): waits for the copy back only."""
        from specinfer.engine.step_sampler import Emitted

        if self._event is not None:
            self._event.synchronize()
        flat = self._host.numpy() if self._host.device.type == "cpu" else self._host.cpu().numpy()
        R = len(self._rows)
        cu = np.zeros(R + 1, dtype=np.int32)
        cu[1:] = np.cumsum(np.bincount(self._sampling, minlength=R)).astype(np.int32)
        return Emitted(flat.astype(np.int64, copy=False), cu, self._num_draft, np.zeros(R, np.int32),
                       self._rows, [None] * R)


def sample_on_device(step_sampler, logits: torch.Tensor, sched, states, draft_probs=None, masks=None,
                     positions=None):
    """Queue a plain step's sampling (samples_on_device holds) -> SampledOnDevice; a step that
    samples nothing -> its Emitted at once. `positions`: each scheduled request's next output
    position (None: len(output_token_ids))."""
    n_rows = np.diff(sched.cu_num_logits)
    sampling = np.flatnonzero(n_rows > 0)
    num_draft = np.asarray(sched.num_draft_tokens, dtype=np.int32)
    rows = n_rows.astype(np.int32)
    if len(sampling) == 0:
        from specinfer.engine.step_sampler import Emitted

        R = len(n_rows)
        return Emitted(np.zeros(0, np.int64), np.zeros(R + 1, np.int32), num_draft, np.zeros(R, np.int32), rows,
                       [None] * R)
    s_states = [states[i] for i in sampling]
    if all(st.params.temperature == 0.0 for st in s_states):
        tokens = argmax_last(logits)
    else:
        pos = None if positions is None else [int(positions[i]) for i in sampling]
        tokens = step_sampler.sampler(logits, sampling_metadata(s_states, device=logits.device,
                                                                positions=pos)).token_ids
    return SampledOnDevice(tokens.to(torch.int64), sampling, rows, num_draft)

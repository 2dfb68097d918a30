"""Tensors in messages: the driver sends them as numpy arrays (`to_wire`: pickling a numpy array
costs a few microseconds, a torch tensor tens to hundreds), each rank turns them back into tensors
on its own device (`to_device`; a CUDA tensor pickled on rank 0 would land on cuda:0 everywhere)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """A CPU tensor in transit, as a numpy array (dtypes numpy has; others travel as tensors)."""

    array: np.ndarray


def to_wire(obj):
    """obj with every tensor in it as a WireTensor (CPU); see _map for the containers walked."""
    def conv(t: torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            return t
        return WireTensor(t.numpy())

    return _map(obj, conv)


def to_device(obj, device: torch.device):
    """obj with every tensor and WireTensor in it as a tensor on `device` (no copy where it is
    already there; a WireTensor on CPU becomes a zero-copy view)."""
    device = torch.device(device)

    def conv(x):
        t = torch.from_numpy(x.array) if isinstance(x, WireTensor) else x
        return t if t.device == device else t.to(device)

    return _map(obj, conv)


def _map(obj, conv):
    """Apply conv to every tensor / WireTensor in obj (dataclass fields, tuples, lists, dicts);
    containers with nothing changed are returned as they are."""
    if isinstance(obj, (torch.Tensor, WireTensor)):
        return conv(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            old = getattr(obj, f.name)
            new = _map(old, conv)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, (tuple, list)):
        moved = [_map(x, conv) for x in obj]
        return obj if all(a is b for a, b in zip(moved, obj)) else type(obj)(moved)
    if isinstance(obj, dict):
        moved = {k: _map(v, conv) for k, v in obj.items()}
        return obj if all(moved[k] is v for k, v in obj.items()) else moved
    return obj

"""Moving a message's tensors between devices: the driver sends CPU tensors, each rank moves
them to its own device (a CUDA tensor pickled on rank 0 would land on cuda:0 everywhere)."""
from __future__ import annotations

import dataclasses

import torch


def to_device(obj, device: torch.device):
    """obj with every tensor in it (dataclass fields, tuples, lists, dicts) on `device`; objects
    already there are returned as they are (no copy on CPU -> CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == torch.device(device) else obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            old = getattr(obj, f.name)
            new = to_device(old, device)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, (tuple, list)):
        moved = [to_device(x, device) for x in obj]
        return obj if all(a is b for a, b in zip(moved, obj)) else type(obj)(moved)
    if isinstance(obj, dict):
        moved = {k: to_device(v, device) for k, v in obj.items()}
        return obj if all(moved[k] is v for k, v in obj.items()) else moved
    return obj

"""What the int8 kernel does to a linear layer's input, for references built from float modules:
the activations quantized per group of 32 inputs by Q8_0's rule (scale = max |x| / 127, C's roundf
as in ggml) and dequantized. A float linear over int8-rounded weights and such inputs computes the
kernel's products exactly; only the float summation order differs."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

GROUP = 32


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded as the kernel rounds it, as float32."""
    x = x.float()
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    s = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    v = (g * inv).double()
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).float()
    return (q * s).reshape(x.shape)


def w8a8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with x fake-quantized (w: the int8-rounded weight)."""
    return fake_quant(x) @ w.T


def hook_linears(*modules: torch.nn.Module) -> list:
    """Fake-quantize the input of every nn.Linear in `modules`; returns the hook handles."""
    handles = []
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, torch.nn.Linear):
                handles.append(sub.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0]),)))
    return handles


@contextmanager
def quantized_functional_linear():
    """Within the block, torch.nn.functional.linear fake-quantizes its input (dense heads that
    call it, standing for their int8 twins)."""
    plain = F.linear
    torch.nn.functional.linear = lambda x, w, b=None: plain(fake_quant(x), w, b)
    try:
        yield
    finally:
        torch.nn.functional.linear = plain

"""Everything that needs a Gaudi: availability and memory queries, HPU graphs per bucket,
lazy-mode mark_step. The ONE module that imports `habana_frameworks`, always lazily inside a
call, so it imports on any machine; the HPU platforms (specinfer.platform.hpu) reach the device
only through it.

`GaudiDevice` is what the bucketed runner calls to execute a forward; `EmulatedDevice`
(specinfer.platform.bucketed_runner) answers the same calls on CPU, so `device="hpu-emulated"`
runs exactly the Gaudi path except these calls. The device calls themselves are NOT exercised by
the CPU test suite (no Gaudi there); the bucketing and the attention math they wrap are plain
torch and are tested on CPU (buckets.py, flat_attention.py, dense_attention.py).
"""
from __future__ import annotations

from typing import Callable, Hashable

from specinfer.kernels.hpu.buckets import BucketPlanner


def hpu_available() -> bool:
    try:
        import habana_frameworks.torch  # noqa: F401  lazy: Gaudi only
    except ImportError:
        return False
    import torch

    return bool(getattr(torch, "hpu", None)) and torch.hpu.is_available()


def register_hccl() -> None:  # pragma: no cover - needs Gaudi
    """Registers torch.distributed's "hccl" backend (tensor parallelism on Gaudi, executor/)."""
    import habana_frameworks.torch.distributed.hccl  # noqa: F401  lazy: Gaudi only


def mem_get_info() -> tuple[int, int]:  # pragma: no cover - needs Gaudi
    """(free, total) bytes of the current HPU."""
    import habana_frameworks.torch.hpu  # noqa: F401  lazy: Gaudi only
    import torch

    free, total = torch.hpu.mem_get_info()
    return int(free), int(total)


def mark_step() -> None:
    """End the lazy-mode graph here so the ops so far are compiled and launched (Gaudi lazy mode)."""
    import habana_frameworks.torch.core as htcore  # lazy: Gaudi only

    htcore.mark_step()


class HpuGraphCache:
    """One captured HPU graph per shape bucket; replays it for every batch padded to that bucket.

    `fn` must be shape-static for a given key (the caller pads inputs to the bucket first).
    """

    def __init__(self, fn: Callable):
        self._fn = fn
        self._graphs: dict[Hashable, Callable] = {}

    def __call__(self, key: Hashable, *args, **kwargs):
        graph = self._graphs.get(key)
        if graph is None:
            from habana_frameworks.torch.hpu import wrap_in_hpu_graph  # lazy: Gaudi only

            graph = self._graphs[key] = wrap_in_hpu_graph(_as_module(self._fn), disable_tensor_cache=True)
        return graph(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._graphs)


def _as_module(fn: Callable):
    """wrap_in_hpu_graph takes an nn.Module; this adapts a plain function."""
    import torch

    class _Fn(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    return _Fn()


def warmup(planner: BucketPlanner, run_decode: Callable[[int, int], None],
           run_multi_token: Callable[[int, int, int], None]) -> int:
    """Compile every warmed bucket once: run_decode(batch, blocks) for the flat decode path and
    run_multi_token(batch, query, context_blocks) for the dense path, with a mark_step after each.
    Returns the number of shapes warmed. Serving then never meets a shape it has not compiled, as
    long as speculation lengths come from planner.speculation_length."""
    count = 0
    for b, n in planner.decode_shapes():
        run_decode(b, n)
        mark_step()
        count += 1
    for b, q, n in planner.multi_token_shapes():
        run_multi_token(b, q, n)
        mark_step()
        count += 1
    return count


class GaudiDevice:  # pragma: no cover - needs Gaudi
    """Executes the bucketed runner's forwards on a Gaudi: one HPU graph per shape key (the caller
    pads every input to a warmed bucket first), and a mark_step after each forward so lazy mode
    compiles and launches it as one graph."""

    def __init__(self):
        self._graphs: dict[str, HpuGraphCache] = {}

    def run(self, kind: str, key, fn: Callable, *args):
        cache = self._graphs.get(kind)
        if cache is None:
            cache = self._graphs[kind] = HpuGraphCache(fn)
        return cache(key, *args)

    def mark_step(self) -> None:
        mark_step()

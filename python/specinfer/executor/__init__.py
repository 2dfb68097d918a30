"""Executors: what runs the models' forwards for the engine.

    executor = make_executor(parallel_config, platform)
    loaded = executor.load_model(path, "target", dtype=..., quantization=...)
    caches = executor.allocate_kv_caches(models, num_blocks, block_size, dtype, backend_name, limits)
    runner = executor.make_runner(model, caches[0], backend, limits)
    hidden, logits = executor.execute_model(batch)     # one step's ModelBatch
    executor.apply_kv_copies(src_slots, dst_slots)     # token-tree compaction
    executor.shutdown()

`InProcessExecutor` (tensor_parallel_size 1) is the engine as it always ran. `MultiprocExecutor`
shards the target over N ranks (and a draft model over its own group) through torch.distributed;
the driver process is rank 0 and sends each call to every rank as one pickled message.
"""
from __future__ import annotations

from specinfer.executor.in_process import InProcessExecutor


def make_executor(parallel, platform):
    """The executor for a ParallelConfig. Under torchrun, ranks > 0 become workers here and exit
    the process when the driver shuts down (they never return)."""
    from specinfer.executor.process_group import env_rank, launched_by_torchrun

    torchrun = launched_by_torchrun() and env_rank()[1] > 1
    if parallel.tensor_parallel_size == 1 and not torchrun:
        return InProcessExecutor(platform)
    from specinfer.executor.multiproc import MultiprocExecutor, run_torchrun_worker

    if torchrun and env_rank()[0] > 0:
        run_torchrun_worker(parallel, platform)  # does not return
    return MultiprocExecutor(parallel, platform)




# every proposer runs with a sharded target (heads sharded over the target's ranks)
TENSOR_PARALLEL_METHODS = ("ngram", "draft_model", "layer_skip", "mlp_speculator", "medusa", "eagle", "eagle3")


def check_parallel_support(parallel, spec) -> None:
    """ValueError naming the field for what tensor parallelism does not cover yet."""
    if parallel.tensor_parallel_size > 1 and spec is not None and spec.method not in TENSOR_PARALLEL_METHODS:
        raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size}: speculative.method "
                         f"{spec.method!r} does not run with a sharded target yet (supported: "
                         f"{list(TENSOR_PARALLEL_METHODS)})")
    if spec is not None and spec.draft_tensor_parallel_size is not None and spec.method != "draft_model":
        raise ValueError(f"speculative.draft_tensor_parallel_size applies only to method 'draft_model' "
                         f"(method is {spec.method!r})")


def shutdown_executor_on_error(init):
    """Decorates an engine's __init__: if it fails after starting an executor, stop the executor
    (no worker process outlives a failed construction)."""
    import functools

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            executor = getattr(self, "executor", None)
            if executor is not None:
                executor.shutdown()
            raise

    return wrapped


__all__ = ["InProcessExecutor", "check_parallel_support", "make_executor", "shutdown_executor_on_error"]

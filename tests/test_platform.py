"""Platforms as subclasses, each owning its policy: resolution, attention-backend overrides, the
CUDA memory budget, the CUDA-graph plan, and the graph runner's padded static batches (run
eagerly under the Triton interpreter: the same buffers a captured graph replays)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it at decoration

import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from specinfer.config import CacheConfig  # noqa: E402
from specinfer.platform import (CpuPlatform, CudaPlatform, EngineLimits, HpuEmulatedPlatform,  # noqa: E402
                                HpuPlatform, Platform, resolve_platform)
from specinfer.platform.cuda import cuda_kv_budget  # noqa: E402
from specinfer.platform.cuda_graphs import GraphPlan, graph_plan  # noqa: E402


def test_resolution_gives_one_subclass_per_hardware(monkeypatch):
    assert type(resolve_platform("cpu")) is CpuPlatform
    emu = resolve_platform("hpu-emulated")
    assert type(emu) is HpuEmulatedPlatform and isinstance(emu, HpuPlatform)
    assert emu.device.type == "cpu" and emu.default_dtype == torch.float32 and emu.num_null_blocks == 1
    assert resolve_platform(emu) is emu  # a Platform object is used as is
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cuda = resolve_platform("cuda:1")
    assert type(cuda) is CudaPlatform and cuda.device == torch.device("cuda:1")
    with pytest.raises(ValueError, match="device='tpu'"):
        resolve_platform("tpu")
    with pytest.raises(ValueError, match="habana_frameworks"):
        resolve_platform("hpu")


def test_no_platform_method_branches_on_its_name():
    """The refactor's point: policy lives in subclass overrides, not `if self.name == ...`."""
    import inspect

    import specinfer.platform as pkg

    for mod in ("base", "cpu", "cuda", "hpu", "bucketed_runner", "cuda_graphs"):
        src = inspect.getsource(__import__(f"specinfer.platform.{mod}", fromlist=["x"]))
        assert "self.name ==" not in src and "self.name !=" not in src, mod
    assert pkg.Platform is Platform


def test_attention_backend_override_is_validated():
    cpu = CpuPlatform()
    assert cpu.choose_attention_backend(None) == "cpu_native"
    assert CpuPlatform().choose_attention_backend("torch_ref") == "torch_ref"
    assert cpu.choose_attention_backend("hpu_flat") == "hpu_flat"
    assert CpuPlatform().choose_attention_backend("triton") == "triton"  # TRITON_INTERPRET=1 here
    with pytest.raises(ValueError, match="attention_backend='flash' is not one of"):
        CpuPlatform().choose_attention_backend("flash")
    with pytest.raises(ValueError, match="does not run on hpu-emulated"):
        HpuEmulatedPlatform().choose_attention_backend("triton")


def test_gpu_memory_utilization_is_validated_and_sets_the_cuda_budget():
    for bad in (0.0, 1.5, -1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    GiB = 1 << 30
    # 141 GiB device, 20 GiB in use (weights and others): 0.9 leaves 141*0.9 - 20 - reserve
    avail, frac, cap = cuda_kv_budget(121 * GiB, 141 * GiB, 0.9, 2 * GiB)
    assert (frac, cap > 1 << 50) == (1.0, True)
    assert avail == 121 * GiB - int(141 * GiB * 0.1) - 2 * GiB
    assert cuda_kv_budget(10 * GiB, 141 * GiB, 0.9, 0)[0] == 0  # over the cap already: nothing left


def test_cli_passes_backend_and_utilization():
    import argparse

    from specinfer.cli import options
    from specinfer.cli.errors import CliError

    p = argparse.ArgumentParser()
    options.add_engine_arguments(p)
    m = argparse.Namespace(model="m")
    kw = options.engine_config(p.parse_args(["--attention-backend", "hpu_flat", "--gpu-memory-utilization", "0.5",
                                             "--device", "hpu-emulated"], m), None).options()
    assert (kw["attention_backend"], kw["gpu_memory_utilization"], kw["device"]) == ("hpu_flat", 0.5, "hpu-emulated")
    m = argparse.Namespace(model="m")
    assert options.engine_config(p.parse_args([], m), None).model.attention_backend == "auto"
    with pytest.raises(CliError, match="--gpu-memory-utilization"):
        options.engine_config(p.parse_args(["--gpu-memory-utilization", "2"], argparse.Namespace(model="m")), None)
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-backend", "flash"])


def test_habana_is_imported_by_one_module_only():
    """Only kernels/hpu/device.py names habana_frameworks, and importing every platform (and
    building an emulated one) imports no habana module."""
    root = os.path.join(os.path.dirname(__file__), "..")
    hits = subprocess.run(["grep", "-rl", "import habana_frameworks", "python/specinfer", "kernels"], cwd=root,
                          capture_output=True, text=True).stdout.split()
    assert sorted(set(h.replace("python/specinfer/kernels", "kernels") for h in hits)) == ["kernels/hpu/device.py"]
    code = ("import sys, specinfer.platform as p; p.resolve_platform('hpu-emulated'); p.resolve_platform('cpu'); "
            "assert not [m for m in sys.modules if m.startswith('habana')]")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


LIMITS = EngineLimits(max_num_seqs=20, max_num_batched_tokens=64, max_model_len=100, block_size=16,
                      num_speculative_tokens=3, scorer="mqa")


def test_graph_plan_covers_decode_and_verification_buckets():
    plan = graph_plan(LIMITS)
    assert plan.batch_sizes == (1, 2, 4, 8, 16, 20) and plan.query_lens == (1, 4)
    assert plan.max_blocks_per_seq == 7
    assert plan.keys()[0] == (20, 4) and len(plan.keys()) == 12
    assert plan.key_for(3, 3, 1) == (4, 1)  # 3 decodes -> the 4-batch decode graph
    assert plan.key_for(5, 20, 4) == (8, 4)  # 5 verification runs of 1 + 3
    assert plan.key_for(2, 5, 4) == (2, 4)  # a 4-run beside a decode: padded into the (2, 4) graph
    assert plan.key_for(2, 6, 3) == (2, 4)  # runs of at most 3: the next planned query length
    assert plan.key_for(1, 9, 9) is None  # a prefill chunk longer than every planned q: eager
    assert plan.key_for(21, 21, 1) is None  # more sequences than any graph
    assert plan.key_for(0, 0, 0) is None
    assert not plan.tree and graph_plan(EngineLimits(20, 64, 100, 16, 3, "mqa", token_tree=True)).tree
    expand = graph_plan(EngineLimits(8, 2048, 100, 16, 3, "batch_expansion"))
    assert expand.query_lens == (1,) and expand.batch_sizes[-1] == 32  # 8 requests x (1 + 3) rows
    assert graph_plan(EngineLimits(300, 64, 100, 16, 0, "mqa")).batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


@pytest.mark.parametrize("tree", [False, True])
def test_graph_runner_static_buffers_equal_eager(tiny_dir, tree):
    """The padded static batch a graph replays (padded sequences with no tokens, padded tokens at
    slot -1, rows past a shorter run's end owned by no sequence) gives the eager forward's hidden
    states and KV writes, for decodes, verification runs, runs of different lengths and (plans
    with trees) token-tree runs beside plain ones, through the Triton kernels (interpreted)."""
    import dataclasses

    from specinfer.attention import get_backend
    from specinfer.attention.triton_backend import TritonBackend
    from specinfer.attention.batch_metadata import attention_metadata_for_runs
    from specinfer.loader.model_loading import load_any
    from specinfer.models.model_runner import ModelRunner
    from specinfer.platform.cuda_graphs import CudaGraphRunner

    path, _ = tiny_dir("llama", False)
    model = load_any(str(path), dtype=torch.float32, device=torch.device("cpu")).model
    bs, nb = 4, 40
    caches = [torch.zeros(model.kv_cache_shape(nb, bs)) for _ in range(model.num_layers)]
    twin = [c.clone() for c in caches]
    plan = GraphPlan(batch_sizes=(2, 4), query_lens=(1, 4), max_blocks_per_seq=8, tree=tree)
    graphed = CudaGraphRunner(model, caches, TritonBackend(), plan, mode="eager_static")
    eager = ModelRunner(model, twin, TritonBackend())
    table = np.arange(24, dtype=np.int32).reshape(3, 8)  # three sequences, disjoint blocks
    g = torch.Generator().manual_seed(0)
    prefill = attention_metadata_for_runs(table, np.zeros(3, np.int64), np.array([9, 5, 12]), bs, torch.device("cpu"))
    ids = torch.randint(3, 256, (26,), generator=g)
    for c in (caches, twin):  # the same context in both caches (torch_ref: the interpreter is slow)
        ModelRunner(model, c, get_backend("torch_ref")).forward(ids, torch.from_numpy(prefill[1]), prefill[0])
    chunk = attention_metadata_for_runs(table[:1], np.array([20]), np.array([5]), bs, torch.device("cpu"))[0]
    for r in (graphed, eager):
        r.forward(ids[:5], torch.arange(20, 25), chunk)  # a 5-token run: longer than every q, eager
    assert graphed.num_eager == 1 and graphed.num_replays == 0
    # tree runs of root + 3 nodes (parents -1, -1, 0): bit j = tree slot j visible (0 = the root)
    node_masks = np.array([0b1, 0b11, 0b101, 0b1011])
    steps = [(np.array([9, 5, 12]), np.ones(3, np.int64), None),  # 3 decodes -> batch 4
             (np.array([10, 6, 13]), np.full(3, 4), None),  # 3 runs of 1 + 3 -> (4, 4)
             (np.array([14, 10, 17]), np.array([1, 4, 2]), None),  # runs of 1, 4 and 2 -> (4, 4)
             (np.array([15, 14, 19]), np.array([4, 1, 4]), [0, 2])]  # tree runs beside a decode
    for starts, lens, tree_rows in steps:
        attn, pos = attention_metadata_for_runs(table, starts, lens, bs, torch.device("cpu"))
        if tree_rows is not None:
            masks = np.zeros(int(lens.sum()), np.int64)
            cu = np.concatenate([[0], np.cumsum(lens)])
            for s in tree_rows:
                masks[cu[s]:cu[s + 1]] = node_masks
            pos = np.concatenate([starts[s] + (np.array([0, 1, 1, 2]) if s in tree_rows else np.arange(lens[s]))
                                  for s in range(3)])
            attn = dataclasses.replace(attn, tree_mask=torch.from_numpy(masks),
                                       tree_start=torch.from_numpy(starts.astype(np.int32)))
        ids = torch.randint(3, 256, (int(lens.sum()),), generator=g)
        got, _ = graphed.forward(ids, torch.from_numpy(pos), attn)
        want, _ = eager.forward(ids, torch.from_numpy(pos), attn)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a plan without trees runs a tree batch eagerly (its graphs have no mask buffers)
    assert graphed.num_replays == (4 if tree else 3) and graphed.num_eager == (1 if tree else 2)
    for a, b in zip(caches, twin):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # padded rows wrote nothing (slot -1)

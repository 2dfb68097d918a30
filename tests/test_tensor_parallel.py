"""Tensor parallelism (executor/): the target sharded over 2 ranks (gloo on CPU, worker
processes) gives the tokens of the unsharded engine, greedy and seeded sampling, with chunked
prefill and preemption, for no speculation, ngram, a draft model sharded over 2 or 1 ranks and a
token tree; the torchrun (env://) path; settings errors that name the field. Failures:
test_tensor_parallel_faults.py."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from spec_cases import prompts
from specinfer import Generator, SamplingParams
from tp_cases import SETTINGS, check_same, children, run

def test_tp2_equals_tp1_without_speculation(tiny_dir):
    target, _ = tiny_dir("llama", False)
    check_same(run(target, 1), run(target, 2, drop=True))


def test_tp2_ngram_int8_with_replicated_kv_heads_bias_padded_vocab(tiny_dir):
    """qwen2 (q/k/v bias) with one KV head (replicated on both ranks), tied embeddings, a
    vocabulary of 251 rows (the vocab-parallel shards are padded), int8 weights (sliced with their
    scales)."""
    target, _ = tiny_dir("qwen2", True, kv_heads=1, vocab=251)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    tp1 = run(target, 1, spec, vocab=251, quantization="int8")
    tp2 = run(target, 2, spec, vocab=251, quantization="int8")
    check_same(tp1, tp2)
    assert tp2["metrics"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("arch,quantization", [("mixtral", "int8"), ("qwen2_moe", None)])
def test_tp2_mixture_of_experts_with_ngram(tiny_dir, arch, quantization):
    """Experts sharded within (every rank a slice of every expert; Qwen2-MoE's shared expert
    too; int8 experts sliced with their scales): the tokens of the unsharded engine."""
    target, _ = tiny_dir(arch, layers=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    tp1 = run(target, 1, spec, quantization=quantization)
    tp2 = run(target, 2, spec, quantization=quantization)
    check_same(tp1, tp2)
    assert tp2["metrics"]["num_draft_tokens"] > 0


_TP1_DRAFT_RUNS: dict = {}


@pytest.mark.parametrize("draft_tp", [2, 1])
def test_tp2_draft_model(target_and_draft, draft_tp):
    """A draft model sharded over both ranks, or kept whole on the driver (draft TP 1)."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp, "policy": "fixed"}  # draft counts compared
    tp2 = run(target, 2, spec)
    key = (str(target), str(draft))
    if key not in _TP1_DRAFT_RUNS:  # the same TP=1 reference for both draft TPs
        _TP1_DRAFT_RUNS[key] = run(target, 1, {**spec, "draft_tensor_parallel_size": None})
    tp1 = _TP1_DRAFT_RUNS[key]
    check_same(tp1, tp2)
    assert tp2["metrics"]["num_accepted_tokens"] > 0
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert tp2["metrics"][key] == tp1["metrics"][key]


def test_tp2_draft_model_token_tree(target_and_draft):
    """A static token tree drafted by a draft model sharded over both ranks: tree masks through
    the sharded attention, and the core's KV copy list (the accepted path's compaction) applied
    on every rank's KV heads; greedy and seeded equal TP=1."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "token_tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}
    copies = []
    from specinfer.executor.multiproc import MultiprocExecutor

    apply = MultiprocExecutor.apply_kv_copies

    def counted(self, src, dst):
        copies.append(len(src))
        return apply(self, src, dst)

    MultiprocExecutor.apply_kv_copies = counted
    try:
        tp2 = run(target, 2, spec)
    finally:
        MultiprocExecutor.apply_kv_copies = apply
    check_same(run(target, 1, spec), tp2)
    assert tp2["metrics"]["num_accepted_tokens"] > 0
    assert sum(copies) > 0, "no accepted tree path needed compaction"


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_size="2"), "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, distributed_timeout_s=0), "distributed_timeout_s"),
    (dict(tensor_parallel_size=2, speculative={"method": "draft_model", "model": "x",
                                               "draft_tensor_parallel_size": 3}), "draft_tensor_parallel_size"),
    (dict(speculative={"method": "ngram", "draft_tensor_parallel_size": 1}), "draft_tensor_parallel_size"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's 4 attention heads"),
])
def test_bad_parallel_settings_name_the_field(tiny_dir, kwargs, field):
    before = set(children())
    with pytest.raises(ValueError, match=field):
        Generator(str(tiny_dir("llama", False)[0]), **kwargs)
    assert set(children()) - before == set()


def test_unshardable_heads_name_the_field():
    from specinfer.models.tensor_parallel import check_shardable, kv_heads_of_rank

    class Cfg:
        num_heads, num_kv_heads, intermediate_size = 4, 2, 128

    check_shardable(Cfg, 2)
    check_shardable(Cfg, 4)  # two KV heads, each replicated on two ranks
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        check_shardable(Cfg, 3)
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads_of_rank(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]

    class MoE(Cfg):
        num_experts, moe_intermediate_size, shared_expert_intermediate_size = 8, 96, 0

    check_shardable(MoE, 2)
    with pytest.raises(ValueError, match="the experts' width 96"):
        check_shardable(MoE, 64)


def test_in_process_kv_copies_move_k_and_v_of_every_pool():
    from specinfer.executor import InProcessExecutor
    from specinfer.platform import resolve_platform

    ex = InProcessExecutor(resolve_platform("cpu"))
    pools = [[torch.randn(2, 3, 4, 2, 8) for _ in range(2)], [torch.randn(2, 3, 4, 1, 8)]]
    ex._kv_caches = pools
    want = [[c.clone() for c in pool] for pool in pools]
    src, dst = np.array([5, 6]), np.array([1, 11])
    ex.apply_kv_copies(src, dst)
    for pool, ref in zip(pools, want):
        for c, r in zip(pool, ref):
            flat, rflat = c.view(2, 12, *c.shape[3:]), r.view(2, 12, *r.shape[3:])
            assert torch.equal(flat[:, [1, 11]], rflat[:, [5, 6]])
            rflat[:, [1, 11]] = rflat[:, [5, 6]]
            assert torch.equal(c, r)  # nothing else changed


TORCHRUN_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
from specinfer import Generator, SamplingParams
gen = Generator(sys.argv[1], tensor_parallel_size=2, distributed_timeout_s=60, **json.loads(sys.argv[2]))
outs = gen.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
gen.close()
"""


def test_torchrun_env_rendezvous(tiny_dir, tmp_path):
    """The multi-machine path (torchrun, env:// rendezvous, every rank runs the script and rank 1
    turns into a worker inside Generator(...)) with both ranks on this machine."""
    import json
    import socket
    import subprocess
    import sys

    target, _ = tiny_dir("llama", False)
    ps = prompts(3)
    want = Generator(str(target), **SETTINGS).generate(ps, SamplingParams(max_tokens=12, temperature=0.0),
                                                       use_tqdm=False)
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(__import__("specinfer").__path__[0].rsplit("/", 1)[0]),
                                                     os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={port}", str(script), str(target), json.dumps(SETTINGS),
           json.dumps(ps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1, done.stdout  # only the driver (rank 0) returns from Generator(...)
    assert json.loads(lines[0][len("TOKENS "):]) == [o.token_ids for o in want]


def test_cli_flags_reach_the_engine(tiny_dir):
    import argparse

    from specinfer.cli import options
    from specinfer.cli.errors import CliError

    target, _ = tiny_dir("llama", False)
    p = argparse.ArgumentParser()
    options.add_speculative_arguments(p)
    options.add_engine_arguments(p)
    args = p.parse_args(["--tensor-parallel-size", "2", "--draft-model", str(target), "--draft-tensor-parallel-size", "1"])
    args.model = str(target)
    assert options.engine_config(args, None).parallel.tensor_parallel_size == 2
    assert options.speculative_config(args).draft_tensor_parallel_size == 1
    with pytest.raises(CliError, match="--tensor-parallel-size must be an integer >= 1"):
        options.engine_config(p.parse_args(["--tensor-parallel-size", "0"], argparse.Namespace(model="m")), None)
    with pytest.raises(CliError, match="--draft-tensor-parallel-size is only used by --method draft_model"):
        options.speculative_config(p.parse_args(["--method", "ngram", "--draft-tensor-parallel-size", "1"]))


@pytest.mark.slow
def test_tp4_with_draft_tp2(target_and_draft):
    """Four ranks (each of the two KV heads replicated on two), the draft over ranks 0-1: a
    draft group that is neither 1 nor N."""
    target, draft = target_and_draft
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": 2, "policy": "fixed"}
    tp4 = run(target, 4, spec)
    check_same(run(target, 1, {**spec, "draft_tensor_parallel_size": None}), tp4)
    assert tp4["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_tp2_on_the_emulated_gaudi_path(tiny_dir):
    """hpu-emulated: the Rust packer pads to buckets, flat block-list attention, eager shards."""
    target, _ = tiny_dir("llama", False)
    check_same(run(target, 1), run(target, 2, device="hpu-emulated"))

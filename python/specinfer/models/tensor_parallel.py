"""Tensor-parallel sharding of a loaded Llama-family model (Megatron layout).

    shard_model(model, TensorParallelGroup(rank, size, group))   # in place, before packing

Per decoder layer, on rank r of a group of N:
- q|k|v (column-parallel): the rank keeps its KV-head group — KV heads
  [r * Hkv / N, (r + 1) * Hkv / N) and the query heads that read them. With fewer KV heads than
  ranks (Hkv < N, N % Hkv == 0) each rank keeps one KV head, replicated over N / Hkv ranks.
- o (row-parallel): the input columns of the rank's query heads; the partial outputs are summed
  over the group (all-reduce) and the bias is added once, after the sum.
- gate|up (column-parallel) and down (row-parallel): intermediate rows / columns
  [r * I / N, (r + 1) * I / N), down's partial outputs all-reduced.
- embedding and LM head (vocab-parallel): rows [r * Vp, (r + 1) * Vp) with Vp = ceil(V / N), the last
  shard zero-padded; embedding lookups outside the shard give zeros and are all-reduced, LM-head
  logits are all-gathered and trimmed to V.
Norms, biases of column-parallel layers (sliced) and RoPE tables stay per rank. Each rank's KV
cache holds only its KV heads (model.num_kv_heads is the local count).
The helpers (vocab_rows, vocab_parallel_embedding / _logits, shard_decoder_layer) also shard the
draft heads (spec_decode/: medusa, mlp_speculator, eagle, eagle3 `shard()`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specinfer.models.int8_linear import Int8Weight, any_linear


@dataclass
class TensorParallelGroup:
    """One model's tensor-parallel group: this process's rank in it, its size and the
    torch.distributed process group its collectives run on (None only when size == 1)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the group's partial outputs [T, n] (row-parallel GEMMs), plus the bias once."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x if bias is None else x + bias

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [L, n] per rank -> [L, size * n]
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_shardable(cfg, size: int, what: str = "tensor_parallel_size") -> None:
    """ValueError naming `what` unless the model's heads and MLP split evenly over `size` ranks."""
    H, Hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    experts = getattr(cfg, "num_experts", 0)
    if experts and cfg.moe_intermediate_size % size:
        raise ValueError(f"{what}={size} does not divide the experts' width {cfg.moe_intermediate_size}")
    if experts and cfg.shared_expert_intermediate_size % size:
        raise ValueError(f"{what}={size} does not divide the shared expert's width "
                         f"{cfg.shared_expert_intermediate_size}")
    if H % size:
        raise ValueError(f"{what}={size} does not divide the model's {H} attention heads")
    if (Hkv % size) and (size % Hkv):
        raise ValueError(f"{what}={size}: the model's {Hkv} KV heads neither split over nor replicate onto "
                         f"{size} ranks (one must divide the other)")
    if inter % size:
        raise ValueError(f"{what}={size} does not divide the model's intermediate_size {inter}")


def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[first, end) of the KV heads rank keeps (one replicated head when num_kv_heads < size)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // num_kv_heads)
    return head, head + 1


def _rows(w, rows: slice):
    if isinstance(w, Int8Weight):
        out = Int8Weight.__new__(Int8Weight)
        out.q, out.scales, out.group = w.q[rows].contiguous(), w.scales[rows].contiguous(), w.group
        return out
    return torch.nn.Parameter(w.data[rows].contiguous(), requires_grad=False)


def _cat_rows(parts):
    if isinstance(parts[0], Int8Weight):
        out = Int8Weight.__new__(Int8Weight)
        out.q = torch.cat([p.q for p in parts]).contiguous()
        out.scales = torch.cat([p.scales for p in parts]).contiguous()
        out.group = parts[0].group
        return out
    return torch.nn.Parameter(torch.cat([p.data for p in parts]).contiguous(), requires_grad=False)


def _cols(w, cols: slice):
    if isinstance(w, Int8Weight):
        g = w.group
        if cols.start % g or cols.stop % g:
            raise ValueError(f"quantization='int8': a row-parallel shard's inputs [{cols.start}, {cols.stop}) "
                             f"do not fall on {g}-input scale groups; use fewer ranks or no quantization")
        out = Int8Weight.__new__(Int8Weight)
        out.q = w.q[:, cols].contiguous()
        out.scales = w.scales[:, cols.start // g: cols.stop // g].contiguous()
        out.group = g
        return out
    return torch.nn.Parameter(w.data[:, cols].contiguous(), requires_grad=False)


def _vocab_rows(w, rank: int, size: int):
    """Rows [rank * Vp, (rank + 1) * Vp) of a [V, h] table, zero-padded to Vp = ceil(V / size)."""
    V = w.shape[0]
    Vp = -(-V // size)
    lo, hi = min(rank * Vp, V), min((rank + 1) * Vp, V)
    part = _rows(w, slice(lo, hi))
    pad = Vp - (hi - lo)
    if pad:
        if isinstance(part, Int8Weight):
            part.q = torch.cat([part.q, part.q.new_zeros(pad, part.q.shape[1])])
            part.scales = torch.cat([part.scales, part.scales.new_zeros(pad, part.scales.shape[1])])
        else:
            part = torch.nn.Parameter(torch.cat([part.data, part.data.new_zeros(pad, part.shape[1])]),
                                      requires_grad=False)
    return part


def _set(module, name, value) -> None:
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, value)


def vocab_rows(w, tp: TensorParallelGroup):
    """This rank's vocab-parallel shard of a [V, h] table (zero-padded to ceil(V / size) rows)."""
    return w if tp.size == 1 else _vocab_rows(w, tp.rank, tp.size)


def vocab_parallel_embedding(ids: torch.Tensor, table: torch.Tensor, tp: TensorParallelGroup | None) -> torch.Tensor:
    """int64[T] -> [T, h] from this rank's rows of a vocab-parallel table (vocab_rows): ids outside
    the shard look up zeros, the group's partial lookups are summed."""
    if tp is None or tp.size == 1:
        return torch.nn.functional.embedding(ids, table)
    local = ids - tp.rank * table.shape[0]
    inside = (local >= 0) & (local < table.shape[0])
    x = torch.nn.functional.embedding(torch.where(inside, local, torch.zeros_like(local)), table)
    return tp.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


def vocab_parallel_logits(x: torch.Tensor, table: torch.Tensor, tp: TensorParallelGroup | None,
                          vocab: int) -> torch.Tensor:
    """[L, h] -> [L, vocab] through this rank's rows of a vocab-parallel head (vocab_rows): the
    group's logit shards gathered, the padding dropped."""
    out = any_linear(x, table)  # a dense table, or an int8 one (a quantized draft head)
    if tp is None or tp.size == 1:
        return out
    return tp.all_gather_last(out)[:, :vocab]


def shard_rows_keeping_ties(weights: list, tp: TensorParallelGroup) -> list:
    """vocab_rows of each table in a list, where entries that are one tensor (tied stages, a
    shared head) stay one tensor."""
    done: dict[int, object] = {}
    return [done.setdefault(id(w), vocab_rows(w, tp)) for w in weights]


@torch.no_grad()
def shard_decoder_layer(layer, cfg, tp: TensorParallelGroup) -> tuple[int, int]:
    """Keep rank tp.rank's shard of one DecoderLayer (q|k|v and gate|up column-parallel, o and
    down row-parallel, all-reduced by the layer); -> (query heads, KV heads) it keeps."""
    check_shardable(cfg, tp.size)
    D, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    k0, k1 = kv_heads_of_rank(Hkv, tp.rank, tp.size)
    hq = H // tp.size
    q0 = tp.rank * hq
    inter = cfg.intermediate_size // tp.size
    i0 = tp.rank * inter
    q_size, kv_size = H * D, Hkv * D
    q_rows = slice(q0 * D, (q0 + hq) * D)
    k_rows = slice(q_size + k0 * D, q_size + k1 * D)
    v_rows = slice(q_size + kv_size + k0 * D, q_size + kv_size + k1 * D)
    gate_rows, up_rows = slice(i0, i0 + inter), slice(cfg.intermediate_size + i0, cfg.intermediate_size + i0 + inter)
    _set(layer, "qkv_weight", _cat_rows([_rows(layer.qkv_weight, r) for r in (q_rows, k_rows, v_rows)]))
    if layer.qkv_bias is not None:
        bias = torch.cat([layer.qkv_bias.data[r] for r in (q_rows, k_rows, v_rows)])
        _set(layer, "qkv_bias", torch.nn.Parameter(bias, requires_grad=False))
    _set(layer, "o_weight", _cols(layer.o_weight, q_rows))
    if layer.moe is not None:
        shard_moe(layer.moe, tp)
    else:
        _set(layer, "gate_up_weight", _cat_rows([_rows(layer.gate_up_weight, r) for r in (gate_rows, up_rows)]))
        _set(layer, "down_weight", _cols(layer.down_weight, gate_rows))
    layer.num_heads, layer.num_kv_heads = hq, k1 - k0
    layer.q_size, layer.kv_size = hq * D, (k1 - k0) * D
    layer.tp = tp
    return hq, k1 - k0


def _gated_shard(gate_up, down, width: int, tp: TensorParallelGroup):
    """One gated MLP's shard: gate|up rows [i0, i1) of each half (column-parallel), down's inputs
    [i0, i1) (row-parallel)."""
    n = width // tp.size
    i0 = tp.rank * n
    rows = (slice(i0, i0 + n), slice(width + i0, width + i0 + n))
    return _cat_rows([_rows(gate_up, r) for r in rows]), _cols(down, slice(i0, i0 + n))


@torch.no_grad()
def shard_moe(moe, tp: TensorParallelGroup) -> None:
    """Tensor parallelism WITHIN experts: every rank keeps every expert, with 1/size of its
    intermediate width (and of the shared expert's); the router and the shared expert's gate are
    replicated, so every rank routes every token the same way, computes its partial sums, and
    the layer all-reduces once. Chosen over expert parallelism (whole experts per rank) because
    speculative steps are small: a decode activates k experts per token and a verification a few
    more, which expert parallelism would leave on one or two ranks while the others idle, and it
    would need an all-to-all exchange of tokens each layer; sharding within experts splits every
    active expert's weight reads evenly and keeps the one all-reduce dense layers already pay."""
    I = moe.inter
    n = I // tp.size
    i0 = tp.rank * n
    if moe.quantized:
        pairs = [_gated_shard(gu, d, I, tp) for gu, d in zip(moe.gate_up, moe.down)]
        moe._gate_up, moe._down = [p[0] for p in pairs], [p[1] for p in pairs]
    else:
        gu = moe.w_gate_up.data
        _set(moe, "w_gate_up", torch.nn.Parameter(torch.cat([gu[:, i0:i0 + n], gu[:, I + i0:I + i0 + n]], 1)
                                                  .contiguous(), requires_grad=False))
        _set(moe, "w_down", torch.nn.Parameter(moe.w_down.data[:, :, i0:i0 + n].contiguous(), requires_grad=False))
    moe.inter = n
    if moe.shared_gate_up is not None:
        gate_up, down = _gated_shard(moe.shared_gate_up, moe.shared_down, moe.shared_inter, tp)
        _set(moe, "shared_gate_up", gate_up)
        _set(moe, "shared_down", down)
        moe.shared_inter //= tp.size


@torch.no_grad()
def shard_model(model, tp: TensorParallelGroup) -> None:
    """Keep only rank tp.rank's shard of every weight (in place; dense or int8 weights, before
    any packing). A group of size 1 leaves the model as it is (no collectives)."""
    if tp.size == 1:
        return
    if model.packed:
        raise RuntimeError("shard_model after pack_linear_weights: shard dense weights, then pack")
    cfg = model.config
    check_shardable(cfg, tp.size)
    model.tp = tp
    for layer in model.layers:
        _, num_kv_heads = shard_decoder_layer(layer, cfg, tp)
    tied = model.lm_head is model.embed_tokens
    embed = _vocab_rows(model.embed_tokens, tp.rank, tp.size)
    _set(model, "embed_tokens", embed)
    _set(model, "lm_head", embed if tied else _vocab_rows(model.lm_head, tp.rank, tp.size))
    model.num_kv_heads = num_kv_heads
    model.vocab_start = tp.rank * (-(-cfg.vocab_size // tp.size))

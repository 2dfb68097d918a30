"""Rotary position embedding: a cos/sin table over all positions, indexed per token.

The table is built once (fp32) from the config's RoPE scaling (default, linear, llama3, yarn, longrope —
the formulas of HF `modeling_rope_utils`), so a forward gathers rows by position and never
recomputes frequencies. Rotation is the "rotate half" (GPT-NeoX) form HF Llama uses.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from specinfer.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq float32[head_dim / 2], attention_factor applied to cos and sin)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rs), 1.0
    if kind == "yarn":
        return _yarn(cfg, rs)
    if kind == "longrope":
        return _longrope(cfg, rs, long=False)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _longrope(cfg: ModelConfig, rs, long: bool) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency factors, short below original_max_position_embeddings and
    long from there on, and one attention factor (HF `_compute_longrope_parameters`)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or (rs.get("max_position_embeddings") or cfg.max_position_embeddings) / orig
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"longrope factors must have head_dim / 2 = {dim // 2} entries (got {tuple(ext.shape)})")
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, rs) -> torch.Tensor:
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, rs) -> tuple[torch.Tensor, float]:
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = rs["factor"]
    orig = rs["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_table(cfg: ModelConfig, num_positions: int, *, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (cos, sin), each float32[num_positions, head_dim / 2]. local: the table of Gemma 3's
    sliding layers (base local_rope_theta, unscaled). LongRoPE switches from its short to its
    long factors at original_max_position_embeddings, position by position (HF switches a whole
    forward once its longest position passes that length: the same for every token of a
    decode or of a chunk wholly on one side)."""
    if local:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
    inv_freq, attention_factor = inverse_frequencies(cfg)
    pos = torch.arange(num_positions, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    if cfg.rope_type == "longrope":
        orig = cfg.rope_scaling["original_max_position_embeddings"]
        long_inv, _ = _longrope(cfg, cfg.rope_scaling, long=True)
        angles = torch.where(pos.unsqueeze(1) >= orig, torch.outer(pos, long_inv), angles)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D/2] -> (cos | cos, -sin | sin), each [T, 1, D]: built once per forward."""
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; factors [T, 1, D] from rope_factors -> rotated x [T, heads, D] (new tensor).

    (x1 cos - x2 sin, x2 cos + x1 sin) computed as x * cos + roll(x, D/2) * sin_signed: the same
    IEEE operations (a + (-b) == a - b), in four ops instead of eight."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

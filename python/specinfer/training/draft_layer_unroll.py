"""The one dense draft layer that EAGLE heads train, unrolled as the engine drafts with it.

"Training-time test" (EAGLE-3; HASS for EAGLE-1/2): step 1 reads the target's own feature at every
pair; step s > 1 reads the head's own step s-1 output at the same pair, with the token that follows,
and its query at position i + s - 1 sees step 1's keys at pairs <= i and its own chain's keys of
steps 2..s at pair i, which is exactly what the engine's draft KV holds when it drafts a chain
(eagle_proposer): the history's true pairs, then the chain's drafted pairs. So positions 2..k of a
chain are trained on the head's own features, not only teacher-forced.

Subclasses say what enters the layer (`_inputs`: EAGLE-1 fc(cat(embed(x), f)) with the fc output as
the residual; EAGLE-3 cat(norm(embed(x)), hidden_norm(g)), 2H wide, with g as the residual); the
attention (RoPE, GQA) and the MLP are shared. Parameters: q, k, v, o, post_ln, gate, up, down.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specinfer.models.rope import apply_rope, rope_factors


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (also under bf16 autocast, whose matmuls hand back bf16)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def chain_mask(T: int, step: int, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """bool[n, T + step n]: the keys a step-`step` query at pair i sees (0-based steps): step 0's
    keys at pairs <= i (causal), then each later step's key at pair i alone. pairs int64[n]: the
    pairs that later steps run at (default all T)."""
    rows = torch.arange(T) if pairs is None else pairs
    n = len(rows)
    return torch.cat([torch.arange(T)[None, :] <= rows[:, None], *[torch.eye(n, dtype=torch.bool)] * step], 1)


class UnrolledDraftLayer:
    cfg: object  # the target's ModelConfig (heads, head_dim, eps)
    params: dict[str, torch.Tensor]
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def _inputs(self, tokens: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens int64[B, T], g [B, T, H] -> (residual [B, T, H], layer input [B, T, W])."""
        raise NotImplementedError

    def _attend_mlp(self, resid, x, positions, keys, values, step, pairs=None):
        """One step of the layer at `positions` (of pairs `pairs`, default all); keys/values (lists)
        collect this step's K/V for later steps."""
        c, p = self.cfg, self.params
        B, T = x.shape[:2]
        q = F.linear(x, p["q"]).view(B, T, c.num_heads, c.head_dim)
        k = F.linear(x, p["k"]).view(B, T, c.num_kv_heads, c.head_dim)
        v = F.linear(x, p["v"]).view(B, T, c.num_kv_heads, c.head_dim)
        cos, sin = rope_factors(self.rope_cos[positions], self.rope_sin[positions])  # [T, 1, d]
        qk = apply_rope(torch.cat([q, k], 2).reshape(B * T, -1, c.head_dim), cos.repeat(B, 1, 1),
                        sin.repeat(B, 1, 1)).view(B, T, -1, c.head_dim)
        q = qk[:, :, : c.num_heads]
        keys.append(qk[:, :, c.num_heads:])
        values.append(v)
        rep = c.num_heads // c.num_kv_heads
        kk, vv = torch.cat(keys, 1).transpose(1, 2), torch.cat(values, 1).transpose(1, 2)
        mask = chain_mask(keys[0].shape[1], step, pairs)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), kk.repeat_interleave(rep, 1).to(q.dtype), vv.repeat_interleave(rep, 1).to(q.dtype),
            attn_mask=mask if step else None, is_causal=not step, scale=c.head_dim ** -0.5)  # [B, nh, T, d]
        return self._output(resid, attn.transpose(1, 2).reshape(B, T, -1))

    def _output(self, resid: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj into the residual, then the post-norm MLP (attn [..., nh * d])."""
        p = self.params
        h = resid + F.linear(attn, p["o"])
        u = rms(h, p["post_ln"], self.cfg.rms_norm_eps)
        return h + F.linear(F.silu(F.linear(u, p["gate"])) * F.linear(u, p["up"]), p["down"])

    def packed(self, tokens: torch.Tensor, first: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Step 0 (teacher-forced) over sequences packed end to end: tokens int64[N], first [N, H],
        lengths (summing to N; each sequence's positions start at 0) -> [N, H], each sequence
        attending causally to itself alone. The same outputs as unroll(...)[0] over the right-padded
        batch at its real positions, without the padding's linears and attention (a random batch
        of four sequences pads ~34 % of its rows and ~64 % of its attention)."""
        c, p = self.cfg, self.params
        N = len(tokens)
        resid, x = (t[0] for t in self._inputs(tokens[None], first[None]))
        q = F.linear(x, p["q"]).view(N, c.num_heads, c.head_dim)
        k = F.linear(x, p["k"]).view(N, c.num_kv_heads, c.head_dim)
        v = F.linear(x, p["v"]).view(N, c.num_kv_heads, c.head_dim)
        positions = torch.cat([torch.arange(n) for n in lengths])
        cos, sin = rope_factors(self.rope_cos[positions], self.rope_sin[positions])  # [N, 1, d]
        qk = apply_rope(torch.cat([q, k], 1), cos, sin)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads:].to(q.dtype)
        rep = c.num_heads // c.num_kv_heads
        out, start = [], 0
        for n in lengths:  # causal attention within each sequence ([1, heads, n, d])
            seg = slice(start, start + n)
            a = F.scaled_dot_product_attention(
                q[seg].transpose(0, 1)[None], k[seg].transpose(0, 1).repeat_interleave(rep, 0)[None],
                v[seg].transpose(0, 1).repeat_interleave(rep, 0)[None].to(q.dtype), is_causal=True,
                scale=c.head_dim ** -0.5)
            out.append(a[0].transpose(0, 1).reshape(n, -1))
            start += n
        return self._output(resid, torch.cat(out))

    def unroll(self, tokens: torch.Tensor, first: torch.Tensor, steps: int,
               pairs: torch.Tensor | None = None) -> list[torch.Tensor]:
        """tokens int64[B, T + steps - 1] (x_{i+1} for pair i, then the tokens that follow), first
        [B, T, H] (the target's features at the pairs) -> per step s the outputs (step s at pair i
        is the draft feature of position i + s + 1): [B, T, H] for step 0, and for later steps
        [B, n, H] at pairs int64[n] (ascending; default every pair). A chain step at pair i reads
        only step 0's keys and its own chain's, so running later steps at a subset of pairs gives
        exactly those pairs' outputs of the full unroll, at a fraction of the cost."""
        T = first.shape[1]
        pos = torch.arange(T)
        at = pos if pairs is None else pairs
        g, keys, values, outs = first, [], [], []
        for s in range(steps):
            rows = pos if s == 0 else at
            if s == 1 and pairs is not None:
                g = g[:, pairs]
            resid, x = self._inputs(tokens[:, rows + s], g)
            g = self._attend_mlp(resid, x, rows + s, keys, values, s, None if s == 0 else pairs)
            outs.append(g)
        return outs

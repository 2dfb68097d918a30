//! A sparse mixture-of-experts MLP over few tokens in one call: every active expert's gate|up
//! GEMM, the gated activation and its down GEMM, then each token's weighted sum over its
//! experts. The host sorts the (token, expert) pairs by expert once; this walks the experts in
//! order, gathers each one's tokens, and runs both GEMMs through [`crate::few_rows_linear`]'s
//! kernel (threads over output rows, weights streamed once with prefetch), so a decode that
//! activates two experts per layer costs one call instead of a dozen small framework ops per
//! expert.
//!
//! Determinism: a pair's output rows come from the few-rows kernel (each output row's sum is
//! independent of how many rows share the call), and each token's result is summed over its
//! pairs in ascending expert order, whatever the batch: a token's output is the same bits in a
//! decode, a verification run or a batch of them.

use crate::dense_linear::{dense_linear, DenseElem};
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::Isa;

/// The gate activation of the experts' gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// x * sigmoid(x) (SwiGLU)
    Silu,
    /// GELU, tanh approximation (GeGLU)
    GeluTanh,
}

impl Activation {
    #[inline]
    fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::GeluTanh => {
                const C: f32 = 0.797_884_6; // sqrt(2 / pi)
                0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
            }
        }
    }
}

/// The experts' weights, stacked: gate|up `[e, 2 * inter, hidden]`, down `[e, hidden, inter]`.
pub struct ExpertWeights<'a, W> {
    pub gate_up: &'a [W],
    pub down: &'a [W],
    pub num_experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// The routed pairs, sorted by expert: pair p belongs to token `token[p]`, weighs `weight[p]`;
/// expert e owns pairs `offsets[e] .. offsets[e + 1]` (tokens ascending within).
pub struct Routing<'a> {
    pub token: &'a [u32],
    pub weight: &'a [f32],
    pub offsets: &'a [usize],
}

/// out `[t, hidden]` = for every token, the sum over its pairs (ascending expert) of
/// weight * down_e(act(gate_e x) * up_e x). x `[t, hidden]` f32; out is overwritten.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts<W: DenseElem>(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    t: usize,
    w: &ExpertWeights<'_, W>,
    act: Activation,
    routing: &Routing<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (h, i, e) = (w.hidden, w.inter, w.num_experts);
    let pairs = routing.token.len();
    let check = |ok: bool, field: &'static str, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(KernelError {
                field,
                message: format!("moe_experts: {what}"),
            })
        }
    };
    check(
        x.len() == t * h && out.len() == t * h,
        "x",
        "x and out must be [t, hidden]",
    )?;
    check(
        w.gate_up.len() == e * 2 * i * h && w.down.len() == e * h * i,
        "weights",
        "expert weights' sizes",
    )?;
    check(
        routing.weight.len() == pairs,
        "weight",
        "one weight per pair",
    )?;
    check(
        routing.offsets.len() == e + 1 && routing.offsets[e] == pairs,
        "offsets",
        "must cover the pairs",
    )?;
    check(
        routing.offsets.windows(2).all(|o| o[0] <= o[1]),
        "offsets",
        "must not decrease",
    )?;
    check(
        routing.token.iter().all(|&tok| (tok as usize) < t),
        "token",
        "a pair's token is out of range",
    )?;
    let most = routing
        .offsets
        .windows(2)
        .map(|o| o[1] - o[0])
        .max()
        .unwrap_or(0);
    let mut xs = vec![0f32; most * h];
    let mut gu = vec![0f32; most * 2 * i];
    let mut a = vec![0f32; most * i];
    let mut y = vec![0f32; pairs * h]; // per pair, in sorted order
    for ex in 0..e {
        let (start, end) = (routing.offsets[ex], routing.offsets[ex + 1]);
        let n = end - start;
        if n == 0 {
            continue;
        }
        for (r, &tok) in routing.token[start..end].iter().enumerate() {
            let tok = tok as usize;
            xs[r * h..(r + 1) * h].copy_from_slice(&x[tok * h..(tok + 1) * h]);
        }
        let wgu = &w.gate_up[ex * 2 * i * h..(ex + 1) * 2 * i * h];
        dense_linear(
            isa,
            num_threads,
            &xs[..n * h],
            n,
            wgu,
            2 * i,
            h,
            None,
            &mut gu[..n * 2 * i],
        )?;
        for r in 0..n {
            let row = &gu[r * 2 * i..(r + 1) * 2 * i];
            for c in 0..i {
                a[r * i + c] = act.apply(row[c]) * row[i + c];
            }
        }
        let wd = &w.down[ex * h * i..(ex + 1) * h * i];
        dense_linear(
            isa,
            num_threads,
            &a[..n * i],
            n,
            wd,
            h,
            i,
            None,
            &mut y[start * h..end * h],
        )?;
    }
    out.fill(0.0);
    for p in 0..pairs {
        let tok = routing.token[p] as usize;
        let wp = routing.weight[p];
        let (dst, src) = (&mut out[tok * h..(tok + 1) * h], &y[p * h..(p + 1) * h]);
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s * wp;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::few_rows_linear::test_rand as rand;

    /// f64 reference of the same routed MLP.
    fn reference(
        x: &[f32],
        t: usize,
        gu: &[f32],
        down: &[f32],
        e: usize,
        h: usize,
        i: usize,
        act: Activation,
        pairs: &[(usize, usize, f32)],
    ) -> Vec<f64> {
        let _ = e;
        let mut out = vec![0f64; t * h];
        for &(tok, ex, wt) in pairs {
            let xr = &x[tok * h..(tok + 1) * h];
            let mut a = vec![0f64; i];
            for c in 0..i {
                let g: f64 = (0..h)
                    .map(|j| gu[ex * 2 * i * h + c * h + j] as f64 * xr[j] as f64)
                    .sum();
                let u: f64 = (0..h)
                    .map(|j| gu[ex * 2 * i * h + (i + c) * h + j] as f64 * xr[j] as f64)
                    .sum();
                a[c] = act.apply(g as f32) as f64 * u;
            }
            for o in 0..h {
                let d: f64 = (0..i)
                    .map(|c| down[ex * h * i + o * i + c] as f64 * a[c])
                    .sum();
                out[tok * h + o] += wt as f64 * d;
            }
        }
        out
    }

    fn routed(
        t: usize,
        e: usize,
        k: usize,
        seed: u64,
    ) -> (Vec<u32>, Vec<f32>, Vec<usize>, Vec<(usize, usize, f32)>) {
        let r = rand(t * k * 2, seed);
        let mut pairs = vec![];
        for tok in 0..t {
            let mut chosen = vec![];
            let mut j = 0;
            while chosen.len() < k {
                let ex = ((r[(tok * k + j) % r.len()].abs() * 997.0) as usize + j) % e;
                if !chosen.contains(&ex) {
                    chosen.push(ex);
                }
                j += 1;
            }
            for (n, ex) in chosen.into_iter().enumerate() {
                pairs.push((tok, ex, 0.25 + 0.5 * n as f32));
            }
        }
        let mut sorted = pairs.clone();
        sorted.sort_by_key(|&(tok, ex, _)| (ex, tok));
        let mut offsets = vec![0usize; e + 1];
        for &(_, ex, _) in &sorted {
            offsets[ex + 1] += 1;
        }
        for ex in 0..e {
            offsets[ex + 1] += offsets[ex];
        }
        let token = sorted.iter().map(|p| p.0 as u32).collect();
        let weight = sorted.iter().map(|p| p.2).collect();
        (token, weight, offsets, pairs)
    }

    #[test]
    fn matches_f64_reference_for_every_isa_and_activation() {
        let (e, h, i, k) = (5, 32, 48, 2);
        let gu = rand(e * 2 * i * h, 1);
        let down = rand(e * h * i, 2);
        for t in [1, 3, 8, 17] {
            let x = rand(t * h, 3 + t as u64);
            let (token, weight, offsets, pairs) = routed(t, e, k, t as u64);
            for act in [Activation::Silu, Activation::GeluTanh] {
                let want = reference(&x, t, &gu, &down, e, h, i, act, &pairs);
                for isa in Isa::supported() {
                    let w = ExpertWeights {
                        gate_up: &gu[..],
                        down: &down[..],
                        num_experts: e,
                        hidden: h,
                        inter: i,
                    };
                    let routing = Routing {
                        token: &token,
                        weight: &weight,
                        offsets: &offsets,
                    };
                    let mut out = vec![0f32; t * h];
                    moe_experts(isa, 2, &x, t, &w, act, &routing, &mut out).unwrap();
                    for (g, r) in out.iter().zip(&want) {
                        assert!(
                            (*g as f64 - r).abs() < 1e-3 * (1.0 + r.abs()),
                            "{isa:?} {act:?} t={t}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_tokens_output_does_not_depend_on_the_batch() {
        let (e, h, i, k, t) = (4, 32, 32, 2, 9);
        let gu = rand(e * 2 * i * h, 5);
        let down = rand(e * h * i, 6);
        let x = rand(t * h, 7);
        let (token, weight, offsets, pairs) = routed(t, e, k, 11);
        let isa = Isa::detect();
        let w = ExpertWeights {
            gate_up: &gu[..],
            down: &down[..],
            num_experts: e,
            hidden: h,
            inter: i,
        };
        let mut all = vec![0f32; t * h];
        moe_experts(
            isa,
            2,
            &x,
            t,
            &w,
            Activation::Silu,
            &Routing {
                token: &token,
                weight: &weight,
                offsets: &offsets,
            },
            &mut all,
        )
        .unwrap();
        for tok in 0..t {
            // the token alone, with the same experts and weights
            let mut mine: Vec<(usize, f32)> = pairs
                .iter()
                .filter(|p| p.0 == tok)
                .map(|p| (p.1, p.2))
                .collect();
            mine.sort_by_key(|p| p.0);
            let mut offsets1 = vec![0usize; e + 1];
            for &(ex, _) in &mine {
                offsets1[ex + 1] += 1;
            }
            for ex in 0..e {
                offsets1[ex + 1] += offsets1[ex];
            }
            let token1 = vec![0u32; mine.len()];
            let weight1: Vec<f32> = mine.iter().map(|p| p.1).collect();
            let mut one = vec![0f32; h];
            moe_experts(
                isa,
                1,
                &x[tok * h..(tok + 1) * h],
                1,
                &w,
                Activation::Silu,
                &Routing {
                    token: &token1,
                    weight: &weight1,
                    offsets: &offsets1,
                },
                &mut one,
            )
            .unwrap();
            assert_eq!(&one[..], &all[tok * h..(tok + 1) * h], "token {tok}");
        }
    }

    #[test]
    fn bad_routing_is_refused() {
        let (e, h, i) = (2, 16, 16);
        let gu = vec![0f32; e * 2 * i * h];
        let down = vec![0f32; e * h * i];
        let w = ExpertWeights {
            gate_up: &gu[..],
            down: &down[..],
            num_experts: e,
            hidden: h,
            inter: i,
        };
        let x = vec![0f32; h];
        let mut out = vec![0f32; h];
        // a token out of range; offsets that do not cover the pairs
        for (token, offsets) in [([3u32], [0usize, 1, 1]), ([0u32], [0usize, 0, 0])] {
            let bad = Routing {
                token: &token,
                weight: &[1.0],
                offsets: &offsets,
            };
            let result = moe_experts(
                Isa::detect(),
                1,
                &x,
                1,
                &w,
                Activation::Silu,
                &bad,
                &mut out,
            );
            assert!(result.is_err());
        }
    }
}

//! Dense linear at few activation rows: `out[M, N] = x[M, K] · w[N, K]^T (+ bias)` with bf16 or
//! f32 weights, f32 activations and f32 accumulation ([`crate::few_rows_linear`]'s kernel).
//! bf16 weights are widened exactly, so the result is the f32 product of the same values a
//! bf16 GEMM multiplies; each output row's sum is independent of M.

use crate::elem::Bf16;
use crate::few_rows_linear::{few_rows_linear, WeightElem, Weights};
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::Isa;

/// Inputs per loop step (and per prefetch step): k must be a multiple of it.
pub const K_STEP: usize = 16;

/// out `[m, n]` = x `[m, k]` · w`[n, k]`^T (+ bias `[n]`), w of bf16 ([`Bf16`]) or f32; all
/// row-major contiguous.
#[allow(clippy::too_many_arguments)]
pub fn dense_linear<W: DenseElem>(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    w: &[W],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let w = Weights {
        q: w,
        scales: &[],
        n,
        k,
        group: step(k),
    };
    few_rows_linear(isa, num_threads, x, m, w, bias, out)
}

/// The unscaled weight elements.
pub trait DenseElem: WeightElem {}
impl DenseElem for Bf16 {}
impl DenseElem for f32 {}

/// The loop unit: 32 inputs (one or two vectors) where k allows, else 16 (k not a multiple of
/// 16 is refused by the kernel, naming `group`).
fn step(k: usize) -> usize {
    if k % 32 == 0 {
        32
    } else {
        K_STEP
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::few_rows_linear::test_rand as rand;

    #[test]
    fn matches_f64_reference_for_every_isa_row_count_and_weight_type() {
        for (n, k) in [(37, 64), (16, 96), (5, 48), (70, 160)] {
            let wf = rand(n * k, 3);
            let wb: Vec<Bf16> = wf.iter().map(|&v| Bf16::from_f32(v)).collect();
            let bias = rand(n, 5);
            for m in [1, 2, 3, 5, 8, 9, 16, 21] {
                let x = rand(m * k, 7 + m as u64);
                let want = |w: &dyn Fn(usize) -> f64| -> Vec<f64> {
                    (0..m * n)
                        .map(|i| {
                            let (mi, ni) = (i / n, i % n);
                            (0..k)
                                .map(|e| x[mi * k + e] as f64 * w(ni * k + e))
                                .sum::<f64>()
                                + bias[ni] as f64
                        })
                        .collect()
                };
                let want_f = want(&|i| wf[i] as f64);
                let want_b = want(&|i| wb[i].to_f32() as f64);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let mut out_f = vec![0.0f32; m * n];
                        dense_linear(isa, threads, &x, m, &wf, n, k, Some(&bias), &mut out_f)
                            .unwrap();
                        let mut out_b = vec![0.0f32; m * n];
                        dense_linear(isa, threads, &x, m, &wb, n, k, Some(&bias), &mut out_b)
                            .unwrap();
                        for i in 0..m * n {
                            for (o, r, what) in
                                [(out_f[i], want_f[i], "f32"), (out_b[i], want_b[i], "bf16")]
                            {
                                assert!(
                                    (o as f64 - r).abs() < 1e-4 * (1.0 + r.abs()),
                                    "{what} {isa:?} m={m} n={n} k={k} {i}: {o} vs {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_output_row_does_not_depend_on_the_number_of_rows() {
        let (n, k) = (40, 128);
        let w = rand(n * k, 11);
        let x = rand(9 * k, 13);
        for isa in Isa::supported() {
            let mut all = vec![0.0f32; 9 * n];
            dense_linear(isa, 1, &x, 9, &w, n, k, None, &mut all).unwrap();
            for mi in 0..9 {
                let mut one = vec![0.0f32; n];
                dense_linear(
                    isa,
                    1,
                    &x[mi * k..(mi + 1) * k],
                    1,
                    &w,
                    n,
                    k,
                    None,
                    &mut one,
                )
                .unwrap();
                assert_eq!(one, all[mi * n..(mi + 1) * n], "{isa:?} row {mi}");
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_naming_the_field() {
        let w = vec![0.0f32; 2 * 40];
        let x = vec![0.0f32; 40];
        let mut out = vec![0.0f32; 2];
        let e = dense_linear(Isa::Scalar, 1, &x, 1, &w, 2, 40, None, &mut out).unwrap_err();
        assert_eq!(e.field, "group"); // 40 inputs: not a multiple of 16
        let w = vec![0.0f32; 2 * 32];
        let e = dense_linear(Isa::Scalar, 1, &x[..31], 1, &w, 2, 32, None, &mut out).unwrap_err();
        assert_eq!(e.field, "x");
        let e =
            dense_linear(Isa::Scalar, 1, &x[..32], 1, &w[..63], 2, 32, None, &mut out).unwrap_err();
        assert_eq!(e.field, "weight");
        let e = dense_linear(
            Isa::Scalar,
            1,
            &x[..32],
            1,
            &w,
            2,
            32,
            Some(&[0.0]),
            &mut out,
        )
        .unwrap_err();
        assert_eq!(e.field, "bias");
    }
}

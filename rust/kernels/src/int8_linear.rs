//! Weight-only int8 linear: `out[M, N] = x[M, K] · (q[N, K] * scale)^T (+ bias)`, the weights
//! int8 with one f32 scale per group of `group` consecutive inputs of a row (GGUF Q8_0: 32;
//! per output channel: K). Activations and accumulation stay f32. The kernel is
//! [`crate::few_rows_linear`]'s: a decode (M = 1) reads a quarter of the f32 weight bytes and a
//! verification or batch step reuses every widened weight vector up to 8 times.

use crate::few_rows_linear::{few_rows_linear, Weights};
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::Isa;

/// int8 weights `[n, k]` with f32 scales `[n, k / group]`.
#[derive(Clone, Copy, Debug)]
pub struct Int8Weight<'a> {
    pub q: &'a [i8],
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

/// out `[m, n]` = x `[m, k]` · w^T (+ bias `[n]`); all row-major contiguous.
pub fn int8_linear(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    w: Int8Weight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let Int8Weight {
        q,
        scales,
        n,
        k,
        group,
    } = w;
    let w = Weights {
        q,
        scales,
        n,
        k,
        group,
    };
    few_rows_linear(isa, num_threads, x, m, w, bias, out)
}

/// Symmetric absmax quantization of `w` `[n, k]` in groups of `group` inputs (GGUF Q8_0's rule:
/// scale = max |w| / 127, q = round(w / scale)). Returns (q, scales).
pub fn quantize(w: &[f32], n: usize, k: usize, group: usize) -> (Vec<i8>, Vec<f32>) {
    assert!(group > 0 && k % group == 0 && w.len() == n * k);
    let mut q = vec![0i8; n * k];
    let mut scales = vec![0.0f32; n * (k / group)];
    for (gi, (chunk, qc)) in w.chunks(group).zip(q.chunks_mut(group)).enumerate() {
        let amax = chunk.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
        let scale = amax / 127.0;
        scales[gi] = scale;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (d, &x) in qc.iter_mut().zip(chunk) {
            *d = (x * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::few_rows_linear::test_rand as rand;

    #[test]
    fn matches_dequantized_f64_reference_for_every_isa_and_row_count() {
        for (n, k, group) in [(37, 64, 32), (16, 96, 32), (5, 128, 128), (40, 48, 16)] {
            let wf = rand(n * k, 3);
            let (q, scales) = quantize(&wf, n, k, group);
            let bias = rand(n, 5);
            for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 21, 40] {
                let x = rand(m * k, 7 + m as u64);
                let want: Vec<f64> = (0..m * n)
                    .map(|i| {
                        let (mi, ni) = (i / n, i % n);
                        (0..k)
                            .map(|e| {
                                x[mi * k + e] as f64
                                    * q[ni * k + e] as f64
                                    * scales[ni * (k / group) + e / group] as f64
                            })
                            .sum::<f64>()
                            + bias[ni] as f64
                    })
                    .collect();
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let mut out = vec![0.0f32; m * n];
                        let w = Int8Weight {
                            q: &q,
                            scales: &scales,
                            n,
                            k,
                            group,
                        };
                        int8_linear(isa, threads, &x, m, w, Some(&bias), &mut out).unwrap();
                        for (i, (&o, &r)) in out.iter().zip(&want).enumerate() {
                            assert!(
                                (o as f64 - r).abs() < 1e-4 * (1.0 + r.abs()),
                                "{isa:?} m={m} n={n} k={k} {i}: {o} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantize_follows_q8_0() {
        let w = [
            0.0f32,
            1.0,
            -2.0,
            0.5,
            127.0 / 127.0 * 2.0,
            -0.01,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ];
        let (q, s) = quantize(&w, 1, 16, 16);
        assert_eq!(s, vec![2.0 / 127.0]);
        assert_eq!(&q[..6], &[0, 64, -127, 32, 127, -1]);
        let (q0, s0) = quantize(&[0.0; 16], 1, 16, 16);
        assert_eq!((q0, s0), (vec![0i8; 16], vec![0.0]));
    }

    #[test]
    fn bad_shapes_are_refused_naming_the_field() {
        let q = vec![0i8; 64];
        let s = vec![1.0f32; 2];
        let x = vec![0.0f32; 32];
        let mut out = vec![0.0f32; 2];
        let w = Int8Weight {
            q: &q,
            scales: &s,
            n: 2,
            k: 32,
            group: 24,
        };
        assert_eq!(
            int8_linear(Isa::Scalar, 1, &x, 1, w, None, &mut out)
                .unwrap_err()
                .field,
            "group"
        );
        let w = Int8Weight {
            q: &q,
            scales: &s[..1],
            n: 2,
            k: 32,
            group: 32,
        };
        assert_eq!(
            int8_linear(Isa::Scalar, 1, &x, 1, w, None, &mut out)
                .unwrap_err()
                .field,
            "scales"
        );
        let w = Int8Weight {
            q: &q,
            scales: &s,
            n: 2,
            k: 32,
            group: 32,
        };
        assert_eq!(
            int8_linear(Isa::Scalar, 1, &x[..31], 1, w, None, &mut out)
                .unwrap_err()
                .field,
            "x"
        );
        assert_eq!(
            int8_linear(Isa::Scalar, 1, &x, 1, w, Some(&[0.0]), &mut out)
                .unwrap_err()
                .field,
            "bias"
        );
    }
}

//! RMSNorm over the rows of a matrix: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, in f32
//! arithmetic with one rounding to the element type at the end (what torch's `F.rms_norm` gives
//! for bfloat16 on CPU, where it takes several passes: upcast, square, mean, rsqrt, two
//! multiplies, downcast). One pass per row; rows split over the pool's threads.

use rayon::prelude::*;

use crate::elem::Elem;
use crate::threads;

/// Lanes of the sum-of-squares accumulator (the compiler vectorizes the fixed-width loop).
const LANES: usize = 16;
/// Rows per parallel task: fewer rows than this run on the calling thread.
const ROWS_PER_TASK: usize = 16;

/// `x` and `out` hold `x.len() / dim` rows of `dim` elements; `weight` holds `dim`.
pub fn rms_norm<E: Elem>(
    num_threads: usize,
    x: &[E],
    weight: &[E],
    dim: usize,
    eps: f32,
    out: &mut [E],
) -> Result<(), String> {
    if dim == 0 || x.len() % dim != 0 {
        return Err(format!(
            "rms_norm: {} elements are not rows of {dim}",
            x.len()
        ));
    }
    if weight.len() != dim || out.len() != x.len() {
        return Err(format!(
            "rms_norm: weight has {} elements and out {} (want {dim} and {})",
            weight.len(),
            out.len(),
            x.len()
        ));
    }
    let w: Vec<f32> = weight.iter().map(|v| v.to_f32()).collect();
    let rows = x.len() / dim;
    let pool = if num_threads > 1 && rows >= 2 * ROWS_PER_TASK {
        threads::pool(num_threads)
    } else {
        None
    };
    let task = |(xs, os): (&[E], &mut [E])| {
        let mut scratch = vec![0f32; dim];
        for (xr, or) in xs.chunks_exact(dim).zip(os.chunks_exact_mut(dim)) {
            norm_row(xr, &w, eps, &mut scratch, or);
        }
    };
    let span = ROWS_PER_TASK * dim;
    match pool {
        Some(pool) => pool.install(|| {
            x.par_chunks(span)
                .zip(out.par_chunks_mut(span))
                .for_each(task)
        }),
        None => task((x, out)),
    }
    Ok(())
}

#[inline]
fn norm_row<E: Elem>(x: &[E], w: &[f32], eps: f32, scratch: &mut [f32], out: &mut [E]) {
    let xf = E::row(x, scratch);
    let mut acc = [0f32; LANES];
    let chunks = xf.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += c[l] * c[l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for v in tail {
        sum += v * v;
    }
    let r = 1.0 / (sum / xf.len() as f32 + eps).sqrt();
    for ((o, &v), &wv) in out.iter_mut().zip(xf).zip(w) {
        *o = E::from_f32(v * r * wv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::elem::Bf16;

    fn reference(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, wv)| v * r * wv).collect()
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn f32_rows_match_a_double_precision_reference_at_every_thread_count() {
        for &(rows, dim) in &[(1, 576), (3, 17), (70, 576), (33, 64)] {
            let x = data(rows * dim, rows as u32);
            let w = data(dim, 7);
            for threads in [1, 2, 3] {
                let mut out = vec![0f32; rows * dim];
                rms_norm(threads, &x, &w, dim, 1e-5, &mut out).unwrap();
                for r in 0..rows {
                    let xr: Vec<f64> = x[r * dim..(r + 1) * dim]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    let wr: Vec<f64> = w.iter().map(|&v| v as f64).collect();
                    let want = reference(&xr, &wr, 1e-5);
                    for (o, e) in out[r * dim..(r + 1) * dim].iter().zip(&want) {
                        assert!(
                            (*o as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{o} vs {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_rows_are_the_f32_result_rounded_once() {
        let (rows, dim) = (40, 96);
        let x: Vec<Bf16> = data(rows * dim, 3)
            .into_iter()
            .map(Bf16::from_f32)
            .collect();
        let w: Vec<Bf16> = data(dim, 4).into_iter().map(Bf16::from_f32).collect();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let mut want = vec![0f32; rows * dim];
        rms_norm(1, &xf, &wf, dim, 1e-6, &mut want).unwrap();
        let mut out = vec![Bf16(0); rows * dim];
        rms_norm(2, &x, &w, dim, 1e-6, &mut out).unwrap();
        for (o, e) in out.iter().zip(&want) {
            assert_eq!(*o, Bf16::from_f32(*e));
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let x = vec![0f32; 10];
        let mut out = vec![0f32; 10];
        assert!(rms_norm(1, &x, &[1.0; 3], 3, 1e-5, &mut out).is_err());
        assert!(rms_norm(1, &x, &[1.0; 4], 5, 1e-5, &mut out).is_err());
        assert!(rms_norm(1, &x, &[1.0; 5], 0, 1e-5, &mut out).is_err());
    }
}

//! Weight-only int8 linear: `out[M, N] = x[M, K] · (q[N, K] * scale)^T (+ bias)`, the weights
//! int8 with one f32 scale per group of `group` consecutive inputs of a row (GGUF Q8_0: 32;
//! per output channel: K). Activations and accumulation stay f32.
//!
//! Each weight vector is widened to f32 and scaled once, then multiplies up to 8 activation
//! rows held in vector registers, so a decode (M = 1) reads a quarter of the f32 weight bytes
//! and a verification or batch step reuses every widened vector up to 8 times. Work is
//! split over output rows (rayon); one call reads each weight once per 8 activation rows.

use rayon::prelude::*;

use crate::paged_attention::AttentionError as KernelError;
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::simd::{prefetch_l2, I8Rows, Isa, Scalar};
use crate::threads;

/// Output rows per work item.
const ROWS_PER_ITEM: usize = 16;
/// How many blocks of NR output rows ahead the decode path prefetches its weights.
const PREFETCH_BLOCKS: usize = 4;

fn err<T>(field: &'static str, message: impl Into<String>) -> Result<T, KernelError> {
    Err(KernelError {
        field,
        message: message.into(),
    })
}

/// int8 weights `[n, k]` with f32 scales `[n, k / group]`.
#[derive(Clone, Copy, Debug)]
pub struct Int8Weight<'a> {
    pub q: &'a [i8],
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

impl Int8Weight<'_> {
    fn validate(&self) -> Result<(), KernelError> {
        if self.group == 0 || self.group % 16 != 0 || self.k % self.group != 0 {
            return err(
                "group",
                format!(
                    "{} must be a multiple of 16 dividing k = {}",
                    self.group, self.k
                ),
            );
        }
        if self.q.len() != self.n * self.k {
            return err(
                "weight",
                format!(
                    "has {} elements, expected {} x {}",
                    self.q.len(),
                    self.n,
                    self.k
                ),
            );
        }
        if self.scales.len() != self.n * (self.k / self.group) {
            return err(
                "scales",
                format!(
                    "has {} elements, expected {} x {}",
                    self.scales.len(),
                    self.n,
                    self.k / self.group
                ),
            );
        }
        Ok(())
    }
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
    w.validate()?;
    if !isa.is_supported() {
        return err(
            "isa",
            format!("{} is not supported by this CPU", isa.name()),
        );
    }
    if x.len() != m * w.k {
        return err(
            "x",
            format!("has {} elements, expected {m} x {}", x.len(), w.k),
        );
    }
    if out.len() != m * w.n {
        return err(
            "out",
            format!("has {} elements, expected {m} x {}", out.len(), w.n),
        );
    }
    if let Some(b) = bias {
        if b.len() != w.n {
            return err(
                "bias",
                format!("has {} elements, expected {}", b.len(), w.n),
            );
        }
    }
    let items: Vec<usize> = (0..w.n).step_by(ROWS_PER_ITEM).collect();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run: RowsFn = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => rows_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => rows_avx2,
        _ => rows_scalar,
    };
    let job = Job { x, m, w, bias };
    let pool = if num_threads > 1 && items.len() > 1 {
        threads::pool(num_threads)
    } else {
        None
    };
    match pool {
        // SAFETY: `run` matches the supported `isa`; items write disjoint output columns.
        Some(pool) => pool.install(|| {
            items
                .par_iter()
                .for_each(|&n0| unsafe { run(&job, n0, out_ptr) })
        }),
        None => items
            .iter()
            .for_each(|&n0| unsafe { run(&job, n0, out_ptr) }),
    }
    Ok(())
}

struct Job<'a> {
    x: &'a [f32],
    m: usize,
    w: Int8Weight<'a>,
    bias: Option<&'a [f32]>,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: items write disjoint columns of out.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

type RowsFn = unsafe fn(&Job<'_>, usize, OutPtr);

unsafe fn rows_scalar(job: &Job<'_>, n0: usize, out: OutPtr) {
    output_rows::<Scalar>(job, n0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(job: &Job<'_>, n0: usize, out: OutPtr) {
    output_rows::<Avx2>(job, n0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_avx512(job: &Job<'_>, n0: usize, out: OutPtr) {
    output_rows::<Avx512>(job, n0, out)
}

/// Output rows n0 .. n0 + ROWS_PER_ITEM for every activation row, up to 8 activation rows per
/// pass over the weights (16 accumulators spill on AVX2 and measured slower with AVX-512 too):
/// a verification run of 1 + k <= 8 rows reads each weight once.
#[inline(always)]
unsafe fn output_rows<L: I8Rows>(job: &Job<'_>, n0: usize, out: OutPtr) {
    let n1 = (n0 + ROWS_PER_ITEM).min(job.w.n);
    let mut m0 = 0;
    while m0 < job.m {
        let mc = (job.m - m0).min(8);
        match mc {
            8 => block::<L, 8>(job, n0, n1, m0, out),
            7 => block::<L, 7>(job, n0, n1, m0, out),
            6 => block::<L, 6>(job, n0, n1, m0, out),
            5 => block::<L, 5>(job, n0, n1, m0, out),
            4 => block::<L, 4>(job, n0, n1, m0, out),
            3 => block::<L, 3>(job, n0, n1, m0, out),
            2 => block::<L, 2>(job, n0, n1, m0, out),
            _ => block::<L, 1>(job, n0, n1, m0, out),
        }
        m0 += mc;
    }
}

/// Activation rows m0 .. m0 + MC against output rows n0 .. n1: MC x NR accumulators in
/// registers, each widened weight vector used MC times and each activation load NR times. NR
/// (output rows per pass) is as large as the register file allows: AVX-512 has 32 vector
/// registers, AVX2 16.
#[inline(always)]
unsafe fn block<L: I8Rows, const MC: usize>(
    job: &Job<'_>,
    n0: usize,
    n1: usize,
    m0: usize,
    out: OutPtr,
) {
    let nr = match (L::W, MC) {
        (16, 1..=4) => 4,
        (16, _) | (8, 1..=4) => 2,
        _ => 1,
    };
    let mut n = n0;
    while n + nr <= n1 {
        match nr {
            4 => rows_of::<L, MC, 4>(job, n, m0, out),
            2 => rows_of::<L, MC, 2>(job, n, m0, out),
            _ => rows_of::<L, MC, 1>(job, n, m0, out),
        }
        n += nr;
    }
    while n < n1 {
        rows_of::<L, MC, 1>(job, n, m0, out);
        n += 1;
    }
}

/// Output rows n .. n + NR against activation rows m0 .. m0 + MC.
#[inline(always)]
unsafe fn rows_of<L: I8Rows, const MC: usize, const NR: usize>(
    job: &Job<'_>,
    n: usize,
    m0: usize,
    out: OutPtr,
) {
    let (k, g, w) = (job.w.k, job.w.group, L::W);
    let groups = k / g;
    let xp = job.x.as_ptr().add(m0 * k);
    let mut acc: [[L::V; MC]; NR] = [[L::splat(0.0); MC]; NR];
    for gi in 0..groups {
        let s: [L::V; NR] =
            std::array::from_fn(|r| L::splat(*job.w.scales.as_ptr().add((n + r) * groups + gi)));
        // The weights are read front to back, NR rows at a time, and a row is short (k bytes):
        // too short for the hardware prefetcher to ramp up on, so cold weights (a decode walks
        // every layer's) came at 6 GB/s. Fetch the lines PREFETCH_BLOCKS blocks of NR rows ahead,
        // as many bytes per group as the group consumes (NR * g).
        let ahead = job.w.q.as_ptr().wrapping_add((n + NR * PREFETCH_BLOCKS) * k + gi * NR * g);
        let mut off = 0;
        while off < NR * g {
            prefetch_l2(ahead.wrapping_add(off));
            off += 64;
        }
        if MC <= 2 {
            // few activation rows: sum the group against the unscaled weights, scale the sum
            // once (one multiply per group instead of one per weight vector; decodes are bound
            // by the widening, not by memory: 10-14 GB/s of int8 before)
            let mut part: [[L::V; MC]; NR] = [[L::splat(0.0); MC]; NR];
            let mut e = gi * g;
            while e < (gi + 1) * g {
                let wv: [L::V; NR] =
                    std::array::from_fn(|r| L::load_i8(job.w.q.as_ptr().add((n + r) * k + e)));
                for mi in 0..MC {
                    let xv = L::load(xp.add(mi * k + e));
                    for r in 0..NR {
                        part[r][mi] = L::fma(xv, wv[r], part[r][mi]);
                    }
                }
                e += w;
            }
            for r in 0..NR {
                for mi in 0..MC {
                    acc[r][mi] = L::fma(part[r][mi], s[r], acc[r][mi]);
                }
            }
            continue;
        }
        let mut e = gi * g;
        while e < (gi + 1) * g {
            let wv: [L::V; NR] = std::array::from_fn(|r| {
                L::mul(L::load_i8(job.w.q.as_ptr().add((n + r) * k + e)), s[r])
            });
            for mi in 0..MC {
                let xv = L::load(xp.add(mi * k + e));
                for r in 0..NR {
                    acc[r][mi] = L::fma(xv, wv[r], acc[r][mi]);
                }
            }
            e += w;
        }
    }
    for r in 0..NR {
        let b = job.bias.map_or(0.0, |b| b[n + r]);
        for (mi, a) in acc[r].iter().enumerate() {
            *out.0.add((m0 + mi) * job.w.n + n + r) = L::sum(*a) + b;
        }
    }
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

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

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

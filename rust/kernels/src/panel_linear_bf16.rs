//! The bf16 form of the panel kernel: `out[M, N] = x[M, K] · W^T (+ bias)` with W bf16 in
//! panels of [`PANEL`] output rows whose k are paired, `[N / 64, K / 2, 64, 2]` (the last panel
//! zero-padded, an odd K padded with a zero k), x and out f32.
//!
//! x is rounded to bf16 (round to nearest even; in a bf16 model it already is), and each output
//! element is one chain over the k pairs in order from zero: `acc += x[2i+1] w[2i+1]`, then
//! `acc += x[2i] w[2i]`, each step one rounding of an exact product (bf16 x bf16 fits an f32),
//! then `+ bias` once. That is what AVX-512 BF16's `vdpbf16ps` computes per lane (checked bit
//! for bit on this kernel's hardware; its inputs' denormals read as zero, so packing flushes
//! the weights' and the rounding the activations'), at twice the multiply-adds per instruction
//! of the f32 form; without AVX-512 BF16 the same chain runs as two fused multiply-adds per pair
//! on widened values (AVX-512F, AVX2, portable), same bits. The one difference left is that
//! `vdpbf16ps` flushes a denormal running sum to zero, which a real layer's sums never are.
//!
//! As in [`crate::panel_linear`], nothing of an element's arithmetic depends on M, the tile, the
//! thread count or the instruction set: a row's output is the same alone or among others.

use crate::elem::{Bf16, Elem};
use crate::few_rows_linear::{check_io, err};
use crate::paged_attention::AttentionError as KernelError;
use crate::panel_linear::{num_panels, store_tile, ScalarFused, PANEL};
use crate::simd::{prefetch_l1, I8Rows, Isa};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::threads;

/// Activation rows per tile.
const MR: usize = 6;
/// Bytes ahead of the current k pair that each panel stream is prefetched into L1 (as the f32
/// form's).
const PREFETCH_AHEAD: usize = 4096;

/// k pairs of k inputs (an odd k's last pair has a zero high half).
pub fn num_pairs(k: usize) -> usize {
    k.div_ceil(2)
}

/// bf16 bits with a denormal (or negative zero) made +0, as `vdpbf16ps` reads its inputs.
#[inline(always)]
fn flush(b: u16) -> u16 {
    if b & 0x7F80 == 0 {
        0
    } else {
        b
    }
}

/// w `[n, k]` bf16 bits, row-major -> `[num_panels(n), num_pairs(k), PANEL]` dwords, each the
/// bf16s of k = 2i (low half) and 2i + 1 (high half) of one output row; rows past n, the k past
/// an odd k and denormals zero.
pub fn panel_pack_pairs(w: &[u16], n: usize, k: usize) -> Vec<u32> {
    assert_eq!(w.len(), n * k, "panel_pack_pairs: weight is not n x k");
    let k2 = num_pairs(k);
    let mut out = vec![0u32; num_panels(n) * k2 * PANEL];
    for r in 0..n {
        let (p, j) = (r / PANEL, r % PANEL);
        for e in 0..k {
            let half = (flush(w[r * k + e]) as u32) << (16 * (e % 2));
            out[(p * k2 + e / 2) * PANEL + j] |= half;
        }
    }
    out
}

/// x `[m, k]` f32 -> `[m, num_pairs(k)]` dwords of bf16 pairs (rounded to nearest even,
/// denormals flushed, an odd k's pad zero). Branch-free per element, so it vectorizes; compiled
/// per instruction set (at prefill sizes a scalar loop cost about as much as the GEMM).
fn activation_pairs<X: Elem>(isa: Isa, x: &[X], m: usize, k: usize) -> Vec<u32> {
    let mut out = vec![0u32; m * num_pairs(k)];
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU has `isa`
        Isa::Avx512 => unsafe { pairs_avx512(x, k, &mut out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above
        Isa::Avx2 => unsafe { pairs_avx2(x, k, &mut out) },
        _ => pairs_rows(x, k, &mut out),
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pairs_avx512<X: Elem>(x: &[X], k: usize, out: &mut [u32]) {
    pairs_rows(x, k, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pairs_avx2<X: Elem>(x: &[X], k: usize, out: &mut [u32]) {
    pairs_rows(x, k, out)
}

#[inline(always)]
fn pairs_rows<X: Elem>(x: &[X], k: usize, out: &mut [u32]) {
    let bits = |v: X| flush(Bf16::from_f32(v.to_f32()).0) as u32;
    let k2 = num_pairs(k);
    for (row, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(k2)) {
        for (d, pair) in dst.iter_mut().zip(row.chunks_exact(2)) {
            *d = bits(pair[0]) | bits(pair[1]) << 16;
        }
        if k % 2 == 1 {
            dst[k2 - 1] = bits(row[k - 1]);
        }
    }
}

/// out `[m, n]` = x `[m, k]` · w^T (+ bias `[n]`), w packed by [`panel_pack_pairs`]; x and out
/// f32 or bf16 (out rounded once from the f32 result).
#[allow(clippy::too_many_arguments)]
pub fn panel_linear_bf16<X: Elem, O: Elem>(
    isa: Isa,
    num_threads: usize,
    x: &[X],
    m: usize,
    packed: &[u32],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [O],
) -> Result<(), KernelError> {
    if k == 0 {
        return err("k", "must be at least 1");
    }
    let k2 = num_pairs(k);
    if packed.len() != num_panels(n) * k2 * PANEL {
        return err(
            "weight",
            format!(
                "has {} bf16 pairs, expected {} panels x {k2} pairs x {PANEL}",
                packed.len(),
                num_panels(n)
            ),
        );
    }
    check_io(isa, x, m, k, n, bias, out)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let xp = activation_pairs(isa, x, m, k);
    let job = Job {
        x: &xp,
        m,
        w: packed,
        n,
        k2,
        bias,
        out: OutPtr(out.as_mut_ptr()),
    };
    let run: unsafe fn(&Job<'_, O>, usize) = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if std::arch::is_x86_feature_detected!("avx512bf16") => item_dpbf16::<O>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => item_avx512::<O>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => item_avx2::<O>,
        _ => item_scalar::<O>,
    };
    let items: Vec<usize> = (0..num_panels(n)).collect();
    // SAFETY: `run` matches the supported `isa`; items write disjoint output columns.
    threads::for_each_item(num_threads, &items, |&p| unsafe { run(&job, p) });
    Ok(())
}

struct Job<'a, O> {
    x: &'a [u32], // [m, k2] activation pairs
    m: usize,
    w: &'a [u32], // [panels, k2, PANEL] weight pairs
    n: usize,
    k2: usize,
    bias: Option<&'a [f32]>,
    out: OutPtr<O>,
}

#[derive(Clone, Copy)]
struct OutPtr<O>(*mut O);
// SAFETY: items write disjoint columns of out.
unsafe impl<O> Send for OutPtr<O> {}
unsafe impl<O> Sync for OutPtr<O> {}

/// Prefetch the k pair e's line(s) of panel p PREFETCH_AHEAD bytes ahead.
#[inline(always)]
unsafe fn prefetch_pair<O>(job: &Job<'_, O>, p: usize, e: usize) {
    let ahead = job.w.as_ptr().wrapping_add((p * job.k2 + e) * PANEL) as *const i8;
    let mut off = 0;
    while off < PANEL * 4 {
        prefetch_l1(ahead.wrapping_add(PREFETCH_AHEAD + off));
        off += 64;
    }
}

/// Rows of tiles of at most MR, the first tile prefetching the panel's stream.
#[inline(always)]
unsafe fn each_tile<O>(job: &Job<'_, O>, mut tile: impl FnMut(usize, usize, bool)) {
    let mut m0 = 0;
    while m0 < job.m {
        let mr = (job.m - m0).min(MR);
        tile(m0, mr, m0 == 0);
        m0 += mr;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn item_dpbf16<O: Elem>(job: &Job<'_, O>, p: usize) {
    each_tile(job, |m0, mr, first| match mr {
        6 => dp_tile::<O, 6>(job, p, m0, first),
        5 => dp_tile::<O, 5>(job, p, m0, first),
        4 => dp_tile::<O, 4>(job, p, m0, first),
        3 => dp_tile::<O, 3>(job, p, m0, first),
        2 => dp_tile::<O, 2>(job, p, m0, first),
        _ => dp_tile::<O, 1>(job, p, m0, first),
    })
}

/// Rows m0 .. m0 + R against the whole panel p (4 vectors of 16 outputs): one `vdpbf16ps` per
/// k pair, row and vector.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dp_tile<O: Elem, const R: usize>(job: &Job<'_, O>, p: usize, m0: usize, first: bool) {
    use std::arch::x86_64::*;
    let k2 = job.k2;
    let w = job.w.as_ptr().add(p * k2 * PANEL);
    let x = job.x.as_ptr().add(m0 * k2);
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    for e in 0..k2 {
        if first {
            prefetch_pair(job, p, e);
        }
        let mut wv = [_mm512_setzero_si512(); 4];
        for (v, reg) in wv.iter_mut().enumerate() {
            *reg = _mm512_loadu_si512(w.add(e * PANEL + v * 16) as *const __m512i);
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xb: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(r * k2 + e) as i32));
            for v in 0..4 {
                acc_r[v] = _mm512_dpbf16_ps(
                    acc_r[v],
                    std::mem::transmute::<__m512i, __m512bh>(wv[v]),
                    xb,
                );
            }
        }
    }
    store_tile::<Avx512, O, R, 4>(job.out.0, job.n, job.bias, m0, p * PANEL, &acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn item_avx512<O: Elem>(job: &Job<'_, O>, p: usize) {
    item::<Avx512, O, 4>(job, p)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn item_avx2<O: Elem>(job: &Job<'_, O>, p: usize) {
    item::<Avx2, O, 2>(job, p)
}

unsafe fn item_scalar<O: Elem>(job: &Job<'_, O>, p: usize) {
    item::<ScalarFused, O, 16>(job, p)
}

/// Panel p in column slices of NV vectors (AVX-512: the whole panel), the chain as fused
/// multiply-adds on widened pairs.
#[inline(always)]
unsafe fn item<L: I8Rows, O: Elem, const NV: usize>(job: &Job<'_, O>, p: usize) {
    let mut c = 0;
    while c < PANEL && p * PANEL + c < job.n {
        each_tile(job, |m0, mr, first| {
            let first = first && c == 0;
            match mr {
                6 => fma_tile::<L, O, 6, NV>(job, p, c, m0, first),
                5 => fma_tile::<L, O, 5, NV>(job, p, c, m0, first),
                4 => fma_tile::<L, O, 4, NV>(job, p, c, m0, first),
                3 => fma_tile::<L, O, 3, NV>(job, p, c, m0, first),
                2 => fma_tile::<L, O, 2, NV>(job, p, c, m0, first),
                _ => fma_tile::<L, O, 1, NV>(job, p, c, m0, first),
            }
        });
        c += NV * L::W;
    }
}

#[inline(always)]
unsafe fn fma_tile<L: I8Rows, O: Elem, const R: usize, const NV: usize>(
    job: &Job<'_, O>,
    p: usize,
    c: usize,
    m0: usize,
    first: bool,
) {
    let k2 = job.k2;
    let w = job.w.as_ptr().add(p * k2 * PANEL + c);
    let x = job.x.as_ptr().add(m0 * k2);
    let mut acc = [[L::splat(0.0); NV]; R];
    for e in 0..k2 {
        if first {
            prefetch_pair(job, p, e);
        }
        let mut even = [L::splat(0.0); NV];
        let mut odd = [L::splat(0.0); NV];
        for v in 0..NV {
            (even[v], odd[v]) = L::load_bf16_pairs(w.add(e * PANEL + v * L::W));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let pair = *x.add(r * k2 + e);
            let (xe, xo) = (
                L::splat(f32::from_bits(pair << 16)),
                L::splat(f32::from_bits(pair & 0xFFFF_0000)),
            );
            for v in 0..NV {
                acc_r[v] = L::fma(xo, odd[v], acc_r[v]);
                acc_r[v] = L::fma(xe, even[v], acc_r[v]);
            }
        }
    }
    store_tile::<L, O, R, NV>(job.out.0, job.n, job.bias, m0, p * PANEL + c, &acc);
}

#[cfg(test)]
#[path = "panel_linear_bf16_tests.rs"]
mod tests;

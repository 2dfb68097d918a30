//! Dense linear for every row count with one arithmetic: `out[M, N] = x[M, K] · W^T (+ bias)`,
//! W f32 packed in panels of [`PANEL`] output rows (`[N / 64, K, 64]`, the last panel
//! zero-padded), x and out f32. (bf16 weights: [`crate::panel_linear_bf16`], paired panels.)
//!
//! Each output element is one chain of fused multiply-adds over k = 0, 1, ..., K - 1 starting
//! from zero, then `+ bias` once: the same operations in the same order whatever M, the tile
//! that holds the element, the thread count or the instruction set (AVX-512, AVX2+FMA and the
//! portable path all fuse). So a row's output does not depend on the other rows of the call: a
//! decode, a 1 + k verification run and a prefill chunk give the same bits for the same input
//! row (batch invariance), at GEMM speed for large M.
//!
//! The panel layout is what makes the k-ordered chain fast: at a fixed k the 64 weights of a
//! panel are contiguous (4 AVX-512 vectors), so a tile of MR rows x NV vectors takes NV weight
//! loads and MR broadcasts per k for MR * NV FMAs (outer products), and a 1-row decode streams
//! each panel front to back as one sequential stream (prefetched ahead). Work items are panels,
//! split over threads.

use crate::elem::Elem;
use crate::few_rows_linear::{check_io, err};
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::{prefetch_l1, I8Rows, Isa, Rows, Scalar};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::threads;

/// Output rows per panel.
pub const PANEL: usize = 64;
/// Activation rows per tile.
const MR: usize = 6;
/// Bytes ahead of the current k that each panel stream is prefetched into L1 (first row block
/// only). On Zen 5, one thread, SmolLM2-135M (benches/verify_cost.py): 1024 bytes into L2 gave a
/// decode of 19-21 ms and a 1 + 4 verification 1.13x that; 4096 into L1 17.6-18.8 ms and 1.08x
/// (the hardware prefetcher alone keeps too few lines in flight once a k step costs 5 rows of
/// FMAs; 2048 measured like 1024, 8192 and 16384 like 4096).
const PREFETCH_AHEAD: usize = 4096;

/// Panels that hold n output rows.
pub fn num_panels(n: usize) -> usize {
    n.div_ceil(PANEL)
}

/// w `[n, k]` row-major -> panels `[num_panels(n), k, PANEL]` (rows past n zero).
pub fn panel_pack<W: Copy + Default>(w: &[W], n: usize, k: usize) -> Vec<W> {
    assert_eq!(w.len(), n * k, "panel_pack: weight is not n x k");
    let mut out = vec![W::default(); num_panels(n) * k * PANEL];
    for r in 0..n {
        let (p, j) = (r / PANEL, r % PANEL);
        for e in 0..k {
            out[(p * k + e) * PANEL + j] = w[r * k + e];
        }
    }
    out
}

/// out `[m, n]` = x `[m, k]` · w^T (+ bias `[n]`), w packed by [`panel_pack`].
#[allow(clippy::too_many_arguments)]
pub fn panel_linear(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    packed: &[f32],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if k == 0 {
        return err("k", "must be at least 1");
    }
    if packed.len() != num_panels(n) * k * PANEL {
        return err(
            "weight",
            format!(
                "has {} elements, expected {} panels x {k} x {PANEL}",
                packed.len(),
                num_panels(n)
            ),
        );
    }
    check_io(isa, x, m, k, n, bias, out)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let items: Vec<usize> = (0..num_panels(n)).collect();
    let job = Job {
        x,
        m,
        w: packed,
        n,
        k,
        bias,
        out: OutPtr(out.as_mut_ptr()),
    };
    let run: unsafe fn(&Job<'_>, usize) = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => item_avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => item_avx2,
        _ => item_scalar,
    };
    // SAFETY: `run` matches the supported `isa`; items write disjoint output columns.
    threads::for_each_item(num_threads, &items, |&p0| unsafe { run(&job, p0) });
    Ok(())
}

struct Job<'a> {
    x: &'a [f32],
    m: usize,
    w: &'a [f32],
    n: usize,
    k: usize,
    bias: Option<&'a [f32]>,
    out: OutPtr,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: items write disjoint columns of out.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

unsafe fn item_scalar(job: &Job<'_>, p0: usize) {
    item::<ScalarFused, 16>(job, p0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn item_avx2(job: &Job<'_>, p0: usize) {
    item::<Avx2, 2>(job, p0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn item_avx512(job: &Job<'_>, p0: usize) {
    item::<Avx512, 4>(job, p0)
}

/// Panel p for every activation row, in column slices of NV vectors (AVX-512: the whole panel).
#[inline(always)]
unsafe fn item<L: Rows, const NV: usize>(job: &Job<'_>, p: usize) {
    let mut c = 0;
    while c < PANEL && p * PANEL + c < job.n {
        let mut m0 = 0;
        while m0 < job.m {
            let mr = (job.m - m0).min(MR);
            tile_dispatch::<L, NV>(job, p, c, m0, mr, m0 == 0 && c == 0);
            m0 += mr;
        }
        c += NV * L::W;
    }
}

#[inline(always)]
unsafe fn tile_dispatch<L: Rows, const NV: usize>(
    job: &Job<'_>,
    p: usize,
    c: usize,
    m0: usize,
    mr: usize,
    first: bool,
) {
    match mr {
        6 => tile::<L, 6, NV>(job, p, c, m0, first),
        5 => tile::<L, 5, NV>(job, p, c, m0, first),
        4 => tile::<L, 4, NV>(job, p, c, m0, first),
        3 => tile::<L, 3, NV>(job, p, c, m0, first),
        2 => tile::<L, 2, NV>(job, p, c, m0, first),
        _ => tile::<L, 1, NV>(job, p, c, m0, first),
    }
}

/// Rows m0 .. m0 + R against the NV vectors of columns c .. of panel p: R x NV accumulators,
/// one FMA chain each over k in order. `first`: the first pass over the panel, which prefetches
/// its stream.
#[inline(always)]
unsafe fn tile<L: Rows, const R: usize, const NV: usize>(
    job: &Job<'_>,
    p: usize,
    c: usize,
    m0: usize,
    first: bool,
) {
    let k = job.k;
    let w = job.w.as_ptr();
    let x = job.x.as_ptr().add(m0 * k);
    let panel = w.add(p * k * PANEL);
    let base = panel.add(c);
    let line = PANEL * std::mem::size_of::<f32>(); // bytes of one k step of the panel
    let ahead = panel as *const i8;
    let mut acc = [[L::splat(0.0); NV]; R];
    for e in 0..k {
        if first {
            let mut off = 0;
            while off < line {
                prefetch_l1(ahead.wrapping_add(e * line + PREFETCH_AHEAD + off));
                off += 64;
            }
        }
        // a plain loop, not array::from_fn: for bf16 that closure was left out of line (a call per
        // k step, ~7x slower on AVX-512)
        let mut wv = [L::splat(0.0); NV];
        for (v, w) in wv.iter_mut().enumerate() {
            *w = L::load(base.add(e * PANEL + v * L::W));
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let xb = L::splat(*x.add(r * k + e));
            for v in 0..NV {
                acc_r[v] = L::fma(xb, wv[v], acc_r[v]);
            }
        }
    }
    store_tile::<L, f32, R, NV>(job.out.0, job.n, job.bias, m0, p * PANEL + c, &acc);
}

/// Rows m0 .. m0 + R of out `[m, n]`, columns col0 .. (NV vectors, clipped at n): the tile's
/// accumulators `+ bias`, rounded once to the output element (nothing for f32; to nearest even
/// for bf16, as torch's `.to(torch.bfloat16)`).
#[inline(always)]
pub(crate) unsafe fn store_tile<L: Rows, O: Elem, const R: usize, const NV: usize>(
    out: *mut O,
    n: usize,
    bias: Option<&[f32]>,
    m0: usize,
    col0: usize,
    acc: &[[L::V; NV]; R],
) {
    for (r, acc_r) in acc.iter().enumerate() {
        let row = out.add((m0 + r) * n);
        for (v, a) in acc_r.iter().enumerate() {
            let c = col0 + v * L::W;
            if c >= n {
                break;
            }
            let mut lanes = [0.0f32; 16];
            let val = match bias {
                Some(b) if c + L::W <= n => L::add(*a, L::load(b.as_ptr().add(c))),
                Some(b) => {
                    // a partial vector: the bias lanes that exist, the rest are dropped below
                    let mut bl = [0.0f32; 16];
                    bl[..n - c].copy_from_slice(&b[c..n]);
                    L::add(*a, L::load(bl.as_ptr()))
                }
                None => *a,
            };
            if std::mem::size_of::<O>() == 4 && c + L::W <= n {
                L::store(row.add(c) as *mut f32, val); // O is f32 (the only 4-byte Elem)
                continue;
            }
            L::store(lanes.as_mut_ptr(), val);
            for (j, &x) in lanes[..L::W.min(n - c)].iter().enumerate() {
                *row.add(c + j) = O::from_f32(x);
            }
        }
    }
}

/// The portable path with fused multiply-adds (`f32::mul_add`), so it gives the vector paths'
/// bits; everything else as [`Scalar`].
pub(crate) struct ScalarFused;

impl crate::simd::Rows for ScalarFused {
    const W: usize = 1;
    type V = f32;
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn exp(x: f32) -> f32 {
        <Scalar as crate::simd::Rows>::exp(x)
    }
}

impl I8Rows for ScalarFused {
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> f32 {
        <Scalar as I8Rows>::load_i8(p)
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> f32 {
        <Scalar as I8Rows>::load_bf16(p)
    }
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const u32) -> (f32, f32) {
        <Scalar as I8Rows>::load_bf16_pairs(p)
    }
    #[inline(always)]
    unsafe fn sum(v: f32) -> f32 {
        v
    }
}

#[cfg(test)]
#[path = "panel_linear_tests.rs"]
mod tests;

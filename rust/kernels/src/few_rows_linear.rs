//! Linear layers for few activation rows — decodes, 1 + k verification runs, small batches:
//! `out[M, N] = x[M, K] · W^T (+ bias)`, x and out f32, W row-major `[N, K]` of int8 with one
//! f32 scale per group of `group` inputs ([`crate::int8_linear`]), of bf16 or of f32
//! ([`crate::dense_linear`]). Accumulation is f32.
//!
//! At such M a linear layer streams its weights once and does little arithmetic per byte, so
//! the kernel is built around the weight stream: each weight vector is widened to f32 once and
//! multiplies up to 8 activation rows held in registers; work items of 16 output rows are split
//! over threads (rayon); the weight lines a few row blocks ahead are prefetched, since a row is
//! only k elements, too short for the hardware prefetcher to ramp up on (cold weights came at
//! 6 GB/s of int8 without it, 13 with it). An output row's sum does not depend on M for
//! unscaled weights (same lanes, same order), so a decode and a verification agree bit for bit.

use crate::elem::Bf16;
use crate::paged_attention::AttentionError as KernelError;
use crate::simd::{prefetch_l2, I8Rows, Isa, Scalar};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};
use crate::threads;

/// Output rows per work item.
const ROWS_PER_ITEM: usize = 16;
/// How many blocks of NR output rows ahead the weights are prefetched.
const PREFETCH_BLOCKS: usize = 4;

/// A weight element: how a run of lanes is widened to f32, and whether rows carry group scales.
pub trait WeightElem: Copy + Send + Sync + 'static {
    const SCALED: bool;
    /// # Safety
    /// `p` addresses at least `L::W` valid elements; `L`'s instruction set is enabled.
    unsafe fn widen<L: I8Rows>(p: *const Self) -> L::V;
}

impl WeightElem for i8 {
    const SCALED: bool = true;
    #[inline(always)]
    unsafe fn widen<L: I8Rows>(p: *const i8) -> L::V {
        L::load_i8(p)
    }
}

impl WeightElem for Bf16 {
    const SCALED: bool = false;
    #[inline(always)]
    unsafe fn widen<L: I8Rows>(p: *const Bf16) -> L::V {
        L::load_bf16(p as *const u16)
    }
}

impl WeightElem for f32 {
    const SCALED: bool = false;
    #[inline(always)]
    unsafe fn widen<L: I8Rows>(p: *const f32) -> L::V {
        L::load(p)
    }
}

/// Weights `[n, k]`; `scales` `[n, k / group]` for scaled elements (empty otherwise). For
/// unscaled elements `group` is only the unit the loops and the prefetch step by.
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a, W> {
    pub q: &'a [W],
    pub scales: &'a [f32],
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

/// The checks every linear kernel makes: `isa` runs here, x `[m, k]`, out `[m, n]`, bias `[n]`.
pub(crate) fn check_io<X, O>(
    isa: Isa,
    x: &[X],
    m: usize,
    k: usize,
    n: usize,
    bias: Option<&[f32]>,
    out: &[O],
) -> Result<(), KernelError> {
    if !isa.is_supported() {
        return err(
            "isa",
            format!("{} is not supported by this CPU", isa.name()),
        );
    }
    if x.len() != m * k {
        return err("x", format!("has {} elements, expected {m} x {k}", x.len()));
    }
    if out.len() != m * n {
        return err(
            "out",
            format!("has {} elements, expected {m} x {n}", out.len()),
        );
    }
    if let Some(b) = bias {
        if b.len() != n {
            return err("bias", format!("has {} elements, expected {n}", b.len()));
        }
    }
    Ok(())
}

pub(crate) fn err<T>(field: &'static str, message: impl Into<String>) -> Result<T, KernelError> {
    Err(KernelError {
        field,
        message: message.into(),
    })
}

/// out `[m, n]` = x `[m, k]` · w^T (+ bias `[n]`); all row-major contiguous. Shapes checked.
pub(crate) fn few_rows_linear<W: WeightElem>(
    isa: Isa,
    num_threads: usize,
    x: &[f32],
    m: usize,
    w: Weights<'_, W>,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if w.group == 0 || w.group % 16 != 0 || w.k % w.group != 0 {
        return err(
            "group",
            format!("{} must be a multiple of 16 dividing k = {}", w.group, w.k),
        );
    }
    if w.q.len() != w.n * w.k {
        return err(
            "weight",
            format!("has {} elements, expected {} x {}", w.q.len(), w.n, w.k),
        );
    }
    let num_scales = if W::SCALED { w.n * (w.k / w.group) } else { 0 };
    if w.scales.len() != num_scales {
        return err(
            "scales",
            format!("has {} elements, expected {num_scales}", w.scales.len()),
        );
    }
    check_io(isa, x, m, w.k, w.n, bias, out)?;
    let items: Vec<usize> = (0..w.n).step_by(ROWS_PER_ITEM).collect();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let run: unsafe fn(&Job<'_, W>, usize, OutPtr) = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => rows_avx512::<W>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => rows_avx2::<W>,
        _ => rows_scalar::<W>,
    };
    let job = Job { x, m, w, bias };
    // SAFETY: `run` matches the supported `isa`; items write disjoint output columns.
    threads::for_each_item(num_threads, &items, |&n0| unsafe { run(&job, n0, out_ptr) });
    Ok(())
}

struct Job<'a, W> {
    x: &'a [f32],
    m: usize,
    w: Weights<'a, W>,
    bias: Option<&'a [f32]>,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: items write disjoint columns of out.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

unsafe fn rows_scalar<W: WeightElem>(job: &Job<'_, W>, n0: usize, out: OutPtr) {
    output_rows::<Scalar, W>(job, n0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2<W: WeightElem>(job: &Job<'_, W>, n0: usize, out: OutPtr) {
    output_rows::<Avx2, W>(job, n0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_avx512<W: WeightElem>(job: &Job<'_, W>, n0: usize, out: OutPtr) {
    output_rows::<Avx512, W>(job, n0, out)
}

/// Output rows n0 .. n0 + ROWS_PER_ITEM for every activation row, up to 8 activation rows per
/// pass over the weights (16 accumulators spill on AVX2 and measured slower with AVX-512 too):
/// a verification run of 1 + k <= 8 rows reads each weight once.
#[inline(always)]
unsafe fn output_rows<L: I8Rows, W: WeightElem>(job: &Job<'_, W>, n0: usize, out: OutPtr) {
    let n1 = (n0 + ROWS_PER_ITEM).min(job.w.n);
    let mut m0 = 0;
    while m0 < job.m {
        let mc = (job.m - m0).min(8);
        match mc {
            8 => block::<L, W, 8>(job, n0, n1, m0, out),
            7 => block::<L, W, 7>(job, n0, n1, m0, out),
            6 => block::<L, W, 6>(job, n0, n1, m0, out),
            5 => block::<L, W, 5>(job, n0, n1, m0, out),
            4 => block::<L, W, 4>(job, n0, n1, m0, out),
            3 => block::<L, W, 3>(job, n0, n1, m0, out),
            2 => block::<L, W, 2>(job, n0, n1, m0, out),
            _ => block::<L, W, 1>(job, n0, n1, m0, out),
        }
        m0 += mc;
    }
}

/// Activation rows m0 .. m0 + MC against output rows n0 .. n1: MC x NR accumulators in
/// registers, each widened weight vector used MC times and each activation load NR times. NR
/// (output rows per pass) is as large as the register file allows: AVX-512 has 32 vector
/// registers, AVX2 16.
#[inline(always)]
unsafe fn block<L: I8Rows, W: WeightElem, const MC: usize>(
    job: &Job<'_, W>,
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
            4 => rows_of::<L, W, MC, 4>(job, n, m0, out),
            2 => rows_of::<L, W, MC, 2>(job, n, m0, out),
            _ => rows_of::<L, W, MC, 1>(job, n, m0, out),
        }
        n += nr;
    }
    while n < n1 {
        rows_of::<L, W, MC, 1>(job, n, m0, out);
        n += 1;
    }
}

/// Output rows n .. n + NR against activation rows m0 .. m0 + MC.
#[inline(always)]
unsafe fn rows_of<L: I8Rows, W: WeightElem, const MC: usize, const NR: usize>(
    job: &Job<'_, W>,
    n: usize,
    m0: usize,
    out: OutPtr,
) {
    let (k, g) = (job.w.k, job.w.group);
    let groups = k / g;
    let q = job.w.q.as_ptr();
    let xp = job.x.as_ptr().add(m0 * k);
    let group_bytes = NR * g * std::mem::size_of::<W>();
    let mut acc: [[L::V; MC]; NR] = [[L::splat(0.0); MC]; NR];
    for gi in 0..groups {
        // the weights are read front to back, NR rows at a time: fetch the lines PREFETCH_BLOCKS
        // blocks of NR rows ahead, as many bytes per group as the group consumes
        let ahead = q.wrapping_add((n + NR * PREFETCH_BLOCKS) * k + gi * NR * g) as *const i8;
        let mut off = 0;
        while off < group_bytes {
            prefetch_l2(ahead.wrapping_add(off));
            off += 64;
        }
        let at = |e: usize| (q, xp, k, n, e);
        if !W::SCALED {
            group_fma::<L, W, MC, NR>(at(gi * g), g, None, &mut acc);
            continue;
        }
        let s: [L::V; NR] =
            std::array::from_fn(|r| L::splat(*job.w.scales.as_ptr().add((n + r) * groups + gi)));
        if MC <= 2 {
            // few activation rows: sum the group against the unscaled weights, scale the sum
            // once (one multiply per group instead of one per weight vector; decodes were bound
            // by the widening, not by memory: 10-14 GB/s of int8 before)
            let mut part: [[L::V; MC]; NR] = [[L::splat(0.0); MC]; NR];
            group_fma::<L, W, MC, NR>(at(gi * g), g, None, &mut part);
            for r in 0..NR {
                for mi in 0..MC {
                    acc[r][mi] = L::fma(part[r][mi], s[r], acc[r][mi]);
                }
            }
            continue;
        }
        group_fma::<L, W, MC, NR>(at(gi * g), g, Some(s), &mut acc);
    }
    for r in 0..NR {
        let b = job.bias.map_or(0.0, |b| b[n + r]);
        for (mi, a) in acc[r].iter().enumerate() {
            *out.0.add((m0 + mi) * job.w.n + n + r) = L::sum(*a) + b;
        }
    }
}

/// acc[r][mi] += x[mi, e0 .. e0 + g] * w[n + r, e0 .. e0 + g] lane-wise, each widened weight
/// vector multiplied by `scale[r]` first when given. `at` = (weights, x rows, k, n, e0).
#[inline(always)]
unsafe fn group_fma<L: I8Rows, W: WeightElem, const MC: usize, const NR: usize>(
    at: (*const W, *const f32, usize, usize, usize),
    g: usize,
    scale: Option<[L::V; NR]>,
    acc: &mut [[L::V; MC]; NR],
) {
    let (q, xp, k, n, e0) = at;
    let mut e = e0;
    while e < e0 + g {
        let wv: [L::V; NR] = std::array::from_fn(|r| {
            let v = W::widen::<L>(q.add((n + r) * k + e));
            match scale {
                Some(s) => L::mul(v, s[r]),
                None => v,
            }
        });
        for mi in 0..MC {
            let xv = L::load(xp.add(mi * k + e));
            for r in 0..NR {
                acc[r][mi] = L::fma(xv, wv[r], acc[r][mi]);
            }
        }
        e += L::W;
    }
}

/// Deterministic values in [-1, 1) for the kernels' tests (xorshift).
#[cfg(test)]
pub(crate) fn test_rand(n: usize, seed: u64) -> Vec<f32> {
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

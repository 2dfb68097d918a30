//! The activation rows of one call, in the forms the formats' dot products read, each row
//! quantized on its own (so a row's form does not depend on the other rows of the batch):
//!
//! - [`Q8Rows`] (the 32-value formats; llama.cpp's `block_q8_0` / `block_q8_1`): per block of
//!   32, `d = amax / 127`, `q = round(x * (127 / amax))` (nearest, ties to even), and
//!   `s = d * sum(q)` for the formats with a minimum (Q4_1, Q5_1). Scales f32 (llama.cpp: f16).
//! - [`Q8KRows`] (the K formats; `block_q8_K`): per block of 256, the same rule, plus the sums
//!   of `q` over each 16 values (`bsums`) for the K formats' minimums and offsets.
//!   With [`Forms::Q8P`] also the quants in *pair order* (`qp`, for the Q4_1 octets of
//!   `q32::octets`): per pair of blocks a, b their values four at a time, `a[0..4], b[0..4],
//!   .., a[12..16], b[12..16]`, then the same from value 16; an odd last block as it is.
//! - F32 (float weights): the rows as given.

use rayon::prelude::*;

use crate::threads::pool;

/// Which forms a call needs (a set of flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forms(u8);

impl Forms {
    pub const NONE: Forms = Forms(0);
    pub const F32: Forms = Forms(1);
    pub const Q8: Forms = Forms(2);
    pub const Q8K: Forms = Forms(4);
    /// Q8 and its pair order.
    pub const Q8P: Forms = Forms(8);

    pub fn has(self, f: Forms) -> bool {
        self.0 & f.0 != 0
    }
}

impl std::ops::BitOr for Forms {
    type Output = Forms;
    fn bitor(self, o: Forms) -> Forms {
        Forms(self.0 | o.0)
    }
}

/// Blocks of 32: `qs [m * k]`, `d [m * k / 32]`, `s [m * k / 32]` (= d * sum of the block's qs),
/// and `qp [m * k]` the qs in pair order (empty unless asked for).
#[derive(Debug, Default)]
pub struct Q8Rows {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qp: Vec<i8>,
}

/// One row's quants `qs` in pair order into `qp` (see the module's doc).
fn pair_order(qs: &[i8], qp: &mut [i8]) {
    let pairs = qs.len() / 64;
    for p in 0..pairs {
        let (a, b) = (&qs[64 * p..64 * p + 32], &qs[64 * p + 32..64 * p + 64]);
        let out = &mut qp[64 * p..64 * p + 64];
        for half in 0..2 {
            for g in 0..4 {
                let (src, dst) = (16 * half + 4 * g, 32 * half + 8 * g);
                out[dst..dst + 4].copy_from_slice(&a[src..src + 4]);
                out[dst + 4..dst + 8].copy_from_slice(&b[src..src + 4]);
            }
        }
    }
    qp[64 * pairs..].copy_from_slice(&qs[64 * pairs..]);
}

/// Blocks of 256: `qs [m * k]`, `d [m * k / 256]`, `bsums [m * k / 16]` (i16 sums of 16 qs),
/// `b32 [m * k / 32]` (sums of 32: the Q4_K groups' minimums read them in pairs).
#[derive(Debug, Default)]
pub struct Q8KRows {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub bsums: Vec<i16>,
    pub b32: Vec<i16>,
}

/// A call's activations: `x [m, k]` f32 and the quantized forms its parts need.
#[derive(Debug)]
pub struct Acts<'a> {
    pub x: &'a [f32],
    pub m: usize,
    pub k: usize,
    pub q8: Option<Q8Rows>,
    pub q8k: Option<Q8KRows>,
}

/// Quantize one block of values into `q`: -> d (0 for an all-zero block).
#[inline(always)]
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let id = 127.0 / amax;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

/// One row of [`Q8Rows`]: blocks of 32 of `x` into `qs`, `d`, `s`.
#[inline(always)]
fn q8_row(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    for (b, ((q, d), s)) in qs.chunks_exact_mut(32).zip(d).zip(s).enumerate() {
        *d = quantize_block(&x[32 * b..32 * b + 32], q);
        *s = *d * q.iter().map(|&v| v as i32).sum::<i32>() as f32;
    }
}

/// One row of [`Q8KRows`]: blocks of 256 of `x` into `qs`, `d`, and the sums of 16 `bs`.
#[inline(always)]
fn q8k_row(x: &[f32], qs: &mut [i8], d: &mut [f32], bs: &mut [i16]) {
    for (b, (q, d)) in qs.chunks_exact_mut(256).zip(d).enumerate() {
        *d = quantize_block(&x[256 * b..256 * b + 256], q);
    }
    for (g, sum) in bs.iter_mut().enumerate() {
        *sum = qs[16 * g..16 * g + 16].iter().map(|&v| v as i16).sum();
    }
}

/// [`q8_row`] and [`q8k_row`] compiled for AVX2 (with SSE4.1's rounding instruction): the same
/// IEEE operations, so the same bits, without a libm `rintf` call per value (at batch-1 decode
/// that call was ~4 % of a SmolLM2 step).
#[cfg(target_arch = "x86_64")]
mod simd_rows {
    #[target_feature(enable = "avx2,fma,sse4.1")]
    pub(super) unsafe fn q8_row(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
        super::q8_row(x, qs, d, s)
    }

    #[target_feature(enable = "avx2,fma,sse4.1")]
    pub(super) unsafe fn q8k_row(x: &[f32], qs: &mut [i8], d: &mut [f32], bs: &mut [i16]) {
        super::q8k_row(x, qs, d, bs)
    }
}

/// Whether this CPU runs [`simd_rows`].
fn simd_rows_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("sse4.1")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl<'a> Acts<'a> {
    /// Quantize `x [m, k]` into `forms` (rows in parallel on `num_threads` threads).
    pub fn new(x: &'a [f32], m: usize, k: usize, forms: Forms, num_threads: usize) -> Acts<'a> {
        let q8 = (forms.has(Forms::Q8) && k % 32 == 0)
            .then(|| q8_rows(x, m, k, forms.has(Forms::Q8P), num_threads));
        let q8k = (forms.has(Forms::Q8K) && k % 256 == 0).then(|| q8k_rows(x, m, k, num_threads));
        Acts { x, m, k, q8, q8k }
    }

    /// Row `mi` of x.
    #[inline(always)]
    pub fn row(&self, mi: usize) -> &[f32] {
        &self.x[mi * self.k..(mi + 1) * self.k]
    }
}

fn par_rows(m: usize, k: usize, num_threads: usize, f: impl Fn(usize) + Sync + Send) {
    // quantizing is cheap next to the GEMM: threads only for many rows
    match pool(num_threads).filter(|_| num_threads > 1 && m * k >= 1 << 16) {
        Some(p) => p.install(|| (0..m).into_par_iter().for_each(&f)),
        None => (0..m).for_each(f),
    }
}

#[derive(Clone, Copy)]
struct Ptr<T>(*mut T);
unsafe impl<T> Send for Ptr<T> {}
unsafe impl<T> Sync for Ptr<T> {}
impl<T> Ptr<T> {
    /// `len` elements from `at` (rows of one activation row: disjoint between rows).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

fn q8_rows(x: &[f32], m: usize, k: usize, pairs: bool, num_threads: usize) -> Q8Rows {
    let nb = k / 32;
    let mut r = Q8Rows {
        qs: vec![0; m * k],
        d: vec![0.0; m * nb],
        s: vec![0.0; m * nb],
        qp: if pairs { vec![0; m * k] } else { Vec::new() },
    };
    let simd = simd_rows_available();
    let (qs, d, s, qp) = (
        Ptr(r.qs.as_mut_ptr()),
        Ptr(r.d.as_mut_ptr()),
        Ptr(r.s.as_mut_ptr()),
        Ptr(r.qp.as_mut_ptr()),
    );
    par_rows(m, k, num_threads, |mi| {
        // SAFETY: row mi's ranges are disjoint from every other row's.
        let (qs, d, s) = unsafe {
            (
                qs.slice(mi * k, k),
                d.slice(mi * nb, nb),
                s.slice(mi * nb, nb),
            )
        };
        let x = &x[mi * k..(mi + 1) * k];
        #[cfg(target_arch = "x86_64")]
        let quantized = simd && {
            // SAFETY: simd_rows_available() checked the features
            unsafe { simd_rows::q8_row(x, qs, d, s) };
            true
        };
        #[cfg(not(target_arch = "x86_64"))]
        let quantized = false;
        if !quantized {
            q8_row(x, qs, d, s);
        }
        if pairs {
            // SAFETY: as above (qp has m * k elements when pairs)
            pair_order(qs, unsafe { qp.slice(mi * k, k) });
        }
    });
    r
}

fn q8k_rows(x: &[f32], m: usize, k: usize, num_threads: usize) -> Q8KRows {
    let nb = k / 256;
    let mut r = Q8KRows {
        qs: vec![0; m * k],
        d: vec![0.0; m * nb],
        bsums: vec![0; m * k / 16],
        b32: Vec::new(),
    };
    let simd = simd_rows_available();
    let (qs, d, bs) = (
        Ptr(r.qs.as_mut_ptr()),
        Ptr(r.d.as_mut_ptr()),
        Ptr(r.bsums.as_mut_ptr()),
    );
    par_rows(m, k, num_threads, |mi| {
        // SAFETY: row mi's ranges are disjoint from every other row's.
        let (qs, d, bs) = unsafe {
            (
                qs.slice(mi * k, k),
                d.slice(mi * nb, nb),
                bs.slice(mi * k / 16, k / 16),
            )
        };
        let x = &x[mi * k..(mi + 1) * k];
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: simd_rows_available() checked the features
            return unsafe { simd_rows::q8k_row(x, qs, d, bs) };
        }
        q8k_row(x, qs, d, bs)
    });
    r.b32 = r.bsums.chunks_exact(2).map(|p| p[0] + p[1]).collect();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows with ties (values whose scaled form is exactly n + 0.5), zeros, an all-zero block,
    /// subnormals and signs.
    fn rows(k: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.0137)
            .collect();
        for b in 0..k / 32 {
            // amax 127 in the block: x * (127 / amax) = x, so x = n + 0.5 ties exactly
            x[32 * b] = 127.0;
            x[32 * b + 1] = 2.5;
            x[32 * b + 2] = -3.5;
            x[32 * b + 3] = 1e-40;
        }
        x[32..64].fill(0.0);
        x
    }

    #[test]
    fn simd_rows_equal_portable_rows() {
        if !simd_rows_available() {
            return;
        }
        let k = 512;
        let x = rows(k);
        let (mut qa, mut da, mut sa) = (vec![0i8; k], vec![0f32; k / 32], vec![0f32; k / 32]);
        let (mut qb, mut db, mut sb) = (qa.clone(), da.clone(), sa.clone());
        q8_row(&x, &mut qa, &mut da, &mut sa);
        #[cfg(target_arch = "x86_64")]
        unsafe {
            simd_rows::q8_row(&x, &mut qb, &mut db, &mut sb)
        };
        assert_eq!(qa, qb);
        assert_eq!(
            da.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            db.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            sa.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            sb.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!((qa[1], qa[2]), (2, -4), "ties go to even");
        let (mut qa, mut da, mut ba) = (vec![0i8; k], vec![0f32; k / 256], vec![0i16; k / 16]);
        let (mut qb, mut db, mut bb) = (qa.clone(), da.clone(), ba.clone());
        q8k_row(&x, &mut qa, &mut da, &mut ba);
        #[cfg(target_arch = "x86_64")]
        unsafe {
            simd_rows::q8k_row(&x, &mut qb, &mut db, &mut bb)
        };
        assert_eq!((qa, ba), (qb, bb));
        assert_eq!(
            da.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            db.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}

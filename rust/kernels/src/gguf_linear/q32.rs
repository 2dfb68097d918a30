//! The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) times activations in blocks of 32
//! ([`super::acts::Q8Rows`]): per block an exact int32 dot, then one f32 multiply-add.
//!
//! - Q4_0 / Q5_0 / Q8_0: `d_w * d_x * sum(q_w * q_x)` (q_w with its offset removed: -8, -16).
//! - Q4_1 / Q5_1: `d_w * d_x * sum(q_w * q_x) + m_w * s_x` (q_w unsigned, s_x = d_x * sum(q_x)).
//!
//! Both paths unpack a weight block once and apply it to each of the `mc` activation rows, each
//! row with its own accumulators and the same operations in the same order whatever `mc`, `m0`
//! and the other rows (batch invariance); the AVX2 path is generic over the row count.
//!
//! - Portable: per row one f32 accumulator, per block `acc = fma(dot, d_w * d_x, acc)` then
//!   (Q4_1, Q5_1) `acc = fma(m_w, s_x, acc)`, blocks in order.
//! - AVX2 (llama.cpp's technique for these dots): a block's 32 weights as bytes (the nibbles of
//!   16 bytes spread over 32 by a variable shift, Q5's fifth bits expanded from `qh` by a byte
//!   shuffle and a compare), `vpmaddubsw` of the unsigned weights (Q4_1, Q5_1: 0..31) or of
//!   |q_w| against q_x given q_w's sign (Q4_0, Q5_0, Q8_0; |q_w| <= 128, |q_x| <= 127: a pair
//!   sums to at most 32512, no saturation) into 16 i16 pair sums. Blocks go in pairs: the two
//!   blocks' sums are interleaved and added down to eight exact i32 (lanes alternately block a's
//!   and block b's), converted once and multiplied-added once by [d_wa * d_xa, d_wb * d_xb] into
//!   a float accumulator, so the per-block float work is half a convert and half an FMA. Per
//!   row two accumulators (pairs alternately: the FMA latency would otherwise bound the decode
//!   loop), the minimums' `m_w * s_x` of eight blocks in one FMA, one horizontal sum at the end.
//!   The decode loop (one row) runs about 13 (Q8_0) to 21 (Q5_0) instructions per block, Q4_0
//!   there multiplying its unsigned nibbles and subtracting 8 x (the same pair sums, exactly).

use super::{Acts, DotFn, Path, ROWS};
use crate::dequant::GgmlType;
use half::f16;

#[path = "q32_octets.rs"]
pub mod octets;

/// Format ids of the const generic parameter (the order of [`BYTES`]).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;

/// Bytes per block of each format id.
const BYTES: [usize; 5] = [18, 20, 22, 24, 34];

/// Whether format `F` has a minimum (`x = d * q + m`).
const fn affine(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

pub(super) fn select_rows(ty: GgmlType, path: Path) -> Option<super::RowsFn> {
    use super::rows_fn;
    match path {
        Path::Scalar => Some(match ty {
            GgmlType::Q4_0 => rows_fn!(scalar::<Q4_0>),
            GgmlType::Q4_1 => rows_fn!(scalar::<Q4_1>),
            GgmlType::Q5_0 => rows_fn!(scalar::<Q5_0>),
            GgmlType::Q5_1 => rows_fn!(scalar::<Q5_1>),
            GgmlType::Q8_0 => rows_fn!(scalar::<Q8_0>),
            GgmlType::Q4_1R => rows_fn!(octets::scalar::<Q4_1>),
            GgmlType::Q4_0R => rows_fn!(octets::scalar::<Q4_0>),
            GgmlType::Q5_0R => rows_fn!(octets::scalar::<Q5_0>),
            _ => return None,
        }),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => {
            if !std::arch::is_x86_feature_detected!("f16c") {
                return select_rows(ty, Path::Scalar);
            }
            Some(match ty {
                GgmlType::Q4_0 => rows_fn!(avx2::<Q4_0>, "avx2,fma,f16c"),
                GgmlType::Q4_1 => rows_fn!(avx2::<Q4_1>, "avx2,fma,f16c"),
                GgmlType::Q5_0 => rows_fn!(avx2::<Q5_0>, "avx2,fma,f16c"),
                GgmlType::Q5_1 => rows_fn!(avx2::<Q5_1>, "avx2,fma,f16c"),
                GgmlType::Q8_0 => rows_fn!(avx2::<Q8_0>, "avx2,fma,f16c"),
                GgmlType::Q4_1R => rows_fn!(octets::avx2::<Q4_1>, "avx2,fma,f16c"),
                GgmlType::Q4_0R => rows_fn!(octets::avx2::<Q4_0>, "avx2,fma,f16c"),
                GgmlType::Q5_0R => rows_fn!(octets::avx2::<Q5_0>, "avx2,fma,f16c"),
                _ => return None,
            })
        }
    }
}

pub(super) fn select(ty: GgmlType, path: Path) -> Option<DotFn> {
    match path {
        Path::Scalar => Some(match ty {
            GgmlType::Q4_0 => scalar::<Q4_0>,
            GgmlType::Q4_1 => scalar::<Q4_1>,
            GgmlType::Q5_0 => scalar::<Q5_0>,
            GgmlType::Q5_1 => scalar::<Q5_1>,
            GgmlType::Q8_0 => scalar::<Q8_0>,
            GgmlType::Q4_1R => octets::scalar::<Q4_1>,
            GgmlType::Q4_0R => octets::scalar::<Q4_0>,
            GgmlType::Q5_0R => octets::scalar::<Q5_0>,
            _ => return None,
        }),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => {
            // every AVX2 CPU has F16C, but Path::Avx2 only checked AVX2 and FMA
            if !std::arch::is_x86_feature_detected!("f16c") {
                return select(ty, Path::Scalar);
            }
            Some(match ty {
                GgmlType::Q4_0 => avx2::<Q4_0>,
                GgmlType::Q4_1 => avx2::<Q4_1>,
                GgmlType::Q5_0 => avx2::<Q5_0>,
                GgmlType::Q5_1 => avx2::<Q5_1>,
                GgmlType::Q8_0 => avx2::<Q8_0>,
                GgmlType::Q4_1R => octets::avx2::<Q4_1>,
                GgmlType::Q4_0R => octets::avx2::<Q4_0>,
                GgmlType::Q5_0R => octets::avx2::<Q5_0>,
                _ => return None,
            })
        }
    }
}

#[inline(always)]
unsafe fn h(p: *const u8) -> f32 {
    f16::from_bits(std::ptr::read_unaligned(p as *const u16)).to_f32()
}

/// Block `blk` of format `F` as its 32 integer weights (offset removed for the symmetric
/// formats) -> (d, m) (m = 0 for the symmetric formats).
#[inline(always)]
unsafe fn decode<const F: u8>(blk: *const u8, q: &mut [i8; 32]) -> (f32, f32) {
    let b = |i: usize| *blk.add(i);
    match F {
        Q4_0 | Q4_1 => {
            let (at, off) = if F == Q4_0 { (2, 8) } else { (4, 0) };
            for j in 0..16 {
                q[j] = (b(at + j) & 0x0F) as i8 - off;
                q[j + 16] = (b(at + j) >> 4) as i8 - off;
            }
        }
        Q5_0 | Q5_1 => {
            let (at, off) = if F == Q5_0 { (2, 16) } else { (4, 0) };
            let qh = u32::from_le(std::ptr::read_unaligned(blk.add(at) as *const u32));
            for j in 0..16 {
                let lo = (b(at + 4 + j) & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (b(at + 4 + j) >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                q[j] = lo as i8 - off;
                q[j + 16] = hi as i8 - off;
            }
        }
        _ => {
            for (j, v) in q.iter_mut().enumerate() {
                *v = b(2 + j) as i8;
            }
        }
    }
    let m = if affine(F) { h(blk.add(2)) } else { 0.0 };
    (h(blk), m)
}

/// The portable path of format `F`.
unsafe fn scalar<const F: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let mut acc = [0.0f32; ROWS];
    scalar_blocks::<F>(w, 0, acts.k / 32, acts, m0, mc, &mut acc);
    out[..mc].copy_from_slice(&acc[..mc]);
}

/// Blocks `b0 .. b0 + n` of a row (the first at `w`, in the file's layout) into `acc`: per row
/// and block `acc = fma(dot, d_w * d_x, acc)`, then (Q4_1, Q5_1) `acc = fma(m_w, s_x, acc)`.
unsafe fn scalar_blocks<const F: u8>(
    w: *const u8,
    b0: usize,
    n: usize,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    acc: &mut [f32; ROWS],
) {
    let q8 = acts.q8.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 32);
    let mut q = [0i8; 32];
    for j in 0..n {
        let b = b0 + j;
        let (dw, mw) = decode::<F>(w.add(BYTES[F as usize] * j), &mut q);
        for (i, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + i;
            let xq = &q8.qs[mi * k + 32 * b..mi * k + 32 * b + 32];
            let mut dot = 0i32;
            for (&wv, &xv) in q.iter().zip(xq) {
                dot += wv as i32 * xv as i32;
            }
            *a = (dot as f32).mul_add(dw * q8.d[mi * nb + b], *a);
            if affine(F) {
                *a = mw.mul_add(q8.s[mi * nb + b], *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Bytes ahead of the read position that the weight row is prefetched (every line; as in
/// `w8a8_linear`: 0, 1 KB and 4 KB measured alike within this machine's noise).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 4096;

/// The AVX2 path of format `F`: one instantiation per row count.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const F: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    match mc {
        4 => avx2_rows::<F, 4>(w, acts, m0, out),
        3 => avx2_rows::<F, 3>(w, acts, m0, out),
        2 => avx2_rows::<F, 2>(w, acts, m0, out),
        _ => avx2_rows::<F, 1>(w, acts, m0, out),
    }
}

/// A weight block unpacked for `vpmaddubsw`: `u` the unsigned operand (the weights, or their
/// magnitudes), `s` the signed weights whose signs go to the activations (symmetric formats).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Unpacked {
    u: __m256i,
    s: __m256i,
}

/// Constants of the unpacking, made once per call.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Consts {
    low4: __m256i,
    /// Shift counts of the nibbles: 0 in the low 128 bits, 4 in the high ones.
    nshift: __m256i,
    /// Byte j: byte j / 8 of the broadcast `qh` (in each 128-bit lane: bytes 0, 1 | 2, 3).
    spread: __m256i,
    /// Byte j: bit j % 8.
    bit: __m256i,
    /// Q4_0: 8; Q5_0: 0xF0 (or-ing it to a nibble subtracts 16); Q5_1: 0x10.
    off: __m256i,
    ones: __m256i,
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn consts<const F: u8>() -> Consts {
    Consts {
        low4: _mm256_set1_epi8(0x0F),
        nshift: _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
        spread: _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
        bit: _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64),
        off: _mm256_set1_epi8(match F {
            Q4_0 => 8,
            Q5_0 => 0xF0u8 as i8,
            _ => 0x10,
        }),
        ones: _mm256_set1_epi16(1),
    }
}

/// 16 bytes of nibbles at `p` -> 32 bytes: the low nibbles, then the high ones.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles(p: *const u8, c: &Consts) -> __m256i {
    // both 128-bit halves hold the 16 bytes; the high half's 32-bit words shift right by 4
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    _mm256_and_si256(_mm256_srlv_epi32(q, c.nshift), c.low4)
}

/// The 32 bits at `p` -> 32 bytes, byte j 0xFF where bit j is set, else 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn bit_bytes(p: *const u8, c: &Consts) -> __m256i {
    let qh = std::ptr::read_unaligned(p as *const i32);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), c.spread);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, c.bit), c.bit)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unpack<const F: u8>(blk: *const u8, c: &Consts, offset_form: bool) -> Unpacked {
    match F {
        Q4_0 if offset_form => {
            let u = nibbles(blk.add(2), c);
            Unpacked { u, s: u }
        }
        Q4_0 => {
            let s = _mm256_sub_epi8(nibbles(blk.add(2), c), c.off);
            Unpacked {
                u: _mm256_sign_epi8(s, s),
                s,
            }
        }
        Q4_1 => {
            let u = nibbles(blk.add(4), c);
            Unpacked { u, s: u }
        }
        Q5_0 => {
            // nibble | 0xF0 (as i8: nibble - 16) where the fifth bit is clear
            let hi = _mm256_andnot_si256(bit_bytes(blk.add(2), c), c.off);
            let s = _mm256_or_si256(nibbles(blk.add(6), c), hi);
            Unpacked {
                u: _mm256_sign_epi8(s, s),
                s,
            }
        }
        Q5_1 => {
            let hi = _mm256_and_si256(bit_bytes(blk.add(4), c), c.off);
            let u = _mm256_or_si256(nibbles(blk.add(8), c), hi);
            Unpacked { u, s: u }
        }
        _ => {
            let s = _mm256_loadu_si256(blk.add(2) as *const __m256i);
            // |-128| = 0x80 read as unsigned 128: still exact
            Unpacked {
                u: _mm256_sign_epi8(s, s),
                s,
            }
        }
    }
}

/// Whether Q4_0 runs in its offset form: the unsigned nibbles times x, minus 8 times x, in place
/// of |q - 8| times x signed by q - 8. The same i16 pair sums (so the same results); per block
/// two instructions fewer on the weights and one more per row: a gain for one row only.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn offset_form<const F: u8, const MC: usize>() -> bool {
    F == Q4_0 && MC == 1
}

/// `vpmaddubsw` of a block against 32 activations: 16 exact i16 sums of 2 products.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pairs<const F: u8>(
    wb: &Unpacked,
    x: *const i8,
    c: &Consts,
    offset_form: bool,
) -> __m256i {
    let x = _mm256_loadu_si256(x as *const __m256i);
    if offset_form {
        // sum (q - 8) x as sum q x - sum 8 x: the same pair sums, exact (|q x pair| <= 3810)
        _mm256_sub_epi16(
            _mm256_maddubs_epi16(wb.u, x),
            _mm256_maddubs_epi16(c.off, x),
        )
    } else if affine(F) {
        _mm256_maddubs_epi16(wb.u, x)
    } else {
        _mm256_maddubs_epi16(wb.u, _mm256_sign_epi8(x, wb.s))
    }
}

/// Two blocks' pair sums -> eight exact i32: lanes 0, 2, 4, 6 block A's, 1, 3, 5, 7 block B's
/// (each the sum of 4 of its 32 products).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn two_blocks<const F: u8>(pa: __m256i, pb: __m256i, c: &Consts) -> __m256i {
    if F == Q8_0 {
        // a pair reaches 2 * 128 * 127: two would overflow i16
        let (a, b) = (_mm256_madd_epi16(pa, c.ones), _mm256_madd_epi16(pb, c.ones));
        _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
    } else {
        // |pair| <= 2 * 31 * 127 (Q5_1): two still fit in i16
        let s = _mm256_add_epi16(_mm256_unpacklo_epi32(pa, pb), _mm256_unpackhi_epi32(pa, pb));
        _mm256_madd_epi16(s, c.ones)
    }
}

/// The f16 pair at `p` (d, m; or d and two bytes of data) -> f32 lanes 0, 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dm(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
}

#[cfg(target_arch = "x86_64")]
use super::hsum;

/// Activation rows `m0 .. m0 + MC` of a call: their int8 values, scales and scaled sums.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Rows {
    xq: *const i8,
    xd: *const f32,
    xs: *const f32,
    k: usize,
    nb: usize,
}

/// Blocks `b, b + 1` (weights at `p`, `dd` = [d_a, d_b] in every 64-bit lane) against every
/// row: per row one FMA of the pair's eight i32 sums by `dd` times the rows' [d_xa, d_xb].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pair<const F: u8, const MC: usize>(
    p: *const u8,
    dd: __m256,
    x: Rows,
    b: usize,
    c: &Consts,
    acc: &mut [__m256; MC],
) {
    let o = offset_form::<F, MC>();
    let (wa, wb) = (
        unpack::<F>(p, c, o),
        unpack::<F>(p.add(BYTES[F as usize]), c, o),
    );
    for (i, a) in acc.iter_mut().enumerate() {
        let xq = x.xq.add(i * x.k + 32 * b);
        let v = two_blocks::<F>(
            pairs::<F>(&wa, xq, c, o),
            pairs::<F>(&wb, xq.add(32), c, o),
            c,
        );
        // [d_xa, d_xb] in every 64-bit lane (the f32 pair need not be 8-byte aligned)
        let dx = _mm256_castpd_ps(_mm256_set1_pd(std::ptr::read_unaligned(
            x.xd.add(i * x.nb + b) as *const f64,
        )));
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dd, dx), *a);
    }
}

/// [d_a, d_b] of two [d, m] pairs, in every 64-bit lane.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dd(u: __m128) -> __m256 {
    _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(u)))
}

/// Eight blocks from `b` (weights at `p`): pairs 0, 2 into `acc0`, 1, 3 into `acc1`, then
/// (Q4_1, Q5_1) the minimums times the rows' scaled sums into `acc0` (one FMA per row).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn octet<const F: u8, const MC: usize>(
    p: *const u8,
    x: Rows,
    b: usize,
    c: &Consts,
    acc0: &mut [__m256; MC],
    acc1: &mut [__m256; MC],
) {
    let bytes = BYTES[F as usize];
    let q = |j: usize| p.add(j * bytes);
    // [d_a, d_b, m_a, m_b] of each pair
    let u: [__m128; 4] = std::array::from_fn(|t| _mm_unpacklo_ps(dm(q(2 * t)), dm(q(2 * t + 1))));
    // every cache line of the octet, PREFETCH_BYTES ahead
    let mut off = 0;
    while PREFETCH_BYTES > 0 && off < 8 * bytes {
        crate::simd::prefetch_l2(p.wrapping_add(PREFETCH_BYTES + off) as *const i8);
        off += 64;
    }
    pair::<F, MC>(q(0), dd(u[0]), x, b, c, acc0);
    pair::<F, MC>(q(2), dd(u[1]), x, b + 2, c, acc1);
    pair::<F, MC>(q(4), dd(u[2]), x, b + 4, c, acc0);
    pair::<F, MC>(q(6), dd(u[3]), x, b + 6, c, acc1);
    if affine(F) {
        let lo = _mm_shuffle_ps::<0b11_10_11_10>(u[0], u[1]);
        let hi = _mm_shuffle_ps::<0b11_10_11_10>(u[2], u[3]);
        let m = _mm256_set_m128(hi, lo);
        for (i, a) in acc0.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.xs.add(i * x.nb + b)), *a);
        }
    }
}

/// The last `n` (< 8) blocks from `b` (weights at `p`), as [`octet`] does them: pairs
/// alternately into `acc0` and `acc1`, a single block (odd n) into `acc1`, then (Q4_1, Q5_1)
/// the minimums' terms into `acc0`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tail<const F: u8, const MC: usize>(
    p: *const u8,
    x: Rows,
    b: usize,
    n: usize,
    c: &Consts,
    acc0: &mut [__m256; MC],
    acc1: &mut [__m256; MC],
) {
    let bytes = BYTES[F as usize];
    let mut j = 0;
    while j + 2 <= n {
        let u = _mm_unpacklo_ps(dm(p.add(j * bytes)), dm(p.add((j + 1) * bytes)));
        let acc = if j % 4 == 0 { &mut *acc0 } else { &mut *acc1 };
        pair::<F, MC>(p.add(j * bytes), dd(u), x, b + j, c, acc);
        j += 2;
    }
    if j < n {
        let q = p.add(j * bytes);
        let o = offset_form::<F, MC>();
        let wb = unpack::<F>(q, c, o);
        let d = _mm256_set1_ps(h(q));
        for (i, a) in acc1.iter_mut().enumerate() {
            let p = pairs::<F>(&wb, x.xq.add(i * x.k + 32 * (b + j)), c, o);
            let v = _mm256_madd_epi16(p, c.ones);
            let s = _mm256_mul_ps(d, _mm256_broadcast_ss(&*x.xd.add(i * x.nb + b + j)));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, *a);
        }
    }
    if affine(F) {
        // the n minimums and scaled sums as vectors, zero past n, built in registers (a scalar
        // store then a vector load of the same bytes stalls on store forwarding: ~20 ns a row)
        let mv = |j: usize| if j < n { h(p.add(j * bytes + 2)) } else { 0.0 };
        let m = _mm256_setr_ps(mv(0), mv(1), mv(2), mv(3), mv(4), mv(5), mv(6), mv(7));
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        for (i, a) in acc0.iter_mut().enumerate() {
            let s = _mm256_maskload_ps(x.xs.add(i * x.nb + b), mask);
            *a = _mm256_fmadd_ps(m, s, *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx2_rows<const F: u8, const MC: usize>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 32);
    let x = Rows {
        xq: q8.qs.as_ptr().add(m0 * k),
        xd: q8.d.as_ptr().add(m0 * nb),
        xs: q8.s.as_ptr().add(m0 * nb),
        k,
        nb,
    };
    let c = consts::<F>();
    let bytes = BYTES[F as usize];
    let mut acc0 = [_mm256_setzero_ps(); MC];
    let mut acc1 = [_mm256_setzero_ps(); MC];
    let mut b = 0;
    while b + 8 <= nb {
        octet::<F, MC>(w.add(bytes * b), x, b, &c, &mut acc0, &mut acc1);
        b += 8;
    }
    if b < nb {
        tail::<F, MC>(w.add(bytes * b), x, b, nb - b, &c, &mut acc0, &mut acc1);
    }
    for i in 0..MC {
        out[i] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
    }
}

#[cfg(test)]
#[path = "q32_tests.rs"]
mod tests;

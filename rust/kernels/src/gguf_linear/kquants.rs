//! The K formats (Q4_K, Q5_K, Q6_K) times activations in blocks of 256
//! ([`super::acts::Q8KRows`]: `qs`, one scale `d_x` per 256, `bsums` per 16). Per super-block
//! of 256 values and activation row, exact int32 sums, then f32 multiply-adds:
//!
//! - Q4_K / Q5_K (value `(d * sc_s) * q - dmin * m_s`, sub-block `s` of 32, `q` unsigned):
//!   `acc += d_x * d * sum_s sc_s * sum_{i in s} q * q_x  -  d_x * dmin * sum_s m_s * bsum32_s`,
//!   `bsum32_s = bsums[2 s] + bsums[2 s + 1]` (the minimum never touches the weights' values).
//! - Q6_K (value `(d * sc_g) * (q - 32)`, group `g` of 16, `q` unsigned 6-bit):
//!   `acc += d_x * d * (sum_g sc_g * sum_{i in g} q * q_x  -  32 * sum_g sc_g * bsums[g])`.
//!
//! Batch invariance: each weight super-block is unpacked once (nibbles, high bits, 6-bit
//! scales) and applied to each of the `mc` activation rows; a row's integer sums are exact and
//! its float operations (two or one multiply-adds per super-block, then one horizontal sum in
//! a fixed order) are the same whatever `mc`, `m0` or the other rows. The AVX2 path keeps
//! eight f32 lanes per row (each lane a fixed share of the super-block's products) and adds
//! them once at the end; the scalar path one f32 per row. The two paths agree to f32
//! rounding, not bit for bit.
//!
//! The AVX2 integer products go through `vpmaddubsw` (unsigned weight values <= 63 times
//! signed activations |q_x| <= 127: pairs <= 16002, no saturation), then `vpmaddwd` with the
//! sub-block's scale (Q4_K / Q5_K: one per 32-value vector; Q6_K: one per 128-bit half).

use super::{Acts, DotFn, Path, ROWS};
use crate::dequant::GgmlType;
use half::f16;

pub(super) fn select(ty: GgmlType, path: Path) -> Option<DotFn> {
    Some(match (ty, path) {
        (GgmlType::Q4K, Path::Scalar) => q45k_scalar::<false>,
        (GgmlType::Q5K, Path::Scalar) => q45k_scalar::<true>,
        (GgmlType::Q6K, Path::Scalar) => q6k_scalar,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q4K, Path::Avx2) => q4k_avx2,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q5K, Path::Avx2) => q5k_avx2,
        #[cfg(target_arch = "x86_64")]
        (GgmlType::Q6K, Path::Avx2) => q6k_avx2,
        _ => return None,
    })
}

/// Bytes per super-block.
const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

/// Bytes ahead of the read position that the weight stream is prefetched.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 4096;

#[inline(always)]
unsafe fn h(p: *const u8) -> f32 {
    f16::from_bits(std::ptr::read_unaligned(p as *const u16)).to_f32()
}

/// The 12 packed scale bytes of Q4_K / Q5_K as four words: bytes 0..8 the eight 6-bit scales,
/// bytes 8..16 the eight 6-bit mins (the layout of `dequant::scale_min_k4`, four bytes at once).
#[inline(always)]
unsafe fn scales_mins(p: *const u8) -> [u32; 4] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let a = std::ptr::read_unaligned(p as *const u32); // low 6 bits: scales 0..4; top 2: scales 4..8
    let b = std::ptr::read_unaligned(p.add(4) as *const u32); // mins 0..4; top 2: mins 4..8
    let c = std::ptr::read_unaligned(p.add(8) as *const u32); // low nibbles: scales 4..8; high: mins 4..8
    [
        a & LOW6,
        (c & LOW4) | (((a >> 6) & LOW2) << 4),
        b & LOW6,
        ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
    ]
}

// ---------------------------------------------------------------------------------------------
// Portable path

/// Q4_K (144-byte blocks: d, dmin, scales[12], qs[128]) or Q5_K (`FIVE`; 176: d, dmin,
/// scales[12], qh[32], qs[128]).
unsafe fn q45k_scalar<const FIVE: bool>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let bytes = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let mut acc = [0.0f32; ROWS];
    let mut q = [0u8; 256];
    for b in 0..nb {
        let blk = w.add(b * bytes);
        let (d, dmin) = (h(blk), h(blk.add(2)));
        let sm: [u8; 16] = std::mem::transmute(scales_mins(blk.add(4)));
        let qs = std::slice::from_raw_parts(blk.add(if FIVE { 48 } else { 16 }), 128);
        let qh = std::slice::from_raw_parts(blk.add(16), if FIVE { 32 } else { 0 });
        for s in 0..8 {
            let src = &qs[32 * (s / 2)..32 * (s / 2) + 32];
            for i in 0..32 {
                let mut v = (src[i] >> (4 * (s % 2))) & 0x0F;
                if FIVE {
                    v |= ((qh[i] >> s) & 1) << 4;
                }
                q[32 * s + i] = v;
            }
        }
        for (r, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + r;
            let x = &q8.qs[mi * k + 256 * b..mi * k + 256 * b + 256];
            let bs = &q8.bsums[mi * (k / 16) + 16 * b..mi * (k / 16) + 16 * b + 16];
            let (mut sumi, mut summ) = (0i32, 0i32);
            for s in 0..8 {
                let dot: i32 = q[32 * s..32 * s + 32]
                    .iter()
                    .zip(&x[32 * s..32 * s + 32])
                    .map(|(&qv, &xv)| qv as i32 * xv as i32)
                    .sum();
                sumi += sm[s] as i32 * dot;
                summ += sm[8 + s] as i32 * (bs[2 * s] as i32 + bs[2 * s + 1] as i32);
            }
            let dx = q8.d[mi * nb + b];
            *a = (sumi as f32).mul_add(d * dx, *a);
            *a = (summ as f32).mul_add(-(dmin * dx), *a);
        }
    }
    out[..mc].copy_from_slice(&acc[..mc]);
}

/// Q6_K (210-byte blocks: ql[128], qh[64], scales (i8)[16], d).
unsafe fn q6k_scalar(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let mut acc = [0.0f32; ROWS];
    let mut q = [0u8; 256];
    for b in 0..nb {
        let blk = std::slice::from_raw_parts(w.add(b * Q6K_BYTES), Q6K_BYTES);
        let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
        let d = h(blk.as_ptr().add(208));
        for (v, qv) in q.iter_mut().enumerate() {
            let (c, r) = (v / 128, v % 128);
            let lo = (ql[64 * c + r % 64] >> (4 * (r / 64))) & 0x0F;
            let hi = (qh[32 * c + r % 32] >> (2 * (r / 32))) & 0x03;
            *qv = lo | (hi << 4);
        }
        for (r, a) in acc.iter_mut().enumerate().take(mc) {
            let mi = m0 + r;
            let x = &q8.qs[mi * k + 256 * b..mi * k + 256 * b + 256];
            let bs = &q8.bsums[mi * (k / 16) + 16 * b..mi * (k / 16) + 16 * b + 16];
            let mut sumi = 0i32;
            for g in 0..16 {
                let dot: i32 = q[16 * g..16 * g + 16]
                    .iter()
                    .zip(&x[16 * g..16 * g + 16])
                    .map(|(&qv, &xv)| qv as i32 * xv as i32)
                    .sum();
                sumi += (sc[g] as i8) as i32 * (dot - 32 * bs[g] as i32);
            }
            *a = (sumi as f32).mul_add(d * q8.d[mi * nb + b], *a);
        }
    }
    out[..mc].copy_from_slice(&acc[..mc]);
}

// ---------------------------------------------------------------------------------------------
// AVX2 path

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_avx2(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    match mc {
        4 => q45k_avx2_rows::<4, false>(w, acts, m0, out),
        3 => q45k_avx2_rows::<3, false>(w, acts, m0, out),
        2 => q45k_avx2_rows::<2, false>(w, acts, m0, out),
        _ => q45k_avx2_rows::<1, false>(w, acts, m0, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_avx2(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    match mc {
        4 => q45k_avx2_rows::<4, true>(w, acts, m0, out),
        3 => q45k_avx2_rows::<3, true>(w, acts, m0, out),
        2 => q45k_avx2_rows::<2, true>(w, acts, m0, out),
        _ => q45k_avx2_rows::<1, true>(w, acts, m0, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_avx2(w: *const u8, acts: &Acts<'_>, m0: usize, mc: usize, out: &mut [f32; ROWS]) {
    match mc {
        4 => q6k_avx2_rows::<4>(w, acts, m0, out),
        3 => q6k_avx2_rows::<3>(w, acts, m0, out),
        2 => q6k_avx2_rows::<2>(w, acts, m0, out),
        _ => q6k_avx2_rows::<1>(w, acts, m0, out),
    }
}

/// The sum of the eight lanes, in one fixed order (the same for every row count).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `vpshufb` masks: 0 .. 8 broadcast i16 lane `s` of a 128-bit half; 8: the bytes 8 .. 16
/// duplicated (`[8, 8, 9, 9, .., 15, 15]`, twice); 9 .. 17: for Q6_K's group pairs
/// `(2 t, 2 t + 1)` of a 128-value half (`t` = 0 .. 4, then again for the second
/// half's scales), i16 lane `2 t` in the low 128 bits and `2 t + 1` in the high.
#[cfg(target_arch = "x86_64")]
static PICK_I16: [[u8; 32]; 13] = {
    let mut m = [[0u8; 32]; 13];
    let mut s = 0;
    while s < 8 {
        let mut i = 0;
        while i < 16 {
            m[s][2 * i] = 2 * s as u8;
            m[s][2 * i + 1] = 2 * s as u8 + 1;
            i += 1;
        }
        s += 1;
    }
    let mut i = 0;
    while i < 32 {
        m[8][i] = 8 + (i % 16) as u8 / 2;
        i += 1;
    }
    let mut t = 0;
    while t < 4 {
        let mut i = 0;
        while i < 8 {
            m[9 + t][2 * i] = 4 * t as u8;
            m[9 + t][2 * i + 1] = 4 * t as u8 + 1;
            m[9 + t][16 + 2 * i] = 4 * t as u8 + 2;
            m[9 + t][16 + 2 * i + 1] = 4 * t as u8 + 3;
            i += 1;
        }
        t += 1;
    }
    m
};

/// `p`, hidden from the optimizer (so loads through it are not constant-folded).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn opaque<T>(mut p: *const T) -> *const T {
    // SAFETY: an empty asm statement that only "modifies" a register.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) p, options(pure, nomem, nostack, preserves_flags))
    };
    p
}

/// [`scales_mins`] in SSE registers: bytes 0 .. 8 the scales, 8 .. 16 the mins (reads 16
/// bytes from `p`, the block's bytes 4 .. 20).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scales_mins_sse(p: *const u8) -> __m128i {
    let v = _mm_loadu_si128(p as *const __m128i); // words a, b, c (and one more)
    let acbc = _mm_shuffle_epi32::<0b10_01_10_00>(v);
    let aabb = _mm_shuffle_epi32::<0b01_01_00_00>(v);
    let low6 = _mm_and_si128(acbc, _mm_set1_epi8(0x3F)); // words 0, 2: a & 0x3F.., b & 0x3F..
    let high = _mm_or_si128(
        _mm_and_si128(
            _mm_srlv_epi32(acbc, _mm_set_epi32(4, 0, 0, 0)),
            _mm_set1_epi8(0x0F),
        ),
        _mm_and_si128(_mm_srli_epi32::<2>(aabb), _mm_set1_epi8(0x30)),
    ); // words 1, 3: c's nibbles with a's, b's top two bits
    _mm_blend_epi32::<0b1010>(low6, high)
}

/// Prefetch the super-block `bytes` ahead of `blk` into L2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_block(blk: *const u8, bytes: usize) {
    let p = blk.wrapping_add(PREFETCH_BYTES);
    let mut off = 0;
    while off < bytes {
        crate::simd::prefetch_l2(p.wrapping_add(off) as *const i8);
        off += 64;
    }
}

/// Q4_K / Q5_K (`FIVE`) weight row against activation rows m0 .. m0 + MC.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q45k_avx2_rows<const MC: usize, const FIVE: bool>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let bytes = if FIVE { Q5K_BYTES } else { Q4K_BYTES };
    let xq = q8.qs.as_ptr().add(m0 * k);
    let xd = q8.d.as_ptr().add(m0 * nb);
    let xs = q8.bsums.as_ptr().add(m0 * (k / 16));
    let low4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    // (opaque to the compiler, so each pick stays one vpshufb)
    let pick = opaque(PICK_I16.as_ptr());
    let mut acc = [_mm256_setzero_ps(); MC];
    for b in 0..nb {
        let blk = w.add(b * bytes);
        prefetch_block(blk, bytes);
        // d, dmin
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            blk as *const i32,
        )));
        let (d, dmin) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
        let sm = scales_mins_sse(blk.add(4));
        // scales as i16 in both 128-bit halves (for the per-sub-block broadcasts)
        let sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        // mins as i16 pairs [m0, m0, m1, m1, .., m7, m7], for madd with the sums of 16
        let mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
            sm,
            _mm_loadu_si128(pick.add(8) as *const __m128i),
        ));
        let qs = blk.add(if FIVE { 48 } else { 16 });
        let mut hb = if FIVE {
            _mm256_loadu_si256(blk.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = [_mm256_setzero_si256(); MC];
        for j in 0..4 {
            // sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles) of qs[32 j ..][..32]
            let bits = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
            let mut lo = _mm256_and_si256(bits, low4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), low4);
            if FIVE {
                // hb holds sub-block 2j's fifth bits at bit 0 of each byte, 2j + 1's at bit 1
                // (the bits a 16-bit shift carries across bytes never land on bit 4)
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(hb), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(hb), bit4));
                hb = _mm256_srli_epi16::<2>(hb);
            }
            let s_lo =
                _mm256_shuffle_epi8(sc16, _mm256_loadu_si256(pick.add(2 * j) as *const __m256i));
            let s_hi = _mm256_shuffle_epi8(
                sc16,
                _mm256_loadu_si256(pick.add(2 * j + 1) as *const __m256i),
            );
            for (r, si) in sumi.iter_mut().enumerate() {
                let x = xq.add(r * k + 256 * b + 64 * j);
                let x_lo = _mm256_loadu_si256(x as *const __m256i);
                let x_hi = _mm256_loadu_si256(x.add(32) as *const __m256i);
                let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_lo), s_lo);
                let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_hi), s_hi);
                *si = _mm256_add_epi32(*si, _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for (r, a) in acc.iter_mut().enumerate() {
            let dx = *xd.add(r * nb + b);
            let bs = _mm256_loadu_si256(xs.add(r * (k / 16) + 16 * b) as *const __m256i);
            let summ = _mm256_madd_epi16(bs, mins);
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), *a);
            *a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_set1_ps(dmin * dx), *a);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = hsum(*a);
    }
}

/// Q6_K weight row against activation rows m0 .. m0 + MC.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn q6k_avx2_rows<const MC: usize>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    out: &mut [f32; ROWS],
) {
    let q8 = acts.q8k.as_ref().unwrap_unchecked();
    let (k, nb) = (acts.k, acts.k / 256);
    let xq = q8.qs.as_ptr().add(m0 * k);
    let xd = q8.d.as_ptr().add(m0 * nb);
    let xs = q8.bsums.as_ptr().add(m0 * (k / 16));
    let low4 = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    // (opaque to the compiler, so each pick stays one vpshufb)
    let pick = opaque(PICK_I16.as_ptr());
    let mut acc = [_mm256_setzero_ps(); MC];
    for b in 0..nb {
        let blk = w.add(b * Q6K_BYTES);
        prefetch_block(blk, Q6K_BYTES);
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            blk.add(208) as *const u16
        ) as i32)));
        let sc8 = _mm_loadu_si128(blk.add(192) as *const __m128i);
        let mut sumi = [_mm256_setzero_si256(); MC];
        for c in 0..2 {
            // the half's eight scales as i16, in both 128-bit halves
            let sc_c = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(if c == 0 {
                sc8
            } else {
                _mm_srli_si128::<8>(sc8)
            }));
            let ql0 = _mm256_loadu_si256(blk.add(64 * c) as *const __m256i);
            let ql1 = _mm256_loadu_si256(blk.add(64 * c + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(blk.add(128 + 32 * c) as *const __m256i);
            // values 128 c + 32 t + i: low 4 bits from ql, bits 4..6 from qh bits 2t, 2t + 1
            // (a 16-bit shift's bits carried across bytes never land on bits 4, 5)
            let q = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, low4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                    _mm256_and_si256(qh, bits45),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), bits45),
                ),
            ];
            for (t, &qt) in q.iter().enumerate() {
                // groups 8 c + 2 t (low 128 bits) and 8 c + 2 t + 1 (high 128 bits)
                let s = _mm256_shuffle_epi8(
                    sc_c,
                    _mm256_loadu_si256(pick.add(9 + t) as *const __m256i),
                );
                for (r, si) in sumi.iter_mut().enumerate() {
                    let x = _mm256_loadu_si256(
                        xq.add(r * k + 256 * b + 128 * c + 32 * t) as *const __m256i
                    );
                    *si = _mm256_add_epi32(*si, _mm256_madd_epi16(_mm256_maddubs_epi16(qt, x), s));
                }
            }
        }
        // the offset: 32 * sum_g sc_g * bsums[g]
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        for (r, a) in acc.iter_mut().enumerate() {
            let dx = *xd.add(r * nb + b);
            let bs = _mm256_loadu_si256(xs.add(r * (k / 16) + 16 * b) as *const __m256i);
            let off = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16));
            let si = _mm256_sub_epi32(sumi[r], off);
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(d * dx), *a);
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = hsum(*a);
    }
}

#[cfg(test)]
#[path = "kquants_tests.rs"]
mod tests;

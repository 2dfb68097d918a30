//! Q4_1, Q4_0 and Q5_0 repacked at load into *octets* ([`GgmlType::Q4_1R`],
//! [`GgmlType::Q4_0R`], [`GgmlType::Q5_0R`]):
//! the same bytes as the file's blocks, not one more, arranged so that the decode loop does
//! less work per block.
//!
//! A row's blocks go in groups of eight (an octet, as many bytes as eight blocks): the eight
//! scales `d` (f16), for Q4_1 the eight minimums `m` (f16), then four *pairs* of 32 bytes:
//! pair p holds blocks a = 2p and b = 2p + 1 as their quant bytes interleaved four at a time
//! (`a.qs[0..4], b.qs[0..4], a.qs[4..8], b.qs[4..8], ...`). The blocks after the last whole
//! octet go the same way as a *short group* of 2, 4 or 6 (its scales, its minimums, its pairs:
//! a row of 576 values is two octets and a group of 2); only an odd last block stays in the
//! file's layout. [`repack_rows`] and [`unpack_group`] convert.
//!
//! The AVX2 decode of a pair: one 32-byte load, the low nibbles (`and`) and the high ones
//! (`shift`, `and`), two `vpmaddubsw` against the activations in the matching *pair order*
//! ([`super::acts::Q8Rows::qp`]: per pair of blocks, `xa[0..4], xb[0..4], ...` then the same
//! from value 16), one `vpaddw` and one `vpmaddwd`: eight exact i32 sums, lanes alternately
//! block a's and b's, with no shuffles. An octet's eight scales are converted at once and
//! multiplied by the activations' eight scales in one product; each pair takes its two by a
//! lane permute. Against [`super::q32`]'s Q4_1 loop (broadcast, variable shift and mask per
//! block, two unpacks per pair, the f16 scales converted pair by pair) that is about 7 in
//! place of 11 instructions a block. Q4_0 (`x = d (q - 8)`) is Q4_1 with `m = -8 d`: the same
//! loop, its minimums computed from the scales.
//!
//! Q5_0 (`x = d (q - 16)`, `q` five bits) is Q4_0 with `m = -16 d` and a fifth bit per value: a
//! group keeps, after its scales, each pair's 64 fifth bits in the pair's byte order
//! ([`pair_bits`]: bit `q` for byte `q` of the low nibbles, `32 + q` of the high ones), so a
//! pair's bits become bytes of 0x10 with one broadcast, `vpshufb`, `and`, `vpcmpeqb`, `and` per
//! 32 bytes, or-ed onto the nibbles (values <= 31: a pair of products <= 7874). 4096^2, one
//! thread, m=1: 16.1 vs 11.8 GB/s for the file layout's loop (its ~21 instructions a block).
//!
//! Every row count (1 to [`ROWS`] activation rows) runs the same operations in the same order
//! per output, so the results do not depend on the batch (greedy speculation stays exact).

use super::{Acts, BYTES, Q4_0, Q4_1, Q5_0, ROWS};
use crate::dequant::GgmlType;

/// The largest octet (eight Q5_0 blocks).
pub const OCTET: usize = 176;

/// Where a file-layout block of format `F` keeps its quants (after d, and m for Q4_1, qh for
/// Q5_0); a group of `n` blocks keeps its pairs after as many bytes (`qs_at(F) * n`).
const fn qs_at(f: u8) -> usize {
    match f {
        Q4_1 => 4,
        Q5_0 => 6,
        _ => 2,
    }
}

/// Pair `p`'s fifth bits (Q5_0) in the pairs' byte order: bit `q` (< 32) for byte `q` of the
/// low nibbles, bit `32 + q` for the high ones; byte `q` holds value `4 (q / 8) + q % 4` of
/// block a (`q % 8 < 4`) or b. `qa`, `qb`: the blocks' `qh` (bit i: value i's fifth bit).
fn pair_bits(qa: u32, qb: u32) -> u64 {
    let mut w = 0u64;
    for q in 0..32 {
        let (h, i) = (if q % 8 < 4 { qa } else { qb }, 4 * (q / 8) + q % 4);
        w |= (((h >> i) & 1) as u64) << q | (((h >> (16 + i)) & 1) as u64) << (32 + q);
    }
    w
}

/// [`pair_bits`] back to the two blocks' `qh`.
fn block_bits(w: u64) -> (u32, u32) {
    let (mut qa, mut qb) = (0u32, 0u32);
    for q in 0..32 {
        let h = if q % 8 < 4 { &mut qa } else { &mut qb };
        let i = 4 * (q / 8) + q % 4;
        *h |= (((w >> q) & 1) as u32) << i | (((w >> (32 + q)) & 1) as u32) << (16 + i);
    }
    (qa, qb)
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// The format id of a file type or of its repacked type.
fn format(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_0R => Some(Q4_0),
        GgmlType::Q4_1 | GgmlType::Q4_1R => Some(Q4_1),
        GgmlType::Q5_0 | GgmlType::Q5_0R => Some(Q5_0),
        _ => None,
    }
}

/// A group of `n` (2, 4, 6 or 8) file-layout blocks of format `F` (`src`) into `dst`: the
/// scales, (Q4_1) the minimums, (Q5_0) the pairs' fifth bits, the pairs.
fn pack_group<const F: u8>(src: &[u8], dst: &mut [u8], n: usize) {
    let (bb, at) = (BYTES[F as usize], qs_at(F));
    for j in 0..n {
        let b = &src[bb * j..bb * (j + 1)];
        dst[2 * j..2 * j + 2].copy_from_slice(&b[0..2]);
        if F == Q4_1 {
            dst[2 * n + 2 * j..2 * n + 2 * j + 2].copy_from_slice(&b[2..4]);
        }
    }
    if F == Q5_0 {
        for p in 0..n / 2 {
            let w = pair_bits(
                le32(&src[bb * 2 * p + 2..]),
                le32(&src[bb * (2 * p + 1) + 2..]),
            );
            dst[2 * n + 8 * p..2 * n + 8 * p + 8].copy_from_slice(&w.to_le_bytes());
        }
    }
    for p in 0..n / 2 {
        let (a, b) = (&src[bb * 2 * p + at..], &src[bb * (2 * p + 1) + at..]);
        let out = &mut dst[at * n + 32 * p..at * n + 32 * p + 32];
        for g in 0..4 {
            out[8 * g..8 * g + 4].copy_from_slice(&a[4 * g..4 * g + 4]);
            out[8 * g + 4..8 * g + 8].copy_from_slice(&b[4 * g..4 * g + 4]);
        }
    }
}

fn unpack<const F: u8>(src: &[u8], n: usize) -> [u8; OCTET] {
    let (bb, at) = (BYTES[F as usize], qs_at(F));
    let mut dst = [0u8; OCTET];
    for j in 0..n {
        let b = &mut dst[bb * j..bb * (j + 1)];
        b[0..2].copy_from_slice(&src[2 * j..2 * j + 2]);
        if F == Q4_1 {
            b[2..4].copy_from_slice(&src[2 * n + 2 * j..2 * n + 2 * j + 2]);
        }
    }
    if F == Q5_0 {
        for p in 0..n / 2 {
            let w = u64::from_le_bytes(src[2 * n + 8 * p..2 * n + 8 * p + 8].try_into().unwrap());
            let (qa, qb) = block_bits(w);
            dst[bb * 2 * p + 2..bb * 2 * p + 6].copy_from_slice(&qa.to_le_bytes());
            dst[bb * (2 * p + 1) + 2..bb * (2 * p + 1) + 6].copy_from_slice(&qb.to_le_bytes());
        }
    }
    for p in 0..n / 2 {
        let pair = &src[at * n + 32 * p..at * n + 32 * p + 32];
        for g in 0..4 {
            let a = bb * 2 * p + at + 4 * g;
            dst[a..a + 4].copy_from_slice(&pair[8 * g..8 * g + 4]);
            let b = bb * (2 * p + 1) + at + 4 * g;
            dst[b..b + 4].copy_from_slice(&pair[8 * g + 4..8 * g + 8]);
        }
    }
    dst
}

/// A group of `n` blocks of `ty` (Q4_0 / Q4_1 / Q5_0 or their repacked types; `src` its
/// bytes) back to the file's layout (the first `n` blocks of the result).
pub fn unpack_group(ty: GgmlType, src: &[u8], n: usize) -> [u8; OCTET] {
    match format(ty) {
        Some(Q4_0) => unpack::<Q4_0>(src, n),
        Some(Q5_0) => unpack::<Q5_0>(src, n),
        _ => unpack::<Q4_1>(src, n),
    }
}

/// The groups of a row of `nb` blocks: (first block, blocks) of each, octets then a short
/// group (an odd last block is in none).
pub fn groups(nb: usize) -> impl Iterator<Item = (usize, usize)> {
    let short = (nb % 8) & !1;
    (0..nb / 8)
        .map(|o| (8 * o, 8))
        .chain((short > 0).then_some((nb / 8 * 8, short)))
}

/// `rows` rows of `k` values of file-layout Q4_0, Q4_1 or Q5_0 (`ty`, `src`) into groups (`dst`,
/// the same size).
pub fn repack_rows(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    k: usize,
    dst: &mut [u8],
) -> Result<(), String> {
    match ty {
        GgmlType::Q4_0 => repack::<Q4_0>(src, rows, k, dst),
        GgmlType::Q4_1 => repack::<Q4_1>(src, rows, k, dst),
        GgmlType::Q5_0 => repack::<Q5_0>(src, rows, k, dst),
        _ => Err(format!("{ty:?} has no repacked layout")),
    }
}

fn repack<const F: u8>(src: &[u8], rows: usize, k: usize, dst: &mut [u8]) -> Result<(), String> {
    if k % 32 != 0 {
        return Err(format!("a row of {k} values is not whole blocks of 32"));
    }
    let bb = BYTES[F as usize];
    let rb = k / 32 * bb;
    if src.len() != rows * rb || dst.len() != src.len() {
        return Err(format!(
            "repack: {} source and {} destination bytes for {rows} rows of {rb}",
            src.len(),
            dst.len()
        ));
    }
    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(rb)) {
        let mut end = 0;
        for (b0, n) in groups(k / 32) {
            pack_group::<F>(&s[bb * b0..], &mut d[bb * b0..], n);
            end = bb * (b0 + n);
        }
        d[end..].copy_from_slice(&s[end..]);
    }
    Ok(())
}

/// The portable path: each group unpacked to file-layout blocks, then [`super::q32`]'s.
pub(super) unsafe fn scalar<const F: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let (nb, bb) = (acts.k / 32, BYTES[F as usize]);
    let mut acc = [0.0f32; ROWS];
    let mut end = 0;
    for (b0, n) in groups(nb) {
        let blocks = unpack::<F>(std::slice::from_raw_parts(w.add(bb * b0), bb * n), n);
        super::scalar_blocks::<F>(blocks.as_ptr(), b0, n, acts, m0, mc, &mut acc);
        end = b0 + n;
    }
    super::scalar_blocks::<F>(w.add(bb * end), end, nb - end, acts, m0, mc, &mut acc);
    out[..mc].copy_from_slice(&acc[..mc]);
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The AVX2 path: one instantiation per row count.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn avx2<const F: u8>(
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

/// The `P` pairs at `wp` of a group whose first block is `b`: `d8` / `m8` its scales and
/// minimums, `xd(i)` / `xs(i)` activation row i's scales and scaled sums of its blocks (zero past
/// the group). Per row: the minimums' terms into `acc0`, then pair p's products times its two
/// scales into `acc0` (p even) or `acc1` (p odd).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<const F: u8, const MC: usize, const P: usize>(
    wp: *const u8,
    qh: *const u8,
    b: usize,
    d8: __m256,
    m8: __m256,
    xd: impl Fn(usize) -> __m256,
    xs: impl Fn(usize) -> __m256,
    xp: *const i8,
    k: usize,
    idx: &[__m256i; 4],
    acc0: &mut [__m256; MC],
    acc1: &mut [__m256; MC],
) {
    let low4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut sd = [_mm256_setzero_ps(); MC];
    for i in 0..MC {
        sd[i] = _mm256_mul_ps(d8, xd(i));
        acc0[i] = _mm256_fmadd_ps(m8, xs(i), acc0[i]);
    }
    for (pp, ix) in idx.iter().enumerate().take(P) {
        let wv = _mm256_loadu_si256(wp.add(32 * pp) as *const __m256i);
        let mut lo = _mm256_and_si256(wv, low4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), low4);
        if F == Q5_0 {
            let bits = std::ptr::read_unaligned(qh.add(8 * pp) as *const u64);
            lo = _mm256_or_si256(lo, fifth_bits(bits as u32));
            hi = _mm256_or_si256(hi, fifth_bits((bits >> 32) as u32));
        }
        for i in 0..MC {
            let xq = xp.add(i * k + 32 * (b + 2 * pp));
            let s16 = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256(xq as *const __m256i)),
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xq.add(32) as *const __m256i)),
            );
            let v = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
            let s = _mm256_permutevar8x32_ps(sd[i], *ix);
            if pp % 2 == 0 {
                acc0[i] = _mm256_fmadd_ps(v, s, acc0[i]);
            } else {
                acc1[i] = _mm256_fmadd_ps(v, s, acc1[i]);
            }
        }
    }
}

/// 32 fifth bits (a pair's low or high nibbles' half of [`pair_bits`]) as bytes of 0x10 / 0.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    // byte q takes byte q / 8 of the word, then its bit q % 8
    let spread = _mm256_setr_epi64x(
        0,
        0x0101_0101_0101_0101,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let v = _mm256_and_si256(
        _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), spread),
        bit,
    );
    _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10))
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
    let x = super::Rows {
        xq: q8.qs.as_ptr().add(m0 * k),
        xd: q8.d.as_ptr().add(m0 * nb),
        xs: q8.s.as_ptr().add(m0 * nb),
        k,
        nb,
    };
    let xp = q8.qp.as_ptr().add(m0 * k);
    let idx: [__m256i; 4] = std::array::from_fn(|p| {
        let (a, b) = (2 * p as i32, 2 * p as i32 + 1);
        _mm256_setr_epi32(a, b, a, b, a, b, a, b)
    });
    let mut acc0 = [_mm256_setzero_ps(); MC];
    let mut acc1 = [_mm256_setzero_ps(); MC];
    let (bb, at) = (BYTES[F as usize], qs_at(F));
    let octet = 8 * bb;
    // Q4_0's minimums: -8 d
    let minimums = |d8: __m256, at_m: *const u8, half: Option<__m128i>| {
        if F == Q5_0 {
            _mm256_mul_ps(d8, _mm256_set1_ps(-16.0))
        } else if F == Q4_1 {
            _mm256_cvtph_ps(match half {
                None => _mm_loadu_si128(at_m as *const __m128i),
                Some(h) => _mm_maskload_epi32(at_m as *const i32, h),
            })
        } else {
            _mm256_mul_ps(d8, _mm256_set1_ps(-8.0))
        }
    };
    let octets = nb / 8;
    for o in 0..octets {
        let p = w.add(octet * o);
        let mut off = 0;
        while off < octet {
            crate::simd::prefetch_l2(p.wrapping_add(super::PREFETCH_BYTES + off) as *const i8);
            off += 64;
        }
        let d8 = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let m8 = minimums(d8, p.add(16), None);
        let (xd, xs) = (
            |i: usize| _mm256_loadu_ps(x.xd.add(i * nb + 8 * o)),
            |i: usize| _mm256_loadu_ps(x.xs.add(i * nb + 8 * o)),
        );
        group::<F, MC, 4>(
            p.add(8 * at),
            p.add(16),
            8 * o,
            d8,
            m8,
            xd,
            xs,
            xp,
            k,
            &idx,
            &mut acc0,
            &mut acc1,
        );
    }
    let short = (nb % 8) & !1;
    if short > 0 {
        // a group of 2, 4 or 6: its scales and minimums, and the activations' sums, by masked
        // loads (lanes past the group read as zero: nothing past the row is touched)
        let (p, b) = (w.add(octet * octets), 8 * octets);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(short as i32), lanes);
        let half = _mm_cmpgt_epi32(_mm_set1_epi32(short as i32 / 2), _mm_setr_epi32(0, 1, 2, 3));
        let d8 = _mm256_cvtph_ps(_mm_maskload_epi32(p as *const i32, half));
        let m8 = minimums(d8, p.add(2 * short), Some(half));
        let (xd, xs) = (
            |i: usize| _mm256_maskload_ps(x.xd.add(i * nb + b), mask),
            |i: usize| _mm256_maskload_ps(x.xs.add(i * nb + b), mask),
        );
        let (wp, qh) = (p.add(at * short), p.add(2 * short));
        match short {
            2 => group::<F, MC, 1>(wp, qh, b, d8, m8, xd, xs, xp, k, &idx, &mut acc0, &mut acc1),
            4 => group::<F, MC, 2>(wp, qh, b, d8, m8, xd, xs, xp, k, &idx, &mut acc0, &mut acc1),
            _ => group::<F, MC, 3>(wp, qh, b, d8, m8, xd, xs, xp, k, &idx, &mut acc0, &mut acc1),
        }
    }
    if nb % 2 == 1 {
        // an odd last block: the file's layout
        let c = super::consts::<F>();
        super::tail::<F, MC>(w.add(bb * (nb - 1)), x, nb - 1, 1, &c, &mut acc0, &mut acc1);
    }
    for i in 0..MC {
        out[i] = super::hsum(_mm256_add_ps(acc0[i], acc1[i]));
    }
}

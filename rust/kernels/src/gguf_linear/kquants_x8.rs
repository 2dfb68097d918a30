//! Q4_K repacked at load in *groups of eight rows* ([`GgmlType::Q4KR`]): the same bytes as the
//! file's super-blocks, not one more, arranged so that one AVX2 lane holds one weight row and
//! the loop needs no shuffle per sub-block.
//!
//! Rows `8 g .. 8 g + 8` of a tensor take the bytes of those eight rows (`8 * row_bytes`), one
//! *group super-block* of 8 x 144 = 1152 bytes per super-block `b` of the row, in order:
//!
//! | bytes | holds |
//! |---|---|
//! | 0 .. 16 | the eight rows' `d` (f16) |
//! | 16 .. 32 | their `dmin` |
//! | 32 .. 64 | word `a` (scale bytes 0 .. 4) of each row |
//! | 64 .. 96 | word `b` (bytes 4 .. 8) of each row |
//! | 96 .. 128 | word `c` (bytes 8 .. 12) of each row |
//! | 128 .. 1152 | for `j` in 0 .. 4, chunk `c` in 0 .. 8, row `r`: the row's quant bytes `qs[32 j + 4 c ..][..4]` |
//!
//! The rows after the last whole group (`n % 8` of them) stay in the file's layout.
//!
//! The AVX2 loop ([`avx2`]), per group super-block: the six-bit scales and minimums of all
//! eight rows unpacked at once (the file's `a`, `b`, `c` words side by side: a dozen
//! instructions for eight rows), then per 32-byte load of quants (four bytes of each row: eight
//! values of sub-block `2 j` in the low nibbles, eight of `2 j + 1` in the high ones) two
//! `vpmaddubsw` against the activations' matching four bytes broadcast to every lane, summed in
//! i16 over the sub-block (16 products of <= 15 * 127: no overflow), then one `vpmaddwd` by the
//! rows' scales per sub-block and one per pair of sub-blocks for the minimums' term. Every
//! lane ends a super-block with its row's exact i32 sums: the float work (d, dmin, the
//! activation's scale) is three lane-wise operations for eight rows, and a row's result is its
//! lane: no horizontal sum. About 34 vector instructions per super-block and row against ~86 for
//! the file layout ([`super::kquants`]), the multiplies 9.5 against 17.
//!
//! Every row count (1 to [`ROWS`] activation rows) runs each output's operations in the same
//! order, so the results do not depend on the batch; they differ from the file layout's kernel
//! only in f32 rounding (one exact i32 sum per super-block instead of eight partial lanes).

use super::{Acts, ROWS};
use crate::dequant::GgmlType;

/// How a format's super-block spreads over its group super-block: its f16 fields (`halves`:
/// their offsets in the block) first, each as eight values (16 bytes), then the block's
/// `words` four-byte words from byte `words_at`: word `i` of row `r` at
/// `16 * halves + 32 i + 4 r`.
#[derive(Clone, Copy, Debug)]
struct Layout {
    name: &'static str,
    block: usize,
    halves: &'static [usize],
    words_at: usize,
    words: usize,
}

/// Q4_K: d, dmin; then the scale words a, b, c and the 32 words of quants (the table above).
const Q4K: Layout = Layout {
    name: "Q4_K",
    block: 144,
    halves: &[0, 2],
    words_at: 4,
    words: 35,
};
/// Bytes of one Q4_K group super-block (eight rows').
pub const GROUP_BLOCK: usize = 8 * 144;

/// The file type a grouped type (or a file type) holds, with its layout.
fn layout(ty: GgmlType) -> Option<(GgmlType, Layout)> {
    match ty {
        GgmlType::Q4K | GgmlType::Q4KR => Some((GgmlType::Q4K, Q4K)),
        _ => None,
    }
}

/// The grouped type of a file type that has one.
pub fn grouped(ty: GgmlType) -> Option<GgmlType> {
    match ty {
        GgmlType::Q4K => Some(GgmlType::Q4KR),
        _ => None,
    }
}

/// Row `r`'s super-block `s` (file layout) into its group super-block `dst`.
#[inline(always)]
fn pack_block(l: &Layout, s: &[u8], r: usize, dst: &mut [u8]) {
    for (f, &at) in l.halves.iter().enumerate() {
        dst[16 * f + 2 * r..16 * f + 2 * r + 2].copy_from_slice(&s[at..at + 2]);
    }
    let base = 16 * l.halves.len() + 4 * r;
    for i in 0..l.words {
        let (to, from) = (base + 32 * i, l.words_at + 4 * i);
        dst[to..to + 4].copy_from_slice(&s[from..from + 4]);
    }
}

/// Row `r` (< 8) of a group super-block `src` back to the file layout.
#[inline(always)]
fn unpack_block(l: &Layout, src: &[u8], r: usize, dst: &mut [u8]) {
    for (f, &at) in l.halves.iter().enumerate() {
        dst[at..at + 2].copy_from_slice(&src[16 * f + 2 * r..16 * f + 2 * r + 2]);
    }
    let base = 16 * l.halves.len() + 4 * r;
    for i in 0..l.words {
        let (from, to) = (base + 32 * i, l.words_at + 4 * i);
        dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
    }
}

fn check(ty: GgmlType, len: usize, rows: usize, k: usize) -> Result<(usize, Layout), String> {
    let Some((_, l)) = layout(ty) else {
        return Err(format!("{ty:?} has no groups of eight rows"));
    };
    if k % 256 != 0 {
        return Err(format!(
            "{}: a row of {k} values is not a whole number of super-blocks",
            l.name
        ));
    }
    let rb = k / 256 * l.block;
    if len != rows * rb {
        return Err(format!(
            "{}: {len} bytes for {rows} rows of {k} values (want {})",
            l.name,
            rows * rb
        ));
    }
    Ok((rb, l))
}

/// `rows` file-layout rows of `k` values of `ty` (Q4_K; `src`) into groups of eight
/// (`dst`, the same size); the last `rows % 8` rows copied as they are. Groups in parallel (a
/// load-time copy: Qwen2.5-1.5B's 626 MB of Q4_K GEMM weights in ~0.2 s on two cores).
pub fn repack_rows(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    k: usize,
    dst: &mut [u8],
) -> Result<(), String> {
    use rayon::prelude::*;
    let (rb, l) = check(ty, src.len(), rows, k)?;
    if dst.len() != src.len() {
        return Err(format!(
            "{} repack: {} bytes out for {} in",
            l.name,
            dst.len(),
            src.len()
        ));
    }
    let full = rows / 8 * 8 * rb;
    let (groups, tail) = dst.split_at_mut(full);
    let pack = |(d, s): (&mut [u8], &[u8])| {
        for (b, out) in d.chunks_exact_mut(8 * l.block).enumerate() {
            for r in 0..8 {
                let at = r * rb + b * l.block;
                pack_block(&l, &s[at..at + l.block], r, out);
            }
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    match crate::threads::pool(threads).filter(|_| threads > 1 && full >= 1 << 20) {
        Some(p) => p.install(|| {
            groups
                .par_chunks_mut(8 * rb)
                .zip(src[..full].par_chunks(8 * rb))
                .for_each(pack)
        }),
        None => groups
            .chunks_mut(8 * rb)
            .zip(src[..full].chunks(8 * rb))
            .for_each(pack),
    }
    tail.copy_from_slice(&src[full..]);
    Ok(())
}

/// Row `row` of a grouped tensor of type `ty` (`rows` rows of `k` values, `src`) in the file
/// layout.
pub fn file_row(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    k: usize,
    row: usize,
) -> Result<Vec<u8>, String> {
    let (rb, l) = check(ty, src.len(), rows, k)?;
    if row >= rows {
        return Err(format!("row {row} is outside the table's {rows} rows"));
    }
    if row >= rows / 8 * 8 {
        return Ok(src[row * rb..(row + 1) * rb].to_vec());
    }
    let group = &src[row / 8 * 8 * rb..(row / 8 + 1) * 8 * rb];
    let mut out = vec![0u8; rb];
    for (b, o) in out.chunks_exact_mut(l.block).enumerate() {
        unpack_block(
            &l,
            &group[b * 8 * l.block..(b + 1) * 8 * l.block],
            row % 8,
            o,
        );
    }
    Ok(out)
}

/// A whole grouped tensor of type `ty` back in the file layout: (the file type, its bytes).
pub fn file_layout(
    ty: GgmlType,
    src: &[u8],
    rows: usize,
    k: usize,
) -> Result<(GgmlType, Vec<u8>), String> {
    let (rb, _) = check(ty, src.len(), rows, k)?;
    let mut out = Vec::with_capacity(src.len());
    for r in 0..rows {
        out.extend_from_slice(&file_row(ty, src, rows, k, r)?);
        debug_assert_eq!(out.len(), (r + 1) * rb);
    }
    Ok((layout(ty).map_or(ty, |(f, _)| f), out))
}

/// The portable path for a grouped type: each group's rows back to the file layout, then the
/// file layout's dot.
#[allow(clippy::too_many_arguments)]
unsafe fn scalar_with(
    l: &Layout,
    dot: super::DotFn,
    w: *const u8,
    row_bytes: usize,
    rows: usize,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut row = vec![0u8; row_bytes];
    let mut tmp = [0.0f32; ROWS];
    let gb = 8 * l.block;
    for r in 0..rows {
        let at = if r < rows / 8 * 8 {
            let group = w.add(r / 8 * 8 * row_bytes);
            for b in 0..row_bytes / l.block {
                let g = std::slice::from_raw_parts(group.add(b * gb), gb);
                unpack_block(l, g, r % 8, &mut row[b * l.block..(b + 1) * l.block]);
            }
            row.as_ptr()
        } else {
            w.add(r * row_bytes)
        };
        dot(at, acts, m0, mc, &mut tmp);
        for (i, &v) in tmp.iter().enumerate().take(mc) {
            *out.add(i * ldo + r) = v;
        }
    }
}

/// The portable rows function of a grouped type.
pub(super) fn scalar_rows(ty: GgmlType) -> Option<super::RowsFn> {
    #[allow(clippy::too_many_arguments)]
    unsafe fn q4k(
        w: *const u8,
        rb: usize,
        n: usize,
        a: &Acts<'_>,
        m0: usize,
        mc: usize,
        o: *mut f32,
        ldo: usize,
    ) {
        scalar_with(
            &Q4K,
            super::kquants::q4k_scalar,
            w,
            rb,
            n,
            a,
            m0,
            mc,
            o,
            ldo,
        )
    }
    match ty {
        GgmlType::Q4KR => Some(q4k),
        _ => None,
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use avx2_path::avx2;

#[cfg(target_arch = "x86_64")]
mod avx2_path {
    use super::{Acts, GROUP_BLOCK, ROWS};
    use std::arch::x86_64::*;

    /// `vpshufb` masks: 0 .. 4, scale byte `s` of each 32-bit lane as the lane's i16 pair
    /// `[sc, sc]`; 4, 5: bytes `2 t`, `2 t + 1` as the pair `[m_2t, m_2t+1]`.
    static PICK: [[u8; 32]; 6] = {
        let mut m = [[0x80u8; 32]; 6];
        let mut i = 0;
        while i < 32 {
            let lane = 4 * ((i % 16) / 4) as u8;
            let mut s = 0;
            while s < 4 {
                if i % 2 == 0 {
                    m[s][i] = lane + s as u8;
                }
                s += 1;
            }
            if i % 4 == 0 {
                m[4][i] = lane;
                m[5][i] = lane + 2;
            } else if i % 4 == 2 {
                m[4][i] = lane + 1;
                m[5][i] = lane + 3;
            }
            i += 1;
        }
        m
    };

    /// The rows function: whole groups through [`group`], the file-layout rows after them
    /// through the file layout's kernel.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn avx2(
        w: *const u8,
        row_bytes: usize,
        rows: usize,
        acts: &Acts<'_>,
        m0: usize,
        mc: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        for g in 0..rows / 8 {
            let (gw, go) = (w.add(8 * g * row_bytes), out.add(8 * g));
            match mc {
                4 => group::<4>(gw, acts, m0, go, ldo),
                3 => group::<3>(gw, acts, m0, go, ldo),
                2 => group::<2>(gw, acts, m0, go, ldo),
                _ => group::<1>(gw, acts, m0, go, ldo),
            }
        }
        let mut tmp = [0.0f32; ROWS];
        for r in rows / 8 * 8..rows {
            super::super::kquants::q4k_avx2(w.add(r * row_bytes), acts, m0, mc, &mut tmp);
            for (i, &v) in tmp.iter().enumerate().take(mc) {
                *out.add(i * ldo + r) = v;
            }
        }
    }

    /// Eight weight rows (a group, at `w`) against activation rows `m0 .. m0 + MC`: output
    /// `out[i * ldo + r]` for row `r` of the group and activation row `m0 + i`.
    #[inline(always)]
    unsafe fn group<const MC: usize>(
        w: *const u8,
        acts: &Acts<'_>,
        m0: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let q8 = acts.q8k.as_ref().unwrap_unchecked();
        let (k, nb) = (acts.k, acts.k / 256);
        let xq = q8.qs.as_ptr().add(m0 * k);
        let xd = q8.d.as_ptr().add(m0 * nb);
        let xb = q8.b32.as_ptr().add(m0 * (k / 32));
        let low4 = _mm256_set1_epi8(0x0F);
        let low6 = _mm256_set1_epi8(0x3F);
        let bits45 = _mm256_set1_epi8(0x30);
        let pick = super::super::kquants::opaque(PICK.as_ptr());
        let mask = |i: usize| _mm256_loadu_si256(pick.add(i) as *const __m256i);
        let mut acc = [_mm256_setzero_ps(); MC];
        for b in 0..nb {
            let p = w.add(b * GROUP_BLOCK);
            // (4 group super-blocks ahead; 1 to 16 measured the same from memory, none 0.8x)
            let mut off = 0;
            while off < GROUP_BLOCK {
                crate::simd::prefetch_l2(p.wrapping_add(off + 4 * GROUP_BLOCK) as *const i8);
                off += 64;
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
            let wa = _mm256_loadu_si256(p.add(32) as *const __m256i);
            let wb = _mm256_loadu_si256(p.add(64) as *const __m256i);
            let wc = _mm256_loadu_si256(p.add(96) as *const __m256i);
            // per lane (row): scales 0..4, scales 4..8, mins 0..4, mins 4..8 (`scale_min_k4`)
            let sc_lo = _mm256_and_si256(wa, low6);
            let sc_hi = _mm256_or_si256(
                _mm256_and_si256(wc, low4),
                _mm256_and_si256(_mm256_srli_epi32::<2>(wa), bits45),
            );
            let mn_lo = _mm256_and_si256(wb, low6);
            let mn_hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32::<4>(wc), low4),
                _mm256_and_si256(_mm256_srli_epi32::<2>(wb), bits45),
            );
            let q = p.add(128);
            let mut isum = [_mm256_setzero_si256(); MC];
            for j in 0..4 {
                let sc = if j < 2 { sc_lo } else { sc_hi };
                // sub-blocks 2 j (low nibbles of the j-th 256 bytes) and 2 j + 1 (high)
                let mut lo = [_mm256_setzero_si256(); MC];
                let mut hi = [_mm256_setzero_si256(); MC];
                for c in 0..8 {
                    let bytes = _mm256_loadu_si256(q.add(256 * j + 32 * c) as *const __m256i);
                    let vl = _mm256_and_si256(bytes, low4);
                    let vh = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low4);
                    for r in 0..MC {
                        let x = xq.add(r * k + 256 * b + 64 * j + 4 * c);
                        let xl = _mm256_set1_epi32(std::ptr::read_unaligned(x as *const i32));
                        let xh =
                            _mm256_set1_epi32(std::ptr::read_unaligned(x.add(32) as *const i32));
                        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(vl, xl));
                        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(vh, xh));
                    }
                }
                let s_lo = _mm256_shuffle_epi8(sc, mask((2 * j) % 4));
                let s_hi = _mm256_shuffle_epi8(sc, mask((2 * j + 1) % 4));
                for r in 0..MC {
                    let both = _mm256_add_epi32(
                        _mm256_madd_epi16(lo[r], s_lo),
                        _mm256_madd_epi16(hi[r], s_hi),
                    );
                    isum[r] = _mm256_add_epi32(isum[r], both);
                }
            }
            // the minimums' term: sum_s m_s * (sum of the activation's 32 values of s)
            let mins = [
                _mm256_shuffle_epi8(mn_lo, mask(4)),
                _mm256_shuffle_epi8(mn_lo, mask(5)),
                _mm256_shuffle_epi8(mn_hi, mask(4)),
                _mm256_shuffle_epi8(mn_hi, mask(5)),
            ];
            for (r, a) in acc.iter_mut().enumerate() {
                let bp = xb.add(r * (k / 32) + 8 * b) as *const i32;
                let mut summ = _mm256_setzero_si256();
                for (t, mv) in mins.iter().enumerate() {
                    let pair = _mm256_set1_epi32(std::ptr::read_unaligned(bp.add(t)));
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(*mv, pair));
                }
                // (d * sumi - dmin * summ) * d_x
                let f = _mm256_fnmadd_ps(
                    _mm256_cvtepi32_ps(summ),
                    dmin,
                    _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), d),
                );
                *a = _mm256_fmadd_ps(f, _mm256_set1_ps(*xd.add(r * nb + b)), *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(i * ldo), *a);
        }
    }
}

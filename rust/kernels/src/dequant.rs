//! GGUF (ggml) tensor data to f32: the block formats of the files specinfer loads (F32, F16, BF16,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), rows in parallel.
//!
//! Each value is computed with the same f32 operations, in the same order, as the `gguf`
//! package's numpy dequantizers (the tests' oracle, `tests/test_gguf_dequant.py`), so the result
//! is bit-identical to theirs; this exists because theirs allocate several temporaries per
//! block row in numpy and took most of a GGUF model's load (Qwen2.5-Coder 1.5B + 0.5B: ~100 s).
//!
//! Block layouts (little-endian; `d`, `m`, `dmin` are f16):
//! - Q4_0 (32 values, 18 bytes): d, qs[16]; value j < 16 = low nibble of qs[j], j >= 16 = high
//!   nibble of qs[j - 16]; x = d * (q - 8).
//! - Q4_1 (32, 20): d, m, qs[16]; x = d * q + m.
//! - Q5_0 (32, 22): d, qh (u32), qs[16]; q = nibble | (bit j of qh) << 4; x = d * (q - 16).
//! - Q5_1 (32, 24): d, m, qh, qs[16]; x = d * q + m.
//! - Q8_0 (32, 34): d, qs (i8)[32]; x = d * q.
//! - Q4_K (256, 144): d, dmin, scales[12] (8 six-bit scales and mins), qs[128]; sub-block s of
//!   32 values: low (s even) or high (s odd) nibbles of qs[32 (s / 2) ..][..32];
//!   x = (d * sc_s) * q - dmin * m_s.
//! - Q5_K (256, 176): d, dmin, scales[12], qh[32], qs[128]; as Q4_K with bit s of qh[i] as the
//!   fifth bit of sub-block s's value i.
//! - Q6_K (256, 210): ql[128], qh[64], scales (i8)[16], d; value v (c = v / 128, r = v % 128):
//!   low 4 bits from ql[64 c + r % 64] >> 4 (r / 64), high 2 from qh[32 c + r % 32] >> 2 (r / 32);
//!   x = (d * scales[v / 16]) * (q - 32).
//! - Q4_0R, Q4_1R, Q5_0R (not ggml types: specinfer's ids [`Q4_0R_ID`], [`Q4_1R_ID`],
//!   [`Q5_0R_ID`]): Q4_0 / Q4_1 / Q5_0
//!   rows repacked at load into groups of up to eight blocks (`gguf_linear::octets`), an odd
//!   last block as in the file; rows read through [`row`].
//! - Q4_KR (specinfer's [`Q4_KR_ID`]): Q4_K rows repacked at load in groups of eight rows
//!   (`gguf_linear::row_groups`); a row is no longer one byte range, so tables of this type are
//!   read through the group's file-layout view.

use half::f16;
use rayon::prelude::*;

use crate::threads::pool;

/// ggml's type ids (the GGUF tensor-info field) this module reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    /// Q4_1 repacked in octets at load (`gguf_linear::octets`); not a ggml type.
    Q4_1R,
    /// Q4_0 repacked in octets at load; not a ggml type.
    Q4_0R,
    /// Q5_0 repacked in octets at load; not a ggml type.
    Q5_0R,
    /// Q4_K repacked in groups of eight rows at load; not a ggml type.
    Q4KR,
}

/// The ids of [`GgmlType::Q4_0R`] and [`GgmlType::Q4_1R`]: outside ggml's range (its ids are
/// below 64).
pub const Q4_0R_ID: u32 = 0x1002;
pub const Q4_1R_ID: u32 = 0x1003;
/// The id of [`GgmlType::Q5_0R`].
pub const Q5_0R_ID: u32 = 0x1006;
/// The id of [`GgmlType::Q4KR`].
pub const Q4_KR_ID: u32 = 0x100C;

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            Q4_1R_ID => Self::Q4_1R,
            Q4_0R_ID => Self::Q4_0R,
            Q5_0R_ID => Self::Q5_0R,
            Q4_KR_ID => Self::Q4KR,
            _ => return None,
        })
    }

    /// (values, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 | Self::Q4_0R => (32, 18),
            Self::Q4_1 | Self::Q4_1R => (32, 20),
            Self::Q5_0 | Self::Q5_0R => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q4K | Self::Q4KR => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }
}

#[inline(always)]
fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The K-quants' 8 six-bit scales and mins from their 12 packed bytes.
#[inline(always)]
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

fn block(t: GgmlType, b: &[u8], out: &mut [f32]) {
    match t {
        GgmlType::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => out[0] = h(b, 0),
        GgmlType::Bf16 => out[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        GgmlType::Q4_0 | GgmlType::Q4_0R => {
            let d = h(b, 0);
            for j in 0..16 {
                out[j] = d * (((b[2 + j] & 0x0F) as i8 - 8) as f32);
                out[j + 16] = d * (((b[2 + j] >> 4) as i8 - 8) as f32);
            }
        }
        // (a Q4_1R block here is one after the row's last octet: the file's layout)
        GgmlType::Q4_1 | GgmlType::Q4_1R => {
            let (d, m) = (h(b, 0), h(b, 2));
            for j in 0..16 {
                out[j] = d * ((b[4 + j] & 0x0F) as f32) + m;
                out[j + 16] = d * ((b[4 + j] >> 4) as f32) + m;
            }
        }
        // (a Q5_0R block here is one after the row's last octet: the file's layout)
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_0R => {
            let affine = t == GgmlType::Q5_1;
            let d = h(b, 0);
            let (m, at) = if affine { (h(b, 2), 4) } else { (0.0, 2) };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            for j in 0..16 {
                let lo = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                if affine {
                    out[j] = d * lo as f32 + m;
                    out[j + 16] = d * hi as f32 + m;
                } else {
                    out[j] = d * ((lo as i8 - 16) as f32);
                    out[j + 16] = d * ((hi as i8 - 16) as f32);
                }
            }
        }
        GgmlType::Q8_0 => {
            let d = h(b, 0);
            for j in 0..32 {
                out[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        // (a Q4_KR block here is one unpacked from its group: the file's layout)
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4KR => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let (sc, mn) = scale_min_k4(&b[4..16]);
            let five = t == GgmlType::Q5K;
            let (qh, qs) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for s in 0..8 {
                let dd = d * sc[s] as f32;
                let dm = dmin * mn[s] as f32;
                let src = &qs[32 * (s / 2)..32 * (s / 2) + 32];
                let shift = 4 * (s % 2);
                for i in 0..32 {
                    let mut q = (src[i] >> shift) & 0x0F;
                    if five {
                        q |= ((qh[i] >> s) & 1) << 4;
                    }
                    out[32 * s + i] = dd * q as f32 - dm;
                }
            }
        }
        GgmlType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for v in 0..256 {
                let (c, r) = (v / 128, v % 128);
                let lo = (ql[64 * c + r % 64] >> (4 * (r / 64))) & 0x0F;
                let hi = (qh[32 * c + r % 32] >> (2 * (r / 32))) & 0x03;
                let q = ((lo | (hi << 4)) as i8 - 32) as f32;
                out[v] = (d * (sc[v / 16] as i8) as f32) * q;
            }
        }
    }
}

/// One row of type `t` (`s` its bytes) into `o` (`cols` values).
fn row(t: GgmlType, s: &[u8], o: &mut [f32]) {
    let (per, bytes) = t.block();
    let mut at = 0; // bytes of s read
    if matches!(t, GgmlType::Q4_0R | GgmlType::Q4_1R | GgmlType::Q5_0R) {
        use crate::gguf_linear::octets::{groups, unpack_group};
        for (b0, n) in groups(o.len() / 32) {
            let blocks = unpack_group(t, &s[bytes * b0..bytes * (b0 + n)], n);
            for j in 0..n {
                let ob = &mut o[32 * (b0 + j)..32 * (b0 + j + 1)];
                block(t, &blocks[bytes * j..bytes * (j + 1)], ob);
            }
            at = bytes * (b0 + n);
        }
    }
    let done = at / bytes * per;
    for (ob, sb) in o[done..]
        .chunks_exact_mut(per)
        .zip(s[at..].chunks_exact(bytes))
    {
        block(t, sb, ob);
    }
}

/// Dequantize the rows `ids` of a tensor of `cols`-value rows (`src` all its rows' blocks) into
/// `out [ids.len() * cols]`: an embedding lookup in a stored table. Ids are checked against
/// the table's row count.
pub fn gather_rows(
    t: GgmlType,
    src: &[u8],
    cols: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), String> {
    let (per, bytes) = t.block();
    if cols == 0 || cols % per != 0 {
        return Err(format!(
            "{t:?}: a row of {cols} values is not a whole number of {per}-value blocks"
        ));
    }
    let row_bytes = cols / per * bytes;
    let rows = src.len() / row_bytes;
    if out.len() != ids.len() * cols {
        return Err(format!(
            "out holds {} values, not {} x {cols}",
            out.len(),
            ids.len()
        ));
    }
    for (o, &id) in out.chunks_exact_mut(cols).zip(ids) {
        if id < 0 || id as usize >= rows {
            return Err(format!("row {id} is outside the table's {rows} rows"));
        }
        if t == GgmlType::Q4KR {
            let file = crate::gguf_linear::row_groups::file_row(t, src, rows, cols, id as usize)?;
            row(t, &file, o);
            continue;
        }
        row(
            t,
            &src[id as usize * row_bytes..(id as usize + 1) * row_bytes],
            o,
        );
    }
    Ok(())
}

/// Dequantize `rows` rows of `cols` values each: `src` holds the rows' blocks back to back
/// (`cols / values-per-block` blocks a row), `out` `rows * cols` f32, row-major. Rows are split
/// over `num_threads` threads.
pub fn dequantize(
    t: GgmlType,
    src: &[u8],
    rows: usize,
    cols: usize,
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), String> {
    let (per, bytes) = t.block();
    if cols % per != 0 {
        return Err(format!(
            "{t:?}: a row of {cols} values is not a whole number of {per}-value blocks"
        ));
    }
    let row_bytes = cols / per * bytes;
    if src.len() != rows * row_bytes {
        return Err(format!(
            "{t:?}: {} bytes of data for {rows} x {cols} values (want {})",
            src.len(),
            rows * row_bytes
        ));
    }
    if out.len() != rows * cols {
        return Err(format!(
            "out holds {} values, not {rows} x {cols}",
            out.len()
        ));
    }
    if cols == 0 || rows == 0 {
        return Ok(());
    }
    if t == GgmlType::Q4KR {
        let (file_type, file) = crate::gguf_linear::row_groups::file_layout(t, src, rows, cols)?;
        return dequantize(file_type, &file, rows, cols, out, num_threads);
    }
    let one_row = |(o, s): (&mut [f32], &[u8])| row(t, s, o);
    let work = || {
        out.par_chunks_mut(cols)
            .zip(src.par_chunks(row_bytes))
            .with_min_len(16)
            .for_each(one_row)
    };
    match pool(num_threads.max(1)).filter(|_| num_threads > 1) {
        Some(p) => p.install(work),
        None => out
            .chunks_mut(cols)
            .zip(src.chunks(row_bytes))
            .for_each(one_row),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn q8_0_and_q4_0_by_hand() {
        let mut b = vec![];
        b.extend(f16b(0.5));
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = vec![0.0; 32];
        dequantize(GgmlType::Q8_0, &b, 1, 32, &mut out, 1).unwrap();
        assert_eq!(out[0], -8.0);
        assert_eq!(out[31], 7.5);
        let mut b = vec![];
        b.extend(f16b(2.0));
        b.extend((0..16).map(|j| (j as u8) | (((15 - j) as u8) << 4)));
        dequantize(GgmlType::Q4_0, &b, 1, 32, &mut out, 1).unwrap();
        assert_eq!(out[0], -16.0); // (0 - 8) * 2
        assert_eq!(out[15], 14.0); // (15 - 8) * 2
        assert_eq!(out[16], 14.0); // high nibble of qs[0] = 15
    }

    #[test]
    fn q6_k_layout() {
        // every value 5 (q = 37: low nibble 5, high bits 2), scales 1..16, d = 1
        let mut b = vec![0u8; 210];
        for x in &mut b[0..128] {
            *x = 0x55;
        }
        for x in &mut b[128..192] {
            *x = 0b1010_1010;
        }
        for (i, x) in b[192..208].iter_mut().enumerate() {
            *x = (i + 1) as u8;
        }
        b[208..210].copy_from_slice(&f16b(1.0));
        let mut out = vec![0.0; 256];
        dequantize(GgmlType::Q6K, &b, 1, 256, &mut out, 1).unwrap();
        for (v, &x) in out.iter().enumerate() {
            assert_eq!(x, ((v / 16) + 1) as f32 * 5.0, "{v}");
        }
    }

    #[test]
    fn threads_and_rows_give_the_same_result() {
        let (rows, cols) = (37, 512);
        let src: Vec<u8> = (0..rows * cols / 256 * 144)
            .map(|i| (i * 7919 % 251) as u8)
            .collect();
        let mut a = vec![0.0; rows * cols];
        let mut b = vec![0.0; rows * cols];
        dequantize(GgmlType::Q4K, &src, rows, cols, &mut a, 1).unwrap();
        dequantize(GgmlType::Q4K, &src, rows, cols, &mut b, 3).unwrap();
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn bad_sizes_are_refused() {
        let mut out = vec![0.0; 64];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], 1, 32, &mut out[..32], 1).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], 1, 33, &mut out[..33], 1).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 68], 2, 32, &mut out[..63], 1).is_err());
        assert!(GgmlType::from_id(10).is_none()); // Q2_K: not here (the caller falls back)
    }
}

//! The layouts of the W8A8 linear kernel ([`crate::w8a8_linear`]): weights packed in tiles of 16
//! output rows for the dot-product instructions, and activations quantized per group per call.
//!
//! Weights: int8 `q [n, k]` with one f32 scale per group of `group` inputs (GGUF Q8_0: 32) are
//! packed as `u8 [tiles][k / 4][16][4]` (`tiles` = ceil(n / 16)): for output row `t * 16 + r`
//! and input `e`, byte `t * 16k + (e / 4) * 64 + r * 4 + e % 4` holds `q + 128`. One 64-byte
//! vector is 4 consecutive inputs of 16 rows, which `vpdpbusd` multiplies by 4 activation bytes
//! broadcast to every lane. A tile's `16 k` bytes are contiguous, so the kernel reads one
//! sequential stream. Scales are packed `f32 [tiles][k / group][16]`. Rows past `n` hold 0
//! (byte 128) with scale 0. The kernels take |q| <= 127, so `pack` stores -128 as -127.
//!
//! Activations: each row `x [m, k]` is quantized per group like Q8_0 (`sx = max |x| / 127`,
//! `xq = round(x / sx)`), with `corr = -128 * sum(xq)` per group so that
//! `corr + sum((q + 128) * xq) = sum(q * xq)` exactly in i32.

/// Output rows per packed tile (the lanes of a 512-bit vector of i32).
pub const TILE: usize = 16;

/// Tiles holding `n` output rows.
pub fn tiles(n: usize) -> usize {
    n.div_ceil(TILE)
}

/// Pack `q [n, k]` / `scales [n, k / group]` into `packed [tiles * 16 * k]` /
/// `packed_scales [tiles * (k / group) * 16]`. Callers check the lengths (see `check_packed`).
pub fn pack(
    q: &[i8],
    scales: &[f32],
    n: usize,
    k: usize,
    group: usize,
    packed: &mut [u8],
    packed_scales: &mut [f32],
) {
    let groups = k / group;
    packed.fill(128);
    packed_scales.fill(0.0);
    for row in 0..n {
        let (t, r) = (row / TILE, row % TILE);
        let base = t * TILE * k + r * 4;
        for (e, &v) in q[row * k..(row + 1) * k].iter().enumerate() {
            // -128 (which Q8_0's quantizer never writes) is stored as -127: the kernels take
            // |q| <= 127 (the AVX2 path negates q)
            packed[base + (e / 4) * 64 + e % 4] = (v.max(-127) as i16 + 128) as u8;
        }
        for g in 0..groups {
            packed_scales[t * groups * TILE + g * TILE + r] = scales[row * groups + g];
        }
    }
}

/// The inverse of [`pack`]: `q [n, k]` and `scales [n, k / group]` from the packed layout.
pub fn unpack(
    packed: &[u8],
    packed_scales: &[f32],
    n: usize,
    k: usize,
    group: usize,
    q: &mut [i8],
    scales: &mut [f32],
) {
    let groups = k / group;
    for row in 0..n {
        let (t, r) = (row / TILE, row % TILE);
        let base = t * TILE * k + r * 4;
        for (e, d) in q[row * k..(row + 1) * k].iter_mut().enumerate() {
            *d = (packed[base + (e / 4) * 64 + e % 4] as i16 - 128) as i8;
        }
        for g in 0..groups {
            scales[row * groups + g] = packed_scales[t * groups * TILE + g * TILE + r];
        }
    }
}

/// Activation rows quantized per group: `xq [m, k]`, `sx [m, groups]`, `corr [m, groups]`.
pub struct QuantizedRows {
    pub xq: Vec<i8>,
    pub sx: Vec<f32>,
    pub corr: Vec<i32>,
}

/// Quantize `x [m, k]` per group of `group` inputs (Q8_0's rule; see the module docs). Scalar
/// code on purpose: one rounding for every instruction set, so every ISA's kernel agrees.
pub fn quantize_rows(x: &[f32], m: usize, k: usize, group: usize) -> QuantizedRows {
    let groups = k / group;
    let mut out = QuantizedRows {
        xq: vec![0; m * k],
        sx: vec![0.0; m * groups],
        corr: vec![0; m * groups],
    };
    for (gi, (chunk, qc)) in x[..m * k]
        .chunks(group)
        .zip(out.xq.chunks_mut(group))
        .enumerate()
    {
        let amax = chunk.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let mut sum = 0i32;
        for (d, &v) in qc.iter_mut().zip(chunk) {
            // NaN / inf inputs: clamp keeps the byte in range (the output is garbage either way)
            *d = (v * inv).round().clamp(-127.0, 127.0) as i8;
            sum += *d as i32;
        }
        out.sx[gi] = scale;
        out.corr[gi] = -128 * sum;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_then_unpack_is_identity_with_padding_rows() {
        for (n, k, group) in [(37, 64, 32), (16, 96, 32), (5, 128, 128), (40, 48, 16)] {
            let q: Vec<i8> = (0..n * k)
                .map(|i| (((i * 37 + 11) % 255) as i32 - 127) as i8)
                .collect();
            let scales: Vec<f32> = (0..n * (k / group)).map(|i| i as f32 * 0.5 + 1.0).collect();
            let mut packed = vec![0u8; tiles(n) * TILE * k];
            let mut ps = vec![0f32; tiles(n) * (k / group) * TILE];
            pack(&q, &scales, n, k, group, &mut packed, &mut ps);
            // padding rows hold zero weights with zero scales
            for row in n..tiles(n) * TILE {
                let (t, r) = (row / TILE, row % TILE);
                for e in 0..k {
                    assert_eq!(packed[t * TILE * k + r * 4 + (e / 4) * 64 + e % 4], 128);
                }
                assert_eq!(ps[t * (k / group) * TILE + r], 0.0);
            }
            let (mut q2, mut s2) = (vec![0i8; n * k], vec![0f32; scales.len()]);
            unpack(&packed, &ps, n, k, group, &mut q2, &mut s2);
            assert!(q2 == q, "unpack(pack(q)) != q");
            assert_eq!(s2, scales);
            // -128 is stored as -127
            let mut q3 = q.clone();
            q3[1] = -128;
            pack(&q3, &scales, n, k, group, &mut packed, &mut ps);
            unpack(&packed, &ps, n, k, group, &mut q2, &mut s2);
            q3[1] = -127;
            assert!(q2 == q3, "-128 is not stored as -127");
        }
    }

    #[test]
    fn activation_quantization_follows_q8_0_and_corrects_the_offset() {
        let x: Vec<f32> = vec![0.0, 1.0, -2.0, 0.5, 2.0, -0.01, 0.0, 0.0];
        let r = quantize_rows(&x, 2, 4, 4);
        assert_eq!(r.sx, vec![2.0 / 127.0, 2.0 / 127.0]);
        assert_eq!(&r.xq, &[0, 64, -127, 32, 127, -1, 0, 0]);
        assert_eq!(r.corr, vec![-128 * (64 - 127 + 32), -128 * 126]);
        let z = quantize_rows(&[0.0; 4], 1, 4, 4);
        assert_eq!((z.xq, z.sx, z.corr), (vec![0; 4], vec![0.0], vec![0]));
    }
}

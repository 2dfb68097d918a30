//! Every format against the `dequant` module's f32 values: each output equals the f64 sum of
//! dequantized weight times dequantized activation (the quantized dot's exact value) within f32
//! rounding, and the unquantized product within the activation rounding; every row count gives
//! the same bits for the rows it shares (batch invariance); parts land in their columns.

use super::*;
use crate::dequant::{dequantize, GgmlType};
use half::f16;

pub(super) const TYPES: [GgmlType; 15] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q4_1R,
    GgmlType::Q4_0R,
    GgmlType::Q4KR,
    GgmlType::Q5_0R,
];

/// A tiny deterministic generator (xorshift).
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

pub(super) fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Random but valid rows: random bytes with every float field set to a sane value.
pub(super) fn random_rows(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    if matches!(ty, GgmlType::Q4_0R | GgmlType::Q4_1R | GgmlType::Q5_0R) {
        let file = match ty {
            GgmlType::Q4_0R => GgmlType::Q4_0,
            GgmlType::Q5_0R => GgmlType::Q5_0,
            _ => GgmlType::Q4_1,
        };
        let src = random_rows(file, n, k, rng);
        let mut dst = vec![0u8; src.len()];
        octets::repack_rows(file, &src, n, k, &mut dst).unwrap();
        return dst;
    }
    if ty == GgmlType::Q4KR {
        let src = random_rows(GgmlType::Q4K, n, k, rng);
        let mut dst = vec![0u8; src.len()];
        row_groups::repack_rows(GgmlType::Q4K, &src, n, k, &mut dst).unwrap();
        return dst;
    }
    let rb = row_bytes(ty, k).unwrap();
    let mut data: Vec<u8> = (0..n * rb).map(|_| rng.next() as u8).collect();
    let (_, bytes) = ty.block();
    for blk in data.chunks_exact_mut(bytes) {
        match ty {
            GgmlType::F32 => blk.copy_from_slice(&rng.unit().to_le_bytes()),
            GgmlType::F16 => put_f16(blk, 0, rng.unit()),
            GgmlType::Bf16 => {
                blk.copy_from_slice(&((rng.unit().to_bits() >> 16) as u16).to_le_bytes())
            }
            GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::Q4_0R
            | GgmlType::Q5_0R => put_f16(blk, 0, 0.01 + 0.02 * rng.unit().abs()),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_1R => {
                put_f16(blk, 0, 0.01 + 0.02 * rng.unit().abs());
                put_f16(blk, 2, 0.1 * rng.unit());
            }
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4KR => {
                put_f16(blk, 0, 0.001 + 0.002 * rng.unit().abs());
                put_f16(blk, 2, 0.001 + 0.002 * rng.unit().abs());
            }
            GgmlType::Q6K => put_f16(blk, 208, 0.001 + 0.002 * rng.unit().abs()),
        }
    }
    data
}

pub(super) fn dequant_rows(ty: GgmlType, data: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; n * k];
    dequantize(ty, data, n, k, &mut w, 1).unwrap();
    w
}

/// The activation rows as the dot products see them (dequantized from their quantized form).
pub(super) fn seen_x(ty: GgmlType, x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let acts = Acts::new(x, m, k, needs(ty), 1);
    if let Some(q8) = &acts.q8 {
        return (0..m * k).map(|i| q8.qs[i] as f32 * q8.d[i / 32]).collect();
    }
    if let Some(q8k) = &acts.q8k {
        return (0..m * k)
            .map(|i| q8k.qs[i] as f32 * q8k.d[i / 256])
            .collect();
    }
    x.to_vec()
}

pub(super) fn run(
    isa: Isa,
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    parts: &[Part<'_>],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let n: usize = parts.iter().map(|p| p.n).sum();
    let mut out = vec![f32::NAN; m * n];
    gguf_linear(isa, threads, x, m, k, parts, bias, &mut out).unwrap();
    out
}

fn check_type(ty: GgmlType, isa: Isa) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ty as u64);
    let per = ty.block().0.max(32);
    // odd row counts; for the 32-value formats also a single block (k = 32) and 15 blocks (an
    // AVX2 octet, three tail pairs and a single block)
    let shapes: &[(usize, usize)] = if per == 32 {
        &[(1, 256), (3, 32), (13, 480), (37, 768)]
    } else {
        &[(1, 256), (13, 512), (37, 768)]
    };
    for &(n, k) in shapes {
        let data = random_rows(ty, n, k, &mut rng);
        let w = dequant_rows(ty, &data, n, k);
        let m = 67; // every row count from 1 to 64 below, and a prefill-sized one
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let bias: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let part = [Part { ty, data: &data, n }];
        let full = run(isa, 2, &x, m, k, &part, Some(&bias));
        let xs = seen_x(ty, &x, m, k);
        for mi in 0..m {
            for ni in 0..n {
                let (mut exact, mut true_val, mut mag) = (bias[ni] as f64, bias[ni] as f64, 0.0f64);
                for e in 0..k {
                    exact += w[ni * k + e] as f64 * xs[mi * k + e] as f64;
                    true_val += w[ni * k + e] as f64 * x[mi * k + e] as f64;
                    mag += (w[ni * k + e] as f64 * x[mi * k + e] as f64).abs();
                }
                let got = full[mi * n + ni] as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * mag + 1e-6,
                    "{ty:?} {isa:?} n={n} k={k} [{mi},{ni}]: {got} vs exact {exact} (mag {mag})"
                );
                // activation rounding: each value moves by at most half a step (amax / 254)
                assert!(
                    (got - true_val).abs() <= 0.02 * mag + 1e-6,
                    "{ty:?} [{mi},{ni}]: {got} vs {true_val}"
                );
            }
        }
        for rows in (1..=64).chain([m]) {
            for threads in [1, 2] {
                let part_out = run(isa, threads, &x[..rows * k], rows, k, &part, Some(&bias));
                assert!(
                    part_out.iter().zip(&full[..rows * n]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?} {isa:?}: {rows} rows on {threads} threads differ from the rows of a {m}-row call"
                );
            }
        }
    }
}

#[test]
fn every_format_on_every_path_matches_the_dequantized_reference() {
    for isa in Isa::supported() {
        for ty in TYPES {
            check_type(ty, isa);
        }
    }
}

#[test]
fn parts_of_different_types_fill_their_columns() {
    let mut rng = Rng(7);
    let k = 512;
    let types = [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::Q6K, GgmlType::F32];
    let datas: Vec<(GgmlType, usize, Vec<u8>)> = types
        .iter()
        .enumerate()
        .map(|(i, &ty)| (ty, 5 + 3 * i, random_rows(ty, 5 + 3 * i, k, &mut rng)))
        .collect();
    let parts: Vec<Part<'_>> = datas
        .iter()
        .map(|(ty, n, d)| Part {
            ty: *ty,
            data: d,
            n: *n,
        })
        .collect();
    let m = 6;
    let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
    let isa = Isa::detect();
    let all = run(isa, 2, &x, m, k, &parts, None);
    let n_total: usize = parts.iter().map(|p| p.n).sum();
    let mut col = 0;
    for p in &parts {
        let alone = run(isa, 1, &x, m, k, &[*p], None);
        for mi in 0..m {
            for c in 0..p.n {
                assert_eq!(
                    alone[mi * p.n + c].to_bits(),
                    all[mi * n_total + col + c].to_bits()
                );
            }
        }
        col += p.n;
    }
}

#[test]
fn bad_shapes_are_refused() {
    let data = vec![0u8; 34 * 2];
    let part = [Part {
        ty: GgmlType::Q8_0,
        data: &data,
        n: 1,
    }];
    let mut out = vec![0.0; 1];
    let e = gguf_linear(Isa::Scalar, 1, &[0.0; 64], 1, 64, &part, None, &mut out);
    assert!(e.is_ok());
    let e = gguf_linear(Isa::Scalar, 1, &[0.0; 48], 1, 48, &part, None, &mut out).unwrap_err();
    assert!(e.message.contains("not a whole number"), "{}", e.message);
    let part = [Part {
        ty: GgmlType::Q8_0,
        data: &data,
        n: 2,
    }];
    let mut out = vec![0.0; 2];
    let e = gguf_linear(Isa::Scalar, 1, &[0.0; 64], 1, 64, &part, None, &mut out).unwrap_err();
    assert!(e.message.contains("bytes"), "{}", e.message);
}

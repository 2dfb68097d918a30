//! The 32-value formats on every path: against the dequantized reference and batch invariant
//! (the shared test's checks, restricted to these formats), exact at the extremes of the
//! integer ranges, and (ignored) timed on a 4096 x 4096 layer.

use super::super::{gguf_linear, needs, row_bytes, Acts, Part};
use crate::dequant::{dequantize, GgmlType};
use crate::simd::Isa;
use half::f16;

const TYPES: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

/// A tiny deterministic generator (xorshift; the shared tests' own has a private seed).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Random but valid rows: random bytes with sane scales (and minimums).
fn random_rows(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = row_bytes(ty, k).unwrap();
    let mut data: Vec<u8> = (0..n * rb).map(|_| rng.next() as u8).collect();
    for blk in data.chunks_exact_mut(ty.block().1) {
        put_f16(blk, 0, 0.01 + 0.02 * rng.unit().abs());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
            put_f16(blk, 2, 0.1 * rng.unit());
        }
    }
    data
}

fn run(
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

/// The activation rows as the dot products see them (dequantized from their quantized form).
fn seen_x(ty: GgmlType, x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let acts = Acts::new(x, m, k, needs(ty), 1);
    let q8 = acts.q8.as_ref().unwrap();
    (0..m * k).map(|i| q8.qs[i] as f32 * q8.d[i / 32]).collect()
}

/// The shared test's `check_type` for one of the formats here.
fn check_type(ty: GgmlType, isa: Isa) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ty as u64);
    // k = 256 (even block count), 480 (odd: the AVX2 path's tail block), 768
    for &(n, k) in &[(1usize, 256usize), (13, 480), (37, 768)] {
        let data = random_rows(ty, n, k, &mut rng);
        let mut w = vec![0.0f32; n * k];
        dequantize(ty, &data, n, k, &mut w, 1).unwrap();
        let m = 67;
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
fn q32_formats_on_every_path_match_the_dequantized_reference() {
    for isa in Isa::supported() {
        for ty in TYPES {
            check_type(ty, isa);
        }
    }
}

/// Weights and activations at the ends of their ranges (the largest `vpmaddubsw` pairs, Q8_0's
/// -128): every path gives the exact integer dot times the scales (powers of two: no rounding).
#[test]
fn q32_formats_are_exact_at_the_range_ends() {
    let k = 96;
    for ty in TYPES {
        let (_, bytes) = ty.block();
        // per-block fill bytes: all ones (largest values), all zeros (most negative for the
        // symmetric formats), 0x80 (Q8_0: -128)
        for fill in [0xFFu8, 0x00, 0x80] {
            let mut data = vec![fill; k / 32 * bytes];
            for blk in data.chunks_exact_mut(bytes) {
                put_f16(blk, 0, 0.25);
                if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                    put_f16(blk, 2, -0.5);
                }
            }
            let mut w = vec![0.0f32; k];
            dequantize(ty, &data, 1, k, &mut w, 1).unwrap();
            // activations +-1 (q = +-127, d = 1/127) with signs to make the dot large or mixed
            for pattern in 0..3 {
                let x: Vec<f32> = (0..k)
                    .map(|e| match pattern {
                        0 => 1.0,
                        1 => -1.0,
                        _ => {
                            if e % 3 == 0 {
                                1.0
                            } else {
                                -1.0
                            }
                        }
                    })
                    .collect();
                let xs = seen_x(ty, &x, 1, k);
                let exact: f64 = w.iter().zip(&xs).map(|(&a, &b)| a as f64 * b as f64).sum();
                let part = [Part {
                    ty,
                    data: &data,
                    n: 1,
                }];
                for isa in Isa::supported() {
                    let got = run(isa, 1, &x, 1, k, &part, None)[0] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-6 * exact.abs().max(1.0),
                        "{ty:?} {isa:?} fill {fill:#x} pattern {pattern}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}

/// Weight GB/s of each format's AVX2 and scalar paths on one thread, a 4096 x 4096 layer,
/// 1 and 16 activation rows: `cargo test -p specinfer_kernels --release q32 -- --ignored --nocapture`.
#[test]
#[ignore]
fn q32_throughput() {
    use std::time::Instant;
    let (n, k) = (4096usize, 4096usize);
    let mut rng = Rng(42);
    let x: Vec<f32> = (0..16 * k).map(|_| rng.unit()).collect();
    let time = |isa: Isa, m: usize, part: &[Part<'_>], reps: usize| -> f64 {
        let mut out = vec![0.0f32; m * n];
        gguf_linear(isa, 1, &x[..m * k], m, k, part, None, &mut out).unwrap();
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = Instant::now();
            gguf_linear(isa, 1, &x[..m * k], m, k, part, None, &mut out).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        best
    };
    for ty in TYPES {
        let data = random_rows(ty, n, k, &mut rng);
        let gb = data.len() as f64 / 1e9;
        let part = [Part { ty, data: &data, n }];
        for m in [1usize, 16] {
            let avx2 = if Isa::Avx2.is_supported() {
                time(Isa::Avx2, m, &part, 20)
            } else {
                f64::NAN
            };
            let scalar = time(Isa::Scalar, m, &part, 3);
            println!(
                "{ty:?} m={m:2}: avx2 {:6.2} GB/s ({:7.3} ms), scalar {:6.2} GB/s ({:8.3} ms), x{:.1}",
                gb / avx2,
                avx2 * 1e3,
                gb / scalar,
                scalar * 1e3,
                scalar / avx2
            );
        }
    }
}

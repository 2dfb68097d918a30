//! Q4_K, Q5_K, Q6_K on each path: against the dequantized reference with every row count
//! (the shared test's logic, restricted to these formats), at the extremes of the value ranges
//! (no `vpmaddubsw` saturation), from unaligned rows, each row the same bits whatever `mc`
//! and `m0`; and an ignored timing of a 4096 x 4096 layer.

use super::super::acts::{Acts, Forms};
use super::super::{gguf_linear, row_bytes, Part, Path, ROWS};
use super::select;
use crate::dequant::{dequantize, GgmlType};
use crate::simd::Isa;
use half::f16;

/// A tiny deterministic generator (xorshift; the shared tests' own, whose field is private).
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

/// Random but valid rows (as the shared tests' `random_rows`): random bytes, sane f16 scales.
fn random_rows(ty: GgmlType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = row_bytes(ty, k).unwrap();
    let mut data: Vec<u8> = (0..n * rb).map(|_| rng.next() as u8).collect();
    let (_, bytes) = ty.block();
    for blk in data.chunks_exact_mut(bytes) {
        match ty {
            GgmlType::Q6K => put_f16(blk, 208, 0.001 + 0.002 * rng.unit().abs()),
            _ => {
                put_f16(blk, 0, 0.001 + 0.002 * rng.unit().abs());
                put_f16(blk, 2, 0.001 + 0.002 * rng.unit().abs());
            }
        }
    }
    data
}

const TYPES: [GgmlType; 3] = [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

fn paths() -> Vec<Path> {
    #[allow(unused_mut)]
    let mut p = vec![Path::Scalar];
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.is_supported() {
        p.push(Path::Avx2);
    }
    p
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

fn dequant_rows(ty: GgmlType, data: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; n * k];
    dequantize(ty, data, n, k, &mut w, 1).unwrap();
    w
}

/// The activation rows as the dot products see them (dequantized from their Q8_K form).
fn seen_x(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let acts = Acts::new(x, m, k, Forms::Q8K, 1);
    let q8k = acts.q8k.as_ref().unwrap();
    (0..m * k)
        .map(|i| q8k.qs[i] as f32 * q8k.d[i / 256])
        .collect()
}

/// The shared test's check (`tests::check_type`) for one K format on one instruction set.
fn check_type(ty: GgmlType, isa: Isa) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ty as u64);
    for &(n, k) in &[(1usize, 256usize), (13, 512), (37, 768)] {
        let data = random_rows(ty, n, k, &mut rng);
        let w = dequant_rows(ty, &data, n, k);
        let m = 67;
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let bias: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let part = [Part { ty, data: &data, n }];
        let full = run(isa, 2, &x, m, k, &part, Some(&bias));
        let xs = seen_x(&x, m, k);
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
fn k_formats_on_the_scalar_path_match_the_dequantized_reference() {
    for ty in TYPES {
        check_type(ty, Isa::Scalar);
    }
}

#[test]
fn k_formats_on_the_avx2_path_match_the_dequantized_reference() {
    if !Isa::Avx2.is_supported() {
        eprintln!("AVX2 not supported here: skipped");
        return;
    }
    assert_eq!(Path::of(Isa::Avx2), paths()[1]);
    for ty in TYPES {
        check_type(ty, Isa::Avx2);
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Every dot function of `ty`, called directly on `data` (n rows) with every (m0, mc) split of
/// the activation rows: each row's value within f32 rounding of the exact dot, and the same
/// bits whatever split it came in.
fn check_direct(ty: GgmlType, data: &[u8], n: usize, x: &[f32], m: usize, k: usize) {
    let rb = row_bytes(ty, k).unwrap();
    let w = dequant_rows(ty, data, n, k);
    let xs = seen_x(x, m, k);
    let acts = Acts::new(x, m, k, Forms::Q8K, 1);
    for path in paths() {
        let f = select(ty, path).unwrap();
        for ni in 0..n {
            let mut first: Vec<Option<u32>> = vec![None; m];
            for mc in 1..=ROWS {
                for m0 in 0..=m.saturating_sub(mc) {
                    let mut o = [f32::NAN; ROWS];
                    // SAFETY: row ni lies within data; m0 + mc <= m.
                    unsafe { f(data.as_ptr().add(ni * rb), &acts, m0, mc, &mut o) };
                    for (i, &v) in o.iter().enumerate().take(mc) {
                        let mi = m0 + i;
                        match first[mi] {
                            None => {
                                let (mut exact, mut mag) = (0.0f64, 0.0f64);
                                for e in 0..k {
                                    exact += w[ni * k + e] as f64 * xs[mi * k + e] as f64;
                                    mag += (w[ni * k + e] as f64 * xs[mi * k + e] as f64).abs();
                                }
                                assert!(
                                    (v as f64 - exact).abs() <= 1e-5 * mag + 1e-6,
                                    "{ty:?} {path:?} [{mi},{ni}]: {v} vs exact {exact} (mag {mag})"
                                );
                                first[mi] = Some(v.to_bits());
                            }
                            Some(bits) => assert_eq!(
                                bits,
                                v.to_bits(),
                                "{ty:?} {path:?} [{mi},{ni}]: mc={mc} m0={m0} gives other bits"
                            ),
                        }
                    }
                }
            }
        }
    }
}

/// The largest weight values and scales against activations of +-127: the products stay
/// exact (no i16 saturation in the pairwise sums), with the rows read from odd addresses.
#[test]
fn extreme_values_from_unaligned_rows() {
    let (n, k, m) = (3usize, 512usize, 6usize);
    let mut rng = Rng(42);
    // activations: +-1 with a few zeros -> q = +-127 (amax 1); row 0 all +1, row 1 all -1
    let x: Vec<f32> = (0..m * k)
        .map(|i| match i / k {
            0 => 1.0,
            1 => -1.0,
            _ => [1.0, -1.0, 1.0, -1.0, 0.0][(rng.next() % 5) as usize],
        })
        .collect();
    for ty in TYPES {
        let rb = row_bytes(ty, k).unwrap();
        let mut buf = vec![0u8; n * rb + 1];
        let data = &mut buf[1..]; // odd address
        let (_, bytes) = ty.block();
        for (bi, blk) in data.chunks_exact_mut(bytes).enumerate() {
            // row 0: every field at its maximum; the others random bytes
            let full = bi < k / 256;
            for v in blk.iter_mut() {
                *v = if full { 0xFF } else { rng.next() as u8 };
            }
            match ty {
                GgmlType::Q6K => {
                    if full {
                        // scales alternating -128 and 127
                        for (g, s) in blk[192..208].iter_mut().enumerate() {
                            *s = if g % 2 == 0 { 0x80 } else { 0x7F };
                        }
                    }
                    put_f16(blk, 208, 0.003);
                }
                _ => {
                    put_f16(blk, 0, 0.003);
                    put_f16(blk, 2, 0.002);
                }
            }
        }
        check_direct(ty, data, n, &x, m, k);
    }
}

/// Random rows of every format from an unaligned address, every (m0, mc) split.
#[test]
fn random_rows_every_split_same_bits() {
    let mut rng = Rng(7);
    let (n, k, m) = (5usize, 1024usize, 7usize);
    let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
    for ty in TYPES {
        let rows = random_rows(ty, n, k, &mut rng);
        let mut buf = vec![0u8; rows.len() + 3];
        buf[3..].copy_from_slice(&rows);
        check_direct(ty, &buf[3..], n, &x, m, k);
    }
}

/// Timing (run with `cargo test -p specinfer_kernels --release kquants -- --ignored
/// --nocapture`): one 4096 x 4096 layer per format, m = 1 and 16, one thread; GB/s of weight
/// bytes, AVX2 against scalar. "hot": the same weight again and again (it fits a 32 MB L3);
/// "cold": rotating over copies totalling > 64 MB (weights streamed from memory, as in a
/// model's decode). A plain read of the same bytes (summing them as u64, the same
/// software prefetch) gives the machine's ceiling.
#[test]
#[ignore]
fn kquants_speed() {
    use std::time::Instant;
    let (n, k) = (4096usize, 4096usize);
    let mut rng = Rng(1);
    let best = |f: &mut dyn FnMut(), bytes: usize| -> f64 {
        f();
        let mut best = f64::INFINITY;
        let t_all = Instant::now();
        let mut reps = 0;
        while reps < 3 || (t_all.elapsed().as_secs_f64() < 0.6 && reps < 400) {
            let t = Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
            reps += 1;
        }
        bytes as f64 / best / 1e9
    };
    for ty in TYPES {
        let data = random_rows(ty, n, k, &mut rng);
        let bytes = data.len();
        let copies_n = (64 << 20) / bytes + 2;
        let copies: Vec<Vec<u8>> = (0..copies_n).map(|_| data.clone()).collect();
        // the machine's read ceiling over the same bytes
        for (label, set) in [("hot", &copies[..1]), ("cold", &copies[..])] {
            let mut which = 0;
            let gbs = best(
                &mut || {
                    let d = &set[which % set.len()];
                    which += 1;
                    let mut s = [0u64; 8];
                    for (i, c) in d.chunks_exact(64).enumerate() {
                        // the same software prefetch distance as the kernels
                        crate::simd::prefetch_l2(
                            d.as_ptr().wrapping_add(64 * i + 4096) as *const i8
                        );
                        for (a, v) in s.iter_mut().zip(c.chunks_exact(8)) {
                            *a = a.wrapping_add(u64::from_le_bytes(v.try_into().unwrap()));
                        }
                    }
                    std::hint::black_box(s);
                },
                bytes,
            );
            println!(
                "{ty:?} {label:4} plain read of {:.1} MB: {gbs:6.1} GB/s",
                bytes as f64 / 1e6
            );
        }
        for m in [1usize, 16] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            let mut out = vec![0.0f32; m * n];
            // the dot functions alone on the first 128 rows (in L2 after the first pass)
            let l2_rows = 128;
            let acts = Acts::new(&x, m, k, Forms::Q8K, 1);
            let mut ns = [0.0f64; 2];
            for (i, path) in paths().into_iter().rev().enumerate() {
                let f = select(ty, path).unwrap();
                let gbs = best(
                    &mut || {
                        let mut o = [0.0f32; ROWS];
                        for r in 0..l2_rows {
                            let mut m0 = 0;
                            while m0 < m {
                                let mc = (m - m0).min(ROWS);
                                // SAFETY: row r lies within data; m0 + mc <= m.
                                unsafe {
                                    f(data.as_ptr().add(r * (bytes / n)), &acts, m0, mc, &mut o)
                                };
                                m0 += mc;
                            }
                        }
                        std::hint::black_box(o);
                    },
                    bytes / n * l2_rows,
                );
                ns[i] = ty.block().1 as f64 / gbs / m as f64;
            }
            println!(
                "{ty:?} l2   m={m:2}: dot alone {:5.2} ns per super-block and row ({:?}), scalar {:5.1} ns",
                ns[0],
                paths().last().unwrap(),
                ns[1]
            );
            for (label, set, rows) in [("hot", &copies[..1], n), ("cold", &copies[..], n)] {
                let used = bytes / n * rows;
                let mut gbs = [0.0f64; 2];
                for (i, isa) in [Isa::Avx2, Isa::Scalar].into_iter().enumerate() {
                    let mut which = 0;
                    gbs[i] = best(
                        &mut || {
                            let d = &set[which % set.len()][..used];
                            which += 1;
                            let part = [Part {
                                ty,
                                data: d,
                                n: rows,
                            }];
                            gguf_linear(isa, 1, &x, m, k, &part, None, &mut out[..m * rows])
                                .unwrap();
                        },
                        used,
                    );
                }
                println!(
                    "{ty:?} {label:4} m={m:2}: AVX2 {:6.1} GB/s ({:5.1} ns per super-block and row)  scalar {:6.2} GB/s  ratio {:5.1}x",
                    gbs[0],
                    ty.block().1 as f64 / gbs[0] / m as f64,
                    gbs[1],
                    gbs[0] / gbs[1]
                );
            }
        }
    }
}

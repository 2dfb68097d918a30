//! The 32-value formats on every path: exact at the extremes of the integer ranges, and
//! (ignored) timed on a 4096 x 4096 layer (the reference and batch-invariance checks of every
//! format are the shared tests').

use super::super::tests::{put_f16, random_rows, run, seen_x, Rng};
use super::super::{gguf_linear, Part};
use crate::dequant::{dequantize, GgmlType};
use crate::simd::Isa;

const TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4_1R,
    GgmlType::Q4_0R,
    GgmlType::Q5_0R,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

/// Q4_0, Q4_1 and Q5_0 repacked in octets: the same values (dequantized bit for bit as the file's
/// blocks, unpacked back to the same bytes) and products within f32 rounding of the file
/// layout's, for rows of whole octets, octets and short groups, odd last blocks.
#[test]
fn octets_hold_the_same_blocks() {
    use super::super::octets::{groups, repack_rows, unpack_group};
    let mut rng = Rng(7);
    // whole octets; two and a group of 2 (SmolLM2's 576); an octet and groups of 4, 6; a group
    // of 2 and an odd block; three octets and a group of 6 and an odd block
    let shapes = [
        (5usize, 256usize),
        (7, 576),
        (3, 384),
        (4, 448),
        (3, 96),
        (2, 1248),
    ];
    for (file, packed_ty) in [
        (GgmlType::Q4_1, GgmlType::Q4_1R),
        (GgmlType::Q4_0, GgmlType::Q4_0R),
        (GgmlType::Q5_0, GgmlType::Q5_0R),
    ] {
        let bb = file.block().1;
        for (n, k) in shapes {
            let src = random_rows(file, n, k, &mut rng);
            let mut packed = vec![0u8; src.len()];
            repack_rows(file, &src, n, k, &mut packed).unwrap();
            let rb = k / 32 * bb;
            for (s, p) in src.chunks_exact(rb).zip(packed.chunks_exact(rb)) {
                let mut end = 0;
                for (b0, g) in groups(k / 32) {
                    let range = bb * b0..bb * (b0 + g);
                    assert_eq!(
                        &unpack_group(packed_ty, &p[range.clone()], g)[..bb * g],
                        &s[range]
                    );
                    end = bb * (b0 + g);
                }
                assert_eq!(&s[end..], &p[end..]);
                assert!(k / 32 - end / bb <= 1);
            }
            let (mut a, mut b) = (vec![0.0f32; n * k], vec![0.0f32; n * k]);
            dequantize(file, &src, n, k, &mut a, 1).unwrap();
            dequantize(packed_ty, &packed, n, k, &mut b, 2).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            let m = 9;
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
            for isa in Isa::supported() {
                let part = |ty, data| [Part { ty, data, n }];
                let want = run(isa, 1, &x, m, k, &part(file, &src), None);
                let got = run(isa, 2, &x, m, k, &part(packed_ty, &packed), None);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let mag: f32 = (0..k)
                        .map(|e| (a[(i % n) * k + e] * x[(i / n) * k + e]).abs())
                        .sum();
                    assert!(
                        (g - w).abs() <= 1e-5 * mag + 1e-6,
                        "{packed_ty:?} {isa:?} n={n} k={k} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
    let q = GgmlType::Q4_1;
    assert!(repack_rows(q, &[0u8; 40], 1, 48, &mut [0u8; 40]).is_err()); // k not whole blocks
    assert!(repack_rows(q, &[0u8; 40], 1, 64, &mut [0u8; 20]).is_err()); // sizes differ
    assert!(repack_rows(GgmlType::Q8_0, &[0u8; 34], 1, 32, &mut [0u8; 34]).is_err());
    // no layout
}

/// Weights and activations at the ends of their ranges (the largest `vpmaddubsw` pairs, Q8_0's
/// -128), the row one byte off alignment: every path gives the exact dot within f32 rounding.
#[test]
fn q32_formats_are_exact_at_the_range_ends() {
    let k = 352; // 11 blocks: an AVX2 octet, a pair and a single block
    for ty in TYPES {
        let (_, bytes) = ty.block();
        // per-block fill bytes: all ones (largest values), all zeros (most negative for the
        // symmetric formats), 0x80 (Q8_0: -128)
        for fill in [0xFFu8, 0x00, 0x80] {
            let mut buf = vec![fill; k / 32 * bytes + 1];
            let data = &mut buf[1..];
            for blk in data.chunks_exact_mut(bytes) {
                put_f16(blk, 0, 0.25);
                if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_1R) {
                    put_f16(blk, 2, -0.5);
                }
            }
            if matches!(ty, GgmlType::Q4_0R | GgmlType::Q4_1R | GgmlType::Q5_0R) {
                // the file's blocks, repacked (k = 352: an octet, a pair and an odd block)
                let file = match ty {
                    GgmlType::Q4_0R => GgmlType::Q4_0,
                    GgmlType::Q5_0R => GgmlType::Q5_0,
                    _ => GgmlType::Q4_1,
                };
                let src = data.to_vec();
                super::super::octets::repack_rows(file, &src, 1, k, data).unwrap();
            }
            let mut w = vec![0.0f32; k];
            dequantize(ty, data, 1, k, &mut w, 1).unwrap();
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
                let part = [Part { ty, data, n: 1 }];
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

/// This thread's CPU time in seconds (time slices lost to other processes on a shared machine
/// do not count).
fn thread_seconds() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: a valid out pointer; Linux's clock id.
    assert_eq!(unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) }, 0);
    t.sec as f64 + t.nsec as f64 * 1e-9
}

/// Weight GB/s of each format's AVX2 and scalar paths on one thread, a 4096 x 4096 layer,
/// 1 and 16 activation rows (thread CPU time): "hot" the best of calls on one weight (in cache
/// when the last level holds it), "cold" the mean over rounds of copies larger than the caches
/// (streamed from memory). `Q32_TYPES=Q4_0,Q8_0` restricts the formats, `Q32_COLD=0` skips
/// the cold rounds and the scalar path:
/// `cargo test -p specinfer_kernels --release q32_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn q32_throughput() {
    let (n, k) = (4096usize, 4096usize);
    let only = std::env::var("Q32_TYPES").ok();
    let full = std::env::var("Q32_COLD").map_or(true, |v| v != "0");
    let mut rng = Rng(42);
    let x: Vec<f32> = (0..16 * k).map(|_| rng.unit()).collect();
    // seconds per call: the best of `reps` calls on copy 0 (hot), or of `reps` rounds over all
    // the copies (cold)
    let time = |isa: Isa, m: usize, copies: &[Vec<u8>], ty: GgmlType, reps: usize| -> f64 {
        let mut out = vec![0.0f32; m * n];
        let call = |d: &Vec<u8>, out: &mut Vec<f32>| {
            let part = [Part { ty, data: d, n }];
            gguf_linear(isa, 1, &x[..m * k], m, k, &part, None, out).unwrap();
        };
        call(&copies[0], &mut out);
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = thread_seconds();
            copies.iter().for_each(|d| call(d, &mut out));
            best = best.min((thread_seconds() - t) / copies.len() as f64);
        }
        best
    };
    for ty in TYPES {
        if only
            .as_ref()
            .is_some_and(|o| !o.split(',').any(|t| t == format!("{ty:?}")))
        {
            continue;
        }
        let data = random_rows(ty, n, k, &mut rng);
        let gb = data.len() as f64 / 1e9;
        let rounds = if full {
            (256 << 20) / data.len() + 1
        } else {
            1
        };
        let copies: Vec<Vec<u8>> = (0..rounds).map(|_| data.clone()).collect();
        for m in [1usize, 16] {
            let reps = if m == 1 { 100 } else { 20 };
            let (hot, cold) = if !Isa::Avx2.is_supported() {
                (f64::NAN, f64::NAN)
            } else if full {
                (
                    time(Isa::Avx2, m, &copies[..1], ty, reps),
                    time(Isa::Avx2, m, &copies, ty, 3),
                )
            } else {
                (time(Isa::Avx2, m, &copies[..1], ty, reps), f64::NAN)
            };
            let scalar = if full {
                time(Isa::Scalar, m, &copies[..1], ty, 3)
            } else {
                f64::NAN
            };
            println!(
                "{ty:?} m={m:2}: avx2 hot {:6.2} GB/s ({:6.3} ms), cold {:6.2} GB/s | scalar hot {:5.2} GB/s ({:7.2} ms) | avx2/scalar x{:.1}",
                gb / hot,
                hot * 1e3,
                gb / cold,
                gb / scalar,
                scalar * 1e3,
                scalar / hot
            );
        }
    }
}

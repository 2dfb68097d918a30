//! Q4_K, Q5_K, Q6_K on each path: against the dequantized reference with every row count
//! (the shared test's logic, restricted to these formats), at the extremes of the value ranges
//! (no `vpmaddubsw` saturation), from unaligned rows, each row the same bits whatever `mc`
//! and `m0`; and an ignored timing of a 4096 x 4096 layer.

use super::super::acts::{Acts, Forms};
use super::super::tests::{dequant_rows, put_f16, random_rows, seen_x, Rng};
use super::super::{gguf_linear, row_bytes, Part, Path, ROWS};
use super::select;
use crate::dequant::GgmlType;
use crate::simd::Isa;

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

/// Every dot function of `ty`, called directly on `data` (n rows) with every (m0, mc) split of
/// the activation rows: each row's value within f32 rounding of the exact dot, and the same
/// bits whatever split it came in.
fn check_direct(ty: GgmlType, data: &[u8], n: usize, x: &[f32], m: usize, k: usize) {
    let rb = row_bytes(ty, k).unwrap();
    let w = dequant_rows(ty, data, n, k);
    let xs = seen_x(ty, x, m, k);
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

/// Activations of +-1 (with a few zeros): q = +-127 (amax 1); row 0 all +1, row 1 all -1.
fn extreme_x(m: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    (0..m * k)
        .map(|i| match i / k {
            0 => 1.0,
            1 => -1.0,
            _ => [1.0, -1.0, 1.0, -1.0, 0.0][(rng.next() % 5) as usize],
        })
        .collect()
}

/// `n` rows of file type `ty` into `data`: the first `full` rows with every field at its
/// maximum (Q6_K's scales alternating -128 and 127), the others random bytes.
fn extreme_rows(ty: GgmlType, data: &mut [u8], k: usize, full: usize, rng: &mut Rng) {
    let (_, bytes) = ty.block();
    for (bi, blk) in data.chunks_exact_mut(bytes).enumerate() {
        let max = bi < full * (k / 256);
        for v in blk.iter_mut() {
            *v = if max { 0xFF } else { rng.next() as u8 };
        }
        match ty {
            GgmlType::Q6K => {
                if max {
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
}

/// The largest weight values and scales against activations of +-127: the products stay
/// exact (no i16 saturation in the pairwise sums), with the rows read from odd addresses.
#[test]
fn extreme_values_from_unaligned_rows() {
    let (n, k, m) = (3usize, 512usize, 6usize);
    let mut rng = Rng(42);
    let x = extreme_x(m, k, &mut rng);
    for ty in TYPES {
        let rb = row_bytes(ty, k).unwrap();
        let mut buf = vec![0u8; n * rb + 1];
        let data = &mut buf[1..]; // odd address
        extreme_rows(ty, data, k, 1, &mut rng);
        check_direct(ty, data, n, &x, m, k);
    }
}

/// The same extremes through the groups of eight rows (a whole group at its maximum, then
/// random rows and three rows after the group): each output the exact dot within f32 rounding.
#[test]
fn extreme_values_in_groups_of_eight_rows() {
    let (n, k, m) = (19usize, 512usize, 6usize);
    let mut rng = Rng(43);
    let x = extreme_x(m, k, &mut rng);
    for (file, grouped) in [(GgmlType::Q4K, GgmlType::Q4KR)] {
        let mut src = vec![0u8; n * row_bytes(file, k).unwrap()];
        extreme_rows(file, &mut src, k, 8, &mut rng);
        let mut data = vec![0u8; src.len()];
        super::super::row_groups::repack_rows(file, &src, n, k, &mut data).unwrap();
        let w = dequant_rows(file, &src, n, k);
        let xs = seen_x(file, &x, m, k);
        for isa in Isa::supported() {
            let part = [Part {
                ty: grouped,
                data: &data,
                n,
            }];
            let mut out = vec![f32::NAN; m * n];
            gguf_linear(isa, 1, &x, m, k, &part, None, &mut out).unwrap();
            for mi in 0..m {
                for ni in 0..n {
                    let (mut exact, mut mag) = (0.0f64, 0.0f64);
                    for e in 0..k {
                        let p = w[ni * k + e] as f64 * xs[mi * k + e] as f64;
                        exact += p;
                        mag += p.abs();
                    }
                    let got = out[mi * n + ni] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * mag + 1e-6,
                        "{grouped:?} {isa:?} [{mi},{ni}]: {got} vs exact {exact}"
                    );
                }
            }
        }
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
    // KQ_TYPES=Q4K,Q4KR picks (the types' Debug names; default: the file formats and Q4KR)
    let types: Vec<GgmlType> = TYPES
        .into_iter()
        .chain([GgmlType::Q4KR])
        .filter(|t| {
            std::env::var("KQ_TYPES").map_or(true, |v| v.split(',').any(|n| n == format!("{t:?}")))
        })
        .collect();
    for ty in types {
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
            // (the repacked groups have no one-row dot function)
            for (i, path) in paths()
                .into_iter()
                .rev()
                .enumerate()
                .filter(|_| ty != GgmlType::Q4KR)
            {
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

/// Timing, the file layout against the groups of eight in alternation (`cargo test --release
/// -p specinfer_kernels q4k_groups_speed -- --ignored --nocapture`): one 4096 x 4096 layer, one
/// thread, ns per super-block and activation row for several row counts; "l2": the first 128
/// rows only (compute alone), "cold": rotating over copies totalling > 64 MB.
#[test]
#[ignore]
fn q4k_groups_speed() {
    use std::time::Instant;
    // Q4K_SHAPE=n,k for another layer (e.g. 17920,1536: Qwen2.5-1.5B's gate | up)
    let shape: Vec<usize> = std::env::var("Q4K_SHAPE")
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_default();
    let (n, k) = if shape.len() == 2 {
        (shape[0], shape[1])
    } else {
        (4096usize, 4096usize)
    };
    let mut rng = Rng(3);
    let types = [GgmlType::Q4K, GgmlType::Q4KR];
    let bytes = types[0].block().1;
    let file = random_rows(types[0], n, k, &mut rng);
    let mut groups = vec![0u8; file.len()];
    super::super::row_groups::repack_rows(types[0], &file, n, k, &mut groups).unwrap();
    let copies_n = (64 << 20) / file.len() + 2;
    let sets: Vec<Vec<Vec<u8>>> = [&file, &groups]
        .iter()
        .map(|d| (0..copies_n).map(|_| (*d).clone()).collect())
        .collect();
    for m in [1usize, 2, 4, 5, 8, 16] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
        let mut out = vec![0.0f32; m * n];
        for (label, rows, cold) in [
            ("l2", 128usize, false),
            ("hot", n, false),
            ("cold", n, true),
        ] {
            let mut best = [f64::INFINITY; 2];
            let mut which = 0;
            let t_all = Instant::now();
            while t_all.elapsed().as_secs_f64() < 1.5 {
                for (i, ty) in types.into_iter().enumerate() {
                    let set = &sets[i];
                    let d =
                        &set[if cold { which % set.len() } else { 0 }][..rows * (k / 256) * bytes];
                    let part = [Part {
                        ty,
                        data: d,
                        n: rows,
                    }];
                    let t = Instant::now();
                    gguf_linear(Isa::Avx2, 1, &x, m, k, &part, None, &mut out[..m * rows]).unwrap();
                    best[i] = best[i].min(t.elapsed().as_secs_f64());
                }
                which += 1;
            }
            let ns = |b: f64| b * 1e9 / (rows * (k / 256) * m) as f64;
            println!(
                "m={m:2} {label:4}: file {:5.2} ns, groups {:5.2} ns per super-block and row ({:.2}x; groups {:5.1} GB/s)",
                ns(best[0]),
                ns(best[1]),
                best[0] / best[1],
                (rows * (k / 256) * bytes) as f64 / best[1] / 1e9
            );
        }
    }
}

use super::*;
use crate::few_rows_linear::test_rand as rand;
use crate::int8_linear::quantize;
use crate::int8_pack::pack;

fn packed(q: &[i8], scales: &[f32], n: usize, k: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    let mut w = vec![0u8; tiles(n) * TILE * k];
    let mut s = vec![0f32; tiles(n) * TILE * (k / group)];
    pack(q, scales, n, k, group, &mut w, &mut s);
    (w, s)
}

/// The documented formula, written independently: exact i64 group dots, f32 FMA per group.
fn reference(
    x: &[f32],
    m: usize,
    q: &[i8],
    scales: &[f32],
    n: usize,
    k: usize,
    group: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let groups = k / group;
    let mut out = vec![0f32; m * n];
    for mi in 0..m {
        for gi in 0..groups {
            let xs = &x[mi * k + gi * group..mi * k + (gi + 1) * group];
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sx = amax / 127.0;
            let inv = if sx > 0.0 { 1.0 / sx } else { 0.0 };
            let xq: Vec<i64> = xs
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i64)
                .collect();
            for ni in 0..n {
                let qs = &q[ni * k + gi * group..ni * k + (gi + 1) * group];
                let dot: i64 = qs
                    .iter()
                    .zip(&xq)
                    .map(|(&a, &b)| a.max(-127) as i64 * b)
                    .sum();
                let s = scales[ni * groups + gi] * sx;
                out[mi * n + ni] = (dot as f32).mul_add(s, out[mi * n + ni]);
            }
        }
        if let Some(b) = bias {
            for ni in 0..n {
                out[mi * n + ni] += b[ni];
            }
        }
    }
    out
}

#[test]
fn every_isa_matches_the_formula_bit_for_bit_and_the_float_product_closely() {
    for (n, k, group) in [
        (37, 64, 32),
        (16, 96, 32),
        (5, 128, 128),
        (40, 48, 16),
        (70, 576, 32),
    ] {
        let wf = rand(n * k, 3);
        let (mut q, scales) = quantize(&wf, n, k, group);
        q[0] = -128; // stored as -127 by pack; the formula does the same
        let (w, s) = packed(&q, &scales, n, k, group);
        let bias = rand(n, 5);
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 21, 40] {
            let x = rand(m * k, 7 + m as u64);
            for b in [None, Some(&bias[..])] {
                let want = reference(&x, m, &q, &scales, n, k, group, b);
                for isa in Isa::supported() {
                    for threads in [1, 3] {
                        let mut out = vec![0.0f32; m * n];
                        let pw = PackedInt8 {
                            w: &w,
                            scales: &s,
                            n,
                            k,
                            group,
                        };
                        w8a8_linear(isa, threads, &x, m, pw, b, &mut out).unwrap();
                        assert_eq!(out, want, "{isa:?} m={m} n={n} k={k} threads={threads}");
                    }
                }
            }
            // close to the float product of the dequantized weights (activation rounding only)
            let mut out = vec![0.0f32; m * n];
            let pw = PackedInt8 {
                w: &w,
                scales: &s,
                n,
                k,
                group,
            };
            w8a8_linear(Isa::detect(), 1, &x, m, pw, None, &mut out).unwrap();
            for i in 0..m * n {
                let (mi, ni) = (i / n, i % n);
                let mut exact = 0f64;
                let mut bound = 1e-5f64;
                for e in 0..k {
                    let wv = q[ni * k + e].max(-127) as f64
                        * scales[ni * (k / group) + e / group] as f64;
                    exact += x[mi * k + e] as f64 * wv;
                    let g0 = mi * k + (e / group) * group;
                    let amax = x[g0..g0 + group].iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                    bound += wv.abs() * amax / 127.0 * 0.5 * 1.001;
                }
                assert!(
                    (out[i] as f64 - exact).abs() <= bound,
                    "m={m} {i}: {} vs {exact} (bound {bound})",
                    out[i]
                );
            }
        }
    }
}

#[test]
fn a_row_does_not_depend_on_the_other_rows_of_the_batch() {
    let (n, k, group) = (100, 256, 32);
    let (q, scales) = quantize(&rand(n * k, 11), n, k, group);
    let (w, s) = packed(&q, &scales, n, k, group);
    let x = rand(13 * k, 12);
    let pw = PackedInt8 {
        w: &w,
        scales: &s,
        n,
        k,
        group,
    };
    let mut all = vec![0f32; 13 * n];
    w8a8_linear(Isa::detect(), 2, &x, 13, pw, None, &mut all).unwrap();
    for mi in 0..13 {
        let mut one = vec![0f32; n];
        w8a8_linear(
            Isa::detect(),
            1,
            &x[mi * k..(mi + 1) * k],
            1,
            pw,
            None,
            &mut one,
        )
        .unwrap();
        assert_eq!(&all[mi * n..(mi + 1) * n], &one[..], "row {mi}");
    }
}

#[test]
fn quantize_follows_q8_0() {
    let mut w = [0.0f32; 16];
    w[..6].copy_from_slice(&[0.0, 1.0, -2.0, 0.5, 2.0, -0.01]);
    let (q, s) = quantize(&w, 1, 16, 16);
    assert_eq!(s, vec![2.0 / 127.0]);
    assert_eq!(&q[..6], &[0, 64, -127, 32, 127, -1]);
    let (q0, s0) = quantize(&[0.0; 16], 1, 16, 16);
    assert_eq!((q0, s0), (vec![0i8; 16], vec![0.0]));
}

#[test]
fn bad_shapes_are_refused_naming_the_field() {
    let (n, k) = (2, 32);
    let w = vec![128u8; TILE * k];
    let s = vec![1.0f32; TILE];
    let x = vec![0.0f32; k];
    let mut out = vec![0.0f32; n];
    let field = |pw: PackedInt8<'_>, x: &[f32], bias: Option<&[f32]>, out: &mut [f32]| {
        w8a8_linear(Isa::Scalar, 1, x, 1, pw, bias, out)
            .unwrap_err()
            .field
    };
    let ok = PackedInt8 {
        w: &w,
        scales: &s,
        n,
        k,
        group: 32,
    };
    assert_eq!(
        field(PackedInt8 { group: 24, ..ok }, &x, None, &mut out),
        "group"
    );
    assert_eq!(
        field(PackedInt8 { w: &w[..100], ..ok }, &x, None, &mut out),
        "weight"
    );
    assert_eq!(
        field(
            PackedInt8 {
                scales: &s[..1],
                ..ok
            },
            &x,
            None,
            &mut out
        ),
        "scales"
    );
    assert_eq!(field(ok, &x[..31], None, &mut out), "x");
    assert_eq!(field(ok, &x, Some(&[0.0]), &mut out), "bias");
    assert_eq!(field(ok, &x, None, &mut out[..1]), "out");
}

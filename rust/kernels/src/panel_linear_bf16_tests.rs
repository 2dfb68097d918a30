use super::*;
use crate::elem::Bf16;
use crate::few_rows_linear::test_rand as rand;

type ItemFn = unsafe fn(&Job<'_, f32>, usize);

/// Every way this machine can run the kernel: (name, item fn).
fn paths() -> Vec<(&'static str, ItemFn)> {
    let mut v: Vec<(&'static str, ItemFn)> = vec![("scalar", item_scalar)];
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::Avx2.is_supported() {
            v.push(("avx2", item_avx2));
        }
        if Isa::Avx512.is_supported() {
            v.push(("avx512", item_avx512));
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                v.push(("avx512bf16", item_dpbf16));
            }
        }
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn run_path(
    item: ItemFn,
    x: &[f32],
    m: usize,
    packed: &[u32],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let xp = activation_pairs(Isa::Scalar, x, m, k);
    let mut out = vec![f32::NAN; m * n];
    let job = Job {
        x: &xp,
        m,
        w: packed,
        n,
        k2: num_pairs(k),
        bias,
        out: OutPtr(out.as_mut_ptr()),
    };
    for p in 0..num_panels(n) {
        // SAFETY: the test only lists paths this CPU supports
        unsafe { item(&job, p) };
    }
    out
}

fn bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| Bf16::from_f32(x).0).collect()
}

fn widen(b: u16) -> f32 {
    f32::from_bits((flush(b) as u32) << 16)
}

/// The element's defining arithmetic: per k pair, the odd product then the even one, each one
/// rounding (the products are exact); then + bias.
fn chain(x: &[u16], w: &[u16], bias: Option<f32>) -> f32 {
    let mut acc = 0.0f32;
    for i in (0..x.len()).step_by(2) {
        if i + 1 < x.len() {
            acc = widen(x[i + 1]).mul_add(widen(w[i + 1]), acc);
        }
        acc = widen(x[i]).mul_add(widen(w[i]), acc);
    }
    bias.map_or(acc, |b| acc + b)
}

#[test]
fn every_path_computes_the_pairwise_chain_bit_for_bit() {
    for (n, k) in [(37, 64), (16, 96), (5, 7), (70, 161), (129, 33), (64, 1)] {
        let w = bits(&rand(n * k, 3));
        let packed = panel_pack_pairs(&w, n, k);
        let bias = rand(n, 5);
        for m in [1, 2, 5, 6, 7, 13] {
            let x = rand(m * k, 7 + m as u64);
            let xb = bits(&x);
            for (name, item) in paths() {
                for with_bias in [false, true] {
                    let b = with_bias.then_some(&bias[..]);
                    let out = run_path(item, &x, m, &packed, n, k, b);
                    for i in 0..m * n {
                        let (mi, ni) = (i / n, i % n);
                        let want = chain(
                            &xb[mi * k..(mi + 1) * k],
                            &w[ni * k..(ni + 1) * k],
                            b.map(|b| b[ni]),
                        );
                        assert_eq!(
                            out[i].to_bits(),
                            want.to_bits(),
                            "{name} m={m} n={n} k={k} bias={with_bias} [{mi},{ni}]"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_entry_point_gives_the_same_bits_on_every_isa_and_thread_count() {
    let (n, k, m) = (200, 130, 9);
    let w = bits(&rand(n * k, 21));
    let packed = panel_pack_pairs(&w, n, k);
    let x = rand(m * k, 22);
    let bias = rand(n, 23);
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::supported() {
        for threads in [1, 3] {
            let mut out = vec![0.0f32; m * n];
            panel_linear_bf16(isa, threads, &x, m, &packed, n, k, Some(&bias), &mut out).unwrap();
            match &first {
                None => first = Some(out),
                Some(f) => assert_eq!(f, &out, "{isa:?} threads={threads}"),
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_alone_and_among_any_number_of_rows() {
    let (n, k) = (200, 128);
    let packed = panel_pack_pairs(&bits(&rand(n * k, 11)), n, k);
    let bias = rand(n, 12);
    let x = rand(40 * k, 13);
    for isa in Isa::supported() {
        let mut all = vec![0.0f32; 40 * n];
        panel_linear_bf16(isa, 2, &x, 40, &packed, n, k, Some(&bias), &mut all).unwrap();
        for (start, rows) in [(0, 1), (3, 5), (7, 6), (11, 29), (39, 1)] {
            let mut part = vec![0.0f32; rows * n];
            let xs = &x[start * k..(start + rows) * k];
            panel_linear_bf16(isa, 1, xs, rows, &packed, n, k, Some(&bias), &mut part).unwrap();
            assert_eq!(
                part,
                all[start * n..(start + rows) * n],
                "{isa:?} rows {start}+{rows}"
            );
        }
    }
}

#[test]
fn packing_pairs_k_per_output_row_and_flushes_denormals() {
    let (n, k) = (66, 3);
    let mut w: Vec<u16> = (0..n * k).map(|i| 0x3F80 + i as u16).collect(); // normal values
    w[1] = 0x0001; // a denormal: read as zero
    let p = panel_pack_pairs(&w, n, k);
    assert_eq!(p.len(), 2 * 2 * PANEL); // 2 panels x 2 pairs x 64
    assert_eq!(p[0], w[0] as u32); // row 0, k = 0 and a flushed k = 1
    assert_eq!(p[1], w[3] as u32 | (w[4] as u32) << 16); // row 1, k = 0 and 1
    assert_eq!(p[PANEL], w[2] as u32); // row 0, k = 2 and the zero pad
    assert_eq!(
        p[2 * PANEL],
        w[64 * k] as u32 | (w[64 * k + 1] as u32) << 16
    ); // row 64
    assert_eq!(p[2 * PANEL + 2], 0); // rows past n are zero
}

#[test]
fn activations_round_to_nearest_even_bf16() {
    let x = [
        1.0f32,
        f32::from_bits(0x3F80_8000),
        f32::from_bits(0x3F81_8000),
        1e-40,
    ];
    let p = activation_pairs(Isa::Scalar, &x, 1, 4);
    let mut y = rand(7 * 33, 9);
    y[5] = f32::NAN;
    y[6] = f32::INFINITY;
    y[7] = -1e-39; // denormal
    y[8] = f32::MAX; // rounds to inf
    let want = activation_pairs(Isa::Scalar, &y, 7, 33);
    for isa in Isa::supported() {
        assert_eq!(activation_pairs(isa, &x, 1, 4), p, "{isa:?}");
        assert_eq!(activation_pairs(isa, &y, 7, 33), want, "{isa:?}");
    }
    assert_eq!(p[0], 0x3F80 | (0x3F80 << 16)); // a tie rounds to even (down)
    assert_eq!(p[1], 0x3F82); // a tie rounds to even (up); the denormal is flushed
}

#[test]
fn bad_shapes_are_refused_naming_the_field() {
    let (n, k) = (20, 8);
    let packed = vec![0u32; num_panels(n) * num_pairs(k) * PANEL];
    let x = vec![0.0f32; 2 * k];
    let mut out = vec![0.0f32; 2 * n];
    let isa = Isa::Scalar;
    let field = |r: Result<(), KernelError>| r.unwrap_err().field;
    let f = panel_linear_bf16(isa, 1, &x, 2, &packed[1..], n, k, None, &mut out);
    assert_eq!(field(f), "weight");
    let f = panel_linear_bf16(isa, 1, &x[1..], 2, &packed, n, k, None, &mut out);
    assert_eq!(field(f), "x");
    let f = panel_linear_bf16(isa, 1, &x, 2, &packed, n, k, None, &mut out[1..]);
    assert_eq!(field(f), "out");
    let f = panel_linear_bf16(isa, 1, &x, 2, &packed, n, k, Some(&[0.0; 3]), &mut out);
    assert_eq!(field(f), "bias");
    let f = panel_linear_bf16(isa, 1, &x[..0], 2, &packed[..0], n, 0, None, &mut out);
    assert_eq!(field(f), "k");
}

#[test]
fn bf16_in_and_out_is_the_f32_result_rounded_once() {
    let (n, k, m) = (150, 75, 7);
    let packed = panel_pack_pairs(&bits(&rand(n * k, 31)), n, k);
    let bias = rand(n, 32);
    let x: Vec<Bf16> = rand(m * k, 33).iter().map(|&v| Bf16::from_f32(v)).collect();
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    for isa in Isa::supported() {
        let mut want = vec![0.0f32; m * n];
        panel_linear_bf16(isa, 1, &xf, m, &packed, n, k, Some(&bias), &mut want).unwrap();
        let mut got = vec![Bf16(0); m * n];
        panel_linear_bf16(isa, 2, &x, m, &packed, n, k, Some(&bias), &mut got).unwrap();
        let want: Vec<u16> = want.iter().map(|&v| Bf16::from_f32(v).0).collect();
        let got: Vec<u16> = got.iter().map(|v| v.0).collect();
        assert_eq!(got, want, "{isa:?}");
    }
}

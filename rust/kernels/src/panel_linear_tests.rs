use super::*;
use crate::few_rows_linear::test_rand as rand;

#[allow(clippy::too_many_arguments)]
fn run(
    isa: Isa,
    threads: usize,
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let packed = panel_pack(w, n, k);
    let mut out = vec![f32::NAN; m * n];
    panel_linear(isa, threads, x, m, &packed, n, k, bias, &mut out).unwrap();
    out
}

/// The element's defining arithmetic: one fused chain over k from zero, then + bias.
fn chain(x: &[f32], w: &[f32], bias: Option<f32>) -> f32 {
    let s = x
        .iter()
        .zip(w)
        .fold(0.0f32, |acc, (a, b)| a.mul_add(*b, acc));
    bias.map_or(s, |b| s + b)
}

#[test]
fn every_element_is_the_fused_k_ordered_chain_on_every_isa() {
    // n not a multiple of 16 or of a tile group, k not a multiple of anything
    for (n, k) in [(37, 64), (16, 96), (5, 7), (70, 161), (129, 33)] {
        let wf = rand(n * k, 3);
        let bias = rand(n, 5);
        for m in [1, 2, 5, 6, 7, 13] {
            let x = rand(m * k, 7 + m as u64);
            for isa in Isa::supported() {
                for threads in [1, 3] {
                    for with_bias in [false, true] {
                        let b = with_bias.then_some(&bias[..]);
                        let out_f = run(isa, threads, &x, m, &wf, n, k, b);
                        for i in 0..m * n {
                            let (mi, ni) = (i / n, i % n);
                            let xr = &x[mi * k..(mi + 1) * k];
                            let bb = b.map(|b| b[ni]);
                            let want_f = chain(xr, &wf[ni * k..(ni + 1) * k], bb);
                            assert_eq!(
                                out_f[i].to_bits(),
                                want_f.to_bits(),
                                "f32 {isa:?} m={m} n={n} k={k} bias={with_bias} [{mi},{ni}]"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_alone_and_among_any_number_of_rows() {
    let (n, k) = (200, 128);
    let w = rand(n * k, 11);
    let bias = rand(n, 12);
    let x = rand(40 * k, 13);
    for isa in Isa::supported() {
        let all = run(isa, 2, &x, 40, &w, n, k, Some(&bias));
        for (start, rows) in [(0, 1), (3, 5), (7, 6), (11, 29), (39, 1)] {
            let part = run(
                isa,
                1,
                &x[start * k..(start + rows) * k],
                rows,
                &w,
                n,
                k,
                Some(&bias),
            );
            assert_eq!(
                part,
                all[start * n..(start + rows) * n],
                "{isa:?} rows {start}+{rows}"
            );
        }
    }
}

#[test]
fn packing_puts_sixty_four_output_rows_side_by_side_per_k() {
    let (n, k) = (66, 3);
    let w: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
    let p = panel_pack(&w, n, k);
    assert_eq!(p.len(), 2 * k * PANEL);
    assert_eq!(p[0..3], [0.0, 3.0, 6.0]); // k = 0 of rows 0, 1, 2
    assert_eq!(p[PANEL], 1.0); // k = 1 of row 0
    assert_eq!(p[k * PANEL], w[64 * k]); // second panel: row 64
    assert_eq!(p[k * PANEL + 2], 0.0); // rows past n are zero
}

#[test]
fn bad_shapes_are_refused_naming_the_field() {
    let (n, k) = (20, 8);
    let packed = vec![0.0f32; num_panels(n) * k * PANEL];
    let x = vec![0.0f32; 2 * k];
    let mut out = vec![0.0f32; 2 * n];
    let e = |r: Result<(), KernelError>| r.unwrap_err().field;
    let isa = Isa::Scalar;
    assert_eq!(
        e(panel_linear(
            isa,
            1,
            &x,
            2,
            &packed[1..],
            n,
            k,
            None,
            &mut out
        )),
        "weight"
    );
    assert_eq!(
        e(panel_linear(
            isa,
            1,
            &x[1..],
            2,
            &packed,
            n,
            k,
            None,
            &mut out
        )),
        "x"
    );
    assert_eq!(
        e(panel_linear(
            isa,
            1,
            &x,
            2,
            &packed,
            n,
            k,
            None,
            &mut out[1..]
        )),
        "out"
    );
    assert_eq!(
        e(panel_linear(
            isa,
            1,
            &x,
            2,
            &packed,
            n,
            k,
            Some(&[0.0; 3]),
            &mut out
        )),
        "bias"
    );
    assert_eq!(
        e(panel_linear(
            isa,
            1,
            &x[..0],
            2,
            &packed[..0],
            n,
            0,
            None,
            &mut out
        )),
        "k"
    );
}

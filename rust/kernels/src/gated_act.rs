//! The gated MLP's activation of a GGUF model's layers: `out[r, j] = silu(gate[r, j]) * up[r, j]`
//! for rows `[gate | up]` (the layout the gate|up GEMM writes), `silu(x) = x / (1 + e^-x)` with
//! the crate's vectorized exp ([`crate::simd::Rows::exp`], Cephes' expf, ~2 ulp).
//!
//! In Rust so that the fused layers ([`crate::gguf_decoder`]) run a whole forward in one call
//! (at batch 1 on SmolLM2-135M torch's `silu(gate) * up` was ~27 µs a layer, 6 % of a step); the
//! unfused layers of a GGUF model call it too, so both give the same bits. Elementwise, every
//! element by the same vector operations wherever it sits (a row's tail goes through the vector
//! code on a padded copy): batch invariant.

use crate::simd::{Isa, Rows, Scalar};
use crate::threads;

/// Rows per work item of a multi-row call (a decode's single row stays on the calling thread).
const ROWS_PER_ITEM: usize = 8;

/// `gate_up` `[t, 2 * inter]` -> `out` `[t, inter]`.
pub fn silu_mul(
    isa: Isa,
    num_threads: usize,
    gate_up: &[f32],
    t: usize,
    inter: usize,
    out: &mut [f32],
) -> Result<(), String> {
    if gate_up.len() != t * 2 * inter || out.len() != t * inter {
        return Err(format!(
            "silu_mul: gate_up has {} values and out {} (want {} and {})",
            gate_up.len(),
            out.len(),
            t * 2 * inter,
            t * inter
        ));
    }
    if !isa.is_supported() {
        return Err(format!("silu_mul: this CPU cannot run {}", isa.name()));
    }
    let row: unsafe fn(&[f32], &mut [f32]) = match isa {
        Isa::Scalar => row_scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => row_avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => row_avx512,
        #[allow(unreachable_patterns)]
        _ => row_scalar,
    };
    let starts: Vec<usize> = (0..t).step_by(ROWS_PER_ITEM).collect();
    let out_ptr = threads::DisjointOut(out.as_mut_ptr());
    let run = |&r0: &usize| {
        for r in r0..(r0 + ROWS_PER_ITEM).min(t) {
            // SAFETY: rows are disjoint; `row` was chosen for a supported ISA (checked above)
            unsafe {
                let o = std::slice::from_raw_parts_mut(out_ptr.at(r * inter), inter);
                row(&gate_up[r * 2 * inter..(r + 1) * 2 * inter], o)
            }
        }
    };
    threads::for_each_item(num_threads, &starts, run);
    Ok(())
}

/// `silu(g) * u` of W lanes at `g`, `u` into `o`.
#[inline(always)]
unsafe fn lanes<R: Rows>(g: *const f32, u: *const f32, o: *mut f32) {
    let x = R::load(g);
    let e = R::exp(R::sub(R::splat(0.0), x));
    let s = R::div(x, R::add(R::splat(1.0), e));
    R::store(o, R::mul(s, R::load(u)));
}

/// One row: `gu` = `[gate | up]` (2 * n values) -> `out` (n values). (No closures here: a
/// closure would not inherit the caller's target features, and its vector code would not inline.)
#[inline(always)]
unsafe fn row<R: Rows>(gu: &[f32], out: &mut [f32]) {
    let n = out.len();
    let (g, u, o) = (gu.as_ptr(), gu.as_ptr().add(n), out.as_mut_ptr());
    let body = n / R::W * R::W;
    let mut j = 0;
    while j < body {
        lanes::<R>(g.add(j), u.add(j), o.add(j));
        j += R::W;
    }
    if j < n {
        // the tail on padded copies, by the same vector operations
        let (mut gt, mut ut, mut ot) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        let rest = n - j;
        gt[..rest].copy_from_slice(&gu[j..n]);
        ut[..rest].copy_from_slice(&gu[n + j..2 * n]);
        lanes::<R>(gt.as_ptr(), ut.as_ptr(), ot.as_mut_ptr());
        out[j..].copy_from_slice(&ot[..rest]);
    }
}

unsafe fn row_scalar(gu: &[f32], out: &mut [f32]) {
    row::<Scalar>(gu, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_avx2(gu: &[f32], out: &mut [f32]) {
    row::<crate::simd::Avx2>(gu, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512(gu: &[f32], out: &mut [f32]) {
    row::<crate::simd::Avx512>(gu, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate_up(t: usize, n: usize) -> Vec<f32> {
        (0..t * 2 * n)
            .map(|i| ((i * 2654435761usize % 10007) as f32 / 10007.0 - 0.5) * 24.0)
            .collect()
    }

    #[test]
    fn silu_mul_is_silu_times_up() {
        for isa in Isa::supported() {
            for n in [1, 7, 8, 16, 37, 1536] {
                let t = 3;
                let gu = gate_up(t, n);
                let mut out = vec![0f32; t * n];
                silu_mul(isa, 1, &gu, t, n, &mut out).unwrap();
                for r in 0..t {
                    for j in 0..n {
                        let (g, u) = (gu[r * 2 * n + j] as f64, gu[r * 2 * n + n + j] as f64);
                        let want = g / (1.0 + (-g).exp()) * u;
                        let got = out[r * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                            "{isa:?} n={n} ({r}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn silu_mul_rows_are_batch_invariant() {
        for isa in Isa::supported() {
            let n = 37;
            let gu = gate_up(19, n);
            let mut all = vec![0f32; 19 * n];
            silu_mul(isa, 2, &gu, 19, n, &mut all).unwrap();
            for r in [0, 5, 18] {
                let mut one = vec![0f32; n];
                silu_mul(isa, 1, &gu[r * 2 * n..(r + 1) * 2 * n], 1, n, &mut one).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&one),
                    bits(&all[r * n..(r + 1) * n]),
                    "{isa:?} row {r}"
                );
            }
        }
    }

    #[test]
    fn silu_mul_refuses_wrong_sizes() {
        let mut out = vec![0f32; 4];
        let err = silu_mul(Isa::Scalar, 1, &[0.0; 6], 1, 4, &mut out).unwrap_err();
        assert!(err.contains("gate_up has 6 values"), "{err}");
    }
}

//! F32, F16 and BF16 weight rows times f32 activations (rare in GGUF GEMMs: small models'
//! embeddings, files converted without quantization). Eight partial sums per row, each over
//! the inputs `e` with `e % 8` equal, added pairwise at the end: the same order on every path.

use super::{Acts, DotFn, Path, ROWS};
use crate::dequant::GgmlType;
use half::f16;

pub(super) fn select(ty: GgmlType, _path: Path) -> Option<DotFn> {
    Some(match ty {
        GgmlType::F32 => dot::<0>,
        GgmlType::F16 => dot::<1>,
        GgmlType::Bf16 => dot::<2>,
        _ => return None,
    })
}

pub(super) fn select_rows(ty: GgmlType, _path: Path) -> Option<super::RowsFn> {
    use super::rows_fn;
    Some(match ty {
        GgmlType::F32 => rows_fn!(dot::<0>),
        GgmlType::F16 => rows_fn!(dot::<1>),
        GgmlType::Bf16 => rows_fn!(dot::<2>),
        _ => return None,
    })
}

#[inline(always)]
unsafe fn weight<const T: u8>(w: *const u8, e: usize) -> f32 {
    match T {
        0 => std::ptr::read_unaligned(w.add(4 * e) as *const f32),
        1 => f16::from_bits(std::ptr::read_unaligned(w.add(2 * e) as *const u16)).to_f32(),
        _ => f32::from_bits((std::ptr::read_unaligned(w.add(2 * e) as *const u16) as u32) << 16),
    }
}

unsafe fn dot<const T: u8>(
    w: *const u8,
    acts: &Acts<'_>,
    m0: usize,
    mc: usize,
    out: &mut [f32; ROWS],
) {
    let k = acts.k;
    let mut acc = [[0.0f32; 8]; ROWS];
    let mut e = 0;
    while e + 8 <= k {
        let wv: [f32; 8] = std::array::from_fn(|j| weight::<T>(w, e + j));
        for (i, a) in acc.iter_mut().enumerate().take(mc) {
            let x = &acts.row(m0 + i)[e..e + 8];
            for j in 0..8 {
                a[j] = wv[j].mul_add(x[j], a[j]);
            }
        }
        e += 8;
    }
    for (i, a) in acc.iter_mut().enumerate().take(mc) {
        let x = acts.row(m0 + i);
        for (j, ee) in (e..k).enumerate() {
            a[j] = weight::<T>(w, ee).mul_add(x[ee], a[j]);
        }
        out[i] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    }
}

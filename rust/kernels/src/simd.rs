//! Vector primitives of the attention kernel, one implementation per instruction set.
//!
//! The kernel body is generic over [`Lanes`] and instantiated inside functions carrying
//! `#[target_feature]` (see `paged_attention`), so the `#[inline(always)]` primitives below
//! are compiled with AVX-512 / AVX2+FMA enabled exactly where the CPU was found to have them
//! ([`Isa::detect`], `is_x86_feature_detected!`). [`Scalar`] is the portable fallback (and the
//! path on non-x86 targets); LLVM still auto-vectorizes it for the baseline ISA.

/// Hint the cache to fetch the line holding `p` into L2 (a no-op off x86-64). Never faults, so
/// `p` may point past the end of a buffer (build it with `wrapping_add`).
#[inline(always)]
pub fn prefetch_l2(p: *const i8) {
    prefetch::<2>(p) // _MM_HINT_T1
}

/// Hint that the cache line at `p` be fetched into L1 (and the levels below it).
#[inline(always)]
pub fn prefetch_l1(p: *const i8) {
    prefetch::<3>(p) // _MM_HINT_T0
}

#[inline(always)]
#[allow(clippy::not_unsafe_ptr_arg_deref)] // a prefetch hint reads nothing: no dereference
fn prefetch<const HINT: i32>(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch hint reads nothing architecturally and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(p)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Whether this CPU can run `self`.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU can run, the portable one first.
    pub fn supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        match name {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }
}

/// f32 vector primitives. Callers pass slices of equal length.
///
/// # Safety
/// The CPU must support the implementation's instruction set (guaranteed by the dispatch).
pub trait Lanes {
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32;
    /// y += a * x
    unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]);
    /// y *= a
    unsafe fn scale(y: &mut [f32], a: f32);
}

/// Vectors of f32 lanes for the row-parallel path (lanes run over query rows), with a
/// vectorized exp. `W` lanes per vector.
///
/// # Safety
/// As for [`Lanes`]; pointers address at least `W` valid f32s.
pub trait Rows {
    const W: usize;
    type V: Copy;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// a * b + c
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// e^x to about 2 ulp (Cephes' expf polynomial); -inf and x < -88.37 give 0.
    unsafe fn exp(x: Self::V) -> Self::V;
}

/// Widening loads of int8 and bf16 weights to f32 lanes, and a horizontal sum, for the
/// few-rows linear kernel.
///
/// # Safety
/// As for [`Rows`]; `p` addresses at least `W` valid elements.
pub trait I8Rows: Rows {
    unsafe fn load_i8(p: *const i8) -> Self::V;
    /// bf16 bits (the upper half of an f32) -> f32, exact.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// W dwords, each a pair of bf16s (k even in the low half, k odd in the high half) -> the
    /// evens and the odds as f32, exact.
    unsafe fn load_bf16_pairs(p: *const u32) -> (Self::V, Self::V);
    unsafe fn sum(v: Self::V) -> f32;
}

/// Cephes expf constants.
pub(crate) mod expf {
    pub const HI: f32 = 88.376_26;
    pub const LO: f32 = -88.376_26;
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes: 5.0000001201e-1, which rounds to 0.5 in f32
    ];
}

pub struct Scalar;

impl Lanes for Scalar {
    #[inline(always)]
    unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        // four partial sums: lets LLVM vectorize without reassociation flags
        let mut acc = [0.0f32; 4];
        let n4 = a.len() / 4 * 4;
        for i in (0..n4).step_by(4) {
            for j in 0..4 {
                acc[j] += a[i + j] * b[i + j];
            }
        }
        let mut s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
        for i in n4..a.len() {
            s += a[i] * b[i];
        }
        s
    }

    #[inline(always)]
    unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += a * xi;
        }
    }

    #[inline(always)]
    unsafe fn scale(y: &mut [f32], a: f32) {
        for yi in y.iter_mut() {
            *yi *= a;
        }
    }
}

impl Rows for Scalar {
    const W: usize = 1;
    type V = f32;
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn exp(x: f32) -> f32 {
        x.exp()
    }
}

impl I8Rows for Scalar {
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> f32 {
        *p as f32
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> f32 {
        f32::from_bits((*p as u32) << 16)
    }
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const u32) -> (f32, f32) {
        (f32::from_bits(*p << 16), f32::from_bits(*p & 0xFFFF_0000))
    }
    #[inline(always)]
    unsafe fn sum(v: f32) -> f32 {
        v
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Lanes;
    use std::arch::x86_64::*;

    pub struct Avx2;

    impl Lanes for Avx2 {
        #[inline(always)]
        unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut acc0 = _mm256_setzero_ps();
            let mut acc1 = _mm256_setzero_ps();
            let mut i = 0;
            while i + 16 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    acc1,
                );
                i += 16;
            }
            if i + 8 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                i += 8;
            }
            let acc = _mm256_add_ps(acc0, acc1);
            let lo = _mm256_castps256_ps128(acc);
            let hi = _mm256_extractf128_ps(acc, 1);
            let s4 = _mm_add_ps(lo, hi);
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
            let mut s = _mm_cvtss_f32(s1);
            while i < n {
                s += *pa.add(i) * *pb.add(i);
                i += 1;
            }
            s
        }

        #[inline(always)]
        unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
            let n = y.len().min(x.len());
            let (py, px) = (y.as_mut_ptr(), x.as_ptr());
            let va = _mm256_set1_ps(a);
            let mut i = 0;
            while i + 8 <= n {
                _mm256_storeu_ps(
                    py.add(i),
                    _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))),
                );
                i += 8;
            }
            while i < n {
                *py.add(i) += a * *px.add(i);
                i += 1;
            }
        }

        #[inline(always)]
        unsafe fn scale(y: &mut [f32], a: f32) {
            let n = y.len();
            let py = y.as_mut_ptr();
            let va = _mm256_set1_ps(a);
            let mut i = 0;
            while i + 8 <= n {
                _mm256_storeu_ps(py.add(i), _mm256_mul_ps(va, _mm256_loadu_ps(py.add(i))));
                i += 8;
            }
            while i < n {
                *py.add(i) *= a;
                i += 1;
            }
        }
    }

    pub struct Avx512;

    #[inline(always)]
    unsafe fn tail_mask(rest: usize) -> __mmask16 {
        ((1u32 << rest) - 1) as __mmask16
    }

    impl Lanes for Avx512 {
        #[inline(always)]
        unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let (pa, pb) = (a.as_ptr(), b.as_ptr());
            let mut acc0 = _mm512_setzero_ps();
            let mut acc1 = _mm512_setzero_ps();
            let mut i = 0;
            while i + 32 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i + 16)),
                    _mm512_loadu_ps(pb.add(i + 16)),
                    acc1,
                );
                i += 32;
            }
            if i + 16 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                acc1 = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(m, pa.add(i)),
                    _mm512_maskz_loadu_ps(m, pb.add(i)),
                    acc1,
                );
            }
            _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
        }

        #[inline(always)]
        unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
            let n = y.len().min(x.len());
            let (py, px) = (y.as_mut_ptr(), x.as_ptr());
            let va = _mm512_set1_ps(a);
            let mut i = 0;
            while i + 16 <= n {
                _mm512_storeu_ps(
                    py.add(i),
                    _mm512_fmadd_ps(va, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i))),
                );
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                let r = _mm512_fmadd_ps(
                    va,
                    _mm512_maskz_loadu_ps(m, px.add(i)),
                    _mm512_maskz_loadu_ps(m, py.add(i)),
                );
                _mm512_mask_storeu_ps(py.add(i), m, r);
            }
        }

        #[inline(always)]
        unsafe fn scale(y: &mut [f32], a: f32) {
            let n = y.len();
            let py = y.as_mut_ptr();
            let va = _mm512_set1_ps(a);
            let mut i = 0;
            while i + 16 <= n {
                _mm512_storeu_ps(py.add(i), _mm512_mul_ps(va, _mm512_loadu_ps(py.add(i))));
                i += 16;
            }
            if i < n {
                let m = tail_mask(n - i);
                _mm512_mask_storeu_ps(
                    py.add(i),
                    m,
                    _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, py.add(i))),
                );
            }
        }
    }

    impl super::Rows for Avx2 {
        const W: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m256, b: __m256) -> __m256 {
            _mm256_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp(x: __m256) -> __m256 {
            use super::expf::*;
            let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(HI)), _mm256_set1_ps(LO));
            let fx = _mm256_floor_ps(_mm256_fmadd_ps(
                x,
                _mm256_set1_ps(LOG2E),
                _mm256_set1_ps(0.5),
            ));
            let r = _mm256_fnmadd_ps(
                fx,
                _mm256_set1_ps(C2),
                _mm256_fnmadd_ps(fx, _mm256_set1_ps(C1), x),
            );
            let mut y = _mm256_set1_ps(P[0]);
            for c in &P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
            }
            y = _mm256_fmadd_ps(
                y,
                _mm256_mul_ps(r, r),
                _mm256_add_ps(r, _mm256_set1_ps(1.0)),
            );
            let e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)),
                23,
            );
            _mm256_mul_ps(y, _mm256_castsi256_ps(e))
        }
    }

    impl super::I8Rows for Avx2 {
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m256 {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(p: *const u32) -> (__m256, __m256) {
            let v = _mm256_loadu_si256(p as *const __m256i);
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            (
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                _mm256_castsi256_ps(_mm256_and_si256(v, high)),
            )
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
        }
    }

    impl super::I8Rows for Avx512 {
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            let wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(p: *const u32) -> (__m512, __m512) {
            let v = _mm512_loadu_si512(p as *const __m512i);
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            (
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(v, high)),
            )
        }
        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
    }

    impl super::Rows for Avx512 {
        const W: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn div(a: __m512, b: __m512) -> __m512 {
            _mm512_div_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp(x: __m512) -> __m512 {
            use super::expf::*;
            let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(HI)), _mm512_set1_ps(LO));
            let fx = _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5));
            let fx = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(fx);
            let r = _mm512_fnmadd_ps(
                fx,
                _mm512_set1_ps(C2),
                _mm512_fnmadd_ps(fx, _mm512_set1_ps(C1), x),
            );
            let mut y = _mm512_set1_ps(P[0]);
            for c in &P[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
            }
            y = _mm512_fmadd_ps(
                y,
                _mm512_mul_ps(r, r),
                _mm512_add_ps(r, _mm512_set1_ps(1.0)),
            );
            let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(fx),
                _mm512_set1_epi32(127),
            ));
            _mm512_mul_ps(y, _mm512_castsi512_ps(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<L: Lanes>() {
        for n in [1usize, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = unsafe { L::dot(&a, &b) };
            assert!(
                (got as f64 - want).abs() < 1e-4,
                "dot n={n}: {got} vs {want}"
            );
            let mut y = b.clone();
            unsafe { L::axpy(&mut y, 0.5, &a) };
            for i in 0..n {
                assert!(
                    (y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6,
                    "axpy n={n} i={i}"
                );
            }
            unsafe { L::scale(&mut y, 2.0) };
            for i in 0..n {
                assert!(
                    (y[i] - 2.0 * (b[i] + 0.5 * a[i])).abs() < 1e-5,
                    "scale n={n} i={i}"
                );
            }
        }
    }

    fn check_exp<R: Rows>() {
        let mut xs: Vec<f32> = (-2000..=800).map(|i| i as f32 * 0.11).collect();
        xs.extend([
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            -88.0,
            -87.0,
            88.0,
            1e-8,
            -1e-8,
        ]);
        while xs.len() % R::W != 0 {
            xs.push(0.5);
        }
        let mut out = vec![0.0f32; xs.len()];
        for i in (0..xs.len()).step_by(R::W) {
            unsafe { R::store(out.as_mut_ptr().add(i), R::exp(R::load(xs.as_ptr().add(i)))) };
        }
        for (&x, &y) in xs.iter().zip(&out) {
            let want = (x as f64).exp();
            if x == f32::NEG_INFINITY || x < -88.3 {
                assert!(y.abs() < 1.2e-38, "exp({x}) = {y}");
            } else if want < 1.2e-38 {
                assert!(
                    (y as f64 - want).abs() < 1.2e-38,
                    "exp({x}) = {y}, want {want}"
                );
            } else {
                assert!(
                    ((y as f64 - want) / want).abs() < 4e-7,
                    "exp({x}) = {y}, want {want}"
                );
            }
        }
    }

    #[test]
    fn vector_exp_is_accurate() {
        check_exp::<Scalar>();
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx2.is_supported() {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn run() {
                    check_exp::<Avx2>()
                }
                unsafe { run() }
            }
            if Isa::Avx512.is_supported() {
                #[target_feature(enable = "avx512f")]
                unsafe fn run512() {
                    check_exp::<Avx512>()
                }
                unsafe { run512() }
            }
        }
    }

    #[test]
    fn scalar_primitives() {
        check::<Scalar>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_primitives() {
        if Isa::Avx2.is_supported() {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn run() {
                check::<Avx2>()
            }
            unsafe { run() }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_primitives() {
        if Isa::Avx512.is_supported() {
            #[target_feature(enable = "avx512f")]
            unsafe fn run() {
                check::<Avx512>()
            }
            unsafe { run() }
        }
    }

    #[test]
    fn names_round_trip_and_detect_is_supported() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert!(Isa::detect().is_supported());
        assert_eq!(Isa::supported()[0], Isa::Scalar);
    }
}

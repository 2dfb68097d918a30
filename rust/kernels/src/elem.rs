//! Element types of q/k/v, the cache and the output. Arithmetic is always f32; an element type
//! only says how a row is read into f32 and how a result is written back.

/// A bfloat16 value as torch stores it: the upper 16 bits of an IEEE f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    /// Round to nearest even, as torch's `.to(torch.bfloat16)` does; NaN stays NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> Self {
        // both results, then a select (no branch, so loops over rows vectorize)
        let bits = x.to_bits();
        let quiet = ((bits >> 16) as u16) | 0x40;
        let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
        Bf16(if x.is_nan() { quiet } else { rounded })
    }
}

pub trait Elem: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The row as f32: borrowed as is for f32, converted into `scratch` otherwise.
    fn row<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
}

impl Elem for f32 {
    const NAME: &'static str = "float32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn row<'a>(src: &'a [f32], _scratch: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl Elem for Bf16 {
    const NAME: &'static str = "bfloat16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        Bf16::from_f32(x)
    }
    #[inline(always)]
    fn row<'a>(src: &'a [Bf16], scratch: &'a mut [f32]) -> &'a [f32] {
        let dst = &mut scratch[..src.len()];
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
        dst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trips_representable_values_and_rounds_to_nearest_even() {
        for x in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            2.0f32.powi(100),
            2.0f32.powi(-100),
            f32::INFINITY,
        ] {
            assert_eq!(Bf16::from_f32(x).to_f32(), x);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 1.0 / 64.0);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }
}

//! Element types and the rounding that emulates them.
//!
//! The CPU computes in f32. A bf16 or f16 "compute copy" on the CPU is an f32 buffer whose
//! values have been rounded to the narrower type, which reproduces exactly the values a GPU
//! kernel would read, including f16 overflow to infinity that the loss scaler must catch.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Rounds an f32 to the nearest value of this type (round to nearest even).
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::BF16 => bf16::from_f32(x).to_f32(),
            DType::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// Rounds every element in place.
    pub fn round_slice(self, xs: &mut [f32]) {
        if self != DType::F32 {
            xs.iter_mut().for_each(|x| *x = self.round(*x));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_formats() {
        assert_eq!(DType::BF16.round(1.0 + 1.0 / 512.0), 1.0); // below bf16's 8-bit mantissa
        assert_eq!(DType::F16.round(1.0 + 1.0 / 512.0), 1.0 + 1.0 / 512.0);
        assert!(DType::F16.round(70000.0).is_infinite());
        assert_eq!(DType::BF16.round(70000.0), 70144.0);
        assert_eq!(DType::F32.size_bytes() + DType::BF16.size_bytes(), 6);
    }
}

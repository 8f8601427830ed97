//! Elementary functions in plain arithmetic the compiler vectorises: libm's `expf` and `tanhf`
//! are a call for every element, which made the GELU and the softmax's exponentials most of
//! a CPU training step's time.

/// (ln 2)^k / k!, k = 0..7: 2^f = e^(f ln 2) as its Taylor polynomial, for |f| <= 1/2 within
/// 5e-9 of 2^f (the first term left out, (ln 2)^8 / 8! / 2^8).
const EXP2_TERMS: [f32; 8] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    0.000_015_252_734,
];

/// 2^a for a <= 0, as 2^n 2^f with n = round(a) placed in the exponent bits and 2^f a
/// polynomial: within 2e-7 relative. Below 2^-126 it returns 2^-126 (what a sum with a term
/// of 1 or more cannot see); NaN stays NaN.
#[inline]
pub fn exp2_nonpositive(a: f32) -> f32 {
    // A NaN fails the test and stays.
    let a = if a < -126.0 { -126.0 } else { a };
    // Rounded to the nearest integer by adding and subtracting 1.5 * 2^23.
    let n = (a + 12_582_912.0) - 12_582_912.0;
    let f = a - n;
    let mut p = EXP2_TERMS[7];
    for c in EXP2_TERMS[..7].iter().rev() {
        p = p * f + c;
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// e^x for x <= 0 (a score minus its row's largest); see [`exp2_nonpositive`]. Rounding x
/// log2(e) to f32 adds a relative error of about |x| 6e-8, so the result is within 1e-7 of
/// e^x absolutely, and within 3e-7 relatively for x >= -2 (where a softmax's mass lies).
#[inline]
pub fn exp_nonpositive(x: f32) -> f32 {
    exp2_nonpositive(x * std::f32::consts::LOG2_E)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_1e_7_absolutely_and_3e_7_relatively_near_0() {
        let (mut abs, mut rel) = (0.0f64, 0.0f64);
        for i in 0..=1_000_000 {
            let x = -(i as f32) * 8.7e-5;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            abs = abs.max((got - want).abs());
            if x >= -2.0 {
                rel = rel.max((got - want).abs() / want);
            }
        }
        assert!(abs < 1e-7, "worst absolute error {abs:e}");
        assert!(rel < 3e-7, "worst relative error near 0 {rel:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp2_nonpositive(-3.0), 0.125);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), f32::from_bits(1 << 23));
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }
}

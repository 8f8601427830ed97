//! GELU in its tanh form (as GPT-2 uses), forward and backward.

use super::fastmath::exp2_nonpositive;
use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
const CHUNK: usize = 4096;

/// tanh(u) = (1 - e) / (1 + e) with e = e^(-2|u|) = 2^n 2^f, n an integer (placed in the
/// exponent bits) and 2^f a polynomial, in arithmetic the compiler vectorises: libm's tanhf
/// is a call for every element, which made the GELU most of a CPU training step's time.
/// Within 2e-7 of the exact value; NaN stays NaN and the infinities give +-1.
#[inline]
pub fn tanh(u: f32) -> f32 {
    // Below 2^-126 e adds nothing to 1 + e; a NaN stays.
    let e = exp2_nonpositive(-2.0 * std::f32::consts::LOG2_E * u.abs());
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + COEF * x * x * x)))
}

#[inline]
pub fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    let t = tanh(u);
    let sech2 = 1.0 - t * t;
    0.5 * (1.0 + t) + 0.5 * x * sech2 * SQRT_2_OVER_PI * (1.0 + 3.0 * COEF * x * x)
}

pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = gelu(x)));
}

/// Overwrites `dinp` with `dout * gelu'(inp)`.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    dinp.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK)))
        .for_each(|(dx, (x, dy))| {
            for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
                *dx = dy * gelu_grad(x);
            }
        });
}

/// [`gelu_backward`] with the incoming gradient already in `d` (the same arithmetic): `d` becomes
/// `d * gelu'(inp)`.
pub fn gelu_backward_in_place(d: &mut [f32], inp: &[f32]) {
    d.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, x)| d.iter_mut().zip(x).for_each(|(d, &x)| *d *= gelu_grad(x)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::random;

    #[test]
    fn tanh_is_within_2e_7_and_keeps_nan_and_infinities() {
        let mut worst = 0.0f64;
        for i in -400_000..=400_000 {
            let u = i as f32 * 5e-5;
            worst = worst.max((tanh(u) as f64 - (u as f64).tanh()).abs());
        }
        for u in [
            1e-30f32,
            -1e-8,
            3.0e-5,
            9.0,
            -9.5,
            20.0,
            87.0,
            -1e30,
            f32::MAX,
        ] {
            worst = worst.max((tanh(u) as f64 - (u as f64).tanh()).abs());
        }
        assert!(worst < 2e-7, "{worst:e}");
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(0.0), 0.0);
        assert!(gelu(f32::NAN).is_nan() && gelu_grad(f32::NAN).is_nan());
    }

    #[test]
    fn forward_and_derivative_match_reference() {
        let x = random(10_000, 1, 6.0);
        let mut out = vec![f32::NAN; x.len()];
        gelu_forward(&mut out, &x);
        let dout = random(x.len(), 2, 1.0);
        let mut dx = vec![f32::NAN; x.len()];
        gelu_backward(&mut dx, &x, &dout);
        for i in 0..x.len() {
            let xd = x[i] as f64;
            let f = |v: f64| {
                0.5 * v
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())
            };
            assert!(
                (out[i] as f64 - f(xd)).abs() < 1e-5 * f(xd).abs().max(1.0),
                "gelu({xd})"
            );
            let h = 1e-4;
            let d = (f(xd + h) - f(xd - h)) / (2.0 * h) * dout[i] as f64;
            assert!(
                (dx[i] as f64 - d).abs() < 1e-4,
                "gelu'({xd}): {} vs {d}",
                dx[i]
            );
        }
    }
}

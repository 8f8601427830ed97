//! GELU in its tanh form (as GPT-2 uses), forward and backward.

use rayon::prelude::*;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const COEF: f32 = 0.044_715;
const CHUNK: usize = 4096;

#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + COEF * x * x * x)).tanh())
}

#[inline]
pub fn gelu_grad(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + COEF * x * x * x);
    let t = u.tanh();
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

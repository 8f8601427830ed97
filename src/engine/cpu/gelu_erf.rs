//! GELU in its exact form, `x * Phi(x)` with the normal CDF through erf, forward and backward.
//!
//! BERT-family encoders (`hidden_act = "gelu"` in transformers) use this form; the tanh
//! form of [`super::gelu`] differs from it by about 1e-4 near |x| = 2, enough to move an
//! imported encoder's embeddings visibly after a few layers. Rust's standard library has no erf,
//! so `erfc` here is the Chebyshev fit of Numerical Recipes (fractional error below 1.2e-7
//! everywhere), evaluated in f64.

use rayon::prelude::*;

const CHUNK: usize = 4096;

/// The complementary error function, with fractional error below 1.2e-7 for every `z`.
pub fn erfc(z: f64) -> f64 {
    let a = z.abs();
    let t = 1.0 / (1.0 + 0.5 * a);
    let poly = -a * a - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if z >= 0.0 { r } else { 2.0 - r }
}

/// The standard normal CDF, `Phi(x) = erfc(-x / sqrt 2) / 2`.
fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
}

#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    let x = x as f64;
    (x * normal_cdf(x)) as f32
}

/// `d/dx [x Phi(x)] = Phi(x) + x phi(x)`.
#[inline]
pub fn gelu_erf_grad(x: f32) -> f32 {
    let x = x as f64;
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    (normal_cdf(x) + x * pdf) as f32
}

pub fn gelu_erf_forward(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, &x)| *o = gelu_erf(x)));
}

/// Overwrites `dinp` with `dout * gelu_erf'(inp)`.
pub fn gelu_erf_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    dinp.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK)))
        .for_each(|(dx, (x, dy))| {
            for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
                *dx = dy * gelu_erf_grad(x);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::random;

    /// erf by its Maclaurin series in f64, accurate to about 1e-13 for |z| <= 3 (past that
    /// the alternating terms cancel away the digits).
    fn erf_series(z: f64) -> f64 {
        let (mut term, mut sum, mut n) = (z, z, 0.0);
        while term.abs() > 1e-17 * sum.abs().max(1e-300) {
            n += 1.0;
            term *= -z * z / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn erfc_matches_the_series_and_known_values() {
        for i in -300..=300 {
            let z = i as f64 / 100.0;
            let want = 1.0 - erf_series(z);
            assert!(
                (erfc(z) - want).abs() <= 1.5e-7 * want.abs(),
                "erfc({z}) = {} vs {want}",
                erfc(z)
            );
        }
        // erfc(5) and erfc(-5) from tables: the tail keeps its relative accuracy.
        assert!((erfc(5.0) / 1.537_459_794_428_035e-12 - 1.0).abs() < 2e-7);
        assert!((erfc(-5.0) - 2.0).abs() < 1e-11);
    }

    #[test]
    fn forward_and_derivative_match_the_definition() {
        // |x| <= 4 keeps x / sqrt 2 inside the series' accurate range.
        let x = random(10_000, 3, 4.0);
        let mut out = vec![f32::NAN; x.len()];
        gelu_erf_forward(&mut out, &x);
        let dout = random(x.len(), 4, 1.0);
        let mut dx = vec![f32::NAN; x.len()];
        gelu_erf_backward(&mut dx, &x, &dout);
        let f = |v: f64| 0.5 * v * (1.0 + erf_series(v / std::f64::consts::SQRT_2));
        for i in 0..x.len() {
            let xd = x[i] as f64;
            assert!(
                (out[i] as f64 - f(xd)).abs() < 1e-6 * f(xd).abs().max(1.0),
                "gelu_erf({xd}) = {} vs {}",
                out[i],
                f(xd)
            );
            let h = 1e-5;
            let d = (f(xd + h) - f(xd - h)) / (2.0 * h) * dout[i] as f64;
            assert!(
                (dx[i] as f64 - d).abs() < 1e-5,
                "gelu_erf'({xd}): {} vs {d}",
                dx[i]
            );
        }
        // The tanh form is a different function: at x = -2 the two differ by about 1e-4.
        let tanh = crate::engine::cpu::gelu::gelu(-2.0);
        assert!((gelu_erf(-2.0) - tanh).abs() > 5e-5);
    }
}

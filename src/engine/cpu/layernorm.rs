//! Layer normalisation, with the residual add fused in.
//!
//! A pre-norm transformer adds each sub-layer's output to the residual stream and immediately
//! normalises the sum for the next sub-layer. Doing both in one pass reads the stream once, and
//! in the backward the same fusion means the gradient of the sum is the gradient of both the
//! residual and the sub-layer output, so no separate add kernel exists at all.

use rayon::prelude::*;

/// The epsilon of GPT-2's layernorm, which [`layernorm_forward`] uses; BERT-family encoders
/// use their own (1e-12) through [`layernorm_forward_eps`].
pub const EPS: f32 = 1e-5;

fn normalise_row(
    out: &mut [f32],
    inp: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (f32, f32) {
    let c = inp.len() as f32;
    let mean = inp.iter().sum::<f32>() / c;
    let var = inp.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / c;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, x), g), b) in out.iter_mut().zip(inp).zip(gamma).zip(beta) {
        *o = (x - mean) * rstd * g + b;
    }
    (mean, rstd)
}

/// `out = layernorm(inp) * gamma + beta` per row of width `c`; saves `mean` and `rstd` per row.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
) {
    layernorm_forward_eps(out, mean, rstd, inp, gamma, beta, c, EPS);
}

/// [`layernorm_forward`] with `eps` added to the variance.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward_eps(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
    eps: f32,
) {
    out.par_chunks_mut(c)
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|((o, x), (m, r))| (*m, *r) = normalise_row(o, x, gamma, beta, eps));
}

/// `sum = x + delta; out = layernorm(sum) * gamma + beta`, in one pass over the rows.
#[allow(clippy::too_many_arguments)]
pub fn residual_layernorm_forward(
    sum: &mut [f32],
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    delta: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
) {
    residual_layernorm_forward_eps(sum, out, mean, rstd, x, delta, gamma, beta, c, EPS);
}

/// [`residual_layernorm_forward`] with `eps` added to the variance.
#[allow(clippy::too_many_arguments)]
pub fn residual_layernorm_forward_eps(
    sum: &mut [f32],
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    delta: &[f32],
    gamma: &[f32],
    beta: &[f32],
    c: usize,
    eps: f32,
) {
    sum.par_chunks_mut(c)
        .zip(out.par_chunks_mut(c))
        .zip(x.par_chunks(c).zip(delta.par_chunks(c)))
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .for_each(|(((s, o), (x, d)), (m, r))| {
            s.iter_mut()
                .zip(x)
                .zip(d)
                .for_each(|((s, x), d)| *s = x + d);
            (*m, *r) = normalise_row(o, s, gamma, beta, eps);
        });
}

/// Backward: ACCUMULATES into `dinp`, `dgamma` and `dbeta`. Accumulating into `dinp` is the
/// fused residual backward: pass the residual stream's incoming gradient as `dinp`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((dx, (dy, x)), (&m, &r))| {
            // dx = rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat))
            let (mut sum_gdy, mut sum_gdy_xhat) = (0.0f32, 0.0f32);
            for ((dy, x), g) in dy.iter().zip(x).zip(gamma) {
                let gdy = g * dy;
                sum_gdy += gdy;
                sum_gdy_xhat += gdy * (x - m) * r;
            }
            let (mean_gdy, mean_gdy_xhat) = (sum_gdy / c as f32, sum_gdy_xhat / c as f32);
            for (((dx, dy), x), g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
                let xhat = (x - m) * r;
                *dx += r * (g * dy - mean_gdy - xhat * mean_gdy_xhat);
            }
        });
    // Parameter gradients reduce over rows; a sequential pass keeps the order fixed.
    for ((dy, x), (&m, &r)) in dout.chunks(c).zip(inp.chunks(c)).zip(mean.iter().zip(rstd)) {
        for (((dg, db), dy), x) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy).zip(x) {
            *dg += dy * (x - m) * r;
            *db += dy;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    /// Straightforward f64 layernorm of one row, the reference.
    fn naive_row(x: &[f32], g: &[f32], b: &[f32]) -> Vec<f32> {
        let c = x.len() as f64;
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / c;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c;
        x.iter()
            .zip(g)
            .zip(b)
            .map(|((&v, &g), &b)| {
                ((v as f64 - mean) / (var + EPS as f64).sqrt() * g as f64 + b as f64) as f32
            })
            .collect()
    }

    #[test]
    fn fused_forward_matches_naive() {
        let (n, c) = (9, 48);
        let x = random(n * c, 1, 2.0);
        let d = random(n * c, 2, 2.0);
        let g = random(c, 3, 1.0);
        let b = random(c, 4, 1.0);
        let (mut sum, mut out) = (vec![f32::NAN; n * c], vec![f32::NAN; n * c]);
        let (mut mean, mut rstd) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        residual_layernorm_forward(&mut sum, &mut out, &mut mean, &mut rstd, &x, &d, &g, &b, c);
        let want_sum: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a + b).collect();
        assert_close(&sum, &want_sum, 0.0, "sum");
        let want: Vec<f32> = want_sum
            .chunks(c)
            .flat_map(|r| naive_row(r, &g, &b))
            .collect();
        assert_close(&out, &want, 1e-5, "normed");
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (3, 16);
        let x = random(n * c, 5, 1.5);
        let g = random(c, 6, 1.0);
        let b = random(c, 7, 1.0);
        let w = random(n * c, 8, 1.0); // loss = sum(w * out)
        let loss = |x: &[f32], g: &[f32], b: &[f32]| -> f64 {
            x.chunks(c)
                .flat_map(|r| naive_row(r, g, b))
                .zip(&w)
                .map(|(o, w)| o as f64 * *w as f64)
                .sum()
        };
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &g, &b, c);
        let carried = random(n * c, 9, 1.0);
        let mut dx = carried.clone();
        let (mut dg, mut db) = (vec![0.0; c], vec![0.0; c]);
        layernorm_backward(&mut dx, &mut dg, &mut db, &w, &x, &g, &mean, &rstd, c);
        let h = 1e-2f32;
        let fd = |v: &[f32], i: usize, f: &dyn Fn(&[f32]) -> f64| {
            let (mut p, mut m) = (v.to_vec(), v.to_vec());
            p[i] += h;
            m[i] -= h;
            ((f(&p) - f(&m)) / (2.0 * h as f64)) as f32
        };
        for i in 0..n * c {
            let want = carried[i] + fd(&x, i, &|x| loss(x, &g, &b));
            assert!(
                (dx[i] - want).abs() < 2e-3 * want.abs().max(1.0),
                "dx[{i}] {} vs {want}",
                dx[i]
            );
        }
        for j in 0..c {
            let want_g = fd(&g, j, &|g| loss(&x, g, &b));
            let want_b = fd(&b, j, &|b| loss(&x, &g, b));
            assert!(
                (dg[j] - want_g).abs() < 2e-3 * want_g.abs().max(1.0),
                "dgamma[{j}]"
            );
            assert!(
                (db[j] - want_b).abs() < 2e-3 * want_b.abs().max(1.0),
                "dbeta[{j}]"
            );
        }
    }
}

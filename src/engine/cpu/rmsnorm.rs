//! Root-mean-square normalisation (Llama's norm), with the residual add fused in.
//!
//! `y = x / sqrt(mean(x^2) + eps) * gamma`: no mean is subtracted and there is no bias, so the
//! only statistic kept for the backward is the reciprocal RMS of each row. As with the
//! layernorm, the fused forward writes the residual sum and its norm in one pass, and the
//! backward adds the input gradient into the residual stream's gradient, so no separate add
//! kernel exists.

use rayon::prelude::*;

fn normalise_row(out: &mut [f32], x: &[f32], gamma: &[f32], eps: f32) -> f32 {
    let rstd = row_rstd(x, eps);
    for ((o, v), g) in out.iter_mut().zip(x).zip(gamma) {
        *o = v * rstd * g;
    }
    rstd
}

/// `1 / sqrt(mean(x^2) + eps)` of one row: RMSNorm's factor.
fn row_rstd(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// Each row of `rows` (of `width`) times the RMSNorm factor of the same row of `x` (of `c`),
/// plus `bias` (`width` values) when given: the projection of `rmsnorm(x) * gain` from that of
/// `x` through a weight with the gain folded in. The CPU reference of the decode step's normed
/// kernels (`ops::kv_append_normed_at`, `ops::swiglu_forward_normed`), which take the factor
/// themselves instead of a norm kernel before the product.
pub fn normed_rows(
    rows: &[f32],
    width: usize,
    x: &[f32],
    c: usize,
    eps: f32,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let mut out = rows.to_vec();
    for (r, xr) in out.chunks_mut(width.max(1)).zip(x.chunks(c.max(1))) {
        let s = row_rstd(xr, eps);
        r.iter_mut().for_each(|v| *v *= s);
        if let Some(b) = bias {
            r.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
    out
}

/// `out = rmsnorm(x) * gamma` per row of width `c`, `out`'s rows `ldo` apart (zeros in the
/// columns past `c`); saves `rstd` per row.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    gamma: &[f32],
    c: usize,
    ldo: usize,
    eps: f32,
) {
    out.par_chunks_mut(ldo)
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter_mut())
        .for_each(|((o, x), r)| {
            o[c..].fill(0.0);
            *r = normalise_row(&mut o[..c], x, gamma, eps)
        });
}

/// `sum = x + delta; out = rmsnorm(sum) * gamma`, in one pass over the rows; `out`'s rows
/// `ldo` apart (zeros past `c`).
#[allow(clippy::too_many_arguments)]
pub fn residual_rmsnorm_forward(
    sum: &mut [f32],
    out: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    delta: &[f32],
    gamma: &[f32],
    c: usize,
    ldo: usize,
    eps: f32,
) {
    sum.par_chunks_mut(c)
        .zip(out.par_chunks_mut(ldo))
        .zip(x.par_chunks(c).zip(delta.par_chunks(c)))
        .zip(rstd.par_iter_mut())
        .for_each(|(((s, o), (x, d)), r)| {
            s.iter_mut()
                .zip(x)
                .zip(d)
                .for_each(|((s, x), d)| *s = x + d);
            o[c..].fill(0.0);
            *r = normalise_row(&mut o[..c], s, gamma, eps);
        });
}

/// Adds the input gradient into `dx` and the gain gradient into `dgamma`.
///
/// With `xhat = x * rstd` and `g = dout * gamma`: `dx = rstd * (g - xhat * mean(g * xhat))`,
/// `dgamma = sum over rows of dout * xhat`. The gain gradient is summed row by row in a fixed
/// order (rows split into fixed chunks, chunks added in order), so it is reproducible.
/// `dout`'s rows are `ldd` apart (only their first `c` values are read).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dgamma: &mut [f32],
    dout: &[f32],
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    c: usize,
    ldd: usize,
) {
    dx.par_chunks_mut(c)
        .zip(dout.par_chunks(ldd))
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((dx, dy), x), &r)| {
            let dy = &dy[..c];
            let dot = dy
                .iter()
                .zip(gamma)
                .zip(x)
                .map(|((dy, g), x)| dy * g * x * r)
                .sum::<f32>()
                / c as f32;
            for (((d, dy), g), x) in dx.iter_mut().zip(dy).zip(gamma).zip(x) {
                *d += r * (dy * g - x * r * dot);
            }
        });
    const ROWS_PER_CHUNK: usize = 64;
    let partials: Vec<Vec<f32>> = dout
        .par_chunks(ROWS_PER_CHUNK * ldd)
        .zip(x.par_chunks(ROWS_PER_CHUNK * c))
        .zip(rstd.par_chunks(ROWS_PER_CHUNK))
        .map(|((dy, x), r)| {
            let mut acc = vec![0.0f32; c];
            for ((dy, x), &r) in dy.chunks(ldd).zip(x.chunks(c)).zip(r) {
                for ((a, dy), x) in acc.iter_mut().zip(&dy[..c]).zip(x) {
                    *a += dy * x * r;
                }
            }
            acc
        })
        .collect();
    for p in partials {
        dgamma.iter_mut().zip(&p).for_each(|(g, p)| *g += p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    fn loss(x: &[f32], gamma: &[f32], w: &[f32], c: usize) -> f64 {
        let mut out = vec![0.0; x.len()];
        let mut rstd = vec![0.0; x.len() / c];
        rmsnorm_forward(&mut out, &mut rstd, x, gamma, c, c, 1e-5);
        out.iter().zip(w).map(|(o, w)| *o as f64 * *w as f64).sum()
    }

    #[test]
    fn forward_matches_the_definition_and_the_fused_sum() {
        let (n, c) = (5, 12);
        let (x, d, gamma) = (
            random(n * c, 1, 2.0),
            random(n * c, 2, 1.0),
            random(c, 3, 1.0),
        );
        let (mut sum, mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n]);
        residual_rmsnorm_forward(&mut sum, &mut out, &mut rstd, &x, &d, &gamma, c, c, 1e-5);
        let mut want = Vec::new();
        for row in 0..n {
            let s: Vec<f64> = (0..c)
                .map(|j| x[row * c + j] as f64 + d[row * c + j] as f64)
                .collect();
            let ms = s.iter().map(|v| v * v).sum::<f64>() / c as f64;
            let r = 1.0 / (ms + 1e-5).sqrt();
            want.extend((0..c).map(|j| (s[j] * r * gamma[j] as f64) as f32));
        }
        assert_close(&out, &want, 1e-5, "rmsnorm");
        let (mut plain, mut r2) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut plain, &mut r2, &sum, &gamma, c, c, 1e-5);
        assert_eq!(plain, out, "the fused sum normalises the same way");
    }

    #[test]
    fn strided_rows_give_the_packed_results() {
        let (n, c, pad) = (6, 12, 4);
        let (x, d, gamma, dy) = (
            random(n * c, 8, 2.0),
            random(n * c, 9, 1.0),
            random(c, 10, 1.0),
            random(n * c, 11, 1.0),
        );
        let (mut sum, mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n]);
        residual_rmsnorm_forward(&mut sum, &mut out, &mut rstd, &x, &d, &gamma, c, c, 1e-5);
        let (mut sum2, mut wide, mut rstd2) =
            (vec![0.0; n * c], vec![7.0; n * (c + pad)], vec![0.0; n]);
        residual_rmsnorm_forward(
            &mut sum2,
            &mut wide,
            &mut rstd2,
            &x,
            &d,
            &gamma,
            c,
            c + pad,
            1e-5,
        );
        for (row, w) in wide.chunks(c + pad).enumerate() {
            assert_eq!(&w[..c], &out[row * c..(row + 1) * c]);
            assert!(w[c..].iter().all(|&v| v == 0.0), "the padding is zeroed");
        }
        let (mut dx, mut dg) = (vec![0.0; n * c], vec![0.0; c]);
        rmsnorm_backward(&mut dx, &mut dg, &dy, &sum, &gamma, &rstd, c, c);
        let mut dy_wide = vec![f32::NAN; n * (c + pad)];
        for (row, w) in dy_wide.chunks_mut(c + pad).enumerate() {
            w[..c].copy_from_slice(&dy[row * c..(row + 1) * c]);
        }
        let (mut dx2, mut dg2) = (vec![0.0; n * c], vec![0.0; c]);
        rmsnorm_backward(
            &mut dx2,
            &mut dg2,
            &dy_wide,
            &sum,
            &gamma,
            &rstd,
            c,
            c + pad,
        );
        assert_eq!(dx, dx2);
        assert_eq!(dg, dg2);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (200, 8);
        let (x, gamma, w) = (
            random(n * c, 4, 1.5),
            random(c, 5, 1.0),
            random(n * c, 6, 1.0),
        );
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut out, &mut rstd, &x, &gamma, c, c, 1e-5);
        let base = random(n * c, 7, 1.0);
        let (mut dx, mut dgamma) = (base.clone(), vec![0.5; c]);
        rmsnorm_backward(&mut dx, &mut dgamma, &w, &x, &gamma, &rstd, c, c);
        let h = 1e-2f32;
        for i in (0..n * c).step_by(97) {
            let (mut p, mut m) = (x.clone(), x.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p, &gamma, &w, c) - loss(&m, &gamma, &w, c)) / (2.0 * h as f64);
            let got = dx[i] - base[i];
            assert!(
                (got as f64 - fd).abs() < 2e-3 * fd.abs().max(1.0),
                "dx[{i}] {got} vs {fd}"
            );
        }
        for j in 0..c {
            let (mut p, mut m) = (gamma.clone(), gamma.clone());
            p[j] += h;
            m[j] -= h;
            let fd = (loss(&x, &p, &w, c) - loss(&x, &m, &w, c)) / (2.0 * h as f64);
            let got = dgamma[j] - 0.5;
            assert!(
                (got as f64 - fd).abs() < 2e-3 * fd.abs().max(1.0),
                "dgamma[{j}] {got} vs {fd}"
            );
        }
    }
}

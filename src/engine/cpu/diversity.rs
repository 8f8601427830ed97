//! Pairwise cosine diversity of sets of embeddings, and its gradient.
//!
//! For each set of `n` embeddings `e_i` of width `d`,
//! `D = mean over i < j of (1 - cos(e_i, e_j))`, with cosines taken as PyTorch's
//! `F.normalize` (eps 1e-12) followed by a Gram matrix would give them: `u_i = e_i /
//! max(|e_i|, eps)`, `cos = u_i . u_j`. The Gram matrix is never formed. Its upper triangle
//! sums to `(|s|^2 - q) / 2` with `s = sum_i u_i` and `q = sum_i |u_i|^2` (`n` unless a row is
//! zero), so
//!
//! `D = 1 - (|s|^2 - q) / (n (n - 1))`
//!
//! costs one pass over the embeddings instead of `n^2 d` multiply-adds, and the gradient
//! needs only `s` and each row's reciprocal norm: with `t_i = s - u_i`,
//! `dD/de_i = -2 / (n (n - 1)) * rnorm_i * (t_i - u_i (u_i . t_i))` (the projection drops the
//! radial part the normalisation removes; a row at or below eps is scaled, not normalised,
//! and keeps `t_i` whole). The forward saves `s` and `rnorm` for the backward.
//!
//! A set of fewer than two embeddings has no pairs: D is undefined there, and asking for it
//! is an error rather than a silent 0 or NaN. This reference accumulates in f64; the GPU
//! kernel (`engine/cuda/diversity.cu`) in f32 with f64 for the final squared norm.

/// Norms at or below this are not normalised (as `torch.nn.functional.normalize`).
pub const NORM_EPS: f32 = 1e-12;

/// `sets` sets of `n` embeddings of width `d`, stored `[sets, n, d]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetShape {
    pub sets: usize,
    pub n: usize,
    pub d: usize,
}

impl SetShape {
    /// Rows of the embedding matrix.
    pub fn rows(&self) -> usize {
        self.sets * self.n
    }

    /// Why D cannot be computed for this shape, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.n < 2 {
            return Err(format!(
                "a set of {} embedding(s) has no pairs: pairwise diversity needs at least 2 per set (it is undefined, not 0); sample 2 or more replies per prompt",
                self.n
            ));
        }
        if self.d == 0 || self.sets == 0 {
            return Err(format!(
                "{} set(s) of width {}: there is nothing to compare; give at least one set of non-empty embeddings",
                self.sets, self.d
            ));
        }
        Ok(())
    }

    /// `-2 / (n (n - 1))`: the derivative of D with respect to `|s|^2`, doubled.
    pub fn grad_scale(&self) -> f64 {
        -2.0 / (self.n as f64 * (self.n as f64 - 1.0))
    }
}

/// `1 / max(|row|, eps)` and the squared norm of the normalised row.
fn reciprocal_norm(row: &[f32]) -> (f32, f64) {
    let norm = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
    let rnorm = 1.0 / norm.max(NORM_EPS as f64);
    (rnorm as f32, (norm * rnorm) * (norm * rnorm))
}

/// Writes `d_out[set]` (D), `s[set, d]` (the sum of the normalised rows) and `rnorm[row]`.
pub fn diversity_forward(
    d_out: &mut [f32],
    s: &mut [f32],
    rnorm: &mut [f32],
    e: &[f32],
    shape: SetShape,
) -> Result<(), String> {
    shape.check()?;
    let SetShape { n, d, .. } = shape;
    let pairs = n as f64 * (n as f64 - 1.0);
    for (((dv, s), rn), set) in d_out
        .iter_mut()
        .zip(s.chunks_mut(d))
        .zip(rnorm.chunks_mut(n))
        .zip(e.chunks(n * d))
    {
        let mut sum = vec![0.0f64; d];
        let mut q = 0.0f64;
        for (r, row) in rn.iter_mut().zip(set.chunks(d)) {
            let (inv, unit) = reciprocal_norm(row);
            *r = inv;
            q += unit;
            for (a, &v) in sum.iter_mut().zip(row) {
                *a += v as f64 * inv as f64;
            }
        }
        let ss: f64 = sum.iter().map(|v| v * v).sum();
        *dv = (1.0 - (ss - q) / pairs) as f32;
        s.iter_mut().zip(&sum).for_each(|(o, v)| *o = *v as f32);
    }
    Ok(())
}

/// Writes `de = dd[set] * dD/de` for every row, from the forward's `s` and `rnorm`.
pub fn diversity_backward(
    de: &mut [f32],
    dd: &[f32],
    e: &[f32],
    s: &[f32],
    rnorm: &[f32],
    shape: SetShape,
) -> Result<(), String> {
    shape.check()?;
    let SetShape { n, d, .. } = shape;
    let scale = shape.grad_scale();
    for row in 0..shape.rows() {
        let set = row / n;
        let (x, sv) = (&e[row * d..(row + 1) * d], &s[set * d..(set + 1) * d]);
        // A clamped row's rnorm is exactly 1 / eps; any normalised row's is smaller.
        let normalised = rnorm[row] < 1.0 / NORM_EPS;
        let inv = rnorm[row] as f64;
        let u = |k: usize| x[k] as f64 * inv;
        // u . t = u . s - |u|^2, only needed when the row was normalised.
        let ut = if normalised {
            (0..d).map(|k| u(k) * (sv[k] as f64 - u(k))).sum::<f64>()
        } else {
            0.0
        };
        let g = dd[set] as f64 * scale * inv;
        for (k, o) in de[row * d..(row + 1) * d].iter_mut().enumerate() {
            let t = sv[k] as f64 - u(k);
            *o = (g * (t - u(k) * ut)) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::random;

    /// D from its definition: every pair's cosine, in f64.
    fn naive(e: &[f32], n: usize, d: usize) -> f64 {
        let row = |i: usize| &e[i * d..(i + 1) * d];
        let norm = |i: usize| {
            row(i)
                .iter()
                .map(|&v| v as f64 * v as f64)
                .sum::<f64>()
                .sqrt()
                .max(NORM_EPS as f64)
        };
        let mut total = 0.0;
        for i in 0..n {
            for j in i + 1..n {
                let dot: f64 = row(i)
                    .iter()
                    .zip(row(j))
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                total += 1.0 - dot / (norm(i) * norm(j));
            }
        }
        total / (n * (n - 1) / 2) as f64
    }

    fn forward(e: &[f32], shape: SetShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut out = (
            vec![f32::NAN; shape.sets],
            vec![f32::NAN; shape.sets * shape.d],
            vec![f32::NAN; shape.rows()],
        );
        diversity_forward(&mut out.0, &mut out.1, &mut out.2, e, shape).unwrap();
        out
    }

    fn one(n: usize, d: usize) -> SetShape {
        SetShape { sets: 1, n, d }
    }

    #[test]
    fn two_rows_give_one_minus_their_cosine() {
        // cos((3, 4), (4, 3)) = 24 / 25.
        let (dv, s, rnorm) = forward(&[3.0, 4.0, 4.0, 3.0], one(2, 2));
        assert!((dv[0] - 1.0 / 25.0).abs() < 1e-7, "{}", dv[0]);
        assert_eq!(rnorm, vec![0.2, 0.2]);
        assert!((s[0] - 1.4).abs() < 1e-6 && (s[1] - 1.4).abs() < 1e-6);
        // Opposite rows are as far apart as cosines go.
        let (dv, ..) = forward(&[1.0, -2.0, -3.0, 6.0], one(2, 2));
        assert!((dv[0] - 2.0).abs() < 1e-6, "{}", dv[0]);
    }

    #[test]
    fn identical_rows_give_zero_and_orthogonal_rows_give_one() {
        let row = random(16, 1, 1.0);
        let same: Vec<f32> = (0..5).flat_map(|_| row.iter().copied()).collect();
        let (dv, ..) = forward(&same, one(5, 16));
        assert!(dv[0].abs() < 1e-6, "{}", dv[0]);
        // Rows of the identity scaled differently: every cosine is 0.
        let mut eye = vec![0.0f32; 6 * 6];
        for i in 0..6 {
            eye[i * 6 + i] = (i + 1) as f32 * 0.5;
        }
        let (dv, ..) = forward(&eye, one(6, 6));
        assert!((dv[0] - 1.0).abs() < 1e-6, "{}", dv[0]);
    }

    #[test]
    fn matches_the_pairwise_definition_per_set_and_counts_zero_rows_as_orthogonal() {
        let shape = SetShape {
            sets: 3,
            n: 7,
            d: 19,
        };
        let mut e = random(shape.rows() * shape.d, 2, 1.0);
        // Clustered rows in the second set (small D, where cancellation would show), and a
        // zero row in the third (cosine 0 with everything, as normalise-then-matmul gives).
        let base = random(shape.d, 3, 1.0);
        for i in 0..shape.n {
            for k in 0..shape.d {
                e[(shape.n + i) * shape.d + k] = base[k] + 0.05 * e[(shape.n + i) * shape.d + k];
            }
        }
        for k in 0..shape.d {
            e[(2 * shape.n + 3) * shape.d + k] = 0.0;
        }
        let (dv, ..) = forward(&e, shape);
        for (set, got) in dv.iter().enumerate() {
            let want = naive(&e[set * shape.n * shape.d..], shape.n, shape.d);
            assert!(
                (*got as f64 - want).abs() < 1e-6 * want.max(1e-2),
                "set {set}: {got} vs {want}"
            );
        }
        assert!(
            dv[1] < 0.02,
            "the clustered set is close together: {}",
            dv[1]
        );
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let shape = SetShape {
            sets: 2,
            n: 5,
            d: 7,
        };
        let e = random(shape.rows() * shape.d, 4, 1.0);
        let dd = [0.7f32, -1.3];
        let (_, s, rnorm) = forward(&e, shape);
        let mut de = vec![f32::NAN; e.len()];
        diversity_backward(&mut de, &dd, &e, &s, &rnorm, shape).unwrap();
        let loss = |x: &[f32]| -> f64 {
            (0..shape.sets)
                .map(|b| {
                    let set = &x[b * shape.n * shape.d..(b + 1) * shape.n * shape.d];
                    dd[b] as f64 * naive(set, shape.n, shape.d)
                })
                .sum()
        };
        let h = 1e-3f32;
        for i in 0..e.len() {
            let (mut p, mut m) = (e.clone(), e.clone());
            p[i] += h;
            m[i] -= h;
            let fd = (loss(&p) - loss(&m)) / (2.0 * h as f64);
            assert!(
                (de[i] as f64 - fd).abs() < 1e-3 * fd.abs().max(0.1),
                "de[{i}] {} vs {fd}",
                de[i]
            );
        }
        // Scaling a row leaves every cosine alone: its gradient is orthogonal to it.
        for row in 0..shape.rows() {
            let r = row * shape.d..(row + 1) * shape.d;
            let dot: f64 = de[r.clone()]
                .iter()
                .zip(&e[r])
                .map(|(&g, &x)| g as f64 * x as f64)
                .sum();
            assert!(dot.abs() < 1e-6, "row {row}: {dot}");
        }
    }

    #[test]
    fn fewer_than_two_rows_is_an_error() {
        for n in [0, 1] {
            let shape = one(n, 4);
            let mut out = (vec![0.0; 1], vec![0.0; 4], vec![0.0; n]);
            let err =
                diversity_forward(&mut out.0, &mut out.1, &mut out.2, &vec![1.0; 4 * n], shape)
                    .unwrap_err();
            assert!(err.contains("at least 2"), "{err}");
            assert!(diversity_backward(&mut [], &[1.0], &[], &[0.0; 4], &[], shape).is_err());
        }
        assert!(one(2, 0).check().is_err());
    }
}

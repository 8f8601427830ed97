//! Row gather and scatter by index, the data movement of mixture-of-experts routing.
//!
//! A router sends each token (a row of the activations) to a few experts. `gather_rows` packs
//! the rows an expert processes into one dense matrix, `scatter_add_rows` adds the expert's
//! output rows back to their tokens (each times its gate weight), and `gathered_row_dot` is
//! the gate weight's gradient: the dot product of a token's output gradient with the expert
//! output it weighted. Each is the other's backward, so three kernels cover both passes.
//!
//! The indices of one scatter are distinct (a token visits an expert at most once), so every
//! destination row has one writer and the result does not depend on the order of the rows.

use rayon::prelude::*;

/// `out[s, :] = scale[s] * src[idx[s], :]` (scale 1 where `scale` is `None`).
pub fn gather_rows(out: &mut [f32], src: &[f32], idx: &[u32], scale: Option<&[f32]>, c: usize) {
    out.par_chunks_mut(c)
        .zip(idx.par_iter())
        .enumerate()
        .for_each(|(s, (o, &i))| {
            let row = &src[i as usize * c..][..c];
            let k = scale.map_or(1.0, |sc| sc[s]);
            for (o, x) in o.iter_mut().zip(row) {
                *o = k * x;
            }
        });
}

/// `dst[idx[s], :] += scale[s] * src[s, :]` (scale 1 where `scale` is `None`); `idx` distinct.
pub fn scatter_add_rows(
    dst: &mut [f32],
    src: &[f32],
    idx: &[u32],
    scale: Option<&[f32]>,
    c: usize,
) {
    for (s, (row, &i)) in src.chunks(c).zip(idx).enumerate() {
        let k = scale.map_or(1.0, |sc| sc[s]);
        for (d, x) in dst[i as usize * c..][..c].iter_mut().zip(row) {
            *d += k * x;
        }
    }
}

/// `out[s] = sum_j a[idx[s], j] * b[s, j]`, summed in column order.
pub fn gathered_row_dot(out: &mut [f32], a: &[f32], idx: &[u32], b: &[f32], c: usize) {
    out.par_iter_mut()
        .zip(b.par_chunks(c))
        .zip(idx.par_iter())
        .for_each(|((o, row_b), &i)| {
            let row_a = &a[i as usize * c..][..c];
            *o = row_a.iter().zip(row_b).map(|(x, y)| x * y).sum();
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn gather_scatter_and_dot_match_naive_loops() {
        let (rows, c) = (7, 5);
        let src = random(rows * c, 1, 1.0);
        let idx = [4u32, 0, 6, 2];
        let scale = random(idx.len(), 2, 2.0);

        let mut out = vec![f32::NAN; idx.len() * c];
        gather_rows(&mut out, &src, &idx, Some(&scale), c);
        let mut want = Vec::new();
        for (s, &i) in idx.iter().enumerate() {
            for j in 0..c {
                want.push(scale[s] * src[i as usize * c + j]);
            }
        }
        assert_close(&out, &want, 0.0, "gather_rows");
        gather_rows(&mut out, &src, &idx, None, c);
        assert_close(&out[c..2 * c], &src[..c], 0.0, "gather_rows unscaled");

        // The scatter adds to what is there: start from random values.
        let dst0 = random(rows * c, 3, 1.0);
        let rows_in = random(idx.len() * c, 4, 1.0);
        let mut dst = dst0.clone();
        scatter_add_rows(&mut dst, &rows_in, &idx, Some(&scale), c);
        let mut want = dst0.clone();
        for (s, &i) in idx.iter().enumerate() {
            for j in 0..c {
                want[i as usize * c + j] += scale[s] * rows_in[s * c + j];
            }
        }
        assert_close(&dst, &want, 1e-6, "scatter_add_rows");
        // Rows no index names are untouched.
        assert_eq!(dst[c..2 * c], dst0[c..2 * c]);

        let mut dots = vec![f32::NAN; idx.len()];
        gathered_row_dot(&mut dots, &src, &idx, &rows_in, c);
        let want: Vec<f32> = idx
            .iter()
            .enumerate()
            .map(|(s, &i)| {
                (0..c)
                    .map(|j| src[i as usize * c + j] * rows_in[s * c + j])
                    .sum()
            })
            .collect();
        assert_close(&dots, &want, 1e-6, "gathered_row_dot");
    }
}

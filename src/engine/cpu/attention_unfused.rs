//! The pieces of attention as a framework without a fused kernel computes it
//! (`train.fused_kernels=false`): heads moved between the token-row layout and one contiguous
//! `[B, H, T, hs]` block per tensor, and the causal softmax and its backward over a stored
//! `[B, H, T, T]` matrix. The products between them are batched GEMMs
//! ([`super::gemm::sgemm_batched`]); `nn::attention` chains the whole.

use crate::engine::AttnShape;
use rayon::prelude::*;

/// Where element `i` of a `[B, H, T, hs]` block lives in rows of width `row` whose heads
/// start at column `col0` (Q at 0, K at C, V at 2C of the packed QKV): the index map both
/// head moves share, and the one the CUDA kernels compute.
pub fn head_to_row_index(i: usize, s: AttnShape, row: usize, col0: usize) -> usize {
    let hs = s.head_size();
    let (d, rest) = (i % hs, i / hs);
    let (t, rest) = (rest % s.seq, rest / s.seq);
    let (h, b) = (rest % s.heads, rest / s.heads);
    (b * s.seq + t) * row + col0 + h * hs + d
}

/// `dst[B, H, T, hs]` from the columns `col0 + h*hs + d` of `src`'s rows of width `row`.
pub fn heads_from_rows(dst: &mut [f32], src: &[f32], s: AttnShape, row: usize, col0: usize) {
    dst.par_iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = src[head_to_row_index(i, s, row, col0)]);
}

/// The inverse move: writes `src[B, H, T, hs]` into the columns `col0 .. col0 + C` of `dst`'s
/// rows of width `row`, leaving the other columns as they were.
pub fn heads_to_rows(dst: &mut [f32], src: &[f32], s: AttnShape, row: usize, col0: usize) {
    // Serial: the scattered writes would need unsafe shared access to parallelise, and this
    // is a copy (the CPU's time goes to the products).
    for (i, &v) in src.iter().enumerate() {
        dst[head_to_row_index(i, s, row, col0)] = v;
    }
}

/// Row `r` of `scores[.., T, T]` belongs to query position `r % T`, which sees keys `0..=t`.
fn query_of(row: usize, t_len: usize) -> usize {
    row % t_len
}

/// `probs = softmax(scores)` over each row's causal prefix; the masked entries are zero.
pub fn causal_softmax(probs: &mut [f32], scores: &[f32], t_len: usize) {
    probs
        .par_chunks_mut(t_len)
        .zip(scores.par_chunks(t_len))
        .enumerate()
        .for_each(|(r, (p, sc))| {
            let seen = query_of(r, t_len) + 1;
            let max = sc[..seen].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            for (p, &v) in p[..seen].iter_mut().zip(sc) {
                *p = (v - max).exp();
                sum += *p;
            }
            let inv = 1.0 / sum;
            p[..seen].iter_mut().for_each(|p| *p *= inv);
            p[seen..].iter_mut().for_each(|p| *p = 0.0);
        });
}

/// Softmax backward: `dscores = P * (dP - sum(P * dP))` per row, masked entries zero.
pub fn causal_softmax_backward(dscores: &mut [f32], probs: &[f32], dprobs: &[f32], t_len: usize) {
    dscores
        .par_chunks_mut(t_len)
        .zip(probs.par_chunks(t_len).zip(dprobs.par_chunks(t_len)))
        .enumerate()
        .for_each(|(r, (ds, (p, dp)))| {
            let seen = query_of(r, t_len) + 1;
            let dot: f32 = p[..seen].iter().zip(dp).map(|(p, dp)| p * dp).sum();
            for ((ds, &p), &dp) in ds[..seen].iter_mut().zip(p).zip(dp) {
                *ds = p * (dp - dot);
            }
            ds[seen..].iter_mut().for_each(|v| *v = 0.0);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn head_moves_are_inverse_and_cover_their_columns() {
        let s = AttnShape {
            batch: 2,
            seq: 5,
            heads: 3,
            channels: 12,
        };
        let n = s.batch * s.seq * s.channels;
        let row = 3 * s.channels;
        let src = random(s.batch * s.seq * row, 1, 1.0);
        let mut back = vec![f32::NAN; src.len()];
        for part in 0..3 {
            let mut heads = vec![f32::NAN; n];
            heads_from_rows(&mut heads, &src, s, row, part * s.channels);
            // Spot-check one element against the layout by hand: b=1, h=2, t=3, d=1.
            let (b, h, t, d, hs) = (1, 2, 3, 1, 4);
            let i = ((b * s.heads + h) * s.seq + t) * hs + d;
            assert_eq!(
                heads[i],
                src[(b * s.seq + t) * row + part * s.channels + h * hs + d]
            );
            heads_to_rows(&mut back, &heads, s, row, part * s.channels);
        }
        assert_eq!(back, src);
    }

    #[test]
    fn softmax_backward_matches_finite_differences() {
        let t_len = 6;
        let rows = 2 * t_len;
        let scores = random(rows * t_len, 2, 2.0);
        let w = random(rows * t_len, 3, 1.0);
        let loss = |sc: &[f32]| -> f64 {
            let mut p = vec![f32::NAN; sc.len()];
            causal_softmax(&mut p, sc, t_len);
            p.iter().zip(&w).map(|(p, w)| *p as f64 * *w as f64).sum()
        };
        let mut p = vec![f32::NAN; scores.len()];
        causal_softmax(&mut p, &scores, t_len);
        for (r, row) in p.chunks(t_len).enumerate() {
            let t = r % t_len;
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(row[t + 1..].iter().all(|&v| v == 0.0));
        }
        let mut ds = vec![f32::NAN; scores.len()];
        causal_softmax_backward(&mut ds, &p, &w, t_len);
        let h = 1e-3f32;
        let fd: Vec<f32> = (0..scores.len())
            .map(|i| {
                let (mut a, mut b) = (scores.clone(), scores.clone());
                a[i] += h;
                b[i] -= h;
                ((loss(&a) - loss(&b)) / (2.0 * h as f64)) as f32
            })
            .collect();
        assert_close(&ds, &fd, 2e-3, "softmax backward");
    }
}

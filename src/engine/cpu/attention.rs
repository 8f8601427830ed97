//! Causal multi-head self-attention, forward and backward.
//!
//! Input is the fused QKV projection, `[B, T, 3C]` with Q, K and V side by side and head `h`
//! in columns `h*hs .. (h+1)*hs` of each. The CPU version stores the softmax probabilities
//! `[B, H, T, T]` for the backward; at the CPU's sequence lengths that is cheaper than
//! recomputing them. Work splits over the batch, whose rows own disjoint output memory.
//!
//! Each head's products run as blocked matrix products over the whole `T x T` block of scores
//! (`gemm::sgemm_strided` on Q, K and V where they lie in the QKV rows), the keys a query does
//! not see computed and then set to zero: at the CPU's sequence lengths a blocked product at
//! twice the multiplies is still about twice as fast as the triangle's dot products one by one,
//! and the exponentials are `fastmath`'s, which vectorise where libm's `expf` is a call each.
//! Every sum is in a fixed order (the products' own, then the rows' in key order), whatever
//! the number of threads.
//!
//! With a sliding window `W > 0` query `i` attends to keys `j` with `i - W < j <= i` (the
//! convention of transformers' `sliding_window_overlay`: `W` keys, its own included); `W = 0`
//! is full causal attention, and so is any `W` at least the sequence length, bit for bit.

use super::fastmath::exp_nonpositive;
use super::gemm::sgemm_strided;
use crate::engine::{AttnShape, GemmShape, MatrixView};
use rayon::prelude::*;

/// The first key query `t` attends to under a sliding `window` (0: none).
pub fn first_key(t: usize, window: usize) -> usize {
    if window == 0 {
        0
    } else {
        (t + 1).saturating_sub(window)
    }
}

/// A matrix in a buffer: rows `ld` elements apart from element `offset`.
fn at(ld: usize, offset: usize) -> MatrixView {
    MatrixView { ld, offset }
}

/// `out[B, T, C]` and the saved probabilities `probs[B, H, T, T]` (upper triangle zero).
pub fn attention_forward(out: &mut [f32], probs: &mut [f32], qkv: &[f32], s: AttnShape) {
    windowed_attention_forward(out, probs, qkv, s, 0)
}

/// [`attention_forward`] within a sliding `window` (0: none); probabilities outside the
/// window are zero.
pub fn windowed_attention_forward(
    out: &mut [f32],
    probs: &mut [f32],
    qkv: &[f32],
    s: AttnShape,
    window: usize,
) {
    let (t_len, c, nh, hs) = (s.seq, s.channels, s.heads, s.head_size());
    let scale = 1.0 / (hs as f32).sqrt();
    out.par_chunks_mut(t_len * c)
        .zip(probs.par_chunks_mut(nh * t_len * t_len))
        .zip(qkv.par_chunks(t_len * 3 * c))
        .for_each(|((out_b, probs_b), qkv_b)| {
            for h in 0..nh {
                let p0 = h * t_len * t_len;
                // S = Q K^T / sqrt(hs), every query against every key.
                sgemm_strided(
                    GemmShape::single(false, true, t_len, t_len, hs),
                    [at(3 * c, h * hs), at(3 * c, c + h * hs), at(t_len, p0)],
                    scale,
                    qkv_b,
                    qkv_b,
                    0.0,
                    probs_b,
                );
                for t in 0..t_len {
                    let row = &mut probs_b[p0 + t * t_len..][..t_len];
                    let lo = first_key(t, window);
                    row[..lo].fill(0.0);
                    row[t + 1..].fill(0.0);
                    let seen = &mut row[lo..=t];
                    let max = seen.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    seen.iter_mut().for_each(|v| *v = exp_nonpositive(*v - max));
                    let inv = 1.0 / seen.iter().sum::<f32>();
                    seen.iter_mut().for_each(|v| *v *= inv);
                }
                // O = P V (the zeros of P add nothing).
                sgemm_strided(
                    GemmShape::single(false, false, t_len, hs, t_len),
                    [at(t_len, p0), at(3 * c, 2 * c + h * hs), at(c, h * hs)],
                    1.0,
                    probs_b,
                    qkv_b,
                    0.0,
                    out_b,
                );
            }
        });
}

/// Overwrites `dqkv[B, T, 3C]` given `dout[B, T, C]` and the forward's inputs and `probs`.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    probs: &[f32],
    s: AttnShape,
) {
    windowed_attention_backward(dqkv, dout, qkv, probs, s, 0)
}

/// [`attention_backward`] of [`windowed_attention_forward`] with the same `window`.
pub fn windowed_attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    probs: &[f32],
    s: AttnShape,
    window: usize,
) {
    backward(dqkv, dout, qkv, probs, None, s, window);
}

/// [`windowed_attention_backward`] with the softmax backward's row term
/// `d_i = sum_j P_ij dP_ij` given (`[B, NH, T]`) instead of summed: the GPU's 16-bit kernels
/// take it as `dO_i . O_i` from their stored output, and their checks compare against this
/// with the same `d`.
pub fn attention_backward_given_row_term(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    probs: &[f32],
    row_term: &[f32],
    s: AttnShape,
    window: usize,
) {
    backward(dqkv, dout, qkv, probs, Some(row_term), s, window);
}

fn backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    probs: &[f32],
    row_term: Option<&[f32]>,
    s: AttnShape,
    window: usize,
) {
    let (t_len, c, nh, hs) = (s.seq, s.channels, s.heads, s.head_size());
    let scale = 1.0 / (hs as f32).sqrt();
    dqkv.par_chunks_mut(t_len * 3 * c)
        .zip(dout.par_chunks(t_len * c))
        .zip(
            qkv.par_chunks(t_len * 3 * c)
                .zip(probs.par_chunks(nh * t_len * t_len)),
        )
        .enumerate()
        .for_each(|(b, ((dqkv_b, dout_b), (qkv_b, probs_b)))| {
            let row_term_b = row_term.map(|d| &d[b * nh * t_len..][..nh * t_len]);
            // dP, then dS in its place.
            let mut ds = vec![0.0f32; t_len * t_len];
            let packed = at(t_len, 0);
            for h in 0..nh {
                let p0 = h * t_len * t_len;
                let (q, k, v) = (h * hs, c + h * hs, 2 * c + h * hs);
                // dP = dO V^T, and dV = P^T dO.
                sgemm_strided(
                    GemmShape::single(false, true, t_len, t_len, hs),
                    [at(c, h * hs), at(3 * c, v), packed],
                    1.0,
                    dout_b,
                    qkv_b,
                    0.0,
                    &mut ds,
                );
                sgemm_strided(
                    GemmShape::single(true, false, t_len, hs, t_len),
                    [at(t_len, p0), at(c, h * hs), at(3 * c, v)],
                    1.0,
                    probs_b,
                    dout_b,
                    0.0,
                    dqkv_b,
                );
                // Softmax backward: dS = P * (dP - sum(P * dP)), times the score scale.
                for t in 0..t_len {
                    let p = &probs_b[p0 + t * t_len..][..t_len];
                    let row = &mut ds[t * t_len..][..t_len];
                    let lo = first_key(t, window);
                    let dot: f32 = match row_term_b {
                        Some(d) => d[h * t_len + t],
                        None => (lo..=t).map(|j| p[j] * row[j]).sum(),
                    };
                    row[..lo].fill(0.0);
                    row[t + 1..].fill(0.0);
                    for (d, &p) in row[lo..=t].iter_mut().zip(&p[lo..=t]) {
                        *d = p * (*d - dot) * scale;
                    }
                }
                // dQ = dS K and dK = dS^T Q.
                sgemm_strided(
                    GemmShape::single(false, false, t_len, hs, t_len),
                    [packed, at(3 * c, k), at(3 * c, q)],
                    1.0,
                    &ds,
                    qkv_b,
                    0.0,
                    dqkv_b,
                );
                sgemm_strided(
                    GemmShape::single(true, false, t_len, hs, t_len),
                    [packed, at(3 * c, q), at(3 * c, k)],
                    1.0,
                    &ds,
                    qkv_b,
                    0.0,
                    dqkv_b,
                );
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    /// Naive f64 attention written from the definition, the reference for the forward:
    /// query `t` sees keys `t2 <= t` with `t - t2 < window` (every one when `window` is 0).
    fn naive(qkv: &[f32], s: AttnShape, window: usize) -> Vec<f64> {
        let (t_len, c, hs) = (s.seq, s.channels, s.head_size());
        let mut out = vec![0.0f64; s.batch * t_len * c];
        for b in 0..s.batch {
            for h in 0..s.heads {
                for t in 0..t_len {
                    let at = |t: usize, part: usize, i: usize| {
                        qkv[(b * t_len + t) * 3 * c + part * c + h * hs + i] as f64
                    };
                    let seen: Vec<usize> = (0..=t)
                        .filter(|&t2| window == 0 || t - t2 < window)
                        .collect();
                    let scores: Vec<f64> = seen
                        .iter()
                        .map(|&t2| {
                            (0..hs).map(|i| at(t, 0, i) * at(t2, 1, i)).sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for i in 0..hs {
                        out[(b * t_len + t) * c + h * hs + i] = seen
                            .iter()
                            .zip(&scores)
                            .map(|(&t2, sc)| (sc - m).exp() / z * at(t2, 2, i))
                            .sum();
                    }
                }
            }
        }
        out
    }

    /// Without a window and within windows of 1, 3 and 5 positions (7-token sequences).
    #[test]
    fn forward_matches_naive_and_backward_matches_finite_differences() {
        let s = AttnShape {
            batch: 2,
            seq: 7,
            heads: 2,
            channels: 8,
        };
        let qkv = random(s.batch * s.seq * 3 * s.channels, 11, 1.0);
        for window in [0, 1, 3, 5] {
            let mut out = vec![f32::NAN; s.batch * s.seq * s.channels];
            let mut probs = vec![f32::NAN; s.batch * s.heads * s.seq * s.seq];
            windowed_attention_forward(&mut out, &mut probs, &qkv, s, window);
            let want: Vec<f32> = naive(&qkv, s, window).iter().map(|&v| v as f32).collect();
            assert_close(
                &out,
                &want,
                1e-5,
                &format!("attention forward, window {window}"),
            );

            let w = random(out.len(), 12, 1.0);
            let loss = |qkv: &[f32]| -> f64 {
                naive(qkv, s, window)
                    .iter()
                    .zip(&w)
                    .map(|(o, w)| o * *w as f64)
                    .sum()
            };
            let mut dqkv = vec![f32::NAN; qkv.len()];
            windowed_attention_backward(&mut dqkv, &w, &qkv, &probs, s, window);
            let h = 1e-3f32;
            for i in 0..qkv.len() {
                let (mut p, mut m) = (qkv.clone(), qkv.clone());
                p[i] += h;
                m[i] -= h;
                let fd = ((loss(&p) - loss(&m)) / (2.0 * h as f64)) as f32;
                assert!(
                    (dqkv[i] - fd).abs() < 1e-3 * fd.abs().max(1.0),
                    "window {window}, dqkv[{i}]: {} vs {fd}",
                    dqkv[i]
                );
            }
        }
    }

    /// A window shorter than the sequence changes the result; one at least as long as the
    /// sequence gives full causal attention bit for bit, forward and backward.
    #[test]
    fn a_window_as_long_as_the_sequence_is_full_attention_bit_for_bit() {
        let s = AttnShape {
            batch: 2,
            seq: 9,
            heads: 3,
            channels: 12,
        };
        let qkv = random(s.batch * s.seq * 3 * s.channels, 21, 1.0);
        let dout = random(s.batch * s.seq * s.channels, 22, 1.0);
        let run = |window: usize| {
            let mut out = vec![f32::NAN; dout.len()];
            let mut probs = vec![f32::NAN; s.batch * s.heads * s.seq * s.seq];
            windowed_attention_forward(&mut out, &mut probs, &qkv, s, window);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            windowed_attention_backward(&mut dqkv, &dout, &qkv, &probs, s, window);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&dqkv))
        };
        let full = run(0);
        assert_eq!(run(9), full);
        assert_eq!(run(1000), full);
        let short = run(4);
        assert_ne!(short.0, full.0);
        assert_ne!(short.1, full.1);
    }
}

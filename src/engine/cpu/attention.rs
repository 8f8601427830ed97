//! Causal multi-head self-attention, forward and backward.
//!
//! Input is the fused QKV projection, `[B, T, 3C]` with Q, K and V side by side and head `h`
//! in columns `h*hs .. (h+1)*hs` of each. The CPU version stores the softmax probabilities
//! `[B, H, T, T]` for the backward; at the CPU's sequence lengths that is cheaper than
//! recomputing them. Work splits over the batch, whose rows own disjoint output memory.
//!
//! With a sliding window `W > 0` query `i` attends to keys `j` with `i - W < j <= i` (the
//! convention of transformers' `sliding_window_overlay`: `W` keys, its own included); `W = 0`
//! is full causal attention, and so is any `W` at least the sequence length, bit for bit.

use crate::engine::AttnShape;
use rayon::prelude::*;

/// The first key query `t` attends to under a sliding `window` (0: none).
pub fn first_key(t: usize, window: usize) -> usize {
    if window == 0 {
        0
    } else {
        (t + 1).saturating_sub(window)
    }
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
                for t in 0..t_len {
                    let q = &qkv_b[t * 3 * c + h * hs..][..hs];
                    let p = &mut probs_b[(h * t_len + t) * t_len..][..t_len];
                    let lo = first_key(t, window);
                    p.fill(0.0);
                    let seen = &mut p[lo..=t];
                    let mut max = f32::NEG_INFINITY;
                    for (t2, pv) in (lo..).zip(seen.iter_mut()) {
                        let k = &qkv_b[t2 * 3 * c + c + h * hs..][..hs];
                        *pv = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                        max = max.max(*pv);
                    }
                    let mut sum = 0.0f32;
                    for pv in seen.iter_mut() {
                        *pv = (*pv - max).exp();
                        sum += *pv;
                    }
                    let inv = 1.0 / sum;
                    seen.iter_mut().for_each(|pv| *pv *= inv);
                    let o = &mut out_b[t * c + h * hs..][..hs];
                    o.iter_mut().for_each(|v| *v = 0.0);
                    for (t2, &pv) in (lo..).zip(seen.iter()) {
                        let v = &qkv_b[t2 * 3 * c + 2 * c + h * hs..][..hs];
                        o.iter_mut().zip(v).for_each(|(o, v)| *o += pv * v);
                    }
                }
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
            dqkv_b.iter_mut().for_each(|v| *v = 0.0);
            let mut dp = vec![0.0f32; t_len];
            for h in 0..nh {
                for t in 0..t_len {
                    let p = &probs_b[(h * t_len + t) * t_len..][..t_len];
                    let dy = &dout_b[t * c + h * hs..][..hs];
                    let lo = first_key(t, window);
                    // dP = dY V^T, and dV += P^T dY.
                    for t2 in lo..=t {
                        let v_off = t2 * 3 * c + 2 * c + h * hs;
                        dp[t2] = dy
                            .iter()
                            .zip(&qkv_b[v_off..][..hs])
                            .map(|(a, b)| a * b)
                            .sum();
                        let dv = &mut dqkv_b[v_off..][..hs];
                        dv.iter_mut().zip(dy).for_each(|(dv, dy)| *dv += p[t2] * dy);
                    }
                    // Softmax backward: dS = P * (dP - sum(P * dP)).
                    let dot: f32 = match row_term_b {
                        Some(d) => d[h * t_len + t],
                        None => (lo..=t).map(|t2| p[t2] * dp[t2]).sum(),
                    };
                    let q_off = t * 3 * c + h * hs;
                    for t2 in lo..=t {
                        let ds = p[t2] * (dp[t2] - dot) * scale;
                        let k_off = t2 * 3 * c + c + h * hs;
                        for i in 0..hs {
                            dqkv_b[q_off + i] += ds * qkv_b[k_off + i];
                            dqkv_b[k_off + i] += ds * qkv_b[q_off + i];
                        }
                    }
                }
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

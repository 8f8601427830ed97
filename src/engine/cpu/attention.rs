//! Causal multi-head self-attention, forward and backward.
//!
//! Input is the fused QKV projection, `[B, T, 3C]` with Q, K and V side by side and head `h`
//! in columns `h*hs .. (h+1)*hs` of each. The CPU version stores the softmax probabilities
//! `[B, H, T, T]` for the backward; at the CPU's sequence lengths that is cheaper than
//! recomputing them. Work splits over the batch, whose rows own disjoint output memory.

use crate::engine::AttnShape;
use rayon::prelude::*;

/// `out[B, T, C]` and the saved probabilities `probs[B, H, T, T]` (upper triangle zero).
pub fn attention_forward(out: &mut [f32], probs: &mut [f32], qkv: &[f32], s: AttnShape) {
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
                    let mut max = f32::NEG_INFINITY;
                    for (t2, pv) in p.iter_mut().enumerate().take(t + 1) {
                        let k = &qkv_b[t2 * 3 * c + c + h * hs..][..hs];
                        *pv = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                        max = max.max(*pv);
                    }
                    let mut sum = 0.0f32;
                    for pv in p.iter_mut().take(t + 1) {
                        *pv = (*pv - max).exp();
                        sum += *pv;
                    }
                    let inv = 1.0 / sum;
                    p.iter_mut().take(t + 1).for_each(|pv| *pv *= inv);
                    p.iter_mut().skip(t + 1).for_each(|pv| *pv = 0.0);
                    let o = &mut out_b[t * c + h * hs..][..hs];
                    o.iter_mut().for_each(|v| *v = 0.0);
                    for (t2, &pv) in p.iter().enumerate().take(t + 1) {
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
    let (t_len, c, nh, hs) = (s.seq, s.channels, s.heads, s.head_size());
    let scale = 1.0 / (hs as f32).sqrt();
    dqkv.par_chunks_mut(t_len * 3 * c)
        .zip(dout.par_chunks(t_len * c))
        .zip(
            qkv.par_chunks(t_len * 3 * c)
                .zip(probs.par_chunks(nh * t_len * t_len)),
        )
        .for_each(|((dqkv_b, dout_b), (qkv_b, probs_b))| {
            dqkv_b.iter_mut().for_each(|v| *v = 0.0);
            let mut dp = vec![0.0f32; t_len];
            for h in 0..nh {
                for t in 0..t_len {
                    let p = &probs_b[(h * t_len + t) * t_len..][..t_len];
                    let dy = &dout_b[t * c + h * hs..][..hs];
                    // dP = dY V^T, and dV += P^T dY.
                    for t2 in 0..=t {
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
                    let dot: f32 = (0..=t).map(|t2| p[t2] * dp[t2]).sum();
                    let q_off = t * 3 * c + h * hs;
                    for t2 in 0..=t {
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

    /// Naive f64 attention written from the definition, the reference for the forward.
    fn naive(qkv: &[f32], s: AttnShape) -> Vec<f64> {
        let (t_len, c, hs) = (s.seq, s.channels, s.head_size());
        let mut out = vec![0.0f64; s.batch * t_len * c];
        for b in 0..s.batch {
            for h in 0..s.heads {
                for t in 0..t_len {
                    let at = |t: usize, part: usize, i: usize| {
                        qkv[(b * t_len + t) * 3 * c + part * c + h * hs + i] as f64
                    };
                    let scores: Vec<f64> = (0..=t)
                        .map(|t2| {
                            (0..hs).map(|i| at(t, 0, i) * at(t2, 1, i)).sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for i in 0..hs {
                        out[(b * t_len + t) * c + h * hs + i] = (0..=t)
                            .map(|t2| (scores[t2] - m).exp() / z * at(t2, 2, i))
                            .sum();
                    }
                }
            }
        }
        out
    }

    #[test]
    fn forward_matches_naive_and_backward_matches_finite_differences() {
        let s = AttnShape {
            batch: 2,
            seq: 7,
            heads: 2,
            channels: 8,
        };
        let qkv = random(s.batch * s.seq * 3 * s.channels, 11, 1.0);
        let mut out = vec![f32::NAN; s.batch * s.seq * s.channels];
        let mut probs = vec![f32::NAN; s.batch * s.heads * s.seq * s.seq];
        attention_forward(&mut out, &mut probs, &qkv, s);
        let want: Vec<f32> = naive(&qkv, s).iter().map(|&v| v as f32).collect();
        assert_close(&out, &want, 1e-5, "attention forward");

        let w = random(out.len(), 12, 1.0);
        let loss = |qkv: &[f32]| -> f64 {
            naive(qkv, s)
                .iter()
                .zip(&w)
                .map(|(o, w)| o * *w as f64)
                .sum()
        };
        let mut dqkv = vec![f32::NAN; qkv.len()];
        attention_backward(&mut dqkv, &w, &qkv, &probs, s);
        let h = 1e-3f32;
        for i in 0..qkv.len() {
            let (mut p, mut m) = (qkv.clone(), qkv.clone());
            p[i] += h;
            m[i] -= h;
            let fd = ((loss(&p) - loss(&m)) / (2.0 * h as f64)) as f32;
            assert!(
                (dqkv[i] - fd).abs() < 1e-3 * fd.abs().max(1.0),
                "dqkv[{i}]: {} vs {fd}",
                dqkv[i]
            );
        }
    }
}

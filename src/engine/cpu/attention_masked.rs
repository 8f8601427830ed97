//! Bidirectional multi-head self-attention with a key padding mask, forward only: the
//! attention of BERT-family encoders over a batch of right-padded sequences.
//!
//! Same `qkv[B, T, 3C]` layout as [`super::attention`]. Sequence `b` holds `lens[b]` real
//! tokens followed by padding; every query row, padded ones included, attends to the keys
//! `0 .. lens[b]` and never to padding (transformers' additive mask does the same, so the
//! padded rows' outputs match too, though poolers ignore them). There is no causal mask.
//!
//! Training an encoder takes the unfused route (batched GEMMs around a softmax over a stored
//! `[B, H, T, T]` matrix, as `nn::attention` does for causal attention): [`padded_softmax`]
//! masks each row's padded keys, and [`softmax_backward`] runs over whole rows, since the
//! masked probabilities are zero and so get a zero gradient.

use crate::engine::AttnShape;
use rayon::prelude::*;

/// Writes `out[B, T, C]`. Every `lens[b]` is in `1 ..= T` (the dispatcher checks).
pub fn masked_attention_forward(out: &mut [f32], qkv: &[f32], lens: &[u32], s: AttnShape) {
    let (t_len, c, nh, hs) = (s.seq, s.channels, s.heads, s.head_size());
    let scale = 1.0 / (hs as f32).sqrt();
    out.par_chunks_mut(t_len * c)
        .zip(qkv.par_chunks(t_len * 3 * c))
        .zip(lens.par_iter())
        .for_each(|((out_b, qkv_b), &len)| {
            let len = len as usize;
            let mut p = vec![0.0f32; len];
            for h in 0..nh {
                for t in 0..t_len {
                    let q = &qkv_b[t * 3 * c + h * hs..][..hs];
                    let mut max = f32::NEG_INFINITY;
                    for (t2, pv) in p.iter_mut().enumerate() {
                        let k = &qkv_b[t2 * 3 * c + c + h * hs..][..hs];
                        *pv = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                        max = max.max(*pv);
                    }
                    let mut sum = 0.0f32;
                    for pv in p.iter_mut() {
                        *pv = (*pv - max).exp();
                        sum += *pv;
                    }
                    let inv = 1.0 / sum;
                    let o = &mut out_b[t * c + h * hs..][..hs];
                    o.iter_mut().for_each(|v| *v = 0.0);
                    for (t2, &pv) in p.iter().enumerate() {
                        let v = &qkv_b[t2 * 3 * c + 2 * c + h * hs..][..hs];
                        o.iter_mut().zip(v).for_each(|(o, v)| *o += pv * inv * v);
                    }
                }
            }
        });
}

/// `probs = softmax(scores)` over each row of `scores[B, H, T, T]` restricted to the keys
/// `0 .. lens[b]` of its sequence; the padded keys get probability zero.
pub fn padded_softmax(probs: &mut [f32], scores: &[f32], lens: &[u32], heads: usize, t_len: usize) {
    probs
        .par_chunks_mut(t_len)
        .zip(scores.par_chunks(t_len))
        .enumerate()
        .for_each(|(r, (p, sc))| {
            let seen = lens[r / (heads * t_len)] as usize;
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

/// Softmax backward over whole rows of width `t_len`: `dscores = P * (dP - sum(P * dP))`.
/// Entries a mask zeroed in `P` get a zero gradient, whatever the mask was.
pub fn softmax_backward(dscores: &mut [f32], probs: &[f32], dprobs: &[f32], t_len: usize) {
    dscores
        .par_chunks_mut(t_len)
        .zip(probs.par_chunks(t_len).zip(dprobs.par_chunks(t_len)))
        .for_each(|(ds, (p, dp))| {
            let dot: f32 = p.iter().zip(dp).map(|(p, dp)| p * dp).sum();
            for ((ds, &p), &dp) in ds.iter_mut().zip(p).zip(dp) {
                *ds = p * (dp - dot);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    /// Naive f64 attention from the definition: softmax over the first `len` keys only.
    fn naive(qkv: &[f32], lens: &[u32], s: AttnShape) -> Vec<f64> {
        let (t_len, c, hs) = (s.seq, s.channels, s.head_size());
        let mut out = vec![0.0f64; s.batch * t_len * c];
        for b in 0..s.batch {
            let len = lens[b] as usize;
            for h in 0..s.heads {
                for t in 0..t_len {
                    let at = |t: usize, part: usize, i: usize| {
                        qkv[(b * t_len + t) * 3 * c + part * c + h * hs + i] as f64
                    };
                    let scores: Vec<f64> = (0..len)
                        .map(|t2| {
                            (0..hs).map(|i| at(t, 0, i) * at(t2, 1, i)).sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for i in 0..hs {
                        out[(b * t_len + t) * c + h * hs + i] = (0..len)
                            .map(|t2| (scores[t2] - m).exp() / z * at(t2, 2, i))
                            .sum();
                    }
                }
            }
        }
        out
    }

    #[test]
    fn forward_matches_naive_and_ignores_padding() {
        let s = AttnShape {
            batch: 3,
            seq: 9,
            heads: 2,
            channels: 8,
        };
        let lens = [9u32, 4, 1];
        let mut qkv = random(s.batch * s.seq * 3 * s.channels, 21, 1.0);
        let mut out = vec![f32::NAN; s.batch * s.seq * s.channels];
        masked_attention_forward(&mut out, &qkv, &lens, s);
        let want: Vec<f32> = naive(&qkv, &lens, s).iter().map(|&v| v as f32).collect();
        assert_close(&out, &want, 1e-5, "masked attention forward");

        // Changing the padded keys and values of sequence 1 changes nothing it computes for
        // its real rows: the mask really hides them.
        let row = 3 * s.channels;
        for t in 4..s.seq {
            for v in &mut qkv[(s.seq + t) * row..][..row] {
                *v = 100.0;
            }
        }
        let mut again = vec![f32::NAN; out.len()];
        masked_attention_forward(&mut again, &qkv, &lens, s);
        let real = s.seq * s.channels..(s.seq + 4) * s.channels;
        assert_eq!(&again[real.clone()], &out[real]);
    }

    #[test]
    fn padded_softmax_and_its_backward_match_the_definition() {
        let (heads, t_len) = (2, 5);
        let lens = [5u32, 2, 1];
        let rows = lens.len() * heads * t_len;
        let scores = random(rows * t_len, 8, 3.0);
        let mut p = vec![f32::NAN; scores.len()];
        padded_softmax(&mut p, &scores, &lens, heads, t_len);
        for (r, row) in p.chunks(t_len).enumerate() {
            let len = lens[r / (heads * t_len)] as usize;
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert!(row[len..].iter().all(|&v| v == 0.0), "row {r}: {row:?}");
            assert!(row[..len].iter().all(|&v| v > 0.0));
        }
        let w = random(scores.len(), 9, 1.0);
        let loss = |sc: &[f32]| -> f64 {
            let mut p = vec![f32::NAN; sc.len()];
            padded_softmax(&mut p, sc, &lens, heads, t_len);
            p.iter().zip(&w).map(|(p, w)| *p as f64 * *w as f64).sum()
        };
        let mut ds = vec![f32::NAN; scores.len()];
        softmax_backward(&mut ds, &p, &w, t_len);
        let h = 1e-3f32;
        let fd: Vec<f32> = (0..scores.len())
            .map(|i| {
                let (mut a, mut b) = (scores.clone(), scores.clone());
                a[i] += h;
                b[i] -= h;
                ((loss(&a) - loss(&b)) / (2.0 * h as f64)) as f32
            })
            .collect();
        assert_close(&ds, &fd, 2e-3, "padded softmax backward");
    }
}

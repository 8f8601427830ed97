//! Softmax cross-entropy over the vocabulary, with the backward fused into the forward.
//!
//! The logits are the largest activation of a language model. The fused kernel turns them into
//! their own gradient in place, so the softmax is computed once and no second buffer of
//! vocabulary width ever exists. Losses are returned per row and summed by the caller in f64 in
//! a fixed order, which keeps the reported loss reproducible.

use rayon::prelude::*;

fn row_logsumexp(row: &[f32]) -> f32 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

/// Per-row loss `-log softmax(logits)[target]`; logits are `[n, v]`.
pub fn cross_entropy_forward(losses: &mut [f32], logits: &[f32], targets: &[u32], v: usize) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks(v).zip(targets.par_iter()))
        .for_each(|(l, (row, &t))| *l = row_logsumexp(row) - row[t as usize]);
}

/// Per-row losses, and `logits` overwritten with `d loss / d logits` where each row's loss
/// carries weight `grad_scale` (for a mean over N tokens, `1/N`, times any loss scale).
pub fn cross_entropy_fused(
    losses: &mut [f32],
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    grad_scale: f32,
) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_mut(v).zip(targets.par_iter()))
        .for_each(|(l, (row, &t))| {
            let lse = row_logsumexp(row);
            *l = lse - row[t as usize];
            row.iter_mut()
                .for_each(|x| *x = (*x - lse).exp() * grad_scale);
            row[t as usize] -= grad_scale;
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn fused_matches_definition_and_finite_differences() {
        let (n, v) = (5, 37);
        let logits = random(n * v, 1, 4.0);
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % v as u32).collect();
        let naive = |lg: &[f32]| -> Vec<f64> {
            lg.chunks(v)
                .zip(&targets)
                .map(|(r, &t)| {
                    let z: f64 = r.iter().map(|&x| (x as f64).exp()).sum();
                    -((r[t as usize] as f64).exp() / z).ln()
                })
                .collect()
        };
        let mut losses = vec![f32::NAN; n];
        cross_entropy_forward(&mut losses, &logits, &targets, v);
        let want: Vec<f32> = naive(&logits).iter().map(|&x| x as f32).collect();
        assert_close(&losses, &want, 1e-5, "loss");

        let mut grad = logits.clone();
        let mut losses2 = vec![f32::NAN; n];
        cross_entropy_fused(&mut losses2, &mut grad, &targets, v, 0.5);
        assert_close(&losses2, &losses, 0.0, "fused loss equals forward loss");
        let h = 1e-2f32;
        for i in 0..n * v {
            let (mut p, mut m) = (logits.clone(), logits.clone());
            p[i] += h;
            m[i] -= h;
            let fd = 0.5 * (naive(&p).iter().sum::<f64>() - naive(&m).iter().sum::<f64>())
                / (2.0 * h as f64);
            assert!(
                (grad[i] as f64 - fd).abs() < 1e-4,
                "dlogits[{i}]: {} vs {fd}",
                grad[i]
            );
        }
    }
}

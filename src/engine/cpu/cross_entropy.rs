//! Softmax cross-entropy over the vocabulary, with the backward fused into the forward.
//!
//! The logits are the largest activation of a language model. The fused kernel turns them into
//! their own gradient in place, so the softmax is computed once and no second buffer of
//! vocabulary width ever exists. Losses are returned per row and summed by the caller in f64 in
//! a fixed order, which keeps the reported loss reproducible.
//!
//! Rows may be wider than the vocabulary: the model pads its vocabulary to a multiple of 128
//! so the head GEMM runs on aligned tensor-core tiles. Only the first `valid` columns of a
//! row take part in the softmax; the padded ones get a zero gradient, as if their logits
//! were minus infinity.
//!
//! The unfused form ([`log_softmax`], [`nll_loss`], [`log_softmax_nll_backward`]) is the same
//! mathematics as three single-purpose kernels, the way a framework without a fused loss runs
//! it: the log-probabilities go to a buffer of their own, the losses are gathered from it, and
//! the backward writes the gradient into a third buffer. `train.fused_kernels=false` runs it,
//! so a benchmark can measure what the fusion saves.
//!
//! A row whose target is [`IGNORE_TARGET`] takes no part in the loss: its loss is zero and its
//! gradient row is zero (fine-tuning trains on completion tokens only).

use rayon::prelude::*;

/// The target of a position that is not trained (a prompt token, padding): loss and gradient
/// zero. `u32::MAX` can never be a vocabulary id.
pub const IGNORE_TARGET: u32 = u32::MAX;

fn row_logsumexp(row: &[f32]) -> f32 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

/// Per-row loss `-log softmax(logits[.., ..valid])[target]`; logits are `[n, v]`.
pub fn cross_entropy_forward(
    losses: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    v: usize,
    valid: usize,
) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks(v).zip(targets.par_iter()))
        .for_each(|(l, (row, &t))| {
            *l = if t == IGNORE_TARGET {
                0.0
            } else {
                row_logsumexp(&row[..valid]) - row[t as usize]
            }
        });
}

/// Per-row losses, and `logits` overwritten with `d loss / d logits` where each row's loss
/// carries weight `grad_scale` (for a mean over N tokens, `1/N`, times any loss scale).
pub fn cross_entropy_fused(
    losses: &mut [f32],
    logits: &mut [f32],
    targets: &[u32],
    v: usize,
    valid: usize,
    grad_scale: f32,
) {
    losses
        .par_iter_mut()
        .zip(logits.par_chunks_mut(v).zip(targets.par_iter()))
        .for_each(|(l, (row, &t))| {
            if t == IGNORE_TARGET {
                *l = 0.0;
                row.fill(0.0);
                return;
            }
            let (real, padding) = row.split_at_mut(valid);
            let lse = row_logsumexp(real);
            *l = lse - real[t as usize];
            real.iter_mut()
                .for_each(|x| *x = (*x - lse).exp() * grad_scale);
            real[t as usize] -= grad_scale;
            padding.fill(0.0);
        });
}

/// Unfused step 1: `logp[r, j] = logits[r, j] - logsumexp(logits[r, ..valid])` for the
/// vocabulary columns, minus infinity in the padding (which keeps them out of step 3).
pub fn log_softmax(logp: &mut [f32], logits: &[f32], v: usize, valid: usize) {
    logp.par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .for_each(|(out, row)| {
            let lse = row_logsumexp(&row[..valid]);
            let (real, padding) = out.split_at_mut(valid);
            real.iter_mut().zip(row).for_each(|(o, &x)| *o = x - lse);
            padding.fill(f32::NEG_INFINITY);
        });
}

/// Unfused step 2: `losses[r] = -logp[r, targets[r]]`.
pub fn nll_loss(losses: &mut [f32], logp: &[f32], targets: &[u32], v: usize) {
    losses
        .par_iter_mut()
        .zip(logp.par_chunks(v).zip(targets.par_iter()))
        .for_each(|(l, (row, &t))| {
            *l = if t == IGNORE_TARGET {
                0.0
            } else {
                -row[t as usize]
            }
        });
}

/// Unfused step 3: `dlogits[r, j] = (exp(logp[r, j]) - [j == targets[r]]) * grad_scale` for
/// the vocabulary columns and zero in the padding, as the fused kernel masks it.
pub fn log_softmax_nll_backward(
    dlogits: &mut [f32],
    logp: &[f32],
    targets: &[u32],
    v: usize,
    valid: usize,
    grad_scale: f32,
) {
    dlogits
        .par_chunks_mut(v)
        .zip(logp.par_chunks(v).zip(targets.par_iter()))
        .for_each(|(d, (row, &t))| {
            if t == IGNORE_TARGET {
                d.fill(0.0);
                return;
            }
            for (j, (d, &lp)) in d.iter_mut().zip(row).enumerate() {
                let onehot = if j == t as usize { 1.0 } else { 0.0 };
                *d = if j < valid {
                    (lp.exp() - onehot) * grad_scale
                } else {
                    0.0
                };
            }
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
        cross_entropy_forward(&mut losses, &logits, &targets, v, v);
        let want: Vec<f32> = naive(&logits).iter().map(|&x| x as f32).collect();
        assert_close(&losses, &want, 1e-5, "loss");

        let mut grad = logits.clone();
        let mut losses2 = vec![f32::NAN; n];
        cross_entropy_fused(&mut losses2, &mut grad, &targets, v, v, 0.5);
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

    /// A padded row gives the loss and gradient of the unpadded row, whatever the padding
    /// holds, and zero gradient in the padding.
    #[test]
    fn padded_columns_are_masked() {
        let (n, valid, v) = (4, 13, 16);
        let real = random(n * valid, 2, 3.0);
        let mut padded = random(n * v, 3, 50.0);
        for r in 0..n {
            padded[r * v..r * v + valid].copy_from_slice(&real[r * valid..(r + 1) * valid]);
        }
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 1) % valid as u32).collect();
        let (mut want, mut got) = (vec![0.0; n], vec![0.0; n]);
        let mut grad_real = real.clone();
        cross_entropy_fused(&mut want, &mut grad_real, &targets, valid, valid, 0.25);
        cross_entropy_fused(&mut got, &mut padded, &targets, v, valid, 0.25);
        assert_close(&got, &want, 0.0, "loss");
        for r in 0..n {
            let row = &padded[r * v..(r + 1) * v];
            assert_close(
                &row[..valid],
                &grad_real[r * valid..(r + 1) * valid],
                0.0,
                "grad",
            );
            assert!(
                row[valid..].iter().all(|&g| g == 0.0),
                "padding gradient {row:?}"
            );
        }
        let mut fwd = vec![0.0; n];
        cross_entropy_forward(
            &mut fwd,
            &padded_copy(&real, n, valid, v),
            &targets,
            v,
            valid,
        );
        assert_close(&fwd, &want, 0.0, "forward loss");
    }

    /// The three unfused kernels give the fused loss and gradient on fresh random rows with
    /// padding. The loss is the same f32 subtraction (`lse - x_t` against `-(x_t - lse)`, exact
    /// negation), so equal bit for bit; each non-target gradient is `exp(x - lse) * scale` in
    /// both; the target's differs in rounding only (`(p - 1) * s` against `p * s - s`, a few
    /// ulp of `s`), hence the 1e-6 bound relative to max(|g|, 1).
    #[test]
    fn unfused_chain_matches_the_fused_kernel() {
        let (n, valid, v) = (9, 181, 256);
        let logits = random(n * v, 21, 6.0);
        let targets: Vec<u32> = (0..n as u32)
            .map(|i| (i * 37 + 11) % valid as u32)
            .collect();
        let scale = 1.0 / 7.0;
        let (mut want_loss, mut want_grad) = (vec![0.0; n], logits.clone());
        cross_entropy_fused(&mut want_loss, &mut want_grad, &targets, v, valid, scale);
        let mut logp = vec![f32::NAN; n * v];
        log_softmax(&mut logp, &logits, v, valid);
        let mut loss = vec![f32::NAN; n];
        nll_loss(&mut loss, &logp, &targets, v);
        let mut grad = vec![f32::NAN; n * v];
        log_softmax_nll_backward(&mut grad, &logp, &targets, v, valid, scale);
        assert_close(&loss, &want_loss, 0.0, "loss");
        assert_close(&grad, &want_grad, 1e-6, "dlogits");
        for r in 0..n {
            assert!(
                logp[r * v + valid..(r + 1) * v]
                    .iter()
                    .all(|&x| x == f32::NEG_INFINITY)
            );
            assert!(grad[r * v + valid..(r + 1) * v].iter().all(|&g| g == 0.0));
        }
    }

    fn padded_copy(real: &[f32], n: usize, valid: usize, v: usize) -> Vec<f32> {
        let mut out = vec![1e4; n * v];
        for r in 0..n {
            out[r * v..r * v + valid].copy_from_slice(&real[r * valid..(r + 1) * valid]);
        }
        out
    }
}

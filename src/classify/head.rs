//! The classifier head on frozen features: linear, or an MLP with one ReLU hidden layer,
//! trained on the CPU with class-weighted cross-entropy and AdamW, keeping the weights of the
//! epoch with the best validation macro-F1 and stopping after `patience` epochs without a
//! better one.
//!
//! Features are standardised with the training rows' mean and deviation first (embeddings
//! differ in scale between models by orders of magnitude). Class weights are
//! `n / (classes * count_c)` over the training rows, so a rare class counts as much as a
//! common one. The products are the CPU GEMM kernel's, so an MLP on a few thousand rows trains
//! in seconds.

use super::metrics;
use crate::engine::cpu::gemm::sgemm;
use crate::engine::rng::{Rng, stream};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum HeadKind {
    Linear,
    Mlp { hidden: usize },
}

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct HeadOptions {
    pub kind: HeadKind,
    pub lr: f32,
    pub weight_decay: f32,
    pub max_epochs: usize,
    pub patience: usize,
    pub batch_size: usize,
    pub seed: u64,
}

/// One fully connected layer, `y = x W^T + b`, `W` stored `[out, in]`.
#[derive(Debug, Clone)]
struct Dense {
    w: Vec<f32>,
    b: Vec<f32>,
    c_in: usize,
    c_out: usize,
}

impl Dense {
    fn new(c_in: usize, c_out: usize, rng: &mut Rng) -> Dense {
        let std = (1.0 / c_in as f32).sqrt();
        Dense {
            w: (0..c_in * c_out).map(|_| rng.normal() * std).collect(),
            b: vec![0.0; c_out],
            c_in,
            c_out,
        }
    }

    fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let mut y: Vec<f32> = (0..rows).flat_map(|_| self.b.iter().copied()).collect();
        sgemm(
            false, true, rows, self.c_out, self.c_in, 1.0, x, &self.w, 1.0, &mut y,
        );
        y
    }
}

/// A trained head with the standardisation it was trained under.
#[derive(Debug, Clone)]
pub struct TrainedHead {
    layers: Vec<Dense>,
    mean: Vec<f32>,
    inv_std: Vec<f32>,
    pub epochs_run: usize,
    pub best_epoch: usize,
    pub best_val_f1: Option<f64>,
}

/// Rows `idx` of `x[n, d]`, standardised.
fn gather(x: &[f32], d: usize, idx: &[usize], mean: &[f32], inv_std: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(idx.len() * d);
    for &i in idx {
        out.extend(
            x[i * d..(i + 1) * d]
                .iter()
                .zip(mean.iter().zip(inv_std))
                .map(|(v, (m, s))| (v - m) * s),
        );
    }
    out
}

/// Softmax of each row of `logits[rows, k]`, in place.
fn softmax_rows(logits: &mut [f32], k: usize) {
    for row in logits.chunks_mut(k) {
        let max = row.iter().copied().fold(f32::MIN, f32::max);
        let mut sum = 0.0;
        row.iter_mut().for_each(|v| {
            *v = (*v - max).exp();
            sum += *v;
        });
        row.iter_mut().for_each(|v| *v /= sum);
    }
}

impl TrainedHead {
    fn logits(layers: &[Dense], x: &[f32], rows: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
        // Inputs of every layer (for the backward), then the logits.
        let mut inputs = vec![x.to_vec()];
        let mut h = x.to_vec();
        for (i, l) in layers.iter().enumerate() {
            h = l.forward(&h, rows);
            if i + 1 < layers.len() {
                h.iter_mut().for_each(|v| *v = v.max(0.0));
                inputs.push(h.clone());
            }
        }
        (inputs, h)
    }

    /// Class probabilities `[idx.len(), k]` of rows `idx` of `x[n, d]`.
    pub fn predict_proba(&self, x: &[f32], d: usize, idx: &[usize]) -> Vec<f32> {
        let rows = gather(x, d, idx, &self.mean, &self.inv_std);
        let (_, mut logits) = Self::logits(&self.layers, &rows, idx.len());
        let k = self.layers.last().map_or(1, |l| l.c_out);
        softmax_rows(&mut logits, k);
        logits
    }
}

/// Trains a head on rows `train` of `x[n, d]` with labels `y` (classes `0 .. k`), choosing
/// the epoch by macro-F1 on rows `val` (all epochs run when `val` is empty).
pub fn train(
    x: &[f32],
    d: usize,
    y: &[usize],
    k: usize,
    train: &[usize],
    val: &[usize],
    o: &HeadOptions,
) -> TrainedHead {
    let n = train.len().max(1);
    let mut mean = vec![0.0f32; d];
    for &i in train {
        mean.iter_mut()
            .zip(&x[i * d..])
            .for_each(|(m, v)| *m += v / n as f32);
    }
    let mut var = vec![0.0f32; d];
    for &i in train {
        var.iter_mut()
            .zip(x[i * d..].iter().zip(&mean))
            .for_each(|(s, (v, m))| *s += (v - m) * (v - m) / n as f32);
    }
    let inv_std: Vec<f32> = var.iter().map(|v| 1.0 / (v.sqrt() + 1e-6)).collect();
    let mut count = vec![0usize; k];
    train.iter().for_each(|&i| count[y[i]] += 1);
    let class_weight: Vec<f32> = count
        .iter()
        .map(|&c| {
            if c > 0 {
                n as f32 / (k * c) as f32
            } else {
                0.0
            }
        })
        .collect();

    let mut rng = Rng::new(o.seed, stream::INIT);
    let mut layers = match o.kind {
        HeadKind::Linear => vec![Dense::new(d, k, &mut rng)],
        HeadKind::Mlp { hidden } => {
            vec![
                Dense::new(d, hidden, &mut rng),
                Dense::new(hidden, k, &mut rng),
            ]
        }
    };
    // AdamW moments, one (w, b) pair per layer.
    let mut moments: Vec<[Vec<f32>; 4]> = layers
        .iter()
        .map(|l| {
            [
                vec![0.0; l.w.len()],
                vec![0.0; l.w.len()],
                vec![0.0; l.b.len()],
                vec![0.0; l.b.len()],
            ]
        })
        .collect();
    let (beta1, beta2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    let val_x = gather(x, d, val, &mean, &inv_std);
    let val_y: Vec<usize> = val.iter().map(|&i| y[i]).collect();
    let mut best = (layers.clone(), 0usize, None::<f64>);
    let mut step = 0i32;
    let mut epochs_run = 0;
    for epoch in 1..=o.max_epochs {
        epochs_run = epoch;
        let order = super::folds::shuffled(train.len(), o.seed.wrapping_add(epoch as u64));
        for chunk in order.chunks(o.batch_size.max(1)) {
            let idx: Vec<usize> = chunk.iter().map(|&j| train[j]).collect();
            let rows = idx.len();
            let xb = gather(x, d, &idx, &mean, &inv_std);
            let (inputs, mut probs) = TrainedHead::logits(&layers, &xb, rows);
            softmax_rows(&mut probs, k);
            // d(weighted mean loss)/d logits = w_y (p - onehot) / sum w.
            let wsum: f32 = idx
                .iter()
                .map(|&i| class_weight[y[i]])
                .sum::<f32>()
                .max(1e-12);
            for (r, &i) in idx.iter().enumerate() {
                let w = class_weight[y[i]] / wsum;
                let row = &mut probs[r * k..(r + 1) * k];
                row[y[i]] -= 1.0;
                row.iter_mut().for_each(|v| *v *= w);
            }
            let mut grad = probs;
            step += 1;
            let (bc1, bc2) = (1.0 - beta1.powi(step), 1.0 - beta2.powi(step));
            for li in (0..layers.len()).rev() {
                let l = &layers[li];
                let input = &inputs[li];
                let mut dw = vec![0.0f32; l.w.len()];
                sgemm(
                    true, false, l.c_out, l.c_in, rows, 1.0, &grad, input, 0.0, &mut dw,
                );
                let mut db = vec![0.0f32; l.c_out];
                grad.chunks(l.c_out)
                    .for_each(|g| db.iter_mut().zip(g).for_each(|(b, g)| *b += g));
                let next = if li > 0 {
                    let mut dx = vec![0.0f32; rows * l.c_in];
                    sgemm(
                        false, false, rows, l.c_in, l.c_out, 1.0, &grad, &l.w, 0.0, &mut dx,
                    );
                    // Through the ReLU: its output is the layer input saved.
                    dx.iter_mut().zip(input).for_each(|(g, &a)| {
                        if a <= 0.0 {
                            *g = 0.0
                        }
                    });
                    Some(dx)
                } else {
                    None
                };
                let l = &mut layers[li];
                let [mw, vw, mb, vb] = &mut moments[li];
                for (p, (g, (m, v))) in
                    l.w.iter_mut()
                        .zip(dw.iter().zip(mw.iter_mut().zip(vw.iter_mut())))
                {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= o.lr * ((*m / bc1) / ((*v / bc2).sqrt() + eps) + o.weight_decay * *p);
                }
                for (p, (g, (m, v))) in
                    l.b.iter_mut()
                        .zip(db.iter().zip(mb.iter_mut().zip(vb.iter_mut())))
                {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= o.lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
                }
                if let Some(dx) = next {
                    grad = dx;
                }
            }
        }
        if val.is_empty() {
            best = (layers.clone(), epoch, None);
            continue;
        }
        let (_, mut p) = TrainedHead::logits(&layers, &val_x, val.len());
        softmax_rows(&mut p, k);
        let f1 = metrics::evaluate(&p, &val_y, k).f1;
        if best.2.is_none_or(|b| f1 > b) {
            best = (layers.clone(), epoch, Some(f1));
        } else if epoch - best.1 >= o.patience {
            break;
        }
    }
    TrainedHead {
        layers: best.0,
        mean,
        inv_std,
        epochs_run,
        best_epoch: best.1,
        best_val_f1: best.2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two classes on either side of a plane in 8 dimensions (offset and scaled, so the
    /// standardisation matters), and an XOR of two coordinates that only the MLP can learn.
    #[test]
    fn heads_learn_what_they_can_represent() {
        let mut rng = Rng::new(5, stream::DATA);
        let (n, d) = (400, 8);
        let x: Vec<f32> = (0..n * d).map(|_| rng.normal() * 50.0 + 100.0).collect();
        let plane: Vec<usize> = (0..n)
            .map(|i| usize::from(x[i * d] + x[i * d + 1] > 200.0))
            .collect();
        let xor: Vec<usize> = (0..n)
            .map(|i| usize::from((x[i * d] > 100.0) != (x[i * d + 1] > 100.0)))
            .collect();
        let train: Vec<usize> = (0..300).collect();
        let (val, test): (Vec<usize>, Vec<usize>) = ((300..340).collect(), (340..400).collect());
        let opts = |kind| HeadOptions {
            kind,
            lr: 1e-2,
            weight_decay: 0.0,
            max_epochs: 300,
            patience: 40,
            batch_size: 32,
            seed: 1,
        };
        let acc = |y: &[usize], h: &TrainedHead| {
            let p = metrics::predictions(&h.predict_proba(&x, d, &test), 2);
            p.iter().zip(&test).filter(|(p, i)| **p == y[**i]).count() as f64 / test.len() as f64
        };
        let linear = train_head(&x, d, &plane, &train, &val, &opts(HeadKind::Linear));
        assert!(
            acc(&plane, &linear) > 0.9,
            "linear on a plane: {}",
            acc(&plane, &linear)
        );
        let linear_xor = train_head(&x, d, &xor, &train, &val, &opts(HeadKind::Linear));
        let mlp_xor = train_head(
            &x,
            d,
            &xor,
            &train,
            &val,
            &opts(HeadKind::Mlp { hidden: 32 }),
        );
        assert!(
            acc(&xor, &linear_xor) < 0.75,
            "linear on XOR: {}",
            acc(&xor, &linear_xor)
        );
        assert!(
            acc(&xor, &mlp_xor) > 0.85,
            "MLP on XOR: {}",
            acc(&xor, &mlp_xor)
        );
        assert!(mlp_xor.best_epoch <= mlp_xor.epochs_run);
    }

    fn train_head(
        x: &[f32],
        d: usize,
        y: &[usize],
        tr: &[usize],
        val: &[usize],
        o: &HeadOptions,
    ) -> TrainedHead {
        train(x, d, y, 2, tr, val, o)
    }
}

//! `kiln classify --finetune lora|full`: the encoder trains together with the head.
//!
//! For each fold a fresh copy of the base encoder is opened (all of it training, or frozen
//! under low-rank adapters on the query, key, value and dense projections), and batches of
//! records run through it on its device: the last hidden states are pooled as the model's
//! sentence-transformers config says (mean over the real tokens, or the first token; the
//! normalisation is left out, as sequence classification does), a head on the host gives
//! class-weighted cross-entropy, and its gradient flows back through the pooling into the
//! encoder's backward. Encoder and head step with AdamW, each at its own learning rate; the
//! epoch with the best validation macro-F1 is kept, and training stops after `patience`
//! epochs without a better one. Nothing is cached: the features change with every step.

use super::head::{HeadKind, HeadOptions};
use super::metrics;
use crate::embed::{Encoded, EncoderOptions, TextEncoder};
use crate::engine::cpu::gemm::sgemm;
use crate::engine::rng::{Rng, stream};
use crate::engine::{Device, Tensor};
use crate::error::{KilnError, Result};
use crate::models::bert::EncoderBatch;
use crate::models::import::bert::PoolingMode;
use crate::nn::Params;
use crate::nn::lora::LoraSpec;
use crate::optim::adamw::{AdamW, AdamWConfig};
use std::path::Path;

/// How the encoder is trained (`--finetune`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Finetune {
    /// The encoder stays as it is; the head trains on cached features.
    Frozen,
    /// Low-rank adapters (rank 8, alpha 16) on every projection; the base stays frozen.
    Lora,
    /// Every encoder parameter trains.
    Full,
}

impl Finetune {
    pub fn parse(s: &str) -> std::result::Result<Finetune, String> {
        match s {
            "frozen" | "none" => Ok(Finetune::Frozen),
            "lora" => Ok(Finetune::Lora),
            "full" => Ok(Finetune::Full),
            other => Err(format!(
                "--finetune {other} is not a mode kiln knows; use lora or full (or leave it out for a frozen encoder)"
            )),
        }
    }

    /// The encoder learning rate when `--encoder-lr` is not given.
    pub fn default_lr(self) -> f32 {
        match self {
            Finetune::Lora => 1e-4,
            _ => 2e-5,
        }
    }
}

/// The adapters `--finetune lora` attaches (PEFT's usual choice for BERT-family encoders).
pub fn lora_spec() -> LoraSpec {
    LoraSpec {
        rank: 8,
        alpha: 16.0,
        rslora: false,
        dropout: 0.0,
        targets: vec!["query".into(), "key".into(), "value".into(), "dense".into()],
    }
}

/// A head layer on the host, `y = x W^T + b`.
#[derive(Clone)]
struct Dense {
    w: Vec<f32>,
    b: Vec<f32>,
    c_in: usize,
    c_out: usize,
}

/// The classifier head with its AdamW moments.
#[derive(Clone)]
pub struct Head {
    layers: Vec<Dense>,
    moments: Vec<[Vec<f32>; 4]>,
    step: i32,
}

impl Head {
    fn new(kind: HeadKind, d: usize, k: usize, seed: u64) -> Head {
        let mut rng = Rng::new(seed, stream::INIT);
        let mut dense = |c_in: usize, c_out: usize| {
            let std = (1.0 / c_in as f32).sqrt();
            Dense {
                w: (0..c_in * c_out).map(|_| rng.normal() * std).collect(),
                b: vec![0.0; c_out],
                c_in,
                c_out,
            }
        };
        let layers = match kind {
            HeadKind::Linear => vec![dense(d, k)],
            HeadKind::Mlp { hidden } => vec![dense(d, hidden), dense(hidden, k)],
        };
        let moments = layers
            .iter()
            .map(|l| {
                let (w, b) = (vec![0.0; l.w.len()], vec![0.0; l.b.len()]);
                [w.clone(), w, b.clone(), b]
            })
            .collect();
        Head {
            layers,
            moments,
            step: 0,
        }
    }

    /// The inputs of every layer and the logits of `rows` rows of `x`.
    fn forward(&self, x: &[f32], rows: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
        let mut inputs = vec![x.to_vec()];
        let mut h = x.to_vec();
        for (i, l) in self.layers.iter().enumerate() {
            let mut y: Vec<f32> = (0..rows).flat_map(|_| l.b.iter().copied()).collect();
            sgemm(
                false, true, rows, l.c_out, l.c_in, 1.0, &h, &l.w, 1.0, &mut y,
            );
            h = y;
            if i + 1 < self.layers.len() {
                h.iter_mut().for_each(|v| *v = v.max(0.0));
                inputs.push(h.clone());
            }
        }
        (inputs, h)
    }

    fn probs(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (_, mut p) = self.forward(x, rows);
        softmax_rows(&mut p, self.layers.last().map_or(1, |l| l.c_out));
        p
    }

    /// Backpropagates `grad` (of the logits), steps AdamW, and returns the input gradient.
    fn backward_step(
        &mut self,
        inputs: &[Vec<f32>],
        mut grad: Vec<f32>,
        rows: usize,
        o: &HeadOptions,
    ) -> Vec<f32> {
        let (beta1, beta2, eps) = (0.9f32, 0.999f32, 1e-8f32);
        self.step += 1;
        let (bc1, bc2) = (1.0 - beta1.powi(self.step), 1.0 - beta2.powi(self.step));
        for li in (0..self.layers.len()).rev() {
            let l = &self.layers[li];
            let input = &inputs[li];
            let mut dw = vec![0.0f32; l.w.len()];
            sgemm(
                true, false, l.c_out, l.c_in, rows, 1.0, &grad, input, 0.0, &mut dw,
            );
            let mut db = vec![0.0f32; l.c_out];
            grad.chunks(l.c_out)
                .for_each(|g| db.iter_mut().zip(g).for_each(|(b, g)| *b += g));
            let mut dx = vec![0.0f32; rows * l.c_in];
            sgemm(
                false, false, rows, l.c_in, l.c_out, 1.0, &grad, &l.w, 0.0, &mut dx,
            );
            if li > 0 {
                // Through the ReLU: its output is this layer's saved input.
                dx.iter_mut()
                    .zip(input)
                    .for_each(|(g, &a)| *g = if a > 0.0 { *g } else { 0.0 });
            }
            let l = &mut self.layers[li];
            let [mw, vw, mb, vb] = &mut self.moments[li];
            let adam = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], decay: f32| {
                for (p, (g, (m, v))) in p.iter_mut().zip(g.iter().zip(m.iter_mut().zip(v))) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= o.lr * ((*m / bc1) / ((*v / bc2).sqrt() + eps) + decay * *p);
                }
            };
            adam(&mut l.w, &dw, mw, vw, o.weight_decay);
            adam(&mut l.b, &db, mb, vb, 0.0);
            grad = dx;
        }
        grad
    }
}

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

/// Pools `hidden[B, T, C]` (on the host) over each sequence's real rows.
pub fn pool(hidden: &[f32], lens: &[u32], seq: usize, c: usize, mode: PoolingMode) -> Vec<f32> {
    let mut out = vec![0.0f32; lens.len() * c];
    for (b, (row, &len)) in out.chunks_mut(c).zip(lens).enumerate() {
        let base = &hidden[b * seq * c..];
        match mode {
            PoolingMode::Cls => row.copy_from_slice(&base[..c]),
            PoolingMode::Mean => {
                for t in 0..len as usize {
                    row.iter_mut()
                        .zip(&base[t * c..(t + 1) * c])
                        .for_each(|(o, v)| *o += v);
                }
                row.iter_mut().for_each(|v| *v /= len as f32);
            }
        }
    }
    out
}

/// The backward of [`pool`]: `dhidden[B, T, C]` from `dpooled[B, C]` (padded rows get 0).
pub fn pool_backward(
    dpooled: &[f32],
    lens: &[u32],
    seq: usize,
    c: usize,
    mode: PoolingMode,
) -> Vec<f32> {
    let mut out = vec![0.0f32; lens.len() * seq * c];
    for (b, (g, &len)) in dpooled.chunks(c).zip(lens).enumerate() {
        let base = &mut out[b * seq * c..(b + 1) * seq * c];
        match mode {
            PoolingMode::Cls => base[..c].copy_from_slice(g),
            PoolingMode::Mean => {
                for t in 0..len as usize {
                    base[t * c..(t + 1) * c]
                        .iter_mut()
                        .zip(g)
                        .for_each(|(o, v)| *o = v / len as f32);
                }
            }
        }
    }
    out
}

/// An encoder and head trained on one fold.
pub struct FineTuned {
    pub encoder: TextEncoder,
    pub head: Head,
    pub epochs_run: usize,
    pub best_epoch: usize,
}

/// What a fine-tune needs besides the records.
pub struct FinetuneSetup<'a> {
    pub init_from: &'a Path,
    pub encoder: &'a EncoderOptions,
    pub mode: Finetune,
    pub encoder_lr: f32,
    pub batch_size: usize,
    pub head: &'a HeadOptions,
}

/// Opens a fresh copy of the base encoder, ready to train in `mode`.
pub fn open_trainable(s: &FinetuneSetup) -> Result<TextEncoder> {
    let mut enc = TextEncoder::open(s.init_from, s.encoder)?;
    let compute = enc.compute_dtype();
    let pool = enc.memory_pool().clone();
    let seed = s.head.seed;
    let Some(bert) = enc.bert_mut() else {
        return Err(KilnError::Setting(format!(
            "--finetune needs a BERT-family encoder; {} is a decoder (leave --finetune out to classify on its frozen features)",
            s.init_from.display()
        )));
    };
    if s.mode == Finetune::Lora {
        bert.attach_lora(&pool, &lora_spec(), compute, seed)?;
    }
    Ok(enc)
}

/// Pooled features of `idx` (records of `inputs`), by the encoder's frozen forward.
fn features(
    enc: &TextEncoder,
    inputs: &[Encoded],
    idx: &[usize],
    batch: usize,
) -> Result<Vec<f32>> {
    let c = enc.dim();
    let mut out = Vec::with_capacity(idx.len() * c);
    for chunk in idx.chunks(batch.max(1)) {
        let b = padded(enc, inputs, chunk);
        let bert = enc.bert().expect("fine-tuned encoders are BERT-family");
        let hidden = bert.forward(&b)?.to_vec()?;
        out.extend(pool(&hidden, &b.lens, b.seq, c, enc.pooling_mode()));
    }
    Ok(out)
}

fn padded(enc: &TextEncoder, inputs: &[Encoded], chunk: &[usize]) -> EncoderBatch {
    let seqs: Vec<(&[u32], &[u32])> = chunk
        .iter()
        .map(|&i| (inputs[i].ids.as_slice(), inputs[i].type_ids.as_slice()))
        .collect();
    let multiple = if enc.device() == Device::Cpu { 1 } else { 32 };
    EncoderBatch::pad_to(&seqs, enc.pad_id(), multiple, enc.max_length())
}

/// Class probabilities `[idx.len(), k]` of records `idx` under a fine-tuned encoder and head.
pub fn predict(f: &FineTuned, inputs: &[Encoded], idx: &[usize], batch: usize) -> Result<Vec<f32>> {
    let x = features(&f.encoder, inputs, idx, batch)?;
    Ok(f.head.probs(&x, idx.len()))
}

/// Trains a fresh encoder and a head on records `train` (labels `y`, classes `0 .. k`),
/// keeping the epoch with the best macro-F1 on `val` (all epochs when `val` is empty).
pub fn train_fold(
    s: &FinetuneSetup,
    inputs: &[Encoded],
    y: &[usize],
    k: usize,
    train: &[usize],
    val: &[usize],
) -> Result<FineTuned> {
    let mut enc = open_trainable(s)?;
    let c = enc.dim();
    let mode = enc.pooling_mode();
    let mut head = Head::new(s.head.kind, c, k, s.head.seed);
    let mut count = vec![0usize; k];
    train.iter().for_each(|&i| count[y[i]] += 1);
    let n = train.len().max(1);
    let class_weight: Vec<f32> = count
        .iter()
        .map(|&cnt| {
            if cnt > 0 {
                n as f32 / (k * cnt) as f32
            } else {
                0.0
            }
        })
        .collect();
    let mut opt = {
        let bert = enc.bert_mut().expect("opened as BERT");
        let trainable: Vec<&crate::nn::Param> =
            bert.params().into_iter().filter(|p| !p.frozen).collect();
        AdamW::new(
            AdamWConfig {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: s.head.weight_decay,
            },
            &trainable,
        )?
    };
    let snapshot = |enc: &mut TextEncoder| -> Result<Vec<Vec<f32>>> {
        let bert = enc.bert_mut().expect("opened as BERT");
        bert.trainable_params_mut()
            .iter()
            .map(|p| Ok(p.value.to_vec()?))
            .collect()
    };
    let mut best = (snapshot(&mut enc)?, head.clone(), 0usize, None::<f64>);
    let val_y: Vec<usize> = val.iter().map(|&i| y[i]).collect();
    let mut epochs_run = 0;
    for epoch in 1..=s.head.max_epochs {
        epochs_run = epoch;
        let order = super::folds::shuffled(train.len(), s.head.seed.wrapping_add(epoch as u64));
        for chunk in order.chunks(s.batch_size.max(1)) {
            let idx: Vec<usize> = chunk.iter().map(|&j| train[j]).collect();
            let b = padded(&enc, inputs, &idx);
            let bert = enc.bert_mut().expect("opened as BERT");
            let (hidden, acts) = bert.forward_train(&b)?;
            let feats = pool(&hidden.to_vec()?, &b.lens, b.seq, c, mode);
            let (head_inputs, mut grad) = head.forward(&feats, idx.len());
            softmax_rows(&mut grad, k);
            // d(weighted mean loss)/d logits = w_y (p - onehot) / sum w.
            let wsum: f32 = idx
                .iter()
                .map(|&i| class_weight[y[i]])
                .sum::<f32>()
                .max(1e-12);
            for (r, &i) in idx.iter().enumerate() {
                let w = class_weight[y[i]] / wsum;
                let row = &mut grad[r * k..(r + 1) * k];
                row[y[i]] -= 1.0;
                row.iter_mut().for_each(|v| *v *= w);
            }
            let dfeats = head.backward_step(&head_inputs, grad, idx.len(), s.head);
            let dhidden = pool_backward(&dfeats, &b.lens, b.seq, c, mode);
            let dhidden = Tensor::from_vec(hidden.pool(), hidden.shape(), hidden.dtype(), dhidden)?;
            drop(hidden);
            let mut params = bert.trainable_params_mut();
            for p in params.iter_mut() {
                p.grad.fill_zero()?;
            }
            drop(params);
            bert.backward(&dhidden, &acts)?;
            drop(acts);
            let mut params = bert.trainable_params_mut();
            opt.step(&mut params, s.encoder_lr, 1.0)?;
        }
        if val.is_empty() {
            best = (snapshot(&mut enc)?, head.clone(), epoch, None);
            continue;
        }
        let x = features(&enc, inputs, val, s.batch_size)?;
        let f1 = metrics::evaluate(&head.probs(&x, val.len()), &val_y, k).f1;
        eprintln!("  epoch {epoch}: validation macro-F1 {f1:.3}");
        if best.3.is_none_or(|b| f1 > b) {
            best = (snapshot(&mut enc)?, head.clone(), epoch, Some(f1));
        } else if epoch - best.2 >= s.head.patience {
            break;
        }
    }
    let bert = enc.bert_mut().expect("opened as BERT");
    for (p, v) in bert.trainable_params_mut().into_iter().zip(&best.0) {
        p.value.copy_from_host(v)?;
        p.refresh_compute()?;
    }
    Ok(FineTuned {
        encoder: enc,
        head: best.1,
        epochs_run,
        best_epoch: best.2,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pooling backward is the transpose of the pooling: `<pool(h), g> = <h, pool'(g)>`
    /// for every `h` and `g`, and padded rows get nothing.
    #[test]
    fn pooling_backward_is_the_adjoint_of_pooling() {
        let (lens, seq, c) = ([3u32, 1], 4, 5);
        let mut rng = Rng::new(1, stream::INIT);
        let h: Vec<f32> = (0..2 * seq * c).map(|_| rng.normal()).collect();
        let g: Vec<f32> = (0..2 * c).map(|_| rng.normal()).collect();
        for mode in [PoolingMode::Mean, PoolingMode::Cls] {
            let p = pool(&h, &lens, seq, c, mode);
            let dh = pool_backward(&g, &lens, seq, c, mode);
            let lhs: f32 = p.iter().zip(&g).map(|(a, b)| a * b).sum();
            let rhs: f32 = h.iter().zip(&dh).map(|(a, b)| a * b).sum();
            assert!((lhs - rhs).abs() < 1e-4, "{mode:?}: {lhs} vs {rhs}");
            assert!(dh[(seq + 1) * c..].iter().all(|&v| v == 0.0));
        }
        assert_eq!(Finetune::parse("lora"), Ok(Finetune::Lora));
        assert!(
            Finetune::parse("partial")
                .unwrap_err()
                .contains("lora or full")
        );
    }
}

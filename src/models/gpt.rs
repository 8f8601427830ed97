//! A GPT-style decoder: token and position embeddings, pre-norm transformer blocks, a final
//! norm and a language-model head (tied to the token embedding by default).
//!
//! The forward below keeps every activation the backward needs in [`Activations`], and the
//! backward walks the blocks in reverse with one gradient buffer for the residual stream.
//! Every layernorm after the first is fused with the residual add that precedes it.

use super::{Model, StepPrecision};
use crate::engine::ops::{self, NormStats};
use crate::engine::rng::{Rng, stream};
use crate::engine::{EngineError, MemoryPool, Result, Tensor};
use crate::nn::attention::{AttnSaved, CausalSelfAttention};
use crate::nn::embedding::Embedding;
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::mlp::{Mlp, MlpSaved};
use crate::nn::{Cost, Param, f32_bytes};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub context: usize,
    pub tied_head: bool,
}

pub struct Block {
    pub ln1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln2: LayerNorm,
    pub mlp: Mlp,
}

pub struct Gpt {
    pub cfg: GptConfig,
    pub embed: Embedding,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    /// Present only when the head is untied.
    pub head: Option<Linear>,
}

/// One block's saved activations. `input` is the residual stream entering the block,
/// `mid` the stream after the attention add.
struct BlockActs {
    input: Tensor,
    ln1: Tensor,
    ln1_stats: NormStats,
    attn: AttnSaved,
    mid: Tensor,
    ln2: Tensor,
    ln2_stats: NormStats,
    mlp: MlpSaved,
}

struct Activations {
    blocks: Vec<BlockActs>,
    /// Residual stream after the last block, and its final norm.
    last: Tensor,
    ln_f: Tensor,
    ln_f_stats: NormStats,
}

impl Gpt {
    pub fn new(pool: &Arc<MemoryPool>, cfg: GptConfig, seed: u64) -> Result<Gpt> {
        let mut rng = Rng::new(seed, stream::INIT);
        let c = cfg.d_model;
        let proj_std = 0.02 / (2.0 * cfg.n_layers as f32).sqrt();
        let embed = Embedding::new(pool, cfg.vocab, cfg.context, c, &mut rng)?;
        let blocks = (0..cfg.n_layers)
            .map(|l| {
                let name = format!("blocks.{l}");
                Ok(Block {
                    ln1: LayerNorm::new(pool, &format!("{name}.ln1"), c, &mut rng)?,
                    attn: CausalSelfAttention::new(
                        pool,
                        &format!("{name}.attn"),
                        c,
                        cfg.n_heads,
                        proj_std,
                        &mut rng,
                    )?,
                    ln2: LayerNorm::new(pool, &format!("{name}.ln2"), c, &mut rng)?,
                    mlp: Mlp::new(pool, &format!("{name}.mlp"), c, proj_std, &mut rng)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(pool, "ln_f", c, &mut rng)?;
        let head = if cfg.tied_head {
            None
        } else {
            Some(Linear::new(
                pool, "lm_head", c, cfg.vocab, false, 0.02, &mut rng,
            )?)
        };
        Ok(Gpt {
            cfg,
            embed,
            blocks,
            ln_f,
            head,
        })
    }

    fn check_len(&self, seq: usize) -> Result<()> {
        if seq > self.cfg.context {
            return Err(EngineError::Shape {
                op: "gpt",
                detail: format!(
                    "a sequence of {seq} tokens is longer than the model's context of {}; use at most {} tokens or train a model with a larger model.context",
                    self.cfg.context, self.cfg.context
                ),
            });
        }
        Ok(())
    }

    /// The layernorm that follows block `l`: the next block's first, or the final one.
    fn norm_after(&self, l: usize) -> &LayerNorm {
        self.blocks.get(l + 1).map_or(&self.ln_f, |b| &b.ln1)
    }

    fn forward(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Activations> {
        self.check_len(seq)?;
        let mut input = self.embed.forward(tokens, batch, seq)?;
        let (mut ln1, mut ln1_stats) = self
            .blocks
            .first()
            .map_or(&self.ln_f, |b| &b.ln1)
            .forward(&input)?;
        let mut acts = Vec::with_capacity(self.blocks.len());
        for (l, block) in self.blocks.iter().enumerate() {
            let (attn_out, attn) = block.attn.forward(&ln1)?;
            let (mid, ln2, ln2_stats) = block.ln2.forward_residual(&input, &attn_out)?;
            drop(attn_out);
            let (mlp_out, mlp) = block.mlp.forward(&ln2)?;
            let (next, next_ln, next_stats) =
                self.norm_after(l).forward_residual(&mid, &mlp_out)?;
            acts.push(BlockActs {
                input,
                ln1,
                ln1_stats,
                attn,
                mid,
                ln2,
                ln2_stats,
                mlp,
            });
            (input, ln1, ln1_stats) = (next, next_ln, next_stats);
        }
        Ok(Activations {
            blocks: acts,
            last: input,
            ln_f: ln1,
            ln_f_stats: ln1_stats,
        })
    }

    fn head_weight(&self) -> &Tensor {
        self.head
            .as_ref()
            .map_or(self.embed.wte.weight(), |h| h.weight.weight())
    }

    fn logits(&self, acts: &Activations) -> Result<Tensor> {
        ops::linear_forward(&acts.ln_f, self.head_weight(), None)
    }
}

impl Model for Gpt {
    fn params(&self) -> Vec<&Param> {
        let mut v = self.embed.params();
        for b in &self.blocks {
            v.extend(b.ln1.params());
            v.extend(b.attn.params());
            v.extend(b.ln2.params());
            v.extend(b.mlp.params());
        }
        v.extend(self.ln_f.params());
        if let Some(h) = &self.head {
            v.extend(h.params());
        }
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.embed.params_mut();
        for b in &mut self.blocks {
            v.extend(b.ln1.params_mut());
            v.extend(b.attn.params_mut());
            v.extend(b.ln2.params_mut());
            v.extend(b.mlp.params_mut());
        }
        v.extend(self.ln_f.params_mut());
        if let Some(h) = &mut self.head {
            v.extend(h.params_mut());
        }
        v
    }

    fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
    ) -> Result<f64> {
        let mut acts = self.forward(inputs, batch, seq)?;
        let mut dlogits = self.logits(&acts)?;
        let losses = ops::cross_entropy_fused(&mut dlogits, targets, p.grad_scale)?;
        ops::round_in_place(&mut dlogits, p.grad_dtype)?;

        let d_ln_f = match &mut self.head {
            Some(head) => head.backward(&dlogits, &acts.ln_f)?,
            None => {
                let (w, dw) = self.embed.wte.weight_and_grad();
                ops::linear_backward(&dlogits, &acts.ln_f, w, dw, None)?
            }
        };
        drop(dlogits);
        // `dstream` is the gradient of the residual stream, carried down through the blocks.
        let mut dstream = Tensor::zeros(acts.last.pool(), acts.last.shape(), acts.last.dtype())?;
        // The final norm (fused with the last block's MLP residual add) comes first.
        self.ln_f
            .backward(&mut dstream, &d_ln_f, &acts.last, &acts.ln_f_stats)?;
        while let Some(a) = acts.blocks.pop() {
            let block = &mut self.blocks[acts.blocks.len()];
            let d_ln2 = block.mlp.backward(&dstream, &a.ln2, &a.mlp)?;
            block
                .ln2
                .backward(&mut dstream, &d_ln2, &a.mid, &a.ln2_stats)?;
            let d_ln1 = block.attn.backward(&dstream, &a.ln1, &a.attn)?;
            block
                .ln1
                .backward(&mut dstream, &d_ln1, &a.input, &a.ln1_stats)?;
        }
        self.embed.backward(&dstream, inputs, seq)?;
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64> {
        let acts = self.forward(inputs, batch, seq)?;
        let logits = self.logits(&acts)?;
        Ok(ops::cross_entropy(&logits, targets)?
            .iter()
            .map(|&l| l as f64)
            .sum())
    }

    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let acts = self.forward(tokens, 1, tokens.len())?;
        let logits = self.logits(&acts)?.to_vec()?;
        Ok(logits[(tokens.len() - 1) * self.cfg.vocab..].to_vec())
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn cost(&self, batch: usize, seq: usize) -> Cost {
        let tokens = batch * seq;
        let blocks: Cost = self
            .blocks
            .iter()
            .map(|b| {
                b.ln1.cost(tokens)
                    + b.attn.cost(batch, seq)
                    + b.ln2.cost(tokens)
                    + b.mlp.cost(tokens)
            })
            .sum();
        let head_mac = (tokens * self.cfg.d_model * self.cfg.vocab) as u64;
        let head = Cost {
            params: self.head.as_ref().map_or(0, |h| h.cost(tokens).params),
            flops_forward: 2 * head_mac,
            flops_backward: 4 * head_mac,
            // The logits buffer, reused in place for its gradient.
            saved_bytes: f32_bytes(tokens * self.cfg.vocab),
        };
        self.embed.cost(tokens) + blocks + self.ln_f.cost(tokens) + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{DType, Device};

    fn tiny(tied: bool) -> Gpt {
        let cfg = GptConfig {
            vocab: 11,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            context: 6,
            tied_head: tied,
        };
        Gpt::new(&MemoryPool::new(Device::Cpu), cfg, 42).unwrap()
    }

    fn batch() -> (Vec<u32>, Vec<u32>) {
        let inputs: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % 11).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 3 + 2) % 11).collect();
        (inputs, targets)
    }

    /// The whole model's gradient against central differences of its loss, on a sample of
    /// elements from every parameter tensor, for tied and untied heads.
    #[test]
    fn model_gradient_matches_finite_differences() {
        for tied in [true, false] {
            let mut model = tiny(tied);
            let (x, y) = batch();
            let p = StepPrecision {
                grad_scale: 1.0,
                grad_dtype: DType::F32,
            };
            model.forward_backward(&x, &y, 2, 6, p).unwrap();
            let grads: Vec<Vec<f32>> = model
                .params()
                .iter()
                .map(|p| p.grad.to_vec().unwrap())
                .collect();
            // Small steps: the first layernorm sees embeddings of scale 0.02, so the loss
            // curves sharply along them.
            let h = 1e-3f32;
            for (pi, g) in grads.iter().enumerate() {
                for i in (0..g.len()).step_by(g.len().div_ceil(5)) {
                    let mut eval = |delta: f32| {
                        let mut ps = model.params_mut();
                        ps[pi].value.host_mut()[i] += delta;
                        drop(ps);
                        model.loss(&x, &y, 2, 6).unwrap()
                    };
                    let plus = eval(h);
                    let minus = eval(-2.0 * h);
                    eval(h);
                    let fd = ((plus - minus) / (2.0 * h as f64)) as f32;
                    let name = &model.params()[pi].name;
                    assert!(
                        (g[i] - fd).abs() < 2e-3 + 1e-2 * fd.abs(),
                        "tied={tied} {name}[{i}]: {} vs {fd}",
                        g[i]
                    );
                }
            }
        }
    }

    #[test]
    fn cost_counts_every_parameter_and_rejects_long_sequences() {
        let model = tiny(false);
        let n: usize = model.params().iter().map(|p| p.value.len()).sum();
        assert_eq!(model.cost(2, 6).params, n);
        let tokens = vec![1u32; 7];
        let err = model.next_logits(&tokens).unwrap_err().to_string();
        assert!(
            err.contains("longer than the model's context of 6"),
            "{err}"
        );
    }
}

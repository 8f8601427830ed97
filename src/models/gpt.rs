//! A GPT-style decoder: token and position embeddings, pre-norm transformer blocks, a final
//! norm and a language-model head (tied to the token embedding by default).
//!
//! The forward below keeps the activations the backward needs in [`Activations`], and the
//! backward walks the blocks in reverse with one gradient buffer for the residual stream.
//! Every layernorm after the first is fused with the residual add that precedes it.
//!
//! The vocabulary is padded to a multiple of [`super::VOCAB_ALIGN`] in the embedding table and
//! the head (see [`super::padded_vocab`]).
//!
//! With [`Recompute::Blocks`] the forward keeps only each block's input (the residual stream
//! entering it) and the backward re-runs that block's forward right before its backward, so
//! one block's activations are alive at a time. The rebuilt activations are bit-identical to
//! the kept ones: the same kernels run on the same inputs, and the block's first norm, fused
//! with the previous residual add in the forward, normalises the same stored sum when re-run
//! on its own.
//!
//! With [`Kernels::Unfused`] (`train.fused_kernels=false`) the fused operations run as chains
//! of single-purpose kernels with the same mathematics: the residual adds before the norms,
//! the norms' gradients added into the stream by kernels of their own, the loss as
//! log-softmax, gather and gradient kernels, and attention as batched GEMMs around a causal
//! softmax whose probabilities are kept for the backward.

use super::{Model, Recompute, StepPrecision};
use crate::engine::ops::{self, NormStats};
use crate::engine::rng::{Rng, stream};
use crate::engine::{MemoryPool, Result, Tensor};
use crate::nn::attention::{AttnSaved, CausalSelfAttention};
use crate::nn::embedding::Embedding;
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::mlp::{Mlp, MlpSaved};
use crate::nn::{ActLayout, Cost, Kernels, Param};
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

impl GptConfig {
    /// Rows of the embedding table and columns of the logits: the vocabulary rounded up to
    /// a multiple of [`super::VOCAB_ALIGN`].
    pub fn padded_vocab(&self) -> usize {
        super::padded_vocab(self.vocab)
    }
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
    recompute: Recompute,
    kernels: Kernels,
    grad_ready: Option<super::GradReady>,
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

/// What the forward keeps of one block for its backward.
enum BlockSaved {
    All(Box<BlockActs>),
    /// Only the block's input, to recompute the rest from.
    Input(Tensor),
}

/// What the forward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Every block's activations (a backward without recomputation).
    All,
    /// Each block's input (a backward that recomputes blocks).
    BlockInputs,
    /// Only the final norm: evaluation and generation run no backward.
    Output,
}

struct Activations {
    blocks: Vec<BlockSaved>,
    /// Residual stream after the last block, and its final norm.
    last: Tensor,
    ln_f: Tensor,
    ln_f_stats: NormStats,
}

impl Block {
    /// Everything the block's backward needs, from its input and its first norm: attention,
    /// the residual add fused with the second norm, and the MLP short of its output
    /// projection (the caller adds that output to the stream, fused with the next norm).
    fn activations(
        &self,
        input: Tensor,
        ln1: Tensor,
        ln1_stats: NormStats,
        kernels: Kernels,
    ) -> Result<BlockActs> {
        let (attn_out, attn) = self.attn.forward(&ln1, kernels)?;
        let (mid, ln2, ln2_stats) = self.ln2.forward_residual_with(&input, &attn_out, kernels)?;
        drop(attn_out);
        let mlp = self.mlp.activations(&ln2)?;
        Ok(BlockActs {
            input,
            ln1,
            ln1_stats,
            attn,
            mid,
            ln2,
            ln2_stats,
            mlp,
        })
    }

    /// Rebuilds the block's activations from its input alone.
    fn recompute(&self, input: Tensor, kernels: Kernels) -> Result<BlockActs> {
        let (ln1, ln1_stats) = self.ln1.forward(&input)?;
        self.activations(input, ln1, ln1_stats, kernels)
    }
}

impl Gpt {
    pub fn new(pool: &Arc<MemoryPool>, cfg: GptConfig, seed: u64) -> Result<Gpt> {
        let mut rng = Rng::new(seed, stream::INIT);
        let c = cfg.d_model;
        let proj_std = 0.02 / (2.0 * cfg.n_layers as f32).sqrt();
        let embed = Embedding::new(pool, cfg.padded_vocab(), cfg.context, c, &mut rng)?;
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
                pool,
                "lm_head",
                c,
                cfg.padded_vocab(),
                false,
                0.02,
                &mut rng,
            )?)
        };
        Ok(Gpt {
            cfg,
            embed,
            blocks,
            ln_f,
            head,
            recompute: Recompute::None,
            kernels: Kernels::Fused,
            grad_ready: None,
        })
    }

    /// Index of the first trainable parameter of each block, then of the final norm.
    fn grad_block_starts(&self) -> Vec<usize> {
        use super::trainable_count as t;
        super::block_starts(
            super::trainable_count(&self.embed.params()),
            self.blocks.iter().map(|b| {
                t(&b.ln1.params()) + t(&b.attn.params()) + t(&b.ln2.params()) + t(&b.mlp.params())
            }),
        )
    }

    /// Tells the hook, if any, that the parameters from index `k` on are final.
    fn grads_final_from(&mut self, k: usize) {
        if let Some(h) = &mut self.grad_ready {
            h(k);
        }
    }

    fn check_len(&self, seq: usize) -> Result<()> {
        super::check_context("gpt", seq, self.cfg.context)
    }

    /// The layernorm that follows block `l`: the next block's first, or the final one.
    fn norm_after(&self, l: usize) -> &LayerNorm {
        self.blocks.get(l + 1).map_or(&self.ln_f, |b| &b.ln1)
    }

    fn forward(&self, tokens: &[u32], batch: usize, seq: usize, keep: Keep) -> Result<Activations> {
        self.check_len(seq)?;
        let mut input = self.embed.forward(tokens, batch, seq)?;
        let (mut ln1, mut ln1_stats) = self
            .blocks
            .first()
            .map_or(&self.ln_f, |b| &b.ln1)
            .forward(&input)?;
        let mut saved = Vec::with_capacity(self.blocks.len());
        for (l, block) in self.blocks.iter().enumerate() {
            let acts = block.activations(input, ln1, ln1_stats, self.kernels)?;
            let mlp_out = block.mlp.output(&acts.mlp)?;
            let (next, next_ln, next_stats) =
                self.norm_after(l)
                    .forward_residual_with(&acts.mid, &mlp_out, self.kernels)?;
            drop(mlp_out);
            match keep {
                Keep::All => saved.push(BlockSaved::All(Box::new(acts))),
                Keep::BlockInputs => saved.push(BlockSaved::Input(acts.input)),
                Keep::Output => {}
            }
            (input, ln1, ln1_stats) = (next, next_ln, next_stats);
        }
        Ok(Activations {
            blocks: saved,
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
        let keep = match self.recompute {
            Recompute::None => Keep::All,
            Recompute::Blocks => Keep::BlockInputs,
        };
        let acts = self.forward(inputs, batch, seq, keep)?;
        // What the forward kept is saved; the head, the loss and the backward are transient.
        acts.ln_f.pool().set_phase(crate::engine::Phase::Backward);
        let (losses, mut dlogits) = match self.kernels {
            Kernels::Fused => {
                let mut dlogits = self.logits(&acts)?;
                let losses =
                    ops::cross_entropy_fused(&mut dlogits, targets, self.cfg.vocab, p.grad_scale)?;
                (losses, dlogits)
            }
            Kernels::Unfused => {
                let logits = self.logits(&acts)?;
                ops::cross_entropy_unfused(&logits, targets, self.cfg.vocab, p.grad_scale)?
            }
        };
        ops::round_in_place(&mut dlogits, p.grad_dtype)?;

        let d_ln_f = match &mut self.head {
            Some(head) => head.backward(&dlogits, &acts.ln_f)?,
            None => {
                let (w, dw) = self.embed.wte.weight_and_grad();
                ops::linear_backward(&dlogits, &acts.ln_f, w, dw, None)?
            }
        };
        drop(dlogits);
        let Activations {
            blocks: mut saved,
            last,
            ln_f,
            ln_f_stats,
        } = acts;
        drop(ln_f);
        // `dstream` is the gradient of the residual stream, carried down through the blocks.
        let mut dstream = Tensor::zeros(last.pool(), last.shape(), last.dtype())?;
        // The final norm (fused with the last block's MLP residual add) comes first.
        let kernels = self.kernels;
        self.ln_f
            .backward_with(&mut dstream, &d_ln_f, &last, &ln_f_stats, kernels)?;
        drop((d_ln_f, last));
        let starts = self.grad_ready.as_ref().map(|_| self.grad_block_starts());
        if let Some(s) = &starts {
            self.grads_final_from(s[self.blocks.len()]);
        }
        while let Some(kept) = saved.pop() {
            let block = &mut self.blocks[saved.len()];
            let a = match kept {
                BlockSaved::All(a) => *a,
                BlockSaved::Input(input) => block.recompute(input, kernels)?,
            };
            let d_ln2 = block.mlp.backward(&dstream, &a.ln2, &a.mlp)?;
            block
                .ln2
                .backward_with(&mut dstream, &d_ln2, &a.mid, &a.ln2_stats, kernels)?;
            let d_ln1 = block.attn.backward(&dstream, &a.ln1, &a.attn)?;
            block
                .ln1
                .backward_with(&mut dstream, &d_ln1, &a.input, &a.ln1_stats, kernels)?;
            if let Some(s) = &starts {
                self.grads_final_from(s[saved.len()]);
            }
        }
        self.embed.backward(&dstream, inputs, seq)?;
        if starts.is_some() {
            self.grads_final_from(0);
        }
        Ok(losses.iter().map(|&l| l as f64).sum())
    }

    fn set_grad_ready(&mut self, hook: Option<super::GradReady>) -> bool {
        self.grad_ready = hook;
        true
    }

    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64> {
        let acts = self.forward(inputs, batch, seq, Keep::Output)?;
        let logits = self.logits(&acts)?;
        Ok(ops::cross_entropy(&logits, targets, self.cfg.vocab)?
            .iter()
            .map(|&l| l as f64)
            .sum())
    }

    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let acts = self.forward(tokens, 1, tokens.len(), Keep::Output)?;
        let logits = self.logits(&acts)?.to_vec()?;
        let row = (tokens.len() - 1) * self.cfg.padded_vocab();
        Ok(logits[row..row + self.cfg.vocab].to_vec())
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn recompute(&self) -> Recompute {
        self.recompute
    }

    fn set_recompute(&mut self, policy: Recompute) -> std::result::Result<(), String> {
        self.recompute = policy;
        Ok(())
    }

    fn set_kernels(&mut self, kernels: Kernels) -> std::result::Result<(), String> {
        self.kernels = kernels;
        Ok(())
    }

    /// Sums the built layers' costs (fp32 on the CPU); [`GptConfig::cost_on`] gives the same
    /// from the shape alone, for any layout, without building the model.
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
        let head = Linear::cost_of(self.cfg.d_model, self.cfg.padded_vocab(), false, tokens);
        let head = Cost {
            params: self.head.as_ref().map_or(0, |h| h.cost(tokens).params),
            saved_bytes: ActLayout::CPU_F32.act_bytes(tokens * self.cfg.padded_vocab()),
            ..head
        };
        self.embed.cost(tokens) + blocks + self.ln_f.cost(tokens) + head
    }
}

impl GptConfig {
    /// The cost of one micro-batch, from the layers' own costs, with the saved bytes of
    /// activations laid out as `layout` keeps them.
    pub fn cost_on(&self, batch: usize, seq: usize, layout: ActLayout) -> Cost {
        let tokens = batch * seq;
        let c = self.d_model;
        let block = LayerNorm::cost_of(c, tokens, layout)
            + CausalSelfAttention::cost_of(c, self.n_heads, batch, seq, layout)
            + LayerNorm::cost_of(c, tokens, layout)
            + Mlp::cost_of(c, 4 * c, tokens, layout);
        let blocks: Cost = (0..self.n_layers).map(|_| block).sum();
        let head = Linear::cost_of(c, self.padded_vocab(), false, tokens);
        let head = Cost {
            params: if self.tied_head { 0 } else { head.params },
            // The logits buffer, reused in place for its gradient.
            saved_bytes: layout.act_bytes(tokens * self.padded_vocab()),
            ..head
        };
        Embedding::cost_of(self.padded_vocab(), self.context, c, tokens)
            + blocks
            + LayerNorm::cost_of(c, tokens, layout)
            + head
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

    /// The padded vocabulary rows exist (128 of them for 11 tokens), get exactly zero
    /// gradient, and never reach the caller's logits.
    #[test]
    fn padded_vocabulary_is_inert() {
        let mut model = tiny(true);
        assert_eq!(model.embed.wte.value.shape(), &[128, 8]);
        let (x, y) = batch();
        let p = StepPrecision {
            grad_scale: 1.0,
            grad_dtype: DType::F32,
        };
        model.forward_backward(&x, &y, 2, 6, p).unwrap();
        let g = model.embed.wte.grad.to_vec().unwrap();
        assert!(g[..11 * 8].iter().any(|&v| v != 0.0));
        assert!(g[11 * 8..].iter().all(|&v| v == 0.0));
        assert_eq!(model.next_logits(&x[..3]).unwrap().len(), 11);
    }

    /// A deeper, narrow model whose activations dwarf its logits (vocab 16 < d_model 32).
    fn deep(pool: &Arc<MemoryPool>, n_layers: usize) -> Gpt {
        let cfg = GptConfig {
            vocab: 16,
            d_model: 32,
            n_layers,
            n_heads: 2,
            context: 32,
            tied_head: false,
        };
        Gpt::new(pool, cfg, 7).unwrap()
    }

    fn rows(batch: usize, seq: usize, salt: u32) -> (Vec<u32>, Vec<u32>) {
        let n = (batch * seq) as u32;
        let inputs = (0..n).map(|i| (i * 7 + salt) % 16).collect();
        let targets = (0..n).map(|i| (i * 5 + 3 * salt + 1) % 16).collect();
        (inputs, targets)
    }

    /// Recomputing blocks re-runs the same kernels on the same inputs, so every gradient and
    /// the loss come out with the same bits as from kept activations, in fp32 and in the
    /// bf16-mixed emulation (bf16 compute copies, bf16 output gradient), over two
    /// accumulated micro-batches.
    #[test]
    fn recomputing_blocks_gives_bit_identical_gradients() {
        for compute in [None, Some(DType::BF16)] {
            let run = |policy: Recompute| {
                let pool = MemoryPool::new(Device::Cpu);
                let mut model = deep(&pool, 3);
                model.set_recompute(policy).unwrap();
                assert_eq!(model.recompute(), policy);
                for p in model.params_mut() {
                    p.set_compute_dtype(compute).unwrap();
                }
                let p = StepPrecision {
                    grad_scale: 1.0 / 128.0,
                    grad_dtype: compute.unwrap_or(DType::F32),
                };
                let mut losses = Vec::new();
                for salt in [1, 2] {
                    let (x, y) = rows(2, 32, salt);
                    losses.push(model.forward_backward(&x, &y, 2, 32, p).unwrap().to_bits());
                }
                let grads: Vec<(String, Vec<u32>)> = model
                    .params()
                    .iter()
                    .map(|p| {
                        let g = p.grad.to_vec().unwrap();
                        (p.name.clone(), g.iter().map(|v| v.to_bits()).collect())
                    })
                    .collect();
                (losses, grads)
            };
            let (kept_loss, kept) = run(Recompute::None);
            let (re_loss, re) = run(Recompute::Blocks);
            assert_eq!(kept_loss, re_loss, "{compute:?}: losses differ");
            assert!(kept.iter().any(|(_, g)| g.iter().any(|&b| b != 0)));
            for ((name, a), (_, b)) in kept.iter().zip(&re) {
                assert!(a == b, "{compute:?}: gradient of {name} differs");
            }
        }
    }

    /// Without recomputation each block keeps 18 activations of [batch, seq, d_model] floats
    /// (input, ln1, qkv x3, attention output, mid, ln2, MLP pre-activation x4 and GELU x4, and
    /// the CPU attention's probabilities, batch x heads x seq^2 = 2 more here): 144 for 8
    /// blocks. Recomputing keeps 8 block inputs and rebuilds one block (18) at a time, and
    /// both share the same few extra buffers (logits at half a unit, the stream gradient,
    /// one block's backward temporaries, a handful of units). So the peak above the weights
    /// must fall to well under half; the bound below leaves room for those shared buffers.
    #[test]
    fn recomputing_blocks_lowers_the_activation_peak() {
        let peak = |policy: Recompute| {
            let pool = MemoryPool::new(Device::Cpu);
            let mut model = deep(&pool, 8);
            model.set_recompute(policy).unwrap();
            let (x, y) = rows(4, 32, 1);
            let before = pool.stats().current;
            pool.reset_peak();
            let p = StepPrecision {
                grad_scale: 1.0,
                grad_dtype: DType::F32,
            };
            model.forward_backward(&x, &y, 4, 32, p).unwrap();
            assert_eq!(
                pool.stats().current,
                before,
                "{policy}: the step freed all it took"
            );
            pool.stats().peak - before
        };
        let unit = 4 * 32 * 32 * 4;
        let (kept, rebuilt) = (peak(Recompute::None), peak(Recompute::Blocks));
        assert!(kept >= 144 * unit, "kept activations: {kept} bytes");
        assert!(
            rebuilt * 2 < kept,
            "recomputation peak {rebuilt} bytes vs {kept} bytes without ({} vs {} units)",
            rebuilt / unit,
            kept / unit
        );
    }

    #[test]
    fn cost_counts_every_parameter_and_rejects_long_sequences() {
        for tied in [false, true] {
            let model = tiny(tied);
            let n: usize = model.params().iter().map(|p| p.value.len()).sum();
            assert_eq!(model.cost(2, 6).params, n);
            // The shape-only cost the planner uses agrees with the built layers' costs.
            assert_eq!(
                model.cfg.cost_on(2, 6, ActLayout::CPU_F32),
                model.cost(2, 6)
            );
        }
        let model = tiny(false);
        let tokens = vec![1u32; 7];
        let err = model.next_logits(&tokens).unwrap_err().to_string();
        assert!(
            err.contains("longer than the model's context of 6"),
            "{err}"
        );
    }
}

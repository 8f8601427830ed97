//! A GPT-style decoder: token and position embeddings, pre-norm transformer blocks, a final
//! norm and a language-model head (tied to the token embedding by default).
//!
//! The embedding, the stack, the head, the loss, block recomputation and the backward's
//! order are [`super::lm`]'s, adapters and the NF4 base [`super::adapters`]'; this file holds
//! the block, its shape and the Hugging Face module names (GPT-2's) adapters are saved
//! under. Every layernorm after the first is fused with the residual add that precedes it.
//!
//! Generation runs the blocks against a key/value cache ([`super::cached`]): the token and
//! position embeddings of the new rows, then each block's projections, the cache append (keys
//! and values as they are: GPT has no rotation) and the cache attention.
//!
//! The vocabulary is padded to a multiple of [`super::VOCAB_ALIGN`] in the embedding table and
//! the head (see [`super::padded_vocab`]).
//!
//! With [`Kernels::Unfused`] (`train.fused_kernels=false`) the fused operations run as chains
//! of single-purpose kernels with the same mathematics: the residual adds before the norms,
//! the norms' gradients added into the stream by kernels of their own, the loss as
//! log-softmax, gather and gradient kernels, and attention as batched GEMMs around a causal
//! softmax whose probabilities are kept for the backward.

use super::adapters::Projections;
use super::cached::CachedStack;
use super::family::{Family, Features};
use super::lm::{self, Lm};
use super::prenorm::PreNormBlock;
use super::{DecodeRows, Decoder, KvCache, Model, Recompute, StepPrecision};
use crate::config::{ConfigError, FamilySettings, ModelConfig};

use crate::engine::cpu::kv_cache::CacheShape;
use crate::engine::cpu::rope::RopeShape;
use crate::engine::{DType, MemoryPool, Result, Tensor, ops};
use crate::nn::attention::CausalSelfAttention;
use crate::nn::embedding::Embedding;
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::mlp::Mlp;
use crate::nn::{ActLayout, Cost, Kernels, ParamBuilder, params};
use std::sync::Arc;

/// `model.kind = "gpt"` in the family registry.
pub static FAMILY: Family = Family {
    kind: "gpt",
    name: "GPT",
    defaults: || FamilySettings::Gpt,
    build: |m, vocab, b| Ok(Box::new(Gpt::build(b, GptConfig::from_model(m, vocab))?)),
    validate: check_heads,
    describe: |m| {
        format!(
            "d_model {}, {} layers, {} heads",
            m.d_model, m.n_layers, m.n_heads
        )
    },
    presets: &[],
    tiny: || super::family::tiny_shape(FamilySettings::Gpt),
    features: Features {
        recompute: true,
        unfused_kernels: true,
        analytic_plan: true,
        lora: true,
        kv_cache: true,
        ..Features::NONE
    },
    nf4_weights: Some(super::adapters::is_projection_weight::<GptBlock>),
};

/// Attention splits the width evenly into heads.
pub(crate) fn check_heads(m: &ModelConfig) -> std::result::Result<(), ConfigError> {
    if !m.d_model.is_multiple_of(m.n_heads) {
        return Err(ConfigError::HeadsDoNotDivide {
            d_model: m.d_model,
            n_heads: m.n_heads,
        });
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub context: usize,
    pub tied_head: bool,
}

impl CachedStack for Gpt {
    fn cached_layers(&self) -> usize {
        self.cfg.n_layers
    }

    fn cache_layout(&self, slots: usize, max_len: usize) -> (CacheShape, DType) {
        let shape = CacheShape {
            slots,
            kv_heads: self.cfg.n_heads,
            // The position table ends at the context.
            max_len: max_len.min(self.cfg.context),
            head_dim: self.cfg.d_model / self.cfg.n_heads,
        };
        let wte = &self.lm.embed.wte.value;
        (
            shape,
            ops::activation_dtype(wte.pool().device(), self.lm.embed.wte.weight().dtype()),
        )
    }

    fn head(&self) -> &Tensor {
        self.lm.head_weight()
    }

    fn logit_vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn decode_hidden(&self, cache: &mut KvCache, r: &DecodeRows) -> Result<Tensor> {
        let (rows, c, heads) = (r.tokens.len(), self.cfg.d_model, self.cfg.n_heads);
        let shape = cache.shape;
        let embed = &self.lm.embed;
        let tokens =
            ops::token_embedding_at(r.tokens, 1, rows, embed.wte.weight())?.reshaped(&[rows, c]);
        let positions = ops::gather_rows_at(embed.wpe.weight(), r.pos, None)?;
        let at = ops::CacheRows::new(&tokens, r.slot, r.pos, shape.head_dim)?;
        // Nothing rotates (rot_dim 0), so the append reads no table: a placeholder stands in.
        let no_table = Tensor::uninit(tokens.pool(), &[1], DType::F32)?;
        let rs = RopeShape {
            rows,
            heads,
            kv_heads: heads,
            head_dim: shape.head_dim,
            rot_dim: 0,
        };
        // The embeddings' sum and the first block's norm of it, in one kernel.
        let (mut x, mut ln, _) = self.lm.first_norm().forward_residual(&tokens, &positions)?;
        drop((tokens, positions));
        for (l, block) in self.lm.blocks.iter().enumerate() {
            let (k, v) = &mut cache.layers[l];
            let qkv = block.attn.qkv.forward(&ln)?;
            let q = ops::kv_append_at(&qkv, k, v, &at, &no_table, &no_table, rs, shape)?;
            drop(qkv);
            let att = ops::cache_attention_at(&q, k, v, &at, heads, 0, r.longest, shape)?;
            let o = block.attn.proj.forward(&att)?;
            let (mid, ln2, _) = block.ln2.forward_residual(&x, &o)?;
            let act = block.mlp.activations(&ln2)?;
            let down = block.mlp.output(&act)?;
            let (next, next_ln, _) = self.lm.norm_after(l).forward_residual(&mid, &down)?;
            (x, ln) = (next, next_ln);
        }
        Ok(ln)
    }
}

impl GptConfig {
    /// The shape the `[model]` settings describe, for a `vocab`-token vocabulary.
    pub fn from_model(m: &ModelConfig, vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            context: m.context,
            tied_head: m.tied_head,
        }
    }

    /// Rows of the embedding table and columns of the logits: the vocabulary rounded up to
    /// a multiple of [`super::VOCAB_ALIGN`].
    pub fn padded_vocab(&self) -> usize {
        super::padded_vocab(self.vocab)
    }
}

/// LayerNorm, causal self-attention and a GELU MLP.
pub type GptBlock = PreNormBlock<LayerNorm, CausalSelfAttention, Mlp>;

impl Projections for GptBlock {
    const SCOPE: &'static str = "blocks";
    const NAMES: &'static [&'static str] = &["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"];

    fn linears(&self) -> Vec<&Linear> {
        vec![
            &self.attn.qkv,
            &self.attn.proj,
            &self.mlp.fc,
            &self.mlp.proj,
        ]
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        vec![
            &mut self.attn.qkv,
            &mut self.attn.proj,
            &mut self.mlp.fc,
            &mut self.mlp.proj,
        ]
    }
}

pub struct Gpt {
    pub cfg: GptConfig,
    pub lm: Lm<Embedding, GptBlock>,
}

impl Gpt {
    pub fn new(pool: &Arc<MemoryPool>, cfg: GptConfig, seed: u64) -> Result<Gpt> {
        super::initialised(pool, seed, |b| Gpt::build(b, cfg))
    }

    /// The model with its parameters named and filled by `b` (initialised or loaded).
    pub fn build(b: &mut ParamBuilder, cfg: GptConfig) -> Result<Gpt> {
        let c = cfg.d_model;
        let proj_std = super::residual_init_std(cfg.n_layers);
        let embed = Embedding::new(b, cfg.padded_vocab(), cfg.context, c)?;
        let blocks = (0..cfg.n_layers)
            .map(|l| {
                let mut b = b.scope(format_args!("blocks.{l}"));
                Ok(GptBlock {
                    ln1: LayerNorm::new(&mut b.scope("ln1"), c)?,
                    attn: CausalSelfAttention::new(&mut b.scope("attn"), c, cfg.n_heads, proj_std)?,
                    ln2: LayerNorm::new(&mut b.scope("ln2"), c)?,
                    mlp: Mlp::new(&mut b.scope("mlp"), c, proj_std)?,
                })
            })
            .collect::<Result<Vec<GptBlock>>>()?;
        let mut blocks = blocks;
        for (l, block) in blocks.iter_mut().enumerate() {
            // GPT2LMHeadModel's module names (its Conv1D layers), which adapters are saved
            // under; the fused query/key/value projection is one module there too.
            let hf = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];
            for (lin, m) in block.linears_mut().into_iter().zip(hf) {
                let cols = lin.c_out;
                lin.set_blocks(&[(format!("transformer.h.{l}.{m}"), cols)]);
            }
        }
        let ln_f = LayerNorm::new(&mut b.scope("ln_f"), c)?;
        let head = if cfg.tied_head {
            None
        } else {
            Some(Linear::new(
                &mut b.scope("lm_head"),
                c,
                cfg.padded_vocab(),
                false,
                0.02,
            )?)
        };
        let lm = Lm::new("gpt", embed, blocks, ln_f, head, cfg.vocab, cfg.context);
        Ok(Gpt { cfg, lm })
    }
}

params!(Gpt { lm });

impl Model for Gpt {
    super::adapters::adapters_on_lm!();

    fn lora_fan_in_fan_out(&self) -> bool {
        true
    }

    fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
    ) -> Result<f64> {
        let (loss, _) = self
            .lm
            .forward_backward(inputs, targets, batch, seq, p, &(), None)?;
        Ok(loss)
    }

    fn set_grad_ready(&mut self, hook: Option<super::GradReady>) -> bool {
        self.lm.set_grad_ready(hook);
        true
    }

    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64> {
        self.lm.loss(inputs, targets, batch, seq, &())
    }

    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.lm.next_logits(tokens, &())
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn recompute(&self) -> Recompute {
        self.lm.recompute
    }

    fn set_recompute(&mut self, policy: Recompute) -> std::result::Result<(), String> {
        self.lm.recompute = policy;
        Ok(())
    }

    fn set_kernels(&mut self, kernels: Kernels) -> std::result::Result<(), String> {
        self.lm.kernels = kernels;
        Ok(())
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn decoder(&self) -> Option<&dyn Decoder> {
        Some(self)
    }

    /// Sums the built layers' costs (fp32 on the CPU); [`GptConfig::cost_on`] gives the same
    /// from the shape alone, for any layout, without building the model.
    fn cost(&self, batch: usize, seq: usize) -> Cost {
        let tokens = batch * seq;
        let lm = &self.lm;
        let blocks: Cost = lm
            .blocks
            .iter()
            .map(|b| {
                b.ln1.cost(tokens)
                    + b.attn.cost(batch, seq)
                    + b.ln2.cost(tokens)
                    + b.mlp.cost(tokens)
            })
            .sum();
        let head = lm::head_cost(
            self.cfg.d_model,
            self.cfg.padded_vocab(),
            lm.head.is_none(),
            tokens,
            ActLayout::CPU_F32,
        );
        lm.embed.cost(tokens) + blocks + lm.ln_f.cost(tokens) + head
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
        let head = lm::head_cost(c, self.padded_vocab(), self.tied_head, tokens, layout);
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
    use crate::nn::Params;
    use crate::nn::lora::LoraSpec;

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
            let (x, y) = batch();
            let label = format!("tied={tied}");
            let all = |_: &str, len: usize| len;
            let (rows, samples, abs) = ((2, 6), 5, 2e-3);
            super::super::check_gradient_by_differences(
                &mut tiny(tied),
                (&x, &y),
                rows,
                samples,
                all,
                abs,
                &label,
            );
        }
    }

    /// Adapters on every projection, under GPT-2's module names: the base is frozen (no
    /// gradient buffers, its norms and embeddings included), the adapters' gradients match
    /// central differences of the loss, and merging them gives the adapted model's logits.
    #[test]
    fn adapters_train_over_a_frozen_base_and_merge_into_it() {
        let mut model = tiny(true);
        let spec = LoraSpec::plain(2, &["all-linear"]);
        let adapted = model.attach_lora(&spec, 5).unwrap();
        assert_eq!(adapted.len(), 8, "2 blocks x 4 projections: {adapted:?}");
        for m in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
            assert!(adapted.contains(&format!("transformer.h.1.{m}")), "{m}");
        }
        assert!(model.lora_fan_in_fan_out());
        // B starts at zero, which would leave A's gradient zero too.
        for ad in model.adapters_mut() {
            let v: Vec<f32> = (0..ad.b.value.len())
                .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.05)
                .collect();
            ad.b.value.copy_from_host(&v).unwrap();
        }
        let trainable: Vec<String> = model
            .trainable_params()
            .iter()
            .map(|p| p.name.clone())
            .collect();
        assert_eq!(trainable.len(), 16);
        assert!(
            trainable.iter().all(|n| n.contains(".lora.")),
            "{trainable:?}"
        );
        let (x, y) = batch();
        let all = |_: &str, len: usize| len;
        super::super::check_gradient_by_differences(
            &mut model,
            (&x, &y),
            (2, 6),
            5,
            all,
            2e-3,
            "adapted",
        );
        let adapted_logits = model.next_logits(&x[..5]).unwrap();
        model.merge_lora().unwrap();
        assert!(model.adapters().is_empty());
        let merged = model.next_logits(&x[..5]).unwrap();
        let plain = tiny(true).next_logits(&x[..5]).unwrap();
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max)
        };
        assert!(diff(&adapted_logits, &merged) < 1e-5);
        assert!(diff(&adapted_logits, &plain) > 1e-3, "the adapters matter");
    }

    /// The padded vocabulary rows exist (128 of them for 11 tokens), get exactly zero
    /// gradient, and never reach the caller's logits.
    #[test]
    fn padded_vocabulary_is_inert() {
        let mut model = tiny(true);
        assert_eq!(model.lm.embed.wte.value.shape(), &[128, 8]);
        let (x, y) = batch();
        let p = StepPrecision {
            grad_scale: 1.0,
            grad_dtype: DType::F32,
        };
        model.forward_backward(&x, &y, 2, 6, p).unwrap();
        let g = model.lm.embed.wte.grad.to_vec().unwrap();
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

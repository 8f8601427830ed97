//! A Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM): token embedding, pre-norm
//! blocks of RMSNorm, grouped-query attention with rotary positions and a SwiGLU feed-forward,
//! a final RMSNorm and a language-model head (tied to the embedding or not).
//!
//! The embedding, the stack, the head, the loss, block recomputation and the backward's order
//! are [`super::lm`]'s, as for the GPT: every norm after the first is fused with the residual
//! add before it. This file holds the block, the shape, the projections adapters wrap and the cached
//! decoder.
//!
//! Weights use kiln's names (`layers.N.attn.qkv.weight`, one fused QKV and one fused
//! gate/up matrix per block); `models::import` maps Hugging Face and GGUF checkpoints onto
//! them.

use super::adapters::Projections;
use super::cached::CachedStack;
use super::family::{Family, Features, other_family, tiny_shape};
use super::lm::{self, Keep, Lm, StreamNorm};
use super::prenorm::{Mixer, PreNormBlock};
use super::{DecodeRows, Decoder, KvCache, Model, Recompute, StepPrecision, padded_vocab};
use crate::config::{
    ConfigError, FamilySettings, LlamaSettings, ModelConfig, finite, out_of_range,
};
use crate::engine::cpu::kv_cache::CacheShape;
use crate::engine::cpu::rope::{self, Llama3Scaling, PairFactors};
use crate::engine::{DType, MemoryPool, Result, Tensor, ops};
use crate::nn::gqa::{GqaAttention, GqaSaved, Heads, LongTables, Rotary};
use crate::nn::linear::Linear;
use crate::nn::rmsnorm::RmsNorm;
use crate::nn::swiglu::SwiGlu;
use crate::nn::{ActLayout, Cost, Init, Kernels, Param, ParamBuilder, params};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The shape of a Llama-family model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_hidden: usize,
    pub context: usize,
    pub rope_theta: f32,
    /// Rotated dimensions of each head (`head_dim` unless the model uses partial rotary).
    pub rot_dim: usize,
    pub rope_scaling: Option<Llama3Scaling>,
    /// LongRoPE's per-pair divisors of passes up to `rope_trained_context` positions (its
    /// short factors), or of every pass when `rope_long_factors` is `None`; `None` without
    /// LongRoPE.
    #[serde(default)]
    pub rope_factors: Option<PairFactors>,
    /// LongRoPE's divisors of passes longer than `rope_trained_context` (its long factors),
    /// where the context is longer than that; `None` otherwise.
    #[serde(default)]
    pub rope_long_factors: Option<PairFactors>,
    /// The context LongRoPE's short factors were trained for.
    #[serde(default)]
    pub rope_trained_context: usize,
    /// The rotary cos and sin multiplied by this (LongRoPE's attention factor); 1 for none.
    #[serde(default = "one")]
    pub rope_attention_factor: f32,
    pub norm_eps: f32,
    pub tied_head: bool,
    /// Biases on the query, key and value projections (Qwen2).
    pub qkv_bias: bool,
    /// A per-head RMSNorm (one gain of `head_dim` for all query heads, one for the key
    /// heads) on queries and keys before the rotation (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window attention: a query attends to the `sliding_window` latest positions,
    /// its own included (transformers' `kv_idx > q_idx - sliding_window`); 0 means none.
    #[serde(default)]
    pub sliding_window: usize,
    /// Layers `0..full_attention_layers` attend fully even with a window (Qwen2's
    /// `max_window_layers`).
    #[serde(default)]
    pub full_attention_layers: usize,
}

fn one() -> f32 {
    1.0
}

/// `model.kind = "llama"` in the family registry.
pub static FAMILY: Family = Family {
    kind: "llama",
    name: "Llama",
    defaults: || FamilySettings::Llama(LlamaSettings::default()),
    build: |m, vocab, b| {
        let cfg = LlamaConfig::from_model(m, vocab).ok_or_else(|| other_family("llama", m))?;
        Ok(Box::new(Llama::build(b, cfg)?))
    },
    validate,
    describe: |m| {
        let kv_heads = match m.llama().map_or(0, |l| l.n_kv_heads) {
            0 => m.n_heads,
            k => k,
        };
        format!(
            "d_model {}, {} layers, {} heads / {kv_heads} key-value heads",
            m.d_model, m.n_layers, m.n_heads
        )
    },
    presets: &[],
    tiny: || {
        tiny_shape(FamilySettings::Llama(LlamaSettings {
            n_kv_heads: 1,
            ffn_hidden: 64,
            ..LlamaSettings::default()
        }))
    },
    features: Features {
        recompute: true,
        kv_cache: true,
        lora: true,
        ..Features::NONE
    },
    nf4_weights: Some(super::adapters::is_projection_weight::<LlamaBlock>),
};

/// The rotary, norm, head-sharing and window settings' ranges.
fn validate(m: &ModelConfig) -> std::result::Result<(), ConfigError> {
    let l = m.llama().ok_or_else(|| other_family("llama", m))?;
    finite(&[
        ("model.rope_theta", l.rope_theta),
        ("model.norm_eps", l.norm_eps),
        ("model.rope_scaling_factor", l.rope_scaling_factor),
    ])?;
    check_longrope(m, l)?;
    if !matches!(l.checkpoint_arch.as_str(), "" | "phi3") {
        return Err(out_of_range(
            "model.checkpoint_arch",
            format!("\"{}\"", l.checkpoint_arch),
            "kiln writes \"\" (the layout chosen from the settings) or \"phi3\"",
        ));
    }
    if l.sliding_window > MAX_SLIDING_WINDOW {
        return Err(out_of_range(
            "model.sliding_window",
            l.sliding_window,
            format!(
                "a window is 1 to {MAX_SLIDING_WINDOW} positions (a window at least as long as the sequence is full attention), or 0 for none"
            ),
        ));
    }
    if l.full_attention_layers > 0
        && (l.sliding_window == 0 || l.full_attention_layers > m.n_layers)
    {
        return Err(out_of_range(
            "model.full_attention_layers",
            l.full_attention_layers,
            format!(
                "it counts the first of the {} layers that ignore model.sliding_window, so it needs a window and at most model.n_layers; 0 puts the window on every layer",
                m.n_layers
            ),
        ));
    }
    if let Some(Err(rule)) = LlamaConfig::from_model(m, 1).map(|c| c.check()) {
        return Err(out_of_range("model.n_kv_heads", l.n_kv_heads, rule));
    }
    if !(l.rope_theta > 0.0 && l.norm_eps > 0.0 && l.rope_scaling_factor >= 0.0) {
        return Err(out_of_range(
            "model.rope_theta",
            l.rope_theta,
            "model.rope_theta and model.norm_eps must be positive, model.rope_scaling_factor 0 or more",
        ));
    }
    // A Llama may set its head width; only without one do the heads split the width.
    if l.head_dim == 0 {
        super::gpt::check_heads(m)?;
    }
    Ok(())
}

/// LongRoPE's settings: both factor lists or neither, one positive factor a rotated pair,
/// not beside Llama 3's scaling, and a positive attention factor.
fn check_longrope(m: &ModelConfig, l: &LlamaSettings) -> std::result::Result<(), ConfigError> {
    if !(l.rope_attention_factor.is_finite() && l.rope_attention_factor > 0.0) {
        return Err(out_of_range(
            "model.rope_attention_factor",
            l.rope_attention_factor,
            "it must be a positive number (1 for none)",
        ));
    }
    let (short, long) = (&l.rope_short_factors, &l.rope_long_factors);
    if short.is_empty() && long.is_empty() {
        return Ok(());
    }
    if short.is_empty() || long.is_empty() {
        return Err(out_of_range(
            "model.rope_short_factors",
            format!("{} factors", short.len()),
            "LongRoPE needs both model.rope_short_factors and model.rope_long_factors (or neither)",
        ));
    }
    if l.rope_scaling_factor > 0.0 {
        return Err(out_of_range(
            "model.rope_scaling_factor",
            l.rope_scaling_factor,
            "Llama 3 scaling and LongRoPE factors cannot both stretch the rotary frequencies; set one",
        ));
    }
    let pairs = LlamaConfig::from_model(m, 1).map_or(0, |c| c.rot_dim / 2);
    for (key, list) in [
        ("model.rope_short_factors", short),
        ("model.rope_long_factors", long),
    ] {
        if list.len() != pairs || pairs > rope::MAX_ROPE_PAIRS {
            return Err(out_of_range(
                key,
                format!("{} factors", list.len()),
                format!(
                    "it needs one factor for each of the {pairs} rotated dimension pairs (model.rot_dim / 2, at most {})",
                    rope::MAX_ROPE_PAIRS
                ),
            ));
        }
        if let Some(bad) = list.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            return Err(out_of_range(
                key,
                format!("a factor {bad}"),
                "every factor must be a positive number",
            ));
        }
    }
    Ok(())
}

/// The longest window the settings accept: far past any context a model is trained or run
/// at (a window at least as long as the sequence is full attention), and small enough for
/// the kernels' 32-bit positions.
pub const MAX_SLIDING_WINDOW: usize = 1 << 24;

impl LlamaConfig {
    /// The shape the `[model]` settings describe, for a `vocab`-token vocabulary; zeros take
    /// their documented defaults.
    /// `None` for another family's settings.
    pub fn from_model(m: &ModelConfig, vocab: usize) -> Option<LlamaConfig> {
        let l = m.llama()?;
        let head_dim = if l.head_dim > 0 {
            l.head_dim
        } else {
            m.d_model / m.n_heads.max(1)
        };
        let rope_scaling = (l.rope_scaling_factor > 0.0).then_some(Llama3Scaling {
            factor: l.rope_scaling_factor as f32,
            low_freq_factor: l.rope_low_freq_factor as f32,
            high_freq_factor: l.rope_high_freq_factor as f32,
            original_context: l.rope_original_context,
        });
        let rot_dim = if l.rot_dim > 0 { l.rot_dim } else { head_dim };
        // LongRoPE picks its factors for each pass, as transformers does for each forward
        // call: the short ones while the pass's longest sequence fits the trained context,
        // the long ones past it (so only a longer context needs them). Lists of the wrong
        // length (which `validate` refuses) are left out here.
        let pair_factors = |factors: &[f64]| {
            (!factors.is_empty() && factors.len() == rot_dim / 2)
                .then(|| factors.iter().map(|&f| f as f32).collect::<Vec<f32>>())
                .and_then(|f| PairFactors::new(&f))
        };
        let rope_factors = pair_factors(&l.rope_short_factors);
        let rope_long_factors = match m.context > l.rope_original_context {
            true => pair_factors(&l.rope_long_factors).filter(|_| rope_factors.is_some()),
            false => None,
        };
        Some(LlamaConfig {
            vocab,
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            n_kv_heads: if l.n_kv_heads > 0 {
                l.n_kv_heads
            } else {
                m.n_heads
            },
            head_dim,
            ffn_hidden: if l.ffn_hidden > 0 {
                l.ffn_hidden
            } else {
                (8 * m.d_model / 3).next_multiple_of(64)
            },
            context: m.context,
            rope_theta: l.rope_theta as f32,
            rot_dim,
            rope_scaling,
            rope_factors,
            rope_long_factors,
            rope_trained_context: l.rope_original_context,
            rope_attention_factor: l.rope_attention_factor as f32,
            norm_eps: l.norm_eps as f32,
            tied_head: m.tied_head,
            qkv_bias: l.qkv_bias,
            qk_norm: l.qk_norm,
            sliding_window: l.sliding_window,
            full_attention_layers: l.full_attention_layers,
        })
    }

    /// The attention window of layer `layer`: 0 (full causal attention) for the first
    /// `full_attention_layers` layers and when the model has no window.
    pub fn window_of(&self, layer: usize) -> usize {
        if layer < self.full_attention_layers {
            0
        } else {
            self.sliding_window
        }
    }

    pub fn heads(&self) -> Heads {
        Heads {
            heads: self.n_heads,
            kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            rot_dim: self.rot_dim,
        }
    }

    /// Why this shape cannot be built, if it cannot.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} attention heads cannot share {} key/value heads evenly; choose model.n_kv_heads dividing model.n_heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.rot_dim.is_multiple_of(2) || self.rot_dim > self.head_dim {
            return Err(format!(
                "rotary dimensions {} must be even and at most the head size {}",
                self.rot_dim, self.head_dim
            ));
        }
        Ok(())
    }

    /// Qwen3's per-head norms: two gains of `head_dim`, the heads before the norms and their
    /// `rstd` saved for the backward.
    fn qk_norm_cost(&self, tokens: usize, layout: ActLayout) -> Cost {
        if !self.qk_norm {
            return Cost::default();
        }
        let heads = self.n_heads + self.n_kv_heads;
        Cost {
            params: 2 * self.head_dim,
            flops_forward: 0,
            flops_backward: 0,
            saved_bytes: layout.act_bytes(tokens * heads * self.head_dim)
                + crate::nn::f32_bytes(tokens * heads),
        }
    }

    /// The parts of the model for a per-layer table: the embedding, each block's layers
    /// (named, the first the norm that opens a block; the attention of a windowed model is
    /// the layer with the window, full layers noted in its name), the final norm and the head.
    pub fn layer_costs(
        &self,
        batch: usize,
        seq: usize,
        layout: ActLayout,
    ) -> (Cost, Vec<(String, Cost)>, Cost, Cost) {
        let tokens = batch * seq;
        let c = self.d_model;
        let norm = RmsNorm::cost_of(c, tokens, layout);
        let window = self.window_of(self.n_layers.saturating_sub(1));
        let attention =
            GqaAttention::cost_of(c, self.heads(), self.qkv_bias, batch, seq, window, layout)
                + self.qk_norm_cost(tokens, layout);
        let attn_name = match (window, self.full_attention_layers) {
            (0, _) => "block.attn".to_string(),
            (w, 0) => format!("block.attn (window {w})"),
            (w, full) => format!("block.attn (window {w}; the first {full} attend fully)"),
        };
        let vocab = padded_vocab(self.vocab);
        (
            Cost {
                params: vocab * c,
                ..Cost::default()
            },
            vec![
                ("block.ln1".into(), norm),
                (attn_name, attention),
                ("block.ln2".into(), norm),
                (
                    "block.mlp (SwiGLU)".into(),
                    SwiGlu::cost_of(c, self.ffn_hidden, tokens, layout),
                ),
            ],
            norm,
            lm::head_cost(c, vocab, self.tied_head, tokens, layout),
        )
    }

    /// The cost of one micro-batch from the layers' own costs, activations laid out as
    /// `layout` keeps them.
    pub fn cost_on(&self, batch: usize, seq: usize, layout: ActLayout) -> Cost {
        let tokens = batch * seq;
        let c = self.d_model;
        let block = |layer: usize| {
            let window = self.window_of(layer);
            RmsNorm::cost_of(c, tokens, layout)
                + GqaAttention::cost_of(c, self.heads(), self.qkv_bias, batch, seq, window, layout)
                + RmsNorm::cost_of(c, tokens, layout)
                + SwiGlu::cost_of(c, self.ffn_hidden, tokens, layout)
                + self.qk_norm_cost(tokens, layout)
        };
        let blocks: Cost = (0..self.n_layers).map(block).sum();
        let vocab = padded_vocab(self.vocab);
        let head = lm::head_cost(c, vocab, self.tied_head, tokens, layout);
        let embed = Cost {
            params: vocab * c,
            ..Cost::default()
        };
        embed + blocks + RmsNorm::cost_of(c, tokens, layout) + head
    }
}

/// RMSNorm, grouped-query attention with rotary positions and a SwiGLU feed-forward.
pub type LlamaBlock = PreNormBlock<RmsNorm, GqaAttention, SwiGlu>;

pub struct Llama {
    pub cfg: LlamaConfig,
    /// The embedding is the `[padded vocab, C]` token table alone, also the head's weight
    /// when the head is tied.
    pub lm: Lm<Param, LlamaBlock>,
    rotary: Rotary,
    /// Whether every block's norm gains are folded into its projections
    /// ([`Llama::fold_norm_gains`]), which the cached decoder then uses.
    folded: bool,
}

/// Each row's position and the rotary tables, for every block of a pass.
pub struct RotaryPass<'p> {
    pos: Vec<u32>,
    rotary: &'p Rotary,
}

/// The rotary tables (`cos`, `sin`, `[positions, rot/2]` row-major) of positions
/// `0..positions` for `cfg`'s frequencies, divided pair by pair by `factors` (LongRoPE) where
/// given.
fn rotary_values(
    cfg: &LlamaConfig,
    factors: Option<&PairFactors>,
    positions: usize,
) -> (Vec<f32>, Vec<f32>) {
    let inv = match factors {
        Some(f) => rope::factored_inverse_frequencies(cfg.rope_theta, cfg.rot_dim, f.as_slice()),
        None => rope::inverse_frequencies(cfg.rope_theta, cfg.rot_dim, cfg.rope_scaling),
    };
    let (mut cos, mut sin) = rope::rope_tables(&inv, positions);
    if cfg.rope_attention_factor != 1.0 {
        // transformers scales the f32 tables, so the rotation is no longer orthogonal and
        // its backward (the tables' transpose) carries the same factor.
        let a = cfg.rope_attention_factor;
        cos.iter_mut().chain(sin.iter_mut()).for_each(|v| *v *= a);
    }
    (cos, sin)
}

/// [`rotary_values`] on `pool`'s device.
fn rotary_tables(
    pool: &Arc<MemoryPool>,
    cfg: &LlamaConfig,
    (cos, sin): (Vec<f32>, Vec<f32>),
) -> Result<Rotary> {
    let half = cfg.rot_dim / 2;
    let positions = cos.len() / half.max(1);
    Ok(Rotary::new(
        Tensor::from_vec(pool, &[positions, half], DType::F32, cos)?,
        Tensor::from_vec(pool, &[positions, half], DType::F32, sin)?,
    ))
}

/// Every rotary table `cfg` asks for: with LongRoPE's long factors, the short factors' tables
/// for the trained context, the long factors' for the whole context, and a decode step's
/// (short below the trained context, long from it on: see [`LongTables::stepwise`]).
fn rotary(pool: &Arc<MemoryPool>, cfg: &LlamaConfig) -> Result<Rotary> {
    let Some(long_factors) = &cfg.rope_long_factors else {
        return rotary_tables(
            pool,
            cfg,
            rotary_values(cfg, cfg.rope_factors.as_ref(), cfg.context),
        );
    };
    // The short factors' tables need only the positions of a pass that fits that context.
    let trained = cfg.rope_trained_context.min(cfg.context);
    let short = rotary_values(cfg, cfg.rope_factors.as_ref(), trained);
    let long = rotary_values(cfg, Some(long_factors), cfg.context);
    let split = trained * (cfg.rot_dim / 2);
    let stepwise = |s: &[f32], l: &[f32]| [&s[..split], &l[split..]].concat();
    let step = (stepwise(&short.0, &long.0), stepwise(&short.1, &long.1));
    let mut tables = rotary_tables(pool, cfg, short)?;
    tables.long = Some(Box::new(LongTables {
        trained,
        long: rotary_tables(pool, cfg, long)?,
        stepwise: rotary_tables(pool, cfg, step)?,
    }));
    Ok(tables)
}

impl Projections for LlamaBlock {
    const SCOPE: &'static str = "layers";
    const NAMES: &'static [&'static str] = &["attn.qkv", "attn.out", "mlp.gate_up", "mlp.down"];

    fn linears(&self) -> Vec<&Linear> {
        vec![
            &self.attn.qkv,
            &self.attn.out,
            &self.mlp.gate_up,
            &self.mlp.down,
        ]
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        vec![
            &mut self.attn.qkv,
            &mut self.attn.out,
            &mut self.mlp.gate_up,
            &mut self.mlp.down,
        ]
    }
}

/// Grouped-query attention takes each row's position and the rotary tables from the pass.
impl Mixer for GqaAttention {
    type Saved = GqaSaved;
    type Pass<'p> = RotaryPass<'p>;

    fn fold_width(&self) -> usize {
        self.qkv.fold_width()
    }

    fn fold_inputs(&self, x: &mut Tensor) -> Result<()> {
        self.qkv.fold_inputs(x)
    }

    fn mix(
        &self,
        x: &Tensor,
        _kernels: Kernels,
        pass: &RotaryPass<'_>,
    ) -> Result<(Tensor, GqaSaved)> {
        self.forward(x, &pass.pos, pass.rotary)
    }

    fn mix_backward(
        &mut self,
        dout: &Tensor,
        x: &Tensor,
        pass: &RotaryPass<'_>,
        saved: &GqaSaved,
    ) -> Result<Tensor> {
        self.backward(dout, x, &pass.pos, pass.rotary, saved)
    }
}

fn positions(batch: usize, seq: usize) -> Vec<u32> {
    (0..batch * seq).map(|i| (i % seq) as u32).collect()
}

impl Llama {
    pub fn new(pool: &Arc<MemoryPool>, cfg: LlamaConfig, seed: u64) -> Result<Llama> {
        super::initialised(pool, seed, |b| Llama::build(b, cfg))
    }

    /// The model with its parameters named and filled by `b` (initialised or loaded).
    pub fn build(b: &mut ParamBuilder, cfg: LlamaConfig) -> Result<Llama> {
        cfg.check()
            .map_err(|detail| crate::engine::EngineError::Shape {
                op: "llama",
                detail,
            })?;
        let pool = b.pool();
        let c = cfg.d_model;
        let out_std = super::residual_init_std(cfg.n_layers);
        let vocab = padded_vocab(cfg.vocab);
        // Its gradient is written through Param's accessors only (the embedding's backward and
        // the tied head's product).
        let embed = b
            .scope("embed")
            .param("weight", &[vocab, c], Init::Normal(0.02))?
            .with_lazy_grad();
        let blocks = (0..cfg.n_layers)
            .map(|l| {
                let mut b = b.scope(format_args!("layers.{l}"));
                Ok(LlamaBlock {
                    ln1: RmsNorm::new(&mut b.scope("ln1"), c, cfg.norm_eps)?,
                    attn: GqaAttention::new(
                        &mut b.scope("attn"),
                        c,
                        cfg.heads(),
                        cfg.qkv_bias,
                        cfg.qk_norm.then_some(cfg.norm_eps),
                        out_std,
                    )?
                    .with_window(cfg.window_of(l)),
                    ln2: RmsNorm::new(&mut b.scope("ln2"), c, cfg.norm_eps)?,
                    mlp: SwiGlu::new(&mut b.scope("mlp"), c, cfg.ffn_hidden, out_std)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut blocks = blocks;
        let (h, k, d, f) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden);
        for (l, b) in blocks.iter_mut().enumerate() {
            // The module names of a Hugging Face checkpoint, which adapters are saved under.
            let named = |m: &str, cols: usize| (format!("model.layers.{l}.{m}"), cols);
            b.attn.qkv.set_blocks(&[
                named("self_attn.q_proj", h * d),
                named("self_attn.k_proj", k * d),
                named("self_attn.v_proj", k * d),
            ]);
            b.attn.out.set_blocks(&[named("self_attn.o_proj", c)]);
            b.mlp
                .gate_up
                .set_blocks(&[named("mlp.gate_proj", f), named("mlp.up_proj", f)]);
            b.mlp.down.set_blocks(&[named("mlp.down_proj", c)]);
        }
        let ln_f = RmsNorm::new(&mut b.scope("ln_f"), c, cfg.norm_eps)?;
        let head = if cfg.tied_head {
            None
        } else {
            Some(Linear::new(&mut b.scope("lm_head"), c, vocab, false, 0.02)?)
        };
        let rotary = rotary(pool, &cfg)?;
        let lm = Lm::new("llama", embed, blocks, ln_f, head, cfg.vocab, cfg.context);
        Ok(Llama {
            cfg,
            lm,
            rotary,
            folded: false,
        })
    }

    /// What every block of a `[batch, seq]` pass of whole sequences needs.
    fn pass(&self, batch: usize, seq: usize) -> RotaryPass<'_> {
        RotaryPass {
            pos: positions(batch, seq),
            rotary: self.rotary.for_positions(seq),
        }
    }

    /// Forward and backward with every token's loss weighted by `grad_scale`, times
    /// `token_weights[t]` when given.
    fn forward_backward_scaled(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
        token_weights: Option<&[f32]>,
    ) -> Result<f64> {
        // The fields apart: the pass borrows the tables while the stack is borrowed to train.
        let pass = RotaryPass {
            pos: positions(batch, seq),
            rotary: self.rotary.for_positions(seq),
        };
        let (loss, _) =
            self.lm
                .forward_backward(inputs, targets, batch, seq, p, &pass, token_weights)?;
        Ok(loss)
    }

    /// The final hidden states `[batch, seq, C]` (after the last norm, before the head), for
    /// using the decoder as a text encoder.
    pub fn final_hidden_states(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Tensor> {
        let pass = self.pass(batch, seq);
        Ok(self
            .lm
            .forward(tokens, batch, seq, Keep::Output, &pass)?
            .normed)
    }
}

params!(Llama { lm });

impl Model for Llama {
    super::adapters::adapters_on_lm!();

    fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
    ) -> Result<f64> {
        self.forward_backward_scaled(inputs, targets, batch, seq, p, None)
    }

    fn forward_backward_weighted(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
        row_weights: &[f32],
    ) -> Result<f64> {
        super::check_row_weights(batch, row_weights)?;
        let per_token: Vec<f32> = row_weights
            .iter()
            .flat_map(|&w| std::iter::repeat_n(w, seq))
            .collect();
        self.forward_backward_scaled(inputs, targets, batch, seq, p, Some(&per_token))
    }

    fn set_grad_ready(&mut self, hook: Option<super::GradReady>) -> bool {
        self.lm.set_grad_ready(hook);
        true
    }

    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64> {
        self.lm
            .loss(inputs, targets, batch, seq, &self.pass(batch, seq))
    }

    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let pass = self.pass(1, tokens.len());
        let acts = self
            .lm
            .forward(tokens, 1, tokens.len(), Keep::Output, &pass)?;
        // Only the last position's logits are needed: project that row alone.
        let c = self.cfg.d_model;
        let last = acts.normed.to_vec()?;
        let row = Tensor::from_vec(
            acts.normed.pool(),
            &[1, c],
            acts.normed.dtype(),
            last[(tokens.len() - 1) * c..].to_vec(),
        )?;
        let logits = ops::linear_forward(&row, self.lm.head_weight(), None)?.to_vec()?;
        Ok(logits[..self.cfg.vocab].to_vec())
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn cost(&self, batch: usize, seq: usize) -> Cost {
        self.cfg.cost_on(batch, seq, ActLayout::CPU_F32)
    }

    fn recompute(&self) -> Recompute {
        self.lm.recompute
    }

    fn set_recompute(&mut self, policy: Recompute) -> std::result::Result<(), String> {
        self.lm.recompute = policy;
        Ok(())
    }

    fn decoder(&self) -> Option<&dyn Decoder> {
        Some(self)
    }

    fn fold_norm_gains(&mut self) -> Result<bool> {
        Llama::fold_norm_gains(self)
    }
}

impl CachedStack for Llama {
    fn cached_layers(&self) -> usize {
        self.cfg.n_layers
    }

    fn cache_layout(&self, slots: usize, max_len: usize) -> (CacheShape, DType) {
        let shape = CacheShape {
            slots,
            kv_heads: self.cfg.n_kv_heads,
            max_len: max_len.min(self.cfg.context),
            head_dim: self.cfg.head_dim,
        };
        let pool = self.lm.embed.value.pool();
        (
            shape,
            ops::activation_dtype(pool.device(), self.lm.embed.weight().dtype()),
        )
    }

    fn head(&self) -> &Tensor {
        self.lm.head_weight()
    }

    fn logit_vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn decode_hidden(&self, cache: &mut KvCache, rows: &DecodeRows) -> Result<Tensor> {
        Llama::decode_hidden(self, cache, rows)
    }

    fn prefill_variant(&self, positions: usize) -> usize {
        usize::from(self.rotary.takes_long(positions))
    }

    fn restart_position(&self) -> Option<usize> {
        self.rotary.long.as_ref().map(|l| l.trained)
    }
}

/// `w[o, i] *= gain[i]` for a `[out, in]` weight: what a norm's gain contributes to the
/// projection reading the norm, moved into the projection. `gain` becomes ones. Each tensor is
/// released before its replacement is booked, the same on a meta device (which has no values
/// to fold), so `kiln plan --generate` books what a real load does.
fn fold_gain(gain: &mut Param, linear: &mut Linear) -> Result<()> {
    let (c, pool) = (linear.c_in, gain.value.pool().clone());
    let meta = gain.value.is_meta();
    let (mut w, g) = match meta {
        true => (Vec::new(), Vec::new()),
        false => (linear.weight.value.to_vec()?, gain.value.to_vec()?),
    };
    for row in w.chunks_mut(c) {
        row.iter_mut().zip(&g).for_each(|(v, g)| *v *= g);
    }
    let replace = |p: &mut Param, shape: &[usize], values: Vec<f32>| -> Result<()> {
        let dtype = p.value.dtype();
        p.value = Tensor::zeros(&pool, &[0], DType::F32)?;
        p.value = match meta {
            true => Tensor::zeros(&pool, shape, dtype)?,
            false => Tensor::from_vec(&pool, shape, dtype, values)?,
        };
        match meta {
            true => Ok(()),
            false => p.refresh_compute(),
        }
    };
    replace(&mut linear.weight, &[linear.c_out, c], w)?;
    replace(gain, &[c], vec![1.0; c])
}

impl Llama {
    /// Folds each block's two RMSNorm gains into the projections that read the norms (the
    /// first into query/key/value, the second into gate/up): `rmsnorm(x) * g` through `W` is
    /// `rmsnorm(x)` through `W diag(g)`. The model computes the same function (rounded
    /// differently), and the cached decoder then projects the unnormalised residual stream and
    /// applies each row's norm factor in the kernel after the projection (the cache append,
    /// SwiGLU), adding the attention and feed-forward outputs into the stream as their
    /// products' accumulate input: a decode step's layer is seven launches instead of nine.
    /// Qwen2's query/key/value biases are added by the append after the row factor. Only where
    /// the projections are otherwise plain matrices: per-head norms (Qwen3) come after the
    /// projection and would not commute with the row factor, and adapters or a 4-bit weight are
    /// not folded into.
    pub fn fold_norm_gains(&mut self) -> Result<bool> {
        let plain = |l: &Linear| l.bias.is_none() && l.nf4.is_none() && l.adapters.is_empty();
        let foldable = !self.cfg.qk_norm
            && self.lm.blocks.iter().all(|b| {
                let qkv = &b.attn.qkv;
                qkv.nf4.is_none()
                    && qkv.adapters.is_empty()
                    && [&b.attn.out, &b.mlp.gate_up, &b.mlp.down]
                        .into_iter()
                        .all(plain)
            });
        if self.folded || !foldable {
            return Ok(self.folded);
        }
        for b in &mut self.lm.blocks {
            fold_gain(&mut b.ln1.gamma, &mut b.attn.qkv)?;
            fold_gain(&mut b.ln2.gamma, &mut b.mlp.gate_up)?;
        }
        self.folded = true;
        Ok(true)
    }

    /// The rotary tables of a decode call: a step's (every row its own sequence's only new
    /// token) or, for a prefill, those of its longest prompt.
    fn decode_rotary(&self, r: &DecodeRows) -> &Rotary {
        if r.distinct_slots {
            self.rotary.for_step()
        } else {
            self.rotary.for_positions(r.positions)
        }
    }

    /// The rotary shape of a decode call's `rows` rows.
    fn decode_rope_shape(&self, rows: usize) -> crate::engine::cpu::rope::RopeShape {
        crate::engine::cpu::rope::RopeShape {
            rows,
            heads: self.cfg.n_heads,
            kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            rot_dim: self.cfg.rot_dim,
        }
    }

    /// The rows run through every block against the cache, after the final norm.
    fn decode_hidden(&self, cache: &mut KvCache, r: &DecodeRows) -> Result<Tensor> {
        if self.folded {
            return self.decode_hidden_folded(cache, r);
        }
        let rows = r.tokens.len();
        let rs = self.decode_rope_shape(rows);
        let c = cache.shape;
        let mut x = ops::token_embedding_at(r.tokens, 1, rows, self.lm.embed.weight())?
            .reshaped(&[rows, self.cfg.d_model]);
        let at = ops::CacheRows::new(&x, r.slot, r.pos, c.head_dim)?;
        let rotary = self.decode_rotary(r);
        let (mut ln, _) = self.lm.first_norm().normalize(&x)?;
        for (l, block) in self.lm.blocks.iter().enumerate() {
            let (k, v) = &mut cache.layers[l];
            let (qkv, _) = block.attn.project(&ln)?;
            let q = ops::kv_append_at(&qkv, k, v, &at, &rotary.cos, &rotary.sin, rs, c)?;
            drop(qkv);
            let att = ops::cache_attention_at(
                &q,
                k,
                v,
                &at,
                self.cfg.n_heads,
                block.attn.window,
                r.longest,
                c,
            )?;
            let o = block.attn.out.forward(&att)?;
            let (mid, ln2, _) = block.ln2.forward_residual(&x, &o)?;
            let act = block.mlp.activations(&ln2)?;
            let down = block.mlp.output(&act)?;
            let (next, next_ln, _) = self.lm.norm_after(l).forward_residual(&mid, &down)?;
            (x, ln) = (next, next_ln);
        }
        Ok(ln)
    }

    /// [`Self::decode_hidden`] with the norm gains folded ([`Self::fold_norm_gains`]): the
    /// stream `x` is projected unnormalised, the append and SwiGLU apply each row's norm
    /// factor, and the attention and feed-forward outputs are added into `x` by their
    /// products.
    fn decode_hidden_folded(&self, cache: &mut KvCache, r: &DecodeRows) -> Result<Tensor> {
        let rows = r.tokens.len();
        let rs = self.decode_rope_shape(rows);
        let c = cache.shape;
        let mut x = ops::token_embedding_at(r.tokens, 1, rows, self.lm.embed.weight())?
            .reshaped(&[rows, self.cfg.d_model]);
        let at = ops::CacheRows::new(&x, r.slot, r.pos, c.head_dim)?;
        let rotary = self.decode_rotary(r);
        // The layers' outputs live through the loop, so that a step's kernels follow one
        // another with no allocation between them (which lets them overlap on a GPU that can:
        // see engine/cuda/overlap.rs).
        let dtype = ops::activation_dtype(x.device(), x.dtype());
        let buffer = |width: usize| Tensor::uninit(x.pool(), &[rows, width], dtype);
        let mut qkv = buffer(rs.qkv_width())?;
        let mut att = buffer(rs.heads * rs.head_dim)?;
        let mut act = buffer(self.cfg.ffn_hidden)?;
        for (l, block) in self.lm.blocks.iter().enumerate() {
            let (k, v) = &mut cache.layers[l];
            ops::linear_forward_into(&mut qkv, &x, block.attn.qkv.weight.weight(), None)?;
            // The bias, if any, is the append's to add after the row factor.
            let bias = block.attn.qkv.bias.as_ref().map(Param::weight);
            let (cos, sin) = (&rotary.cos, &rotary.sin);
            let eps = block.ln1.eps;
            let (window, longest) = (block.attn.window, r.longest);
            if r.distinct_slots {
                ops::cache_attention_append_into(
                    &mut att,
                    &qkv,
                    &x,
                    eps,
                    bias,
                    (k, v),
                    &at,
                    cos,
                    sin,
                    rs,
                    window,
                    longest,
                    c,
                )?;
            } else {
                att = ops::cache_attention_append_at(
                    &qkv, &x, eps, bias, k, v, &at, cos, sin, rs, window, longest, false, c,
                )?;
            }
            block.attn.out.forward_add(&att, &mut x)?;
            let gate_up = block.mlp.gate_up.weight.weight();
            ops::linear_swiglu_normed_into(&mut act, &x, gate_up, block.ln2.eps)?;
            block.mlp.down.forward_add(&act, &mut x)?;
        }
        drop((qkv, att, act));
        Ok(self.lm.ln_f.forward(&x)?.0)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::Device;
    use crate::nn::Params;

    /// A two-layer model of 16 wide on the CPU (seed 3); `tied` also picks Qwen3's q/k
    /// norms, untied Qwen2's QKV biases. The parameter-order record uses it too.
    pub(crate) fn tiny(tied: bool, kv_heads: usize) -> Llama {
        tiny_windowed(tied, kv_heads, 0, 0)
    }

    /// [`tiny`] attending within `window` positions from layer `full_layers` on.
    fn tiny_windowed(tied: bool, kv_heads: usize, window: usize, full_layers: usize) -> Llama {
        tiny_wide(tied, kv_heads, window, full_layers, 16)
    }

    /// [`tiny_windowed`] with a residual stream `d_model` wide.
    fn tiny_wide(
        tied: bool,
        kv_heads: usize,
        window: usize,
        full_layers: usize,
        d_model: usize,
    ) -> Llama {
        let cfg = LlamaConfig {
            vocab: 13,
            d_model,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: kv_heads,
            head_dim: 4,
            ffn_hidden: 24,
            context: 8,
            rope_theta: 100.0,
            rot_dim: 4,
            rope_scaling: None,
            rope_factors: None,
            rope_long_factors: None,
            rope_trained_context: 0,
            rope_attention_factor: 1.0,
            norm_eps: 1e-5,
            tied_head: tied,
            qkv_bias: !tied,
            qk_norm: tied,
            sliding_window: window,
            full_attention_layers: full_layers,
        };
        Llama::new(&MemoryPool::new(Device::Cpu), cfg, 3).unwrap()
    }

    fn batch() -> (Vec<u32>, Vec<u32>) {
        let x = (0..14).map(|i| (i * 5 + 1) % 13).collect();
        let y = (0..14).map(|i| (i * 3 + 2) % 13).collect();
        (x, y)
    }

    /// The whole model's gradient against central differences of its loss, for tied and
    /// untied heads, plain and grouped key/value heads, with QKV biases, and within a
    /// sliding window of 3 positions (on both layers, and on the second only).
    #[test]
    fn model_gradient_matches_finite_differences() {
        for (tied, kv, window, full) in [
            (true, 2, 0, 0),
            (false, 4, 0, 0),
            (false, 1, 0, 0),
            (false, 2, 3, 0),
            (true, 2, 3, 1),
        ] {
            let mut model = tiny_windowed(tied, kv, window, full);
            for p in model.params_mut() {
                // Random gains and biases, so their gradients are not at a symmetric point.
                if p.value.shape().len() == 1 {
                    let n = p.value.len();
                    let v: Vec<f32> = (0..n)
                        .map(|i| 1.0 + 0.3 * ((i * 7 % 5) as f32 - 2.0) / 2.0)
                        .collect();
                    p.value.copy_from_host(&v).unwrap();
                }
            }
            let (x, y) = batch();
            let label = format!("tied={tied} kv={kv} window={window}/{full}");
            // Only the real vocabulary rows of the embedding move the loss.
            let live = |name: &str, len: usize| if name == "embed.weight" { 13 * 16 } else { len };
            let (rows, samples, abs) = ((2, 7), 6, 3e-3);
            super::super::check_gradient_by_differences(
                &mut model,
                (&x, &y),
                rows,
                samples,
                live,
                abs,
                &label,
            );
        }
    }

    /// The batched weighted pass (row weights scaling the head's input and its gradient)
    /// against one pass per row with the weight in the gradient scale, for tied and untied
    /// heads, weights of both signs and a zero.
    #[test]
    fn weighted_rows_match_one_pass_per_row() {
        for tied in [true, false] {
            let (x, y) = batch();
            let weights = [0.7f32, -1.3];
            let p = StepPrecision {
                grad_scale: 0.5,
                grad_dtype: DType::F32,
            };
            let grads = |m: &Llama| -> Vec<Vec<f32>> {
                m.params()
                    .iter()
                    .map(|p| p.grad.to_vec().unwrap())
                    .collect()
            };
            let mut batched = tiny(tied, 2);
            let loss = batched
                .forward_backward_weighted(&x, &y, 2, 7, p, &weights)
                .unwrap();
            let mut rows = tiny(tied, 2);
            let mut want_loss = 0.0;
            for (r, &w) in weights.iter().enumerate() {
                let one = StepPrecision {
                    grad_scale: p.grad_scale * w,
                    ..p
                };
                want_loss += rows
                    .forward_backward(&x[r * 7..(r + 1) * 7], &y[r * 7..(r + 1) * 7], 1, 7, one)
                    .unwrap();
            }
            assert!((loss - want_loss).abs() < 1e-4 * want_loss.abs());
            let (got, want) = (grads(&batched), grads(&rows));
            let scale = want.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-3, "the gradient is not trivially zero");
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-5 * scale, "tied={tied}: {g} vs {w}");
            }
            // A zero weight removes a row's gradient entirely.
            let mut zero = tiny(tied, 2);
            zero.forward_backward_weighted(&x, &y, 2, 7, p, &[0.0, 0.0])
                .unwrap();
            assert!(grads(&zero).iter().flatten().all(|&v| v == 0.0));
            assert!(
                zero.forward_backward_weighted(&x, &y, 2, 7, p, &[1.0])
                    .is_err()
            );
        }
    }

    /// LoRA on every projection (rank 8), trained through a pass with the adapters folded
    /// into their frozen products (query/key/value and gate/up, fed by RMSNorms: with Qwen3's
    /// q/k norms, and with Qwen2's QKV biases, which keep that product apart) gives the loss
    /// and adapter gradients of the adapters run apart, and recomputing blocks changes no bit.
    /// The stream is 40 wide: 40 + 24 (three rank-8 adapters) stays within 64.
    #[test]
    fn folded_adapters_train_as_adapters_apart() {
        use crate::nn::lora::{self, LoraSpec};
        for tied in [true, false] {
            let run = |fold: bool, recompute: Recompute| {
                let mut model = tiny_wide(tied, 2, 0, 0, 40);
                model
                    .lm
                    .attach_lora(&LoraSpec::plain(8, &["all-linear"]), 5)
                    .unwrap();
                for (i, p) in model.params_mut().into_iter().enumerate() {
                    if p.name.ends_with(".B") {
                        let v: Vec<f32> = (0..p.value.len())
                            .map(|j| ((i * 31 + j * 7) % 11) as f32 / 11.0 - 0.45)
                            .collect();
                        p.value.copy_from_host(&v).unwrap();
                        p.refresh_compute().unwrap();
                    }
                }
                model.set_recompute(recompute).unwrap();
                lora::keep_apart_on_this_thread(!fold);
                let (x, y) = batch();
                let p = StepPrecision {
                    grad_scale: 0.5,
                    grad_dtype: DType::F32,
                };
                let loss = {
                    let _pass = lora::dropout_scope(9);
                    assert_eq!(model.lm.blocks[0].mlp.gate_up.fold_width() > 0, fold);
                    model.forward_backward(&x, &y, 2, 7, p).unwrap()
                };
                lora::keep_apart_on_this_thread(false);
                let grads: Vec<Vec<f32>> = model
                    .params()
                    .iter()
                    .filter(|p| !p.frozen)
                    .map(|p| p.grad.to_vec().unwrap())
                    .collect();
                (loss, grads)
            };
            let (want_loss, want) = run(false, Recompute::None);
            let (loss, got) = run(true, Recompute::None);
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
                "{loss} vs {want_loss}"
            );
            let scale = want.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-3, "the adapters' gradient is not trivially zero");
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
                assert!((g - w).abs() < 1e-5 * scale, "tied={tied}: {g} vs {w}");
            }
            let (rloss, rgot) = run(true, Recompute::Blocks);
            assert_eq!(rloss.to_bits(), loss.to_bits());
            assert_eq!(rgot, got, "recomputed blocks");
        }
    }

    #[test]
    fn recomputing_blocks_gives_bit_identical_gradients() {
        let run = |policy: Recompute| {
            let mut model = tiny(false, 2);
            model.set_recompute(policy).unwrap();
            let (x, y) = batch();
            let p = StepPrecision {
                grad_scale: 0.5,
                grad_dtype: DType::F32,
            };
            let loss = model.forward_backward(&x, &y, 2, 7, p).unwrap();
            let grads = crate::models::grad_bits(&model.params());
            (loss.to_bits(), grads)
        };
        assert_eq!(run(Recompute::None), run(Recompute::Blocks));
    }

    #[test]
    fn next_logits_agree_with_the_batch_forward_and_costs_count_every_parameter() {
        let model = tiny(true, 2);
        let (x, _) = batch();
        let logits = model.next_logits(&x[..5]).unwrap();
        assert_eq!(logits.len(), 13);
        // The loss of the 5-token prefix with target t is -log softmax(logits)[t].
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + logits
            .iter()
            .map(|&l| (l as f64 - m).exp())
            .sum::<f64>()
            .ln();
        let mut targets = vec![0u32; 5];
        targets[4] = 7;
        let total = model.loss(&x[..5], &targets, 1, 5).unwrap();
        let first4 = model.loss(&x[..4], &targets[..4], 1, 4).unwrap();
        assert!(((total - first4) - (lse - logits[7] as f64)).abs() < 1e-4);
        let n: usize = model.params().iter().map(|p| p.value.len()).sum();
        assert_eq!(model.cost(2, 7).params, n);
        // The cached decoder: a 4-token prefill in slot 1, then one step, against the
        // full-window logits.
        let dec = model.decoder().unwrap();
        let mut cache = dec.new_cache(2, 8).unwrap();
        assert_eq!(cache.bytes(), dec.cache_bytes(2, 8));
        let prefill = dec
            .decode(&mut cache, &x[..4], &[1; 4], &[0, 1, 2, 3], &[3])
            .unwrap();
        let want = model.next_logits(&x[..4]).unwrap();
        crate::engine::cpu::testutil::assert_close(&prefill, &want, 1e-5, "prefill logits");
        cache.copy_slot(1, 0, 4).unwrap();
        let step = dec
            .decode(&mut cache, &[x[4], x[4]], &[0, 1], &[4, 4], &[0, 1])
            .unwrap();
        crate::engine::cpu::testutil::assert_close(
            &step[..13],
            &logits,
            1e-5,
            "decode step slot 0",
        );
        crate::engine::cpu::testutil::assert_close(
            &step[13..],
            &logits,
            1e-5,
            "decode step slot 1",
        );
        let err = model.next_logits(&[1; 9]).unwrap_err().to_string();
        assert!(
            err.contains("longer than the model's context of 8"),
            "{err}"
        );
    }

    /// Gains folded into the projections: the same logits from the batch forward and from
    /// the cached decoder (which then runs the fused append and SwiGLU and adds into the
    /// stream by the products), with gains that are not ones. Models with QKV biases or
    /// per-head norms are left as they are.
    #[test]
    fn folded_norm_gains_decode_the_same_logits() {
        let plain = || {
            let mut m = tiny(true, 2);
            m.cfg.qk_norm = false;
            m.lm.blocks.iter_mut().for_each(|b| b.attn.qk_norm = None);
            let pool = m.lm.embed.value.pool().clone();
            for (i, b) in m.lm.blocks.iter_mut().enumerate() {
                for (j, g) in [&mut b.ln1.gamma, &mut b.ln2.gamma].into_iter().enumerate() {
                    let v = (0..16)
                        .map(|k| 0.5 + ((k * 7 + i * 3 + j * 5) % 11) as f32 / 10.0)
                        .collect();
                    g.value = Tensor::from_vec(&pool, &[16], DType::F32, v).unwrap();
                }
            }
            m
        };
        let (x, _) = batch();
        let reference = plain();
        let mut folded = plain();
        assert!(folded.fold_norm_gains().unwrap());
        assert!(
            folded.lm.blocks[1]
                .ln2
                .gamma
                .value
                .to_vec()
                .unwrap()
                .iter()
                .all(|&g| g == 1.0)
        );
        let want = reference.next_logits(&x[..5]).unwrap();
        let got = folded.next_logits(&x[..5]).unwrap();
        crate::engine::cpu::testutil::assert_close(&got, &want, 1e-5, "batch forward");
        let decode = |m: &Llama| {
            let dec = m.decoder().unwrap();
            let mut cache = dec.new_cache(2, 8).unwrap();
            let mut out = dec
                .decode(&mut cache, &x[..4], &[1; 4], &[0, 1, 2, 3], &[3])
                .unwrap();
            cache.copy_slot(1, 0, 4).unwrap();
            out.extend(
                dec.decode(&mut cache, &[x[4], x[5]], &[0, 1], &[4, 4], &[0, 1])
                    .unwrap(),
            );
            out
        };
        let (want, got) = (decode(&reference), decode(&folded));
        crate::engine::cpu::testutil::assert_close(&got, &want, 1e-5, "cached decoder");
        crate::engine::cpu::testutil::assert_close(
            &want[13..26],
            &reference.next_logits(&x[..5]).unwrap(),
            1e-5,
            "decode step",
        );
        // Qwen3's per-head norms come after the projection: not folded.
        assert!(!tiny(true, 2).fold_norm_gains().unwrap());
        // Qwen2's biases are added after the row factor: the same logits, gains not ones.
        let qwen2 = || {
            let mut m = tiny(false, 2);
            let pool = m.lm.embed.value.pool().clone();
            for b in &mut m.lm.blocks {
                let v = (0..16).map(|k| 0.6 + (k % 7) as f32 / 8.0).collect();
                b.ln1.gamma.value = Tensor::from_vec(&pool, &[16], DType::F32, v).unwrap();
                let bias = b.attn.qkv.bias.as_mut().unwrap();
                let n = bias.value.len();
                let v = (0..n).map(|k| ((k * 5) % 9) as f32 / 10.0 - 0.4).collect();
                bias.value = Tensor::from_vec(&pool, &[n], DType::F32, v).unwrap();
            }
            m
        };
        let reference = qwen2();
        let mut folded = qwen2();
        assert!(folded.fold_norm_gains().unwrap());
        let (want, got) = (decode(&reference), decode(&folded));
        crate::engine::cpu::testutil::assert_close(&got, &want, 1e-5, "cached decoder, biases");
        let want = reference.next_logits(&x[..5]).unwrap();
        crate::engine::cpu::testutil::assert_close(
            &got[13..26],
            &want,
            1e-5,
            "decode step, biases",
        );
    }

    /// A window of 3 positions: the cached decoder (a prefill, then steps past the window)
    /// gives the logits of the windowed full forward, which differ from full attention's; a
    /// window as long as the context is full attention bit for bit, in the loss, its gradient
    /// and the decoder; and the cost counts fewer attention FLOPs.
    #[test]
    fn a_sliding_window_decodes_like_its_full_forward() {
        let (x, y) = batch();
        for full_layers in [0, 1] {
            let model = tiny_windowed(false, 2, 3, full_layers);
            let dec = model.decoder().unwrap();
            let mut cache = dec.new_cache(1, 8).unwrap();
            let got = dec
                .decode(&mut cache, &x[..4], &[0; 4], &[0, 1, 2, 3], &[3])
                .unwrap();
            let want = model.next_logits(&x[..4]).unwrap();
            crate::engine::cpu::testutil::assert_close(&got, &want, 1e-5, "windowed prefill");
            for p in 4..7 {
                let got = dec
                    .decode(&mut cache, &[x[p]], &[0], &[p as u32], &[0])
                    .unwrap();
                let want = model.next_logits(&x[..=p]).unwrap();
                crate::engine::cpu::testutil::assert_close(&got, &want, 1e-5, "windowed step");
            }
            let plain = tiny_windowed(false, 2, 0, 0);
            assert_ne!(
                plain.next_logits(&x[..7]).unwrap(),
                model.next_logits(&x[..7]).unwrap(),
                "a window of 3 changes 7-token logits"
            );
            assert!(model.cost(2, 7).flops_forward < plain.cost(2, 7).flops_forward);
        }
        // Every window at least the context long gives full attention's bits.
        let p = StepPrecision {
            grad_scale: 1.0,
            grad_dtype: DType::F32,
        };
        let run = |window: usize| {
            let mut m = tiny_windowed(true, 2, window, 0);
            let loss = m.forward_backward(&x, &y, 2, 7, p).unwrap();
            let grads: Vec<u32> = m
                .params()
                .iter()
                .flat_map(|p| p.grad.to_vec().unwrap())
                .map(f32::to_bits)
                .collect();
            let dec = m.decoder().unwrap();
            let mut cache = dec.new_cache(1, 8).unwrap();
            let pos: Vec<u32> = (0..7).collect();
            let logits = dec
                .decode(&mut cache, &x[..7], &[0; 7], &pos, &[6])
                .unwrap();
            (loss.to_bits(), grads, logits)
        };
        let full = run(0);
        assert_eq!(run(8), full);
        assert_eq!(run(7), full);
        assert_ne!(run(2).0, full.0);
    }
}

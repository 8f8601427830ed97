//! `[model]`: the keys every family shares, and each family's own keys as one variant of a
//! tagged enum chosen by `model.kind`.
//!
//! On disk and on the command line the section stays flat (`model.kind = "llama"` beside
//! `model.n_kv_heads = 2`), as kiln has always written it; in Rust a family's keys exist only
//! in its variant, so code that reads `rope_theta` has a Llama in hand. Which family a key
//! belongs to follows from the variants themselves (see [`family_of_key`]), and the
//! resolution refuses a key of another family than the chosen kind.
//!
//! What a family *does* with its keys (build, checks, presets, features) is its entry in the
//! registry, [`crate::models::family`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use toml::{Table, Value};

use crate::models::family::{FAMILIES, Family};

/// `[model]`: the network's shape.
// `flatten` keeps the section flat: the variant's `kind` tag and its keys sit beside the
// shared ones. Serde cannot deny unknown fields through a flatten, so decoding here is
// lenient; keys are checked one by one before anything is decoded (`super::flatten_file`,
// `super::parse_override`, `super::select_family`), and a checkpoint written before the
// section was per family still loads with every family's keys in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    /// The family (`model.kind`) and the keys only it has.
    #[serde(flatten)]
    pub family: FamilySettings,
    /// Width of the residual stream (embedding size).
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads per block; must divide `d_model` (unused by resnet_bk).
    pub n_heads: usize,
    /// Longest sequence the model can attend over (size of the position table).
    pub context: usize,
    /// Share the token embedding matrix with the output head.
    pub tied_head: bool,
    /// Named size for the model kind (resnet_bk: tiny, small, base); it sets the model keys
    /// that the file and overrides leave at their defaults. Empty: no preset.
    pub preset: String,
    /// Rows of the embedding (the vocabulary size); 0 means the tokenizer's. Imported models
    /// set it when their embedding is larger than their tokenizer.
    pub vocab: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            family: FamilySettings::Gpt,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            context: 128,
            tied_head: true,
            preset: String::new(),
            vocab: 0,
        }
    }
}

impl ModelConfig {
    /// The `model.kind` name.
    pub fn kind(&self) -> &'static str {
        self.family.kind()
    }

    /// The family's registry entry: how it is built, checked, described, what it supports.
    pub fn entry(&self) -> &'static Family {
        crate::models::family::of(self.kind())
            .expect("every FamilySettings variant has a registry entry (tested)")
    }

    /// The ResNet-BK keys, if this is a ResNet-BK.
    pub fn resnet_bk(&self) -> Option<&ResnetBkSettings> {
        match &self.family {
            FamilySettings::ResnetBk(s) => Some(s),
            _ => None,
        }
    }

    /// The Llama keys, if this is a Llama-family model.
    pub fn llama(&self) -> Option<&LlamaSettings> {
        match &self.family {
            FamilySettings::Llama(s) => Some(s),
            _ => None,
        }
    }
}

/// `model.kind` and the keys only that family has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FamilySettings {
    /// A GPT-2-style decoder: the shared keys say all.
    Gpt,
    ResnetBk(ResnetBkSettings),
    Llama(LlamaSettings),
}

impl FamilySettings {
    /// The `model.kind` name, as serde spells the tag.
    pub fn kind(&self) -> &'static str {
        match self {
            FamilySettings::Gpt => "gpt",
            FamilySettings::ResnetBk(_) => "resnet_bk",
            FamilySettings::Llama(_) => "llama",
        }
    }
}

/// The keys of `model.kind = "resnet_bk"`: its mixture-of-experts layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResnetBkSettings {
    /// Experts per mixture-of-experts layer.
    pub moe_experts: usize,
    /// Experts each token is routed to (1 or 2).
    pub moe_top_k: usize,
    /// Hidden width of each expert; 0 means 2 x d_model.
    pub moe_hidden: usize,
    /// Expert capacity, as a multiple of an even share of the token slots.
    pub moe_capacity_factor: f64,
    /// Weight of the load-balancing loss.
    pub moe_aux_coef: f64,
}

impl Default for ResnetBkSettings {
    fn default() -> Self {
        Self {
            moe_experts: 4,
            moe_top_k: 2,
            moe_hidden: 0,
            moe_capacity_factor: 1.25,
            moe_aux_coef: 0.01,
        }
    }
}

impl ResnetBkSettings {
    /// Each expert's hidden width with the `0 = 2 x d_model` default resolved.
    pub fn moe_hidden_width(&self, d_model: usize) -> usize {
        if self.moe_hidden == 0 {
            2 * d_model
        } else {
            self.moe_hidden
        }
    }
}

/// The keys of `model.kind = "llama"` (Llama 2/3, Qwen2/3, Mistral, SmolLM).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LlamaSettings {
    /// Key/value heads shared by the query heads; 0 means one per query head.
    pub n_kv_heads: usize,
    /// Width of each attention head; 0 means d_model / n_heads.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU feed-forward; 0 means about 8/3 x d_model, rounded up to
    /// a multiple of 64.
    pub ffn_hidden: usize,
    /// Base of the rotary position frequencies.
    pub rope_theta: f64,
    /// Rotated dimensions of each head; 0 means all of them.
    pub rot_dim: usize,
    /// Llama 3 rotary frequency scaling factor; 0 means no scaling.
    pub rope_scaling_factor: f64,
    /// Llama 3 scaling, low-frequency factor.
    pub rope_low_freq_factor: f64,
    /// Llama 3 scaling, high-frequency factor.
    pub rope_high_freq_factor: f64,
    /// The context the rotary frequencies were trained for (Llama 3 scaling; LongRoPE takes
    /// its short factors for passes up to it, its long ones for longer passes).
    pub rope_original_context: usize,
    /// LongRoPE (Phi-3): per-pair divisors of the rotary frequencies, one a rotated pair,
    /// taken by a pass whose longest sequence fits model.rope_original_context; empty for
    /// none.
    pub rope_short_factors: Vec<f64>,
    /// LongRoPE's divisors for a pass whose longest sequence passes
    /// model.rope_original_context (only a longer model.context reads them).
    pub rope_long_factors: Vec<f64>,
    /// The rotary cos and sin multiplied by this (LongRoPE's attention factor); 1 for none.
    pub rope_attention_factor: f64,
    /// The most positions LongRoPE's long factors were made for (a checkpoint's
    /// max_position_embeddings), which exports state again; 0 where none is known.
    pub rope_longest_context: usize,
    /// Epsilon of the RMS norms.
    pub norm_eps: f64,
    /// Biases on the query, key and value projections (Qwen2).
    pub qkv_bias: bool,
    /// A per-head RMSNorm on queries and keys before the rotation (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window attention (Mistral, Qwen2): query `i` attends to keys `j` with
    /// `i - W < j <= i`, the `W` latest positions including its own; 0 means full causal
    /// attention.
    pub sliding_window: usize,
    /// The first layers that attend fully even with a window (Qwen2's `max_window_layers`);
    /// the window applies from this layer on.
    pub full_attention_layers: usize,
    /// The Hugging Face architecture whose tensor layout export writes: "" chooses from the
    /// settings (Llama, Mistral, Qwen2, Qwen3), "phi3" writes Phi3ForCausalLM's fused
    /// query/key/value and gate/up projections.
    pub checkpoint_arch: String,
}

impl Default for LlamaSettings {
    fn default() -> Self {
        Self {
            n_kv_heads: 0,
            head_dim: 0,
            ffn_hidden: 0,
            rope_theta: 10000.0,
            rot_dim: 0,
            rope_scaling_factor: 0.0,
            rope_low_freq_factor: 1.0,
            rope_high_freq_factor: 4.0,
            rope_original_context: 8192,
            rope_short_factors: Vec::new(),
            rope_long_factors: Vec::new(),
            rope_attention_factor: 1.0,
            rope_longest_context: 0,
            norm_eps: 1e-5,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: 0,
            full_attention_layers: 0,
            checkpoint_arch: String::new(),
        }
    }
}

impl LlamaSettings {
    /// The positions a LongRoPE model's exports state (`max_position_embeddings`, GGUF's
    /// `context_length`): the longest its factors were made for, at least the trained context
    /// and the model's own `context`.
    pub fn stated_positions(&self, context: usize) -> usize {
        context
            .max(self.rope_original_context)
            .max(self.rope_longest_context)
    }
}

/// The dotted keys of `settings` alone (its variant's, without `model.kind`) with their values.
pub(crate) fn own_keys(settings: &FamilySettings) -> BTreeMap<String, Value> {
    // Serializing a derived enum of numbers, strings and bools cannot fail.
    let table = Table::try_from(settings).unwrap_or_default();
    table
        .into_iter()
        .filter(|(k, _)| k != "kind")
        .map(|(k, v)| (format!("model.{k}"), v))
        .collect()
}

/// Every family's own keys, each with the `model.kind` it belongs to.
pub(crate) fn family_keys() -> BTreeMap<String, &'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| {
            own_keys(&(f.defaults)())
                .into_keys()
                .map(move |k| (k, f.kind))
        })
        .collect()
}

/// The `model.kind` whose own key `key` is; `None` for a shared key or no model key at all.
pub fn family_of_key(key: &str) -> Option<&'static str> {
    family_keys().get(key).copied()
}

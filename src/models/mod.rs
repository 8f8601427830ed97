//! Models: compositions of `nn` layers with a loss, behind one interface the trainer uses.

pub mod adapters;
pub mod bert;
pub mod cached;
pub mod export;
pub mod export_gguf;
pub mod family;
pub mod gpt;
pub mod import;
pub mod llama;
pub mod lm;
#[cfg(test)]
mod param_order;
pub mod peft;
pub mod prenorm;
pub mod resnet_bk;

use crate::config::ModelConfig;
use crate::engine::cpu::kv_cache::CacheShape;
use crate::engine::ops::Ids;
use crate::engine::rng::{Rng, stream};
use crate::engine::{DType, EngineError, MemoryPool, Result, Tensor, ops};
use crate::error::KilnError;
use crate::nn::builder::{HostTensor, NameMap, WeightSource};
use crate::nn::lora::{Adapter, LoraSpec};
use crate::nn::moe::MoeStats;
use crate::nn::{Cost, Kernels, ParamBuilder, Params};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// A pretrained model's tensors on the host, by kiln's parameter names.
pub type HostWeights = BTreeMap<String, crate::nn::builder::HostTensor>;

/// A base kept in NF4 by [`Model::quantize_base_nf4`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QuantizedBase {
    /// Weights quantised, and their values.
    pub weights: usize,
    pub values: usize,
    /// Bytes the NF4 weights hold in the pool (codes, scales and, on a GPU, code tables).
    pub nf4_bytes: usize,
    /// Bytes of the shared workspace they are expanded into (the largest, in the compute dtype).
    pub workspace_bytes: usize,
}

/// Called during a backward pass with `k` once every trainable parameter from index `k` on
/// (in [`Model::trainable_params`] order) holds its final gradient for the pass: data
/// parallelism sends those gradients while backward goes on below them.
pub type GradReady = Box<dyn FnMut(usize) + Send + Sync>;

/// Every parameter's gradient as bits, in order: for tests that hold two runs to the same
/// gradients bit for bit.
#[cfg(test)]
pub(crate) fn grad_bits(params: &[&crate::nn::Param]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            p.grad
                .to_vec()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// One f32 forward/backward of `model` on `[batch, seq]` rows, then each parameter's
/// gradient against central differences of the loss at `samples` evenly spaced elements of
/// its first `live(name, len)` values (rows that cannot move the loss, such as padded
/// vocabulary, left out), within `abs + 1e-2 * |difference|`. `label` names the case.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_gradient_by_differences(
    model: &mut dyn Model,
    (x, y): (&[u32], &[u32]),
    (batch, seq): (usize, usize),
    samples: usize,
    live: impl Fn(&str, usize) -> usize,
    abs: f32,
    label: &str,
) {
    let p = StepPrecision {
        grad_scale: 1.0,
        grad_dtype: DType::F32,
    };
    model.forward_backward(x, y, batch, seq, p).unwrap();
    let grads: Vec<Vec<f32>> = model
        .params()
        .iter()
        .map(|p| p.grad.to_vec().unwrap())
        .collect();
    // Small steps: a first norm sees embeddings of scale 0.02, so the loss curves sharply
    // along them.
    let h = 1e-3f32;
    for (pi, g) in grads.iter().enumerate() {
        let name = model.params()[pi].name.clone();
        // A frozen parameter has no gradient to check.
        let n = live(&name, g.len());
        if n == 0 {
            continue;
        }
        for i in (0..n).step_by(n.div_ceil(samples)) {
            let mut eval = |delta: f32| {
                let mut ps = model.params_mut();
                ps[pi].value.host_mut()[i] += delta;
                drop(ps);
                model.loss(x, y, batch, seq).unwrap()
            };
            let plus = eval(h);
            let minus = eval(-2.0 * h);
            eval(h);
            let fd = ((plus - minus) / (2.0 * h as f64)) as f32;
            assert!(
                (g[i] - fd).abs() < abs + 1e-2 * fd.abs(),
                "{label} {name}[{i}]: {} vs {fd}",
                g[i]
            );
        }
    }
}

/// The index of the first trainable parameter of each block and, last, of what follows the
/// blocks, given the trainable parameters before the blocks and in each block.
pub fn block_starts(before: usize, per_block: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut at = before;
    let mut out = Vec::new();
    for n in per_block {
        out.push(at);
        at += n;
    }
    out.push(at);
    out
}

/// What the trainer asks of a model. Its parameters come through [`Params`], in a fixed
/// order (imports and exports map them by name; the optimizer, checkpoints and data-parallel
/// buckets rely on the order).
pub trait Model: Params + Send {
    /// Freezes every weight and adds low-rank adapters on the projections `spec` targets
    /// (see [`crate::nn::lora`]); returns the adapted modules. Families without adapters say
    /// so.
    fn attach_lora(
        &mut self,
        _spec: &LoraSpec,
        _seed: u64,
    ) -> std::result::Result<Vec<String>, String> {
        let with: Vec<&str> = family::FAMILIES
            .iter()
            .filter(|f| f.features.lora)
            .map(|f| f.kind)
            .collect();
        Err(format!(
            "this model has no low-rank adapters; model.kind = {} has them",
            with.join(", ")
        ))
    }

    /// The modules adapters can target (Hugging Face names), for error messages.
    fn lora_modules(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether the Hugging Face modules the adapters are named after store their weights
    /// `[in, out]` (GPT-2's Conv1D), which PEFT's `fan_in_fan_out` records.
    fn lora_fan_in_fan_out(&self) -> bool {
        false
    }

    /// Folds the adapters into the base weights (f32 masters) and removes them.
    fn merge_lora(&mut self) -> Result<()> {
        Ok(())
    }

    /// Readies the model for sampling by folding each norm's gain into the projection that
    /// reads it, where the family decodes faster that way (the Llama family: see
    /// `Llama::fold_norm_gains`). The model computes the same function afterwards; call it on
    /// f32 masters, before generation freezes them into their compute dtype. Returns whether
    /// anything was folded.
    fn fold_norm_gains(&mut self) -> Result<bool> {
        Ok(false)
    }

    /// Keeps every frozen projection only in NF4 (QLoRA), quantised from the values it
    /// holds now (or, for one loaded as a placeholder, from its tensor in `host`), each GEMM
    /// expanding it into one workspace of `compute` values that all of them share. `None`
    /// for a family without such projections.
    fn quantize_base_nf4(
        &mut self,
        _compute: DType,
        _host: Option<&HostWeights>,
    ) -> Result<Option<QuantizedBase>> {
        Ok(None)
    }

    /// The low-rank adapters, in parameter order.
    fn adapters(&self) -> Vec<&Adapter> {
        Vec::new()
    }

    fn adapters_mut(&mut self) -> Vec<&mut Adapter> {
        Vec::new()
    }

    /// Forward and backward on one micro-batch of `inputs`/`targets` (`[batch, seq]`),
    /// accumulating parameter gradients of `grad_scale * sum(token losses)`. Returns the sum
    /// of the token losses (unscaled, in f64).
    fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        step: StepPrecision,
    ) -> Result<f64>;

    /// Installs (or removes) the hook backward calls as gradients become final; returns
    /// whether this family calls it (one that does not has its gradients sent after backward).
    fn set_grad_ready(&mut self, _hook: Option<GradReady>) -> bool {
        false
    }

    /// [`Model::forward_backward`] with each row's token losses weighted by `row_weights[r]`
    /// (times `step.grad_scale`), weights of either sign: the gradient of a weighted sum of
    /// sequence log-likelihoods, as score-function objectives need. Returns the unweighted
    /// sum of the token losses. This default runs one row per pass; a family overrides it
    /// with one batched pass.
    fn forward_backward_weighted(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        step: StepPrecision,
        row_weights: &[f32],
    ) -> Result<f64> {
        check_row_weights(batch, row_weights)?;
        let mut loss = 0.0;
        for (r, &w) in row_weights.iter().enumerate() {
            let span = r * seq..(r + 1) * seq;
            let row = StepPrecision {
                grad_scale: step.grad_scale * w,
                ..step
            };
            loss += self.forward_backward(&inputs[span.clone()], &targets[span], 1, seq, row)?;
        }
        Ok(loss)
    }

    /// Sum of token losses without touching gradients (evaluation).
    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64>;

    /// Logits `[vocab]` for the token after the last of `tokens` (generation).
    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>>;

    /// Longest sequence the model accepts.
    fn context(&self) -> usize;

    /// Size of the vocabulary (the logits per position).
    fn vocab(&self) -> usize;

    /// Cost of one micro-batch.
    fn cost(&self, batch: usize, seq: usize) -> Cost;

    /// The activation recomputation the backward runs with (the planner counts saved
    /// activations from it).
    fn recompute(&self) -> Recompute {
        Recompute::None
    }

    /// Chooses activation recomputation. A model without a recomputing backward accepts only
    /// [`Recompute::None`] and says so for anything else.
    fn set_recompute(&mut self, policy: Recompute) -> std::result::Result<(), String> {
        match policy {
            Recompute::None => Ok(()),
            other => Err(format!(
                "this model has no {other} recomputation; use train.recompute=none"
            )),
        }
    }

    /// Chooses the fused kernels or their unfused chains (`train.fused_kernels`). A model
    /// without an unfused path accepts only [`Kernels::Fused`] and says so otherwise.
    fn set_kernels(&mut self, kernels: Kernels) -> std::result::Result<(), String> {
        match kernels {
            Kernels::Fused => Ok(()),
            Kernels::Unfused => {
                Err("this model has no unfused kernel path; use train.fused_kernels=true".into())
            }
        }
    }

    /// Incremental decoding with a key/value cache, for the families that have it (the
    /// generation engine falls back to re-running the whole window otherwise).
    fn decoder(&self) -> Option<&dyn Decoder> {
        None
    }

    /// How the mixture-of-experts layers routed tokens in the forward-backward passes since
    /// the last call (`None` for a model without them); clears the record.
    fn take_routing_stats(&mut self) -> Option<RoutingStats> {
        None
    }
}

/// A model's key/value cache: one `(keys, values)` pair of `[slots, K, max_len, D]` per layer.
pub struct KvCache {
    pub layers: Vec<(Tensor, Tensor)>,
    pub shape: CacheShape,
}

impl KvCache {
    /// Copies the first `len` positions of slot `from` into slot `to` in every layer.
    pub fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<()> {
        for (k, v) in &mut self.layers {
            ops::copy_cache_slot(k, from, to, len, self.shape)?;
            ops::copy_cache_slot(v, from, to, len, self.shape)?;
        }
        Ok(())
    }

    /// Bytes the cache holds on its device.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| k.bytes() + v.bytes()).sum()
    }
}

/// Decoding one token per sequence (or a prompt's tokens at once) against a [`KvCache`].
pub trait Decoder {
    /// A cache for `slots` sequences of up to `max_len` tokens, in the model's pool.
    fn new_cache(&self, slots: usize, max_len: usize) -> Result<KvCache>;

    /// Bytes [`Decoder::new_cache`] books for `slots` sequences of up to `max_len` tokens.
    fn cache_bytes(&self, slots: usize, max_len: usize) -> usize;

    /// Runs `tokens` as rows, each at `(slot, pos)` of the cache (a prefill is one slot at
    /// positions `0..T`, a decode step one row per sequence), appending their keys and
    /// values. Returns the logits of the rows listed in `emit`, `[emit.len() x vocab]`.
    fn decode(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        slot: &[u32],
        pos: &[u32],
        emit: &[u32],
    ) -> Result<Vec<f32>>;

    /// A logits buffer of `rows` rows for [`Decoder::decode_into`]: `[rows, padded_vocab]`
    /// in the dtype the model computes in on its device.
    fn new_logits(&self, rows: usize) -> Result<Tensor>;

    /// [`Decoder::decode`] leaving the logits on the device, in `logits` (from
    /// [`Decoder::new_logits`] with one row per emitted row). Everything else it allocates it
    /// frees before returning and it never waits for the device, so a call can be captured
    /// into a CUDA graph and replayed (its shapes fixed, its indices read from device
    /// buffers).
    fn decode_into(
        &self,
        cache: &mut KvCache,
        rows: &DecodeRows,
        logits: &mut Tensor,
    ) -> Result<()>;

    /// Which rotary tables a prefill whose longest prompt has `positions` positions reads:
    /// 0, or 1 for LongRoPE's long factors past the trained context. transformers picks them
    /// by each forward call's largest position, so a prompt's choice is its own length's: a
    /// prefill pass runs prompts of one variant only. (A decode step gives every row its own
    /// sequence's choice from one table, whatever the variants of the rows.)
    fn rotary_variant(&self, _positions: usize) -> usize {
        0
    }

    /// LongRoPE: the trained context, where generation prefills a sequence again from its
    /// first token when its next token would sit there (its keys so far carry the short
    /// factors' rotation; after, all of them carry the long factors', as in a forward call
    /// over the whole sequence). transformers' Phi-3 generation, the family LongRoPE comes
    /// with, drops its cache at that step the same way. `None`: never.
    fn restart_at(&self) -> Option<usize> {
        None
    }
}

/// The rows of one [`Decoder::decode_into`] call: row `i` feeds `tokens[i]` at position
/// `pos[i]` of cache slot `slot[i]`.
pub struct DecodeRows<'a> {
    pub tokens: Ids<'a>,
    pub slot: Ids<'a>,
    pub pos: Ids<'a>,
    /// At least every row's position + 1. It only chooses how the attention splits rows over
    /// GPU blocks, which decides the last bits of the result: calls that must agree bit for
    /// bit (a step run directly and the same step replayed from a graph) pass the same bound.
    pub longest: usize,
    /// Every row's position + 1, the most: exactly, where `longest` may be a bound. A
    /// prefill picks LongRoPE's factors by it ([`Decoder::rotary_variant`]); a decode step
    /// (`distinct_slots`) reads each row's own ([`crate::nn::gqa::LongTables::stepwise`]).
    pub positions: usize,
    /// Every row names a different slot (a decode step, not a prefill): each row's key and
    /// value can then be appended and attended to in one kernel.
    pub distinct_slots: bool,
    /// The rows whose logits are wanted, in order (`None`: every row).
    pub emit: Option<Ids<'a>>,
}

/// Which activations the backward rebuilds instead of keeping them from the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep everything the backward needs: fastest, most memory.
    #[default]
    None,
    /// Keep only each block's input and re-run the block's forward right before its
    /// backward, so one block's activations are alive at a time, for about one more forward
    /// pass of compute.
    Blocks,
}

impl Recompute {
    /// The policy a `train.recompute` value asks for. `auto` leaves the choice to the memory
    /// planner; until the planner chooses, it means no recomputation.
    pub fn from_setting(value: &str) -> std::result::Result<Recompute, String> {
        match value {
            "none" | "auto" => Ok(Recompute::None),
            "blocks" => Ok(Recompute::Blocks),
            other => Err(format!(
                "train.recompute = \"{other}\" is not a recomputation policy; use none, blocks or auto"
            )),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Recompute::None => "none",
            Recompute::Blocks => "blocks",
        })
    }
}

/// Mixture-of-experts routing over some forward passes (an optimizer step's micro-batches).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RoutingStats {
    /// Token slots asked for, over all layers and micro-batches.
    pub slots: usize,
    /// Slots dropped because their expert was full.
    pub dropped: usize,
    /// Slots each expert processed, summed over layers and micro-batches.
    pub load: Vec<usize>,
    /// The load-balancing loss (before its coefficient), averaged over layers and
    /// micro-batches.
    pub aux_loss: f64,
}

impl RoutingStats {
    /// Sums the passes' counts and averages their aux losses; `None` for no passes.
    pub fn summarise(passes: &[MoeStats]) -> Option<RoutingStats> {
        let first = passes.first()?;
        let mut total = RoutingStats {
            load: vec![0; first.load.len()],
            ..RoutingStats::default()
        };
        for s in passes {
            total.slots += s.slots;
            total.dropped += s.dropped;
            total
                .load
                .iter_mut()
                .zip(&s.load)
                .for_each(|(t, l)| *t += l);
            total.aux_loss += s.aux_loss / passes.len() as f64;
        }
        Some(total)
    }
}

/// What a built or loaded model is for: `Train` (gradient buffers allocated as training needs
/// them) or `Run` (every parameter frozen from the start, so no gradient buffer is ever
/// allocated: generation, which then peaks at the values alone). `Run(Some(dtype))` also
/// holds every matrix in `dtype` from the moment it is made (see
/// [`crate::nn::ParamBuilder::frozen_in`]), so a device never holds all of them in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Train,
    Run(Option<crate::engine::DType>),
}

/// The model `cfg` describes (its family's [`family::Family::build`]), with a `vocab`-token
/// vocabulary, initialised from `seed`, to train; [`build_for`] with [`Role::Train`].
pub fn build(
    cfg: &ModelConfig,
    vocab: usize,
    pool: &Arc<MemoryPool>,
    seed: u64,
) -> std::result::Result<Box<dyn Model>, KilnError> {
    build_for(cfg, vocab, pool, seed, Role::Train)
}

/// [`build`] for `role`: with [`Role::Run`], the planner's stand-in for [`load_for`] with the
/// same role, booking the same memory.
pub fn build_for(
    cfg: &ModelConfig,
    vocab: usize,
    pool: &Arc<MemoryPool>,
    seed: u64,
    role: Role,
) -> std::result::Result<Box<dyn Model>, KilnError> {
    let mut rng = Rng::new(seed, stream::INIT);
    let mut b = ParamBuilder::init(pool, &mut rng);
    if let Role::Run(dtype) = role {
        b = b.frozen_in(dtype);
    }
    (cfg.entry().build)(cfg, vocab, &mut b)
}

/// The model `cfg` describes with its parameters read from `weights` (under kiln's names, as
/// [`import::pretrained`] maps a checkpoint's), never initialised first, to train; [`load_for`]
/// with [`Role::Train`]. Every parameter must find its tensor with its shape and every tensor
/// must be used; `origin` (a path) names the weights in the error that says otherwise.
pub fn load(
    cfg: &ModelConfig,
    vocab: usize,
    pool: &Arc<MemoryPool>,
    weights: &BTreeMap<String, HostTensor>,
    origin: &Path,
) -> std::result::Result<Box<dyn Model>, KilnError> {
    load_for(cfg, vocab, pool, weights, origin, Role::Train)
}

/// [`load`] for `role`.
pub fn load_for(
    cfg: &ModelConfig,
    vocab: usize,
    pool: &Arc<MemoryPool>,
    weights: &BTreeMap<String, HostTensor>,
    origin: &Path,
    role: Role,
) -> std::result::Result<Box<dyn Model>, KilnError> {
    load_deferring(cfg, vocab, pool, weights, origin, role, None)
}

/// [`load_for`] leaving the parameters `defer` names on the host as empty placeholders (a
/// base about to be quantised from `weights`: see [`Model::quantize_base_nf4`]).
pub fn load_deferring(
    cfg: &ModelConfig,
    vocab: usize,
    pool: &Arc<MemoryPool>,
    weights: &BTreeMap<String, HostTensor>,
    origin: &Path,
    role: Role,
    defer: Option<fn(&str) -> bool>,
) -> std::result::Result<Box<dyn Model>, KilnError> {
    let mut source = WeightSource::new(origin.display(), weights, NameMap::identity());
    if let Some(d) = defer {
        source = source.deferring(d);
    }
    let mut b = ParamBuilder::load(pool, &mut source);
    if let Role::Run(dtype) = role {
        b = b.frozen_in(dtype);
    }
    let model = (cfg.entry().build)(cfg, vocab, &mut b)?;
    drop(b);
    source.finish()?;
    Ok(model)
}

/// The standard deviation of the projections that write into the residual stream: GPT-2's
/// 0.02 scaled by `1/sqrt(2 * layers)`, so the stream's variance does not grow with depth.
pub(crate) fn residual_init_std(n_layers: usize) -> f32 {
    0.02 / (2.0 * n_layers as f32).sqrt()
}

/// A model built by `build` from a builder that initialises from `seed` (the constructors
/// behind each family's `new`).
pub(crate) fn initialised<M>(
    pool: &Arc<MemoryPool>,
    seed: u64,
    build: impl FnOnce(&mut ParamBuilder) -> Result<M>,
) -> Result<M> {
    let mut rng = Rng::new(seed, stream::INIT);
    build(&mut ParamBuilder::init(pool, &mut rng))
}

/// Embedding tables and heads pad the vocabulary to a multiple of this many entries, so the
/// largest GEMM of a language model runs on whole tensor-core tiles (50257 -> 50304 for
/// GPT-2). Padded rows are never looked up and their logits are masked out of the loss, so
/// they get no gradient and change nothing the model computes.
pub const VOCAB_ALIGN: usize = 128;

/// Rows of the embedding table and columns of the logits for a `vocab`-token vocabulary.
pub fn padded_vocab(vocab: usize) -> usize {
    vocab.next_multiple_of(VOCAB_ALIGN)
}

/// Refuses a sequence longer than a model's `context` (its position table), naming the fix.
pub(crate) fn check_context(model: &'static str, seq: usize, context: usize) -> Result<()> {
    if seq > context {
        return Err(EngineError::Shape {
            op: model,
            detail: format!(
                "a sequence of {seq} tokens is longer than the model's context of {context}; use at most {context} tokens or train a model with a larger model.context"
            ),
        });
    }
    Ok(())
}

/// One weight per row of a weighted forward/backward.
pub(crate) fn check_row_weights(batch: usize, row_weights: &[f32]) -> Result<()> {
    if row_weights.len() != batch {
        return Err(EngineError::Shape {
            op: "forward_backward_weighted",
            detail: format!("{} row weights for {batch} rows", row_weights.len()),
        });
    }
    Ok(())
}

/// How one backward pass treats precision.
#[derive(Debug, Clone, Copy)]
pub struct StepPrecision {
    /// Weight of each token's loss in the gradient: the loss scale over the global batch's
    /// token count, so accumulated micro-batches sum to the global mean.
    pub grad_scale: f32,
    /// The dtype the output gradient is stored in; f16 overflows to inf exactly as on a GPU,
    /// which is what the dynamic loss scaler exists to catch.
    pub grad_dtype: DType,
}

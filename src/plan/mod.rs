//! The memory and FLOP planner: what one training step of a model needs on a device, and the
//! largest micro-batch that fits.
//!
//! A plan runs the step itself — construction, forward, loss, backward, optimizer — once on a
//! meta device ([`meta`]) standing in for the planned one, so its pool peak is the peak the
//! memory pool books, not an estimate; the CPU test suite holds it to real steps byte for
//! byte. The meta pool's ledger says what is live at the peak (weights, compute copies,
//! gradients, optimizer state, what the forward saved, the transient tensors of the backward,
//! scratch outside the pool) and which operation booked it. Around that peak a GPU adds the
//! allocator's rounding and the CUDA context, each its own line. FLOPs and saved bytes per
//! layer come from the layers' own `cost_of`.

pub mod finetune;
pub mod generate;
pub mod gpus;
pub mod meta;

use crate::config::Config;
use crate::data::Batch;
use crate::engine::{DType, Device, EngineError, MemoryPool, Phase};
use crate::models::gpt::GptConfig;
use crate::models::resnet_bk::ResnetBkConfig;
use crate::nn::moe::MoeConfig;
use crate::nn::{ActLayout, Cost};
use crate::train::{Precision, Trainer};
use serde::Serialize;
use std::sync::Arc;

/// The vocabulary size the model is built with for a tokenizer of `vocab` tokens.
pub use crate::models::padded_vocab;

/// What a CUDA context with kiln's kernels and cuBLASLt loaded takes before any tensor,
/// when it cannot be measured (planning for a GPU not in this machine).
pub const CUDA_CONTEXT_ESTIMATE: usize = 500 << 20;
/// The stream-ordered allocator maps device memory in granules of this size...
pub const POOL_GRANULE: usize = 2 << 20;
/// ...and aligns each buffer to this.
pub const POOL_ALIGNMENT: usize = crate::engine::pool::GPU_BUFFER_ALIGNMENT;

/// Which model the request's shape describes (`model.kind`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arch {
    Gpt,
    /// ResNet-BK: `model` gives its vocabulary, width, depth, context and head tying
    /// (`n_heads` is unused), and `moe` its mixture-of-experts layers.
    ResnetBk {
        moe: MoeConfig,
    },
}

impl Arch {
    /// The model `model.kind` names (of the families with
    /// [`crate::models::family::Features::analytic_plan`]).
    pub fn of(m: &crate::config::ModelConfig) -> Arch {
        match crate::models::resnet_bk::ResnetBkConfig::from_model(m, 0) {
            Some(r) => Arch::ResnetBk { moe: r.moe },
            None => Arch::Gpt,
        }
    }

    /// The `model.kind` name.
    pub fn kind(&self) -> &'static str {
        match self {
            Arch::Gpt => "gpt",
            Arch::ResnetBk { .. } => "resnet_bk",
        }
    }
}

/// What to plan: a model shape, a micro-batch, and how the step runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanRequest {
    #[serde(rename = "model_kind", serialize_with = "arch_kind")]
    pub arch: Arch,
    /// The model with `vocab` already padded ([`padded_vocab`]).
    #[serde(skip)]
    pub model: GptConfig,
    pub micro_batch: usize,
    pub seq_len: usize,
    #[serde(serialize_with = "device_name")]
    pub device: Device,
    /// The dtype of the weight copies compute reads: bf16/f16 under mixed precision, f32
    /// under fp32 and tf32.
    pub compute: DType,
    pub recompute: bool,
    pub offload_optimizer: bool,
    /// Everything else the step is built from (kernels, dropout, adapters...): the fields
    /// above override its `train` settings.
    #[serde(skip)]
    pub config: Arc<Config>,
    /// The tokenizer's vocabulary (before padding).
    #[serde(skip)]
    pub vocab: usize,
}

fn arch_kind<S: serde::Serializer>(a: &Arch, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(a.kind())
}

fn device_name<S: serde::Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if *d == Device::Cpu { "cpu" } else { "cuda" })
}

impl PlanRequest {
    /// The plan of `cfg`'s step on `device` for a tokenizer of `vocab` tokens, with compute
    /// copies in `compute` (recomputation as `train.recompute=blocks` asks; offload only
    /// beside a GPU, where it means anything).
    pub fn for_config(
        cfg: &crate::config::Config,
        vocab: usize,
        compute: DType,
        device: Device,
    ) -> PlanRequest {
        let m = &cfg.model;
        let arch = Arch::of(m);
        PlanRequest {
            arch,
            model: GptConfig {
                vocab: padded_vocab(vocab),
                d_model: m.d_model,
                n_layers: m.n_layers,
                n_heads: m.n_heads,
                context: m.context,
                tied_head: m.tied_head,
            },
            micro_batch: cfg.train.micro_batch,
            seq_len: cfg.train.seq_len,
            device,
            compute,
            recompute: cfg.train.recompute == "blocks",
            offload_optimizer: cfg.train.offload_optimizer && device != Device::Cpu,
            config: Arc::new(cfg.clone()),
            vocab,
        }
    }

    /// The configuration one planned step runs: `config` with this request's micro-batch,
    /// sequence length, recomputation and offload.
    pub fn step_config(&self) -> Config {
        let mut c = (*self.config).clone();
        c.train.micro_batch = self.micro_batch;
        c.train.seq_len = self.seq_len;
        c.train.recompute = if self.recompute { "blocks" } else { "none" }.into();
        c.train.offload_optimizer = self.offload_optimizer;
        c
    }

    /// The precision policy whose compute copies are `compute` (tf32 books what fp32 does).
    pub fn precision(&self) -> Precision {
        match self.compute {
            DType::BF16 => Precision::Bf16Mixed,
            DType::F16 => Precision::Fp16Mixed,
            DType::F32 => Precision::Fp32,
        }
    }

    pub fn layout(&self) -> ActLayout {
        ActLayout {
            device: self.device,
            weights: self.compute,
        }
    }

    pub fn with_batch(&self, micro_batch: usize) -> PlanRequest {
        PlanRequest {
            micro_batch,
            ..self.clone()
        }
    }

    fn gpu(&self) -> bool {
        self.device != Device::Cpu
    }

    /// The ResNet-BK the request describes, if it is one.
    pub fn resnet_bk(&self) -> Option<ResnetBkConfig> {
        match self.arch {
            Arch::Gpt => None,
            Arch::ResnetBk { moe } => Some(ResnetBkConfig {
                vocab: self.model.vocab,
                d_model: self.model.d_model,
                n_layers: self.model.n_layers,
                context: self.model.context,
                tied_head: self.model.tied_head,
                moe,
            }),
        }
    }
}

/// The four operations that booked the most of what is live at the peak, weights and
/// optimizer state (booked at construction) left out.
pub fn largest_at_peak(l: &crate::engine::pool::PeakLedger) -> Vec<(String, usize)> {
    l.by_op
        .iter()
        .filter(|(op, _)| *op != "construction")
        .take(4)
        .map(|(op, n)| (op.to_string(), *n))
        .collect()
}

impl Breakdown {
    /// The breakdown of a step run on the meta device, from its ledger at the peak.
    pub fn of(m: &meta::MetaStep) -> Breakdown {
        let l = &m.at_peak;
        let built = l.phase(Phase::Construction);
        Breakdown {
            master_weights: m.masters,
            compute_copies: m.compute_copies,
            gradients: m.gradients,
            optimizer_state: built.saturating_sub(m.masters + m.compute_copies + m.gradients),
            saved_activations: l.phase(Phase::Forward),
            transient: l.phase(Phase::Backward) + l.phase(Phase::Optimizer),
            outside_pool: l.outside,
        }
    }
}

/// Bytes by purpose at the device peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    pub master_weights: usize,
    pub compute_copies: usize,
    pub gradients: usize,
    /// AdamW's moments, with the model's fixed buffers (rotary tables).
    pub optimizer_state: usize,
    /// What the forward booked and is still live at the peak (saved for the backward).
    pub saved_activations: usize,
    /// What the head, the loss, the backward and the optimizer booked and is live at the
    /// peak (logits and their gradient included).
    pub transient: usize,
    /// Outside the pool: the GEMM workspace and the kernel scratch live at the peak.
    pub outside_pool: usize,
}

/// One layer's line in the activation table.
#[derive(Debug, Clone, Serialize)]
pub struct LayerLine {
    pub layer: String,
    /// How many of this layer the model has (a block's layers repeat per block).
    pub count: usize,
    pub params: usize,
    pub flops_forward: u64,
    pub flops_backward: u64,
    /// Device bytes kept for the backward, per layer.
    pub saved_bytes: usize,
    /// The same under `train.recompute=blocks`.
    pub saved_bytes_recompute: usize,
}

/// A tensor-core dimension that is not a multiple of what the tensor cores want.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Misaligned {
    pub dimension: String,
    pub value: usize,
    pub multiple: usize,
    pub padded: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub request: PlanRequest,
    pub params: usize,
    pub breakdown: Breakdown,
    /// The pool's peak: what `MemoryPool::stats().peak` measures for the step.
    pub pool_peak: usize,
    /// Rounding of the pool's buffers by the device allocator (0 on the CPU).
    pub allocator_rounding: usize,
    /// Everything kiln allocates on the device at the peak: the breakdown plus rounding.
    pub device_peak: usize,
    /// The operation running at the peak.
    pub peak_at: String,
    /// The step's live bytes at the peak by the operation that booked them, largest first
    /// (weights and optimizer state left out).
    pub largest_at_peak: Vec<(String, usize)>,
    /// Host bytes the optimizer offload keeps (fp32 masters and both moments), pinned.
    pub host_offload: usize,
    pub cost: Cost,
    /// Extra forward FLOPs the backward runs under recomputation.
    pub recompute_flops: u64,
    pub tokens: usize,
    /// Elements of each trained parameter, in the model's order.
    #[serde(skip)]
    pub trainable_elements: Vec<usize>,
}

impl Plan {
    pub fn flops_per_token(&self) -> f64 {
        (self.cost.flops_forward + self.cost.flops_backward + self.recompute_flops) as f64
            / self.tokens as f64
    }
}

/// Plans one step of `r` by running it on a meta device standing in for `r.device`. A
/// configuration the real step refuses is refused with the same error, before anything is
/// allocated. For ResNet-BK the mixture-of-experts layers route nothing on the meta device,
/// so their buffers are booked at the capacity factor's sizes: the worst case, which a real
/// step's routing meets or undercuts.
pub fn plan(r: &PlanRequest) -> crate::error::Result<Plan> {
    let m = meta::meta_step(&r.step_config(), r.vocab, r.device, r.precision())?;
    let l = &m.at_peak;
    let b = Breakdown::of(&m);
    let mut rounding = 0;
    if r.gpu() {
        rounding = l.alignment;
        let total = m.device_peak + rounding;
        rounding += total.next_multiple_of(POOL_GRANULE) - total;
    }
    let largest = largest_at_peak(l);
    let cost = match r.resnet_bk() {
        None => r.model.cost_on(r.micro_batch, r.seq_len, r.layout()),
        Some(cfg) => cfg.cost(r.micro_batch, r.seq_len),
    };
    Ok(Plan {
        request: r.clone(),
        params: m.params,
        breakdown: b,
        pool_peak: m.pool_peak,
        allocator_rounding: rounding,
        device_peak: m.device_peak + rounding,
        peak_at: l.op.to_string(),
        largest_at_peak: largest,
        host_offload: if r.offload_optimizer {
            12 * m.params
        } else {
            0
        },
        recompute_flops: if r.recompute {
            let block = match r.resnet_bk() {
                None => block_cost(&r.model, r.micro_batch, r.seq_len, r.layout()),
                Some(cfg) => cfg.block_cost(r.micro_batch, r.seq_len),
            };
            block.flops_forward * r.model.n_layers as u64
        } else {
            0
        },
        cost,
        tokens: r.micro_batch * r.seq_len,
        trainable_elements: m.trainable_elements,
    })
}

fn block_cost(m: &GptConfig, batch: usize, seq: usize, layout: ActLayout) -> Cost {
    use crate::nn::{attention::CausalSelfAttention, layernorm::LayerNorm, mlp::Mlp};
    let tokens = batch * seq;
    LayerNorm::cost_of(m.d_model, tokens, layout)
        + CausalSelfAttention::cost_of(m.d_model, m.n_heads, batch, seq, layout)
        + LayerNorm::cost_of(m.d_model, tokens, layout)
        + Mlp::cost_of(m.d_model, 4 * m.d_model, tokens, layout)
}

/// The activation table: each layer's parameters, FLOPs and saved bytes for the request's
/// micro-batch, from the layers' own costs.
pub fn layer_table(r: &PlanRequest) -> Vec<LayerLine> {
    use crate::nn::{
        attention::CausalSelfAttention,
        bk_core::{BkCore, BkCoreOptions},
        embedding::Embedding,
        layernorm::LayerNorm,
        linear::Linear,
        mlp::Mlp,
        moe::Moe,
    };
    let layout = r.layout();
    let (b, t, c) = (r.micro_batch, r.seq_len, r.model.d_model);
    let n = b * t;
    let padded = r.model.padded_vocab();
    let norm = LayerNorm::cost_of(c, n, layout);
    let block: Vec<(&str, Cost)> = match r.resnet_bk() {
        Some(cfg) => vec![
            ("block.ln", norm),
            ("block.moe (all slots kept)", Moe::cost_of(&cfg.moe, n)),
            ("block.v_proj", Linear::cost_of(c, 1, true, n)),
            (
                "block.bk_core",
                BkCore::cost_of(BkCoreOptions::default(), cfg.context, b, t),
            ),
            ("block.out_proj", Linear::cost_of(2, c, false, n)),
        ],
        None => vec![
            ("block.ln1", norm),
            (
                "block.attn",
                CausalSelfAttention::cost_of(c, r.model.n_heads, b, t, layout),
            ),
            ("block.ln2", norm),
            ("block.mlp", Mlp::cost_of(c, 4 * c, n, layout)),
        ],
    };
    stack_table(
        Embedding::cost_of(padded, r.model.context, c, n),
        &block,
        r.model.n_layers,
        layout.act_bytes(n * c),
        norm,
        Linear::cost_of(c, padded, false, n),
        r.model.tied_head,
    )
}

/// The activation table of a Llama-family step: each layer's parameters, FLOPs and saved
/// bytes for `batch x seq` tokens, from the layers' own costs (as [`layer_table`] for GPT).
pub fn llama_layer_table(
    l: &crate::models::llama::LlamaConfig,
    batch: usize,
    seq: usize,
    layout: ActLayout,
) -> Vec<LayerLine> {
    let (embedding, block, ln_f, head) = l.layer_costs(batch, seq, layout);
    let block: Vec<(&str, Cost)> = block.iter().map(|(n, c)| (n.as_str(), *c)).collect();
    stack_table(
        embedding,
        &block,
        l.n_layers,
        layout.act_bytes(batch * seq * l.d_model),
        ln_f,
        head,
        l.tied_head,
    )
}

/// The table of a pre-norm stack: the embedding, `layers` times the `block` lines (the first
/// being the norm that opens a block), the final norm and the head. Under recomputation a
/// block keeps only its input, `stream` bytes; the token ids live in host memory and the
/// logits only between the forward and the head's backward.
fn stack_table(
    embedding: Cost,
    block: &[(&str, Cost)],
    layers: usize,
    stream: usize,
    ln_f: Cost,
    head: Cost,
    tied: bool,
) -> Vec<LayerLine> {
    let line = |layer: &str, count: usize, cost: Cost, recompute: usize| LayerLine {
        layer: layer.into(),
        count,
        params: cost.params,
        flops_forward: cost.flops_forward,
        flops_backward: cost.flops_backward,
        saved_bytes: cost.saved_bytes,
        saved_bytes_recompute: recompute,
    };
    let mut lines = vec![line(
        "embedding",
        1,
        Cost {
            saved_bytes: 0,
            ..embedding
        },
        0,
    )];
    for (i, (name, cost)) in block.iter().enumerate() {
        lines.push(line(name, layers, *cost, if i == 0 { stream } else { 0 }));
    }
    lines.push(line("ln_f", 1, ln_f, ln_f.saved_bytes));
    let head = Cost {
        params: if tied { 0 } else { head.params },
        saved_bytes: 0,
        ..head
    };
    let name = if tied { "head (tied to wte)" } else { "head" };
    lines.push(line(name, 1, head, 0));
    lines
}

/// Where the plan must fit: a device's memory, what is not kiln's on it, and a margin.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budget {
    /// What the memory is ("NVIDIA H100 80GB", "this machine's RAM", "train.memory_limit").
    pub name: String,
    #[serde(serialize_with = "device_name")]
    pub device: Device,
    /// Total memory of the device.
    pub capacity: usize,
    /// The CUDA context and anything else on the device before kiln allocates (0 on the CPU).
    pub context: usize,
    /// Whether `context` was measured on this machine (else it is [`CUDA_CONTEXT_ESTIMATE`]).
    pub context_measured: bool,
    /// Headroom left unplanned, for allocator fragmentation and what the plan does not see.
    pub margin: usize,
    /// A cap on the pool's bytes (`train.memory_limit`), which the pool enforces exactly.
    pub pool_limit: Option<usize>,
    /// Compute capability of a GPU, for the precision it can run.
    pub compute_capability: Option<(u32, u32)>,
}

impl Budget {
    /// A GPU of `capacity` bytes; the margin is 5% of it (allocator fragmentation and
    /// buffers the plan cannot see, such as a first step's GEMM tuning scratch).
    pub fn gpu(name: String, capacity: usize, context: Option<usize>, cc: (u32, u32)) -> Budget {
        Budget {
            name,
            device: Device::Cuda(0),
            capacity,
            context: context.unwrap_or(CUDA_CONTEXT_ESTIMATE),
            context_measured: context.is_some(),
            margin: capacity / 20,
            pool_limit: None,
            compute_capability: Some(cc),
        }
    }

    /// The CPU with `ram` bytes; the margin is 10% for the rest of the system.
    pub fn cpu(ram: usize) -> Budget {
        Budget {
            name: "this machine's RAM".into(),
            device: Device::Cpu,
            capacity: ram,
            context: 0,
            context_measured: true,
            margin: ram / 10,
            pool_limit: None,
            compute_capability: None,
        }
    }

    /// Caps the pool at `limit` bytes. On the CPU the limit is then the whole budget, and
    /// exact: the pool books every tensor and refuses past it, so no margin is needed.
    pub fn with_pool_limit(mut self, limit: usize) -> Budget {
        if self.device == Device::Cpu {
            self.name = format!("train.memory_limit ({})", gib(limit));
            self.capacity = limit;
            self.margin = 0;
        }
        self.pool_limit = Some(limit);
        self
    }

    /// Bytes the plan may use on the device.
    pub fn usable(&self) -> usize {
        self.capacity.saturating_sub(self.context + self.margin)
    }

    pub fn fits(&self, p: &Plan) -> bool {
        self.holds(p.pool_peak, p.device_peak)
    }

    /// Whether a pool peak and a device peak fit this budget (any plan's peaks).
    pub fn holds(&self, pool_peak: usize, device_peak: usize) -> bool {
        device_peak <= self.usable() && self.pool_limit.is_none_or(|l| pool_peak <= l)
    }
}

/// The largest micro-batch of `r` (its `micro_batch` ignored) whose step fits `budget`, or
/// `None` when one sequence does not fit. Memory grows with the micro-batch, so the boundary
/// is found by doubling, then bisection.
pub fn largest_micro_batch(
    r: &PlanRequest,
    budget: &Budget,
) -> crate::error::Result<Option<usize>> {
    let fits = |b: usize| plan(&r.with_batch(b)).map(|p| budget.fits(&p));
    if !fits(1)? {
        return Ok(None);
    }
    // A cap far beyond any device, so a model of no activations cannot loop forever.
    const CAP: usize = 1 << 24;
    let mut lo = 1;
    let mut hi = 2;
    while hi <= CAP && fits(hi)? {
        lo = hi;
        hi *= 2;
    }
    if hi > CAP {
        return Ok(Some(lo));
    }
    // fits(lo), !fits(hi)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

/// The four ways to run a step that the planner compares.
pub const VARIANTS: [(&str, bool, bool); 4] = [
    ("plain", false, false),
    ("recompute=blocks", true, false),
    ("offload", false, true),
    ("recompute+offload", true, true),
];

/// The largest micro-batch of each variant ([`VARIANTS`]); offload is skipped on the CPU,
/// where host memory is the device.
pub fn largest_by_variant(
    r: &PlanRequest,
    budget: &Budget,
) -> crate::error::Result<Vec<(&'static str, Option<usize>)>> {
    VARIANTS
        .iter()
        .filter(|v| r.gpu() || !v.2)
        .map(|&(name, recompute, offload)| {
            let v = PlanRequest {
                recompute,
                offload_optimizer: offload,
                ..r.clone()
            };
            Ok((name, largest_micro_batch(&v, budget)?))
        })
        .collect()
}

/// When one sequence of `r` does not fit `budget`: what it needs, what the device has, and
/// the options that would bring it down, each with the bytes it saves.
pub fn one_sequence_advice(
    r: &PlanRequest,
    budget: &Budget,
) -> crate::error::Result<Option<String>> {
    let one = r.with_batch(1);
    let base = plan(&one)?;
    if budget.fits(&base) {
        return Ok(None);
    }
    let saves =
        |alt: PlanRequest| plan(&alt).map(|p| base.device_peak.saturating_sub(p.device_peak));
    let mut options = Vec::new();
    if !one.recompute {
        let s = saves(PlanRequest {
            recompute: true,
            ..one.clone()
        })?;
        options.push(format!("train.recompute=blocks (saves {})", gib(s)));
    }
    if !one.offload_optimizer && one.gpu() {
        let s = saves(PlanRequest {
            offload_optimizer: true,
            ..one.clone()
        })?;
        options.push(format!("train.offload_optimizer=true (saves {})", gib(s)));
    }
    let bf16_ok = budget.compute_capability.is_none_or(|cc| cc.0 >= 8);
    if one.compute == DType::F32 {
        let s = saves(PlanRequest {
            compute: DType::BF16,
            ..one.clone()
        })?;
        let name = if bf16_ok { "bf16-mixed" } else { "fp16-mixed" };
        options.push(format!("train.precision={name} (saves {})", gib(s)));
    }
    // The longest sequence that fits with everything else as configured.
    let mut lo = 0;
    let mut hi = one.seq_len;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if budget.fits(&plan(&PlanRequest {
            seq_len: mid,
            ..one.clone()
        })?) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    options.push(if lo > 0 {
        format!("a shorter train.seq_len (at most {lo} fits as configured)")
    } else {
        "a shorter train.seq_len (none fits as configured: the weights and optimizer state alone are too large)".into()
    });
    let device_word = if one.gpu() { "the GPU" } else { "the budget" };
    Ok(Some(format!(
        "needs {} for one sequence of {} tokens (plus {} for the CUDA context and a margin of {}), {device_word} ({}) has {}; try {}",
        gib(base.device_peak),
        one.seq_len,
        gib(budget.context),
        gib(budget.margin),
        budget.name,
        gib(budget.capacity),
        options.join(", ")
    )))
}

/// Tensor-core GEMM dimensions of the model and micro-batch that are not multiples of 8
/// (16 for 1-byte types), with the padded size that fixes each. `vocab` is the tokenizer's.
pub fn misaligned_dimensions(r: &PlanRequest, vocab: usize, elem_bytes: usize) -> Vec<Misaligned> {
    let multiple = if elem_bytes == 1 { 16 } else { 8 };
    let m = &r.model;
    if let Some(cfg) = r.resnet_bk() {
        let dims = [
            ("d_model", cfg.d_model),
            ("expert hidden width", cfg.moe.hidden),
            ("vocabulary (logits)", cfg.vocab.max(vocab)),
            ("tokens per micro-batch", r.micro_batch * r.seq_len),
        ];
        return misaligned_of(&dims, multiple);
    }
    let dims = [
        ("d_model", m.d_model),
        ("3 x d_model (qkv)", 3 * m.d_model),
        ("4 x d_model (mlp)", 4 * m.d_model),
        (
            "head size (d_model / n_heads)",
            m.d_model / m.n_heads.max(1),
        ),
        ("vocabulary (logits)", m.vocab.max(vocab)),
        ("tokens per micro-batch", r.micro_batch * r.seq_len),
    ];
    misaligned_of(&dims, multiple)
}

fn misaligned_of(dims: &[(&str, usize)], multiple: usize) -> Vec<Misaligned> {
    dims.iter()
        .filter(|(_, v)| v % multiple != 0)
        .map(|&(d, v)| Misaligned {
            dimension: d.into(),
            value: v,
            multiple,
            padded: if d.starts_with("vocabulary") {
                v.next_multiple_of(128)
            } else {
                v.next_multiple_of(multiple)
            },
        })
        .collect()
}

/// Bytes as GiB (or MiB when small) for messages.
pub fn gib(bytes: usize) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Total RAM from `/proc/meminfo`, if readable.
pub fn machine_ram() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests;

/// Builds a trainer with micro-batch `b` and runs one optimizer step on synthetic tokens;
/// everything it allocated is freed on return.
pub fn trial_step(
    cfg: &Config,
    vocab: usize,
    precision: Precision,
    pool: &Arc<MemoryPool>,
    b: usize,
) -> crate::error::Result<bool> {
    let mut cfg = cfg.clone();
    cfg.train.micro_batch = b;
    let t = cfg.train.seq_len;
    let mut trainer = Trainer::new(&cfg, vocab, pool, precision)?;
    let ids = |k: usize| {
        (0..b * t)
            .map(|i| ((i * 31 + k) % vocab) as u32)
            .collect::<Vec<u32>>()
    };
    let batch = Batch {
        inputs: ids(0),
        targets: ids(1),
        batch: b,
        seq: t,
    };
    trainer.step(&[batch])?;
    if let Ok(g) = pool.cuda() {
        g.synchronize().map_err(EngineError::from)?;
    }
    // The trainer recovers from out-of-memory by splitting the micro-batch; a split means
    // `b` sequences did not fit in one pass.
    Ok(trainer.passes.learned().is_none())
}

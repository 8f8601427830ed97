//! Layered run configuration for kiln.
//!
//! A run's settings come from four layers, each overriding the one before:
//! built-in defaults, a hardware profile (`--profile`, see [`profile`]), then an
//! optional TOML file (`--config FILE`), then `KEY=VALUE` overrides on dotted
//! keys such as `train.steps=50`. With `--profile auto` a last step ([`auto`])
//! replaces the values no file or override chose with ones derived from the
//! machine and the memory planner. The file
//! holds the settings a user wants to keep and share; overrides are for the
//! one-off tweak on the command line, so they win. Every value remembers
//! which layer set it, so `--print-config` can show why a run used what it
//! used.
//!
//! Layers are merged as flat maps from dotted key to TOML value rather than
//! as typed structs. That way a layer only has to mention the keys it
//! changes, every key can be checked against the known set (with a
//! "did you mean" hint) before anything is decoded, and type errors can name
//! the key and the layer that supplied the bad value.

pub mod auto;
mod error;
pub mod model;
mod presets;
pub mod profile;
pub mod settings;
mod validate;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use toml::{Table, Value};

use crate::models::family::{self, FAMILIES};

pub use error::ConfigError;
pub use model::{FamilySettings, LlamaSettings, ModelConfig, ResnetBkSettings};
pub use profile::Profile;
pub use validate::parse_bytes;
pub(crate) use validate::{at_least_one, finite, out_of_range};

/// The full configuration of a training run.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Model architecture.
    pub model: ModelConfig,
    /// Corpus, tokenizer and data loading.
    pub data: DataConfig,
    /// Device, precision, batch shape, schedule of evals and checkpoints.
    pub train: TrainConfig,
    /// Optimizer (AdamW) and learning-rate schedule.
    pub optim: OptimConfig,
    /// Low-rank adapters over a frozen pretrained base (`kiln finetune`).
    pub lora: LoraConfig,
    /// The Shannon control unit: a controller on the strength of the adapters' penalty.
    pub scu: ScuConfig,
    /// Data parallelism (`kiln train --gpus N`, torchrun, Slurm).
    pub dist: DistConfig,
    /// Polychromic fine-tuning: a reward for the diversity of sampled replies.
    pub polychromic: PolychromicConfig,
}

// `default` on the sections lets a config saved by an older build, which
// lacks keys added since, still load; resolution itself always supplies
// every key.

/// `[data]`: what to train on and how to feed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Path of a text corpus; empty means the bundled Shakespeare corpus.
    pub corpus: String,
    /// Tokenizer: "byte" (256 raw bytes), "gpt2" (BPE), or the path of a pretrained model's
    /// tokenizer (a model directory, a tokenizer.json, a SentencePiece tokenizer.model or a .gguf
    /// file).
    pub tokenizer: String,
    /// Fraction of the corpus held out for validation, in (0, 0.5).
    pub val_fraction: f64,
    /// A validation file in the shape of `corpus` (text, or the same JSON lines): all of
    /// `corpus` then trains and this validates, in place of `val_fraction`'s tail. Empty:
    /// the tail.
    pub val_corpus: String,
    /// Batches prepared ahead of the training loop.
    pub prefetch: usize,
    /// Threads that tokenise the corpus; 0 means one per CPU thread.
    pub loader_threads: usize,
    /// How to read data.corpus: "text" (plain text, every token trained), "prompt_completion"
    /// (JSON lines with `prompt` and `completion`; only completions trained), "alpaca" (JSON
    /// lines with `instruction`, optional `input` and `output` under Alpaca's prompt; only
    /// outputs trained) or "chat" (conversations as `messages`, ShareGPT's `conversations`,
    /// TRL's `prompt`/`completion` turn lists or Alpaca lines, rendered by the model's chat
    /// template; only assistant turns trained).
    pub format: String,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            corpus: String::new(),
            tokenizer: "byte".into(),
            val_fraction: 0.05,
            val_corpus: String::new(),
            prefetch: 4,
            loader_threads: 0,
            format: "text".into(),
        }
    }
}

/// `[train]`: where and how the training loop runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// "auto" (GPU if present), "cpu", "cuda" or "cuda:N" for GPU number N.
    pub device: String,
    /// Numeric precision: "fp32", "tf32", "bf16-mixed" or "fp16-mixed".
    pub precision: String,
    /// Tokens per training sequence; at most `model.context`.
    pub seq_len: usize,
    /// Sequences per forward/backward pass.
    pub micro_batch: usize,
    /// Micro-batches accumulated into one optimizer step.
    pub grad_accum: usize,
    /// Sequences per optimizer step; 0 means micro_batch x grad_accum. When set, the
    /// accumulation is derived from it, so the micro-batch can change (by hand, by the
    /// planner, or after an out-of-memory split) without changing the optimisation.
    pub global_batch: usize,
    /// Number of optimizer steps to run.
    pub steps: usize,
    /// When above 0, decides `steps` instead: enough steps to draw this many times as many
    /// rows as the training data holds (its packed fine-tuning rows, or its windows of
    /// `seq_len` tokens). Rows are drawn at random, so an epoch is a count of rows, not one
    /// pass over each of them.
    pub epochs: f64,
    /// Seed for weight init and data order; same seed, same run.
    pub seed: u64,
    /// Evaluate every this many steps; 0 evaluates only at the end.
    pub eval_every: usize,
    /// Validation batches averaged per evaluation.
    pub eval_batches: usize,
    /// Stop the run (with a checkpoint) once this many evaluations in a row have not
    /// lowered the best validation loss by more than `early_stop_min_delta`; 0 never stops
    /// early. Needs `eval_every` > 0.
    pub early_stop_patience: usize,
    /// The least fall of the validation loss that counts as an improvement.
    pub early_stop_min_delta: f64,
    /// Checkpoint every evaluation that lowers the best validation loss (by more than
    /// `early_stop_min_delta`) and keep the newest such checkpoint through pruning;
    /// `checkpoints/best` names it and `--checkpoint best` reads it. Needs `eval_every` > 0.
    pub keep_best: bool,
    /// Save a checkpoint every this many steps; 0 saves only at the end.
    pub checkpoint_every: usize,
    /// Write checkpoints on a background thread from a host copy of the state (gathered
    /// through page-locked staging beside a GPU), so training stands still only for the
    /// copy. `false` saves in line, as kiln first did: training waits for the copy and the
    /// write, which is what the background writer is measured against.
    pub checkpoint_async: bool,
    /// Save a checkpoint after the last step. `false` is for runs whose weights nobody
    /// needs (benchmarks, throughput checks): a 1B model's final save is 14 GB of weights
    /// and moments. A stop request (SIGTERM, Ctrl-C) still saves.
    pub save_final: bool,
    /// Evaluate once before the first step of a fresh run (not on resume): for a
    /// fine-tune, the base model's validation loss, the "before" of the run.
    pub eval_at_start: bool,
    /// Print training metrics every this many steps.
    pub log_every: usize,
    /// Starting loss scale for fp16-mixed; a power of two.
    pub loss_scale_init: f64,
    /// Overflow-free steps before the fp16 loss scale doubles.
    pub loss_scale_growth_interval: usize,
    /// Activation recomputation: "none", "blocks" (keep only each transformer block's input
    /// and re-run its forward during the backward) or "auto" (only when the model would not
    /// fit otherwise).
    pub recompute: String,
    /// Keep fp32 master weights and optimizer state in pinned host memory and run the
    /// optimizer on the CPU, leaving the GPU only the compute weights and gradients.
    pub offload_optimizer: bool,
    /// Run kiln's fused kernels (cross-entropy with its backward, AdamW in one pass, residual
    /// add with layernorm). `false` runs each as the chain of single-purpose kernels a
    /// framework without custom kernels launches, with the same mathematics: the baseline
    /// that `kiln bench amp` measures the fusion against.
    pub fused_kernels: bool,
    /// Cap on the bytes the memory pool may hand out, e.g. "12GiB" or "800MB"; empty means
    /// no cap beyond the device. Lets out-of-memory handling be exercised on purpose.
    pub memory_limit: String,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            device: "auto".into(),
            precision: "fp32".into(),
            seq_len: 128,
            micro_batch: 16,
            grad_accum: 1,
            global_batch: 0,
            steps: 300,
            epochs: 0.0,
            seed: 1337,
            eval_every: 100,
            eval_batches: 16,
            early_stop_patience: 0,
            early_stop_min_delta: 0.0,
            keep_best: false,
            checkpoint_every: 100,
            checkpoint_async: true,
            save_final: true,
            eval_at_start: false,
            log_every: 10,
            loss_scale_init: 65536.0,
            loss_scale_growth_interval: 2000,
            recompute: "auto".into(),
            offload_optimizer: false,
            fused_kernels: true,
            memory_limit: String::new(),
        }
    }
}

/// `[optim]`: AdamW and the learning-rate schedule (warmup, then cosine, linear or constant).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate, reached after warmup.
    pub lr: f64,
    /// Learning rate at the last step, where the decay ends (cosine and linear schedules).
    pub min_lr: f64,
    /// The schedule after warmup: "cosine" (to min_lr), "linear" (to min_lr, the Hugging Face
    /// Trainer's default shape) or "constant" (lr to the end).
    pub schedule: String,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: usize,
    /// Decoupled (AdamW) weight decay.
    pub weight_decay: f64,
    /// Adam first-moment decay.
    pub beta1: f64,
    /// Adam second-moment decay.
    pub beta2: f64,
    /// Adam denominator epsilon, for numerical stability.
    pub eps: f64,
    /// Clip the global gradient norm to this; 0 disables clipping.
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            min_lr: 3e-4,
            schedule: "cosine".into(),
            warmup_steps: 20,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
        }
    }
}

/// `[lora]`: low-rank adapters over a frozen base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Train adapters on a frozen base instead of every weight.
    pub enabled: bool,
    /// The pretrained base the adapters belong to (a Hugging Face directory or .gguf file).
    pub base: String,
    /// Rank of each adapter.
    pub rank: usize,
    /// Scale numerator: the adapter's output is multiplied by alpha / rank.
    pub alpha: f64,
    /// Dropout on the adapters' input (only 0 is supported).
    pub dropout: f64,
    /// Comma-separated module names to adapt, as Hugging Face names them (a Llama's q_proj,
    /// k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; a GPT-2's c_attn, c_proj,
    /// c_fc), or "all-linear": every block projection (the default; not the head).
    pub targets: String,
    /// Rank-stabilised scaling: alpha / sqrt(rank).
    pub rslora: bool,
    /// How the frozen projections are kept: "none" (the compute dtype) or "nf4" (QLoRA:
    /// 4-bit NormalFloat, expanded into a shared workspace for each GEMM).
    pub quantize: String,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            base: String::new(),
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: "all-linear".into(),
            rslora: false,
            quantize: "none".into(),
        }
    }
}

/// `[scu]`: the Shannon control unit, a PI controller on the penalty weight lambda that holds
/// the penalty's share S of the total bits per token at a target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScuConfig {
    /// Add the penalty lambda * ParamBPT to the loss (with lora.enabled).
    pub enabled: bool,
    /// Run the controller; false keeps lambda at scu.lambda_init (a fixed penalty).
    pub control: bool,
    /// Target S* of S = ParamBPT / (DataBPT + ParamBPT), in (0, 1).
    pub target: f64,
    /// Proportional gain.
    pub kp: f64,
    /// Integral gain.
    pub ki: f64,
    /// Prior scale sigma of the adapter weights.
    pub sigma: f64,
    /// Training tokens per epoch N in ParamBPT; 0 = the training split's size.
    pub tokens_per_epoch: f64,
    /// Smoothing factor of the EMA of S.
    pub ema: f64,
    /// Half-width of the band around S* where lambda holds.
    pub deadband: f64,
    /// Leak of the integral per controller update.
    pub leak: f64,
    /// Bound on the integral term.
    pub i_max: f64,
    /// Starting lambda.
    pub lambda_init: f64,
    pub lambda_min: f64,
    pub lambda_max: f64,
    /// Run the controller every this many optimizer steps.
    pub every: usize,
}

impl Default for ScuConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            control: true,
            target: 0.02,
            kp: 0.8,
            ki: 0.15,
            sigma: 0.01,
            tokens_per_epoch: 0.0,
            ema: 0.1,
            deadband: 0.002,
            leak: 0.995,
            i_max: 0.2,
            lambda_init: 1.0,
            lambda_min: 1e-4,
            lambda_max: 10.0,
            every: 1,
        }
    }
}

/// `[dist]`: how ranks of a data-parallel run share the work. The number of ranks comes from
/// the launch (`--gpus`, torchrun, Slurm), not from here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// ZeRO stage: 0 replicates everything, 1 shards the optimizer moments, 2 also the
    /// reduced gradients.
    pub zero: usize,
    /// Gradient bytes per all-reduce bucket, in MiB.
    pub bucket_mb: f64,
    /// Seconds a rank waits for the others (rendezvous, control collectives) before it
    /// stops with an error naming the rank it waited for.
    pub timeout_s: f64,
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            zero: 0,
            bucket_mb: 25.0,
            timeout_s: 300.0,
        }
    }
}

/// `[polychromic]`: fine-tuning on `CE - lambda * D`, where D is the mean pairwise cosine
/// distance between the embeddings of replies sampled for one prompt (see
/// [`crate::train::polychromic`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolychromicConfig {
    /// Add the diversity term (`kiln finetune --objective polychromic`).
    pub enabled: bool,
    /// Weight of D against the cross-entropy.
    pub lambda: f64,
    /// Accept a negative lambda, which rewards replies for resembling each other.
    pub allow_negative_lambda: bool,
    /// Replies sampled per prompt (at least 2: D is a mean over pairs).
    pub samples: usize,
    /// Training prompts per step that get replies sampled.
    pub prompts: usize,
    /// Sample and add the diversity term every this many optimizer steps.
    pub every: usize,
    /// Sampling temperature of the replies.
    pub temperature: f64,
    /// Nucleus (top-p) sampling of the replies; 1 = the whole distribution.
    pub top_p: f64,
    /// Longest reply in tokens.
    pub max_new_tokens: usize,
    /// The sentence encoder that embeds replies; empty = the starting model, frozen, its
    /// final hidden states mean-pooled.
    pub embedder: String,
}

impl Default for PolychromicConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lambda: 0.5,
            allow_negative_lambda: false,
            samples: 4,
            prompts: 4,
            every: 1,
            temperature: 1.0,
            top_p: 1.0,
            max_new_tokens: 32,
            embedder: String::new(),
        }
    }
}

/// Every key with its `--help` text, in the order the sections and fields
/// are declared. A test checks this list against the structs so the two
/// cannot drift apart.
const KEYS: &[(&str, &str)] = &[
    (
        "model.kind",
        "model family: \"gpt\", \"resnet_bk\" or \"llama\"",
    ),
    ("model.d_model", "embedding width"),
    ("model.n_layers", "number of transformer blocks"),
    ("model.n_heads", "attention heads; must divide d_model"),
    ("model.context", "max sequence length the model supports"),
    ("model.tied_head", "share embedding and output weights"),
    (
        "model.preset",
        "named size (resnet_bk: tiny, small, base); empty = none",
    ),
    ("model.moe_experts", "resnet_bk: experts per MoE layer"),
    ("model.moe_top_k", "resnet_bk: experts per token, 1 or 2"),
    (
        "model.moe_hidden",
        "resnet_bk: expert hidden width; 0 = 2 x d_model",
    ),
    (
        "model.moe_capacity_factor",
        "resnet_bk: expert capacity over an even share of slots",
    ),
    (
        "model.moe_aux_coef",
        "resnet_bk: load-balancing loss weight",
    ),
    (
        "model.vocab",
        "embedding rows; 0 = the tokenizer's vocabulary",
    ),
    (
        "model.n_kv_heads",
        "llama: key/value heads (grouped-query); 0 = n_heads",
    ),
    (
        "model.head_dim",
        "llama: width per head; 0 = d_model / n_heads",
    ),
    (
        "model.ffn_hidden",
        "llama: SwiGLU hidden width; 0 = 8/3 x d_model rounded to 64",
    ),
    ("model.rope_theta", "llama: rotary frequency base"),
    ("model.rot_dim", "llama: rotated dims per head; 0 = all"),
    (
        "model.rope_scaling_factor",
        "llama: Llama 3 rotary scaling factor; 0 = none",
    ),
    (
        "model.rope_low_freq_factor",
        "llama: Llama 3 scaling low factor",
    ),
    (
        "model.rope_high_freq_factor",
        "llama: Llama 3 scaling high factor",
    ),
    (
        "model.rope_original_context",
        "llama: trained rotary context (Llama 3, LongRoPE)",
    ),
    (
        "model.rope_short_factors",
        "llama: LongRoPE divisors up to trained context; [] = none",
    ),
    (
        "model.rope_long_factors",
        "llama: LongRoPE divisors past the trained context",
    ),
    (
        "model.rope_attention_factor",
        "llama: rotary cos/sin scale (LongRoPE); 1 = none",
    ),
    (
        "model.rope_longest_context",
        "llama: positions LongRoPE was made for; 0 = unstated",
    ),
    ("model.norm_eps", "llama: RMS norm epsilon"),
    (
        "model.qkv_bias",
        "llama: biases on q/k/v projections (Qwen2)",
    ),
    (
        "model.qk_norm",
        "llama: per-head RMSNorm on queries and keys (Qwen3)",
    ),
    (
        "model.sliding_window",
        "llama: attend to the latest N positions (Mistral); 0 = all",
    ),
    (
        "model.full_attention_layers",
        "llama: first layers without the window (max_window_layers)",
    ),
    (
        "model.checkpoint_arch",
        "llama: export layout: \"\" = from the settings, or \"phi3\"",
    ),
    (
        "data.corpus",
        "text file to train on; empty = bundled Shakespeare",
    ),
    (
        "data.tokenizer",
        "\"byte\", \"gpt2\", or a pretrained model's tokenizer path",
    ),
    (
        "data.val_fraction",
        "share of corpus held out for validation",
    ),
    (
        "data.val_corpus",
        "validation file; empty = data.corpus's last val_fraction",
    ),
    ("data.prefetch", "batches prepared ahead of time"),
    (
        "data.loader_threads",
        "threads that tokenise the corpus; 0 = CPU threads",
    ),
    (
        "data.format",
        "\"text\", \"prompt_completion\", \"alpaca\" or \"chat\" (JSON lines)",
    ),
    ("train.device", "\"auto\", \"cpu\", \"cuda\" or \"cuda:N\""),
    (
        "train.precision",
        "\"fp32\", \"tf32\", \"bf16-mixed\" or \"fp16-mixed\"",
    ),
    ("train.seq_len", "tokens per sequence; <= model.context"),
    ("train.micro_batch", "sequences per forward/backward pass"),
    ("train.grad_accum", "micro-batches per optimizer step"),
    (
        "train.global_batch",
        "sequences per optimizer step; 0 = micro x accum",
    ),
    ("train.steps", "optimizer steps to run"),
    (
        "train.epochs",
        "> 0: steps drawing this many times the data's rows",
    ),
    ("train.seed", "random seed"),
    (
        "train.eval_every",
        "steps between evals; 0 = only at the end",
    ),
    ("train.eval_batches", "batches per eval"),
    (
        "train.early_stop_patience",
        "evals without a better val loss before stopping; 0 = never",
    ),
    (
        "train.early_stop_min_delta",
        "least val loss fall that counts as better",
    ),
    (
        "train.keep_best",
        "keep the checkpoint of the best val loss (--checkpoint best)",
    ),
    (
        "train.checkpoint_every",
        "steps between checkpoints; 0 = only at the end",
    ),
    (
        "train.eval_at_start",
        "true = evaluate before the first step (the base's loss)",
    ),
    (
        "train.checkpoint_async",
        "false = save in line (training waits for the write)",
    ),
    (
        "train.save_final",
        "false = no checkpoint after the last step (benchmarks)",
    ),
    ("train.log_every", "steps between log lines"),
    (
        "train.loss_scale_init",
        "initial fp16 loss scale (power of two)",
    ),
    (
        "train.loss_scale_growth_interval",
        "clean steps before the fp16 loss scale doubles",
    ),
    (
        "train.recompute",
        "\"none\", \"blocks\" or \"auto\" (when it would not fit)",
    ),
    (
        "train.offload_optimizer",
        "keep master weights and AdamW state in host memory",
    ),
    (
        "train.fused_kernels",
        "false = unfused kernel chains (the bench amp baseline)",
    ),
    (
        "train.memory_limit",
        "cap on pool memory, e.g. \"12GiB\"; empty = none",
    ),
    ("optim.lr", "peak learning rate"),
    ("optim.min_lr", "final learning rate after the decay"),
    (
        "optim.schedule",
        "\"cosine\", \"linear\" or \"constant\" after warmup",
    ),
    ("optim.warmup_steps", "linear warmup steps"),
    ("optim.weight_decay", "AdamW weight decay"),
    ("optim.beta1", "Adam beta1"),
    ("optim.beta2", "Adam beta2"),
    ("optim.eps", "Adam epsilon"),
    ("optim.grad_clip", "max gradient norm; 0 disables clipping"),
    ("lora.enabled", "train low-rank adapters on a frozen base"),
    ("lora.base", "the pretrained base (HF directory or .gguf)"),
    ("lora.rank", "rank of each adapter"),
    (
        "lora.alpha",
        "adapter scale numerator (scale = alpha / rank)",
    ),
    (
        "lora.dropout",
        "drop probability of the adapters' input, in [0, 1)",
    ),
    (
        "lora.targets",
        "modules to adapt (q_proj,v_proj or c_attn) or all-linear",
    ),
    ("lora.rslora", "rank-stabilised scale alpha / sqrt(rank)"),
    (
        "lora.quantize",
        "frozen projections: \"none\" or \"nf4\" (QLoRA)",
    ),
    ("scu.enabled", "add the adapter penalty lambda * ParamBPT"),
    ("scu.control", "adjust lambda to hold S at scu.target"),
    ("scu.target", "target share S* of penalty bits, in (0, 1)"),
    ("scu.kp", "controller proportional gain"),
    ("scu.ki", "controller integral gain"),
    ("scu.sigma", "prior scale of the adapter weights"),
    (
        "scu.tokens_per_epoch",
        "N in ParamBPT; 0 = the training split's tokens",
    ),
    ("scu.ema", "EMA factor of S"),
    ("scu.deadband", "band around S* where lambda holds"),
    ("scu.leak", "integral leak per update"),
    ("scu.i_max", "bound on the integral term"),
    ("scu.lambda_init", "starting lambda"),
    ("scu.lambda_min", "lower bound of lambda"),
    ("scu.lambda_max", "upper bound of lambda"),
    ("scu.every", "controller update every this many steps"),
    (
        "dist.zero",
        "ZeRO stage: 0 none, 1 optimizer state, 2 + gradients",
    ),
    ("dist.bucket_mb", "gradient MiB per all-reduce bucket"),
    ("dist.timeout_s", "seconds to wait for other ranks"),
    (
        "polychromic.enabled",
        "train on CE - lambda * D of sampled replies",
    ),
    ("polychromic.lambda", "weight of the diversity D"),
    (
        "polychromic.allow_negative_lambda",
        "accept lambda < 0 (rewards sameness)",
    ),
    (
        "polychromic.samples",
        "replies sampled per prompt, at least 2",
    ),
    ("polychromic.prompts", "prompts per step that get replies"),
    (
        "polychromic.every",
        "sample and add D every this many steps",
    ),
    (
        "polychromic.temperature",
        "sampling temperature of the replies",
    ),
    (
        "polychromic.top_p",
        "nucleus sampling of the replies; 1 = off",
    ),
    ("polychromic.max_new_tokens", "longest reply in tokens"),
    (
        "polychromic.embedder",
        "encoder of the replies; empty = the starting model",
    ),
];

/// Every dotted key, in section and field order.
pub fn all_keys() -> Vec<&'static str> {
    KEYS.iter().map(|(k, _)| *k).collect()
}

/// Short description of a dotted key, for `--help` text.
pub fn key_help(key: &str) -> Option<&'static str> {
    KEYS.iter().find(|(k, _)| *k == key).map(|(_, h)| *h)
}

/// Which layer set a value.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// The `--config` file at this path.
    File(PathBuf),
    /// A `KEY=VALUE` override.
    Override,
    /// A hardware profile, by name (or path).
    Profile(String),
    /// Derived from the machine or another key; the text says by which rule.
    Auto(String),
    /// The named `model.preset`.
    Preset(&'static str),
}

/// A validated configuration plus the layer each key's value came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedConfig {
    pub config: Config,
    /// Dotted key -> the layer that set it; has an entry for every key of the config (the
    /// shared keys and those of its `model.kind`).
    pub sources: BTreeMap<String, Source>,
}

/// The flat working form of a config while layers are merged.
type Flat = BTreeMap<String, Value>;

impl ResolvedConfig {
    /// Applies defaults, then the file (if any), then the overrides ("key=value" strings), then validates.
    pub fn resolve(file: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        Self::resolve_layers(None, file, overrides)
    }

    /// Applies defaults, the profile, the file and the overrides in that order, derives the
    /// accumulation from `train.global_batch`, then validates.
    pub fn resolve_layers(
        profile: Option<&Profile>,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut values = default_flat()?;
        let mut sources: BTreeMap<String, Source> = values
            .keys()
            .map(|k| (k.clone(), Source::Default))
            .collect();

        if let Some(p) = profile {
            let origin = Source::Profile(p.name.clone());
            let table: Table =
                p.text
                    .parse()
                    .map_err(|e: toml::de::Error| ConfigError::ParseFile {
                        path: PathBuf::from(format!("profile {}", p.name)),
                        reason: e.to_string().trim_end().to_string(),
                    })?;
            let mut entries = Vec::new();
            flatten_file(&table, "", &origin, &values, &mut entries)?;
            for (key, value) in entries {
                set(&mut values, &mut sources, key, value, &origin)?;
            }
        }

        let mut saved_before_families = None;
        if let Some(path) = file {
            let origin = Source::File(path.to_path_buf());
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::ReadFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
            if text.lines().next() == Some(HEADER_BEFORE_FAMILIES) {
                saved_before_families = Some(origin.clone());
            }
            let table: Table =
                text.parse()
                    .map_err(|e: toml::de::Error| ConfigError::ParseFile {
                        path: path.to_path_buf(),
                        reason: e.to_string().trim_end().to_string(),
                    })?;
            let mut entries = Vec::new();
            flatten_file(&table, "", &origin, &values, &mut entries)?;
            for (key, value) in entries {
                set(&mut values, &mut sources, key, value, &origin)?;
            }
        }

        for arg in overrides {
            let (key, value) = parse_override(arg, &values)?;
            set(&mut values, &mut sources, key, value, &Source::Override)?;
        }

        select_family(&mut values, &mut sources, saved_before_families.as_ref())?;
        presets::apply(&mut values, &mut sources)?;
        let config = decode(&values)?;
        let mut resolved = Self { config, sources };
        resolved.derive_accumulation()?;
        resolved.config.validate()?;
        Ok(resolved)
    }

    /// Whether `key` still holds a value nobody chose for this run (a default or a profile's),
    /// which the automatic rules may replace.
    pub fn is_open(&self, key: &str) -> bool {
        matches!(
            self.sources.get(key),
            None | Some(Source::Default) | Some(Source::Profile(_))
        )
    }

    /// Sets `key` to `value` with `rule` as its origin, if nobody chose it (see
    /// [`Self::is_open`]); returns whether it did. Call [`Self::finish_auto`] afterwards.
    pub fn set_auto(
        &mut self,
        key: &str,
        value: impl Into<Value>,
        rule: impl Into<String>,
    ) -> Result<bool, ConfigError> {
        if !self.is_open(key) {
            return Ok(false);
        }
        self.set_derived(key, value.into(), rule.into())?;
        Ok(true)
    }

    /// Sets `key` whoever chose it, for a value that was literally "decide for me" (such
    /// as `train.recompute = "auto"`).
    pub fn set_derived(
        &mut self,
        key: &str,
        value: Value,
        rule: String,
    ) -> Result<(), ConfigError> {
        let mut values = flatten_config(&self.config)?;
        set(
            &mut values,
            &mut self.sources,
            key.to_string(),
            value,
            &Source::Auto(rule),
        )?;
        self.config = decode(&values)?;
        Ok(())
    }

    /// Re-derives the accumulation and re-validates after automatic changes.
    pub fn finish_auto(&mut self) -> Result<(), ConfigError> {
        self.derive_accumulation()?;
        self.config.validate()
    }

    /// With `train.global_batch` set, `train.grad_accum` follows from the micro-batch; a
    /// global batch the micro-batch does not divide, or an accumulation someone set that
    /// disagrees, is an error that says what to change.
    fn derive_accumulation(&mut self) -> Result<(), ConfigError> {
        let t = &self.config.train;
        let (global, micro) = (t.global_batch, t.micro_batch);
        if global == 0 || micro == 0 {
            return Ok(());
        }
        if global % micro != 0 {
            let divisors: Vec<String> = (1..=global)
                .filter(|d| global % d == 0)
                .map(|d| d.to_string())
                .collect();
            return Err(ConfigError::GlobalBatch {
                detail: format!(
                    "train.global_batch = {global} cannot be reached with train.micro_batch = {micro} ({global} is not a multiple of {micro}); choose a micro_batch that divides it: {}",
                    divisors.join(", ")
                ),
            });
        }
        let accum = global / micro;
        if t.grad_accum != accum {
            if !self.is_open("train.grad_accum")
                && !matches!(self.sources.get("train.grad_accum"), Some(Source::Auto(_)))
            {
                return Err(ConfigError::GlobalBatch {
                    detail: format!(
                        "train.grad_accum = {} disagrees with train.global_batch = {global} / train.micro_batch = {micro} = {accum}; set only one of grad_accum and global_batch",
                        t.grad_accum
                    ),
                });
            }
            self.set_derived(
                "train.grad_accum",
                Value::Integer(accum as i64),
                format!("global_batch {global} / micro_batch {micro}"),
            )?;
        }
        Ok(())
    }

    /// One line per key, in section order: `train.micro_batch = 16    # default` (aligned columns), for --print-config.
    pub fn render(&self) -> String {
        let values = match flatten_config(&self.config) {
            Ok(v) => v,
            // Serializing plain structs of numbers, strings and bools
            // cannot fail; print something rather than panic if it ever did.
            Err(e) => return format!("# {e}\n"),
        };
        let rows: Vec<(&str, String, String)> = KEYS
            .iter()
            .filter_map(|(key, _)| {
                let value = values.get(*key)?.to_string();
                let source = self
                    .sources
                    .get(*key)
                    .map(Source::to_string)
                    .unwrap_or_else(|| Source::Default.to_string());
                Some((*key, value, source))
            })
            .collect();
        let key_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let val_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (key, value, source) in rows {
            let _ = writeln!(out, "{key:<key_w$} = {value:<val_w$}  # {source}");
        }
        out
    }

    /// The resolved config as a TOML document (every key of the config: the shared ones and
    /// those of its `model.kind`), which `resolve(Some(file), &[])` reads back to an equal
    /// Config. Builds from before the model section was per family read it too: they take
    /// the keys it leaves out at their defaults, which are the values it would have held.
    pub fn to_toml(&self) -> String {
        let values = match flatten_config(&self.config) {
            Ok(v) => v,
            Err(e) => return format!("# {e}\n"),
        };
        let mut out = format!("{HEADER}\n");
        let mut section = "";
        for (key, help) in KEYS {
            let Some((sec, field)) = key.split_once('.') else {
                continue;
            };
            if sec != section {
                let _ = write!(out, "\n[{sec}]\n");
                section = sec;
            }
            if let Some(value) = values.get(*key) {
                let _ = writeln!(out, "# {help}\n{field} = {value}");
            }
        }
        out
    }
}

/// Flattens a config into dotted keys, e.g. `train.steps -> 300`.
fn flatten_config(config: &Config) -> Result<Flat, ConfigError> {
    let table = Table::try_from(config).map_err(|e| ConfigError::Decode {
        reason: e.to_string(),
    })?;
    let mut flat = Flat::new();
    for (section, inner) in &table {
        if let Value::Table(fields) = inner {
            for (field, value) in fields {
                flat.insert(format!("{section}.{field}"), value.clone());
            }
        }
    }
    Ok(flat)
}

/// The first line of [`ResolvedConfig::to_toml`].
const HEADER: &str = "# kiln run configuration (the model keys of its model.kind)";
/// The first line `to_toml` wrote before the model section was per family, when it listed
/// every family's keys: in a file that starts with it, keys of other families than its kind
/// are the values kiln wrote, not a person's choice, and are dropped rather than refused.
const HEADER_BEFORE_FAMILIES: &str = "# kiln run configuration";

/// Every key with its default: the defaults' keys plus every family's own keys, so a layer
/// may set a family's key before or after it sets `model.kind`.
fn default_flat() -> Result<Flat, ConfigError> {
    let mut flat = flatten_config(&Config::default())?;
    for f in FAMILIES {
        for (key, value) in model::own_keys(&(f.defaults)()) {
            flat.entry(key).or_insert(value);
        }
    }
    Ok(flat)
}

/// Checks `model.kind` and removes the other families' keys, refusing any that a layer set
/// (except a file `saved_before_families`, which listed them all). It runs once every layer
/// is merged, so a kind chosen after its keys (`model.rope_theta=1e5 model.kind=llama`)
/// counts as much as one chosen before.
fn select_family(
    values: &mut Flat,
    sources: &mut BTreeMap<String, Source>,
    saved_before_families: Option<&Source>,
) -> Result<(), ConfigError> {
    let kind = match values.get("model.kind") {
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    };
    if family::of(&kind).is_none() {
        return Err(ConfigError::NotAllowed {
            key: "model.kind",
            value: kind,
            allowed: family::kinds(),
        });
    }
    for (key, family) in model::family_keys() {
        if family == kind {
            continue;
        }
        match sources.get(&key) {
            None | Some(Source::Default) => {}
            Some(origin) if Some(origin) == saved_before_families => {}
            Some(origin) => {
                return Err(ConfigError::OtherFamilyKey {
                    key,
                    family,
                    kind,
                    origin: origin.clone(),
                });
            }
        }
        values.remove(&key);
        sources.remove(&key);
    }
    Ok(())
}

fn static_key(key: &str) -> Option<&'static str> {
    KEYS.iter().map(|(k, _)| *k).find(|k| *k == key)
}

fn is_section(name: &str) -> bool {
    KEYS.iter()
        .any(|(k, _)| k.split_once('.').is_some_and(|(s, _)| s == name))
}

fn example_key_in(section: &str) -> String {
    KEYS.iter()
        .find_map(|(k, _)| {
            k.split_once('.')
                .filter(|(s, _)| *s == section)
                .map(|_| k.to_string())
        })
        .unwrap_or_default()
}

fn section_as_value(section: &str, origin: &Source, defaults: &Flat) -> ConfigError {
    let key = example_key_in(section);
    let value = defaults.get(&key).map(Value::to_string).unwrap_or_default();
    ConfigError::SectionAsValue {
        section: section.to_string(),
        origin: origin.clone(),
        example: format!("{key}={value}"),
    }
}

fn value_as_section(key: &str, origin: &Source, defaults: &Flat) -> ConfigError {
    ConfigError::ValueAsSection {
        key: key.to_string(),
        origin: origin.clone(),
        example: defaults.get(key).map(Value::to_string).unwrap_or_default(),
    }
}

fn unknown_key(key: &str, origin: &Source) -> ConfigError {
    ConfigError::UnknownKey {
        key: key.to_string(),
        origin: origin.clone(),
        hint: error::unknown_key_hint(key, &all_keys()),
    }
}

/// Walks a parsed file into `(dotted key, value)` pairs, rejecting keys that
/// do not exist and tables/values in each other's places.
fn flatten_file(
    table: &Table,
    prefix: &str,
    origin: &Source,
    known: &Flat,
    out: &mut Vec<(String, Value)>,
) -> Result<(), ConfigError> {
    for (name, value) in table {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match value {
            Value::Table(inner) => {
                if known.contains_key(&key) {
                    return Err(value_as_section(&key, origin, known));
                }
                // An empty unknown table has no leaf to complain about, so
                // report it here rather than silently accept a typo'd section.
                if inner.is_empty() && !is_section(&key) {
                    return Err(unknown_key(&key, origin));
                }
                flatten_file(inner, &key, origin, known, out)?;
            }
            _ if is_section(&key) => return Err(section_as_value(&key, origin, known)),
            _ => {
                if !known.contains_key(&key) {
                    return Err(unknown_key(&key, origin));
                }
                out.push((key, value.clone()));
            }
        }
    }
    Ok(())
}

/// Splits `KEY=VALUE`, checks the key, and reads VALUE as a TOML literal,
/// falling back to a bare string so paths and names need no quoting.
fn parse_override(arg: &str, known: &Flat) -> Result<(String, Value), ConfigError> {
    let syntax = || ConfigError::OverrideSyntax {
        arg: arg.to_string(),
    };
    let (key, raw) = arg.split_once('=').ok_or_else(syntax)?;
    let (key, raw) = (key.trim(), raw.trim());
    if key.is_empty() {
        return Err(syntax());
    }
    let origin = Source::Override;
    if is_section(key) {
        return Err(section_as_value(key, &origin, known));
    }
    if !known.contains_key(key) {
        // `train.steps.x=1` should say steps is a value, not "unknown key".
        let mut prefix = key;
        while let Some((head, _)) = prefix.rsplit_once('.') {
            if known.contains_key(head) {
                return Err(value_as_section(head, &origin, known));
            }
            prefix = head;
        }
        return Err(unknown_key(key, &origin));
    }
    let expects_string = matches!(known.get(key), Some(Value::String(_)));
    let value = match raw.parse::<Value>() {
        Ok(Value::String(s)) => Value::String(s),
        // For string keys any text is a valid value, so something that
        // happens to look like another type (`data.corpus=2024-01-01`,
        // `train.device=inf`) is still taken as the text it is.
        Ok(_) if expects_string => Value::String(raw.to_string()),
        Ok(v) => v,
        Err(_) => Value::String(raw.to_string()),
    };
    Ok((key.to_string(), value))
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::String(_) => "string",
        Value::Integer(_) => "integer",
        Value::Float(_) => "float",
        Value::Boolean(_) => "boolean",
        Value::Datetime(_) => "datetime",
        Value::Array(_) => "array",
        Value::Table(_) => "table",
    }
}

/// Stores `value` under `key` after checking it has the type the key's
/// default has. Integers are widened for float keys, since writing `lr = 1`
/// for `1.0` is an easy and harmless slip.
fn set(
    values: &mut Flat,
    sources: &mut BTreeMap<String, Source>,
    key: String,
    value: Value,
    origin: &Source,
) -> Result<(), ConfigError> {
    let (Some(default), Some(static_key)) = (values.get(&key), static_key(&key)) else {
        return Err(unknown_key(&key, origin));
    };
    let wrong = |expected: &'static str| ConfigError::WrongType {
        key: static_key,
        expected,
        got: value.to_string(),
        got_type: type_name(&value),
        origin: origin.clone(),
        example: default.to_string().into(),
    };
    let checked = match (default, &value) {
        (Value::Integer(_), Value::Integer(i)) if *i >= 0 => value.clone(),
        (Value::Integer(_), _) => return Err(wrong("a non-negative integer")),
        (Value::Float(_), Value::Float(_)) => value.clone(),
        (Value::Float(_), Value::Integer(i)) => Value::Float(*i as f64),
        (Value::Float(_), _) => return Err(wrong("a number")),
        (Value::Boolean(_), Value::Boolean(_)) => value.clone(),
        (Value::Boolean(_), _) => return Err(wrong("true or false")),
        (Value::String(_), Value::String(_)) => value.clone(),
        (Value::String(_), _) => return Err(wrong("a string")),
        // Lists of numbers (LongRoPE's factors), integers widened as for float keys.
        (Value::Array(_), Value::Array(items))
            if items
                .iter()
                .all(|v| matches!(v, Value::Float(_) | Value::Integer(_))) =>
        {
            Value::Array(
                items
                    .iter()
                    .map(|v| match v {
                        Value::Integer(i) => Value::Float(*i as f64),
                        v => v.clone(),
                    })
                    .collect(),
            )
        }
        (Value::Array(_), _) => return Err(wrong("a list of numbers, like [1.0, 1.5]")),
        _ => return Err(wrong("a scalar value")),
    };
    values.insert(key.clone(), checked);
    sources.insert(key, origin.clone());
    Ok(())
}

/// Rebuilds the nested table from the flat map and decodes it.
fn decode(values: &Flat) -> Result<Config, ConfigError> {
    let mut root = Table::new();
    for (key, value) in values {
        let Some((section, field)) = key.split_once('.') else {
            continue;
        };
        let entry = root
            .entry(section.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        if let Value::Table(t) = entry {
            t.insert(field.to_string(), value.clone());
        }
    }
    Value::Table(root)
        .try_into()
        .map_err(|e: toml::de::Error| ConfigError::Decode {
            reason: e.to_string(),
        })
}

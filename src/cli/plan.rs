//! `kiln plan`: the memory and FLOPs of one training step, the largest micro-batch that fits a
//! GPU (this machine's or a named one), and, with `--find-batch`, the boundary confirmed by
//! real steps; with `--generate`, the memory of a generation call (weights, key/value cache,
//! prefill and decode buffers) and the most sequences that fit at once.

use crate::config::Config;
use crate::engine::device::DeviceRequest;
use crate::engine::{self, DType, Device, EngineError, MemoryPool};
use crate::error::{KilnError, Result};
use crate::plan::{self, Budget, Plan, PlanRequest, gib, gpus};
use crate::train::Precision;
use clap::Args;
use serde::Serialize;
use std::sync::Arc;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln plan                                          the default model on this machine's GPU (or CPU)
  kiln plan --gpu a100-40gb model.d_model=768 model.n_layers=12 model.n_heads=12 \\
      model.context=1024 data.tokenizer=gpt2 train.seq_len=1024 train.precision=bf16-mixed
  kiln plan --gpu rtx4090 --json ...                the same as JSON, for scripts
  kiln plan --find-batch train.micro_batch=8        run steps at the predicted largest micro-batch
                                                     and one more, and compare measured peaks
  kiln plan --find-batch train.device=cpu train.memory_limit=64MiB   the same on the CPU
  kiln plan --generate --init-from model.gguf --prompts 64 --prompt-tokens 64 --tokens 128 --gpu h100
                                                     a generation call: weights, cache, buffers

Settings resolve as for `kiln train` (defaults < --profile < --config FILE < KEY=VALUE). The plan runs the
step once on a meta device (tensors booked, nothing computed), so its pool peak is what the
memory pool books (exact on the CPU). On a GPU it adds the cuBLASLt workspace, kernel scratch, allocator
rounding, the CUDA context (measured when the GPU is here) and a safety margin of 5% of memory.")]
pub struct PlanArgs {
    /// TOML file with settings, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Plan for a named GPU instead of this machine's (an unknown name lists the known ones).
    #[arg(long, value_name = "NAME")]
    pub gpu: Option<String>,
    /// Print the plan as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Confirm the largest micro-batch by trial on this machine's device: one step at the
    /// predicted largest and one at the next size up (on the CPU under train.memory_limit).
    #[arg(long, conflicts_with = "gpu")]
    pub find_batch: bool,
    /// Hardware profile, as for `kiln train` (auto plans what `kiln train` would run).
    #[arg(long, value_name = "NAME", default_value = "auto")]
    pub profile: String,
    /// Data-parallel over N GPUs: each GPU's memory under ZeRO stages 0, 1 and 2.
    #[arg(long, value_name = "N")]
    pub gpus: Option<usize>,
    /// Plan a generation call instead of a training step: the model as `kiln generate`
    /// keeps it, the key/value cache, the prefill and decode buffers, by running the call on
    /// a meta device.
    #[arg(long, conflicts_with_all = ["find_batch", "gpus"])]
    pub generate: bool,
    /// With --generate: the model's shape from a Hugging Face directory or a GGUF file.
    #[arg(long, value_name = "PATH", requires = "generate")]
    pub init_from: Option<std::path::PathBuf>,
    /// With --generate: prompts in the call.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "generate")]
    pub prompts: usize,
    /// With --generate: replies per prompt (they share the prompt's prefill).
    #[arg(long, value_name = "N", default_value_t = 1, requires = "generate")]
    pub num_samples: usize,
    /// With --generate: tokens per prompt.
    #[arg(long, value_name = "N", default_value_t = 64, requires = "generate")]
    pub prompt_tokens: usize,
    /// With --generate: new tokens per reply (as `kiln generate --tokens`).
    #[arg(
        long,
        value_name = "N",
        visible_alias = "max-new-tokens",
        default_value_t = 300,
        requires = "generate"
    )]
    pub tokens: usize,
    /// With --generate: the most sequences decoded at once (as `kiln generate --max-batch`).
    #[arg(long, value_name = "N", requires = "generate")]
    pub max_batch: Option<usize>,
    /// With --generate: fp32 or bf16 (bf16 on a GPU unless fp32 is asked for; the CPU runs
    /// fp32), as `kiln generate --precision`.
    #[arg(long, value_name = "fp32|bf16", requires = "generate")]
    pub precision: Option<String>,
    /// Overrides on dotted keys, e.g. model.n_layers=12 train.micro_batch=8.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// The device the plan is for, and the pool to run trials on when it is this machine's.
struct Target {
    budget: Budget,
    pool: Option<Arc<MemoryPool>>,
    notes: Vec<String>,
}

#[derive(Serialize)]
struct Trial {
    micro_batch: usize,
    fits: bool,
    planned_pool_peak: usize,
    measured_pool_peak: usize,
    planned_device_peak: usize,
    /// The driver allocator's reserved bytes after the step (GPU).
    measured_reserved: Option<usize>,
    /// total - free from cudaMemGetInfo after the step (GPU): context and other processes too.
    measured_device_used: Option<usize>,
}

#[derive(Serialize)]
struct Report<'a> {
    budget: &'a Budget,
    notes: &'a [String],
    vocab: usize,
    precision: String,
    recompute_setting: &'a str,
    plan: &'a Plan,
    fits: bool,
    layers: Vec<plan::LayerLine>,
    largest_micro_batch: Vec<Largest>,
    misaligned: Vec<plan::Misaligned>,
    advice: Option<String>,
    trials: Vec<Trial>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_parallel: Option<DataParallelPlan>,
}

/// What each GPU of a data-parallel run holds at its peak, per ZeRO stage.
#[derive(Serialize)]
struct DataParallelPlan {
    gpus: usize,
    /// Per stage 0, 1, 2: the pool peak and the optimizer moments of the GPU that holds the
    /// most of them.
    stages: Vec<StagePlan>,
}

#[derive(Serialize)]
struct StagePlan {
    zero: usize,
    pool_peak: usize,
    device_peak: usize,
    optimizer_moments: usize,
    gradients_after_reduce: usize,
}

/// Each stage's per-GPU peak: the single-GPU plan less the optimizer moments of the
/// parameters another rank owns (the fullest rank's share). kiln keeps every gradient
/// buffer through backward, so stage 2 frees gradients only after the reduction and its
/// peak equals stage 1's. NCCL's own buffers are outside the pool and not counted.
fn data_parallel_plan(
    pool_peak: usize,
    device_peak: usize,
    elements: &[usize],
    gpus: usize,
) -> DataParallelPlan {
    use crate::dist::shard::{self, ZeroStage};
    let owners = shard::owners(elements, gpus);
    let stages = [ZeroStage::Zero0, ZeroStage::Zero1, ZeroStage::Zero2]
        .into_iter()
        .map(|stage| {
            let worst = (0..gpus)
                .map(|r| shard::state_bytes(elements, &owners, r, stage, 4, 0))
                .max_by_key(|s| s.moments)
                .expect("at least one GPU");
            let all_moments = 8 * elements.iter().sum::<usize>();
            let saved = all_moments - worst.moments;
            StagePlan {
                zero: stage.number(),
                pool_peak: pool_peak - saved,
                device_peak: device_peak - saved,
                optimizer_moments: worst.moments,
                gradients_after_reduce: worst.grads_after_reduce,
            }
        })
        .collect();
    DataParallelPlan { gpus, stages }
}

#[derive(Serialize)]
struct Largest {
    variant: &'static str,
    micro_batch: Option<usize>,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let settings = crate::config::settings::resolve(&a.profile, a.config.as_deref(), &a.overrides)?;
    let mut cfg = settings.config.config;
    if a.generate {
        return plan_generation(&a, &cfg);
    }
    let base_path = std::path::Path::new(&cfg.lora.base);
    if cfg.lora.enabled
        && !cfg.lora.base.is_empty()
        && (!cfg.model.entry().features.lora || base_path.exists())
    {
        // The shape and tokenizer of the base the adapters go on, as kiln finetune reads them
        // (a `lora.base` that names no file over a family with adapters is a label for its
        // seeded initialisation, as `kiln bench finetune` writes).
        let base = crate::models::import::pretrained::open(base_path)?;
        base.check_overrides(&a.overrides)?;
        let mut overrides = base.overrides();
        overrides.extend(a.overrides.iter().cloned());
        cfg = crate::config::settings::resolve(&a.profile, a.config.as_deref(), &overrides)?
            .config
            .config;
    }
    // The analytic planner counts a full training step; adapters over a frozen (or NF4)
    // base are booked by running the step on the meta device.
    if !cfg.model.entry().features.analytic_plan || cfg.lora.enabled {
        return plan_by_meta_step(&a, &cfg);
    }
    let mut target = target(&a, &cfg)?;
    let device = target.budget.device;
    let (precision, note) = Precision::parse(&cfg.train.precision)?
        .check_device(device, target.budget.compute_capability)?;
    target.notes.extend(note);
    let vocab = crate::train::model_vocab(&cfg)?;
    let base = PlanRequest::for_config(
        &cfg,
        vocab,
        precision.compute_dtype().unwrap_or(DType::F32),
        device,
    );
    if cfg.train.offload_optimizer && device == Device::Cpu {
        target.notes.push(
            "train.offload_optimizer has no effect on the CPU (host memory is the device)".into(),
        );
    }
    if !cfg.train.fused_kernels {
        target.notes.push(unfused_note(&cfg, vocab, &base));
    }
    let budget = &target.budget;
    let mut request = base.clone();
    if cfg.train.recompute == "auto" && !budget.fits(&plan::plan(&base)?) {
        request.recompute = true;
        target.notes.push(
            "train.recompute=auto: the configured micro-batch does not fit without recomputation, so the plan recomputes blocks".into(),
        );
    }
    let p = plan::plan(&request)?;
    let elem_bytes = request.compute.size_bytes();
    let trials = if a.find_batch {
        find_batch(&cfg, vocab, precision, &request, &target)?
    } else {
        Vec::new()
    };
    let data_parallel =
        gpus(&a)?.map(|n| data_parallel_plan(p.pool_peak, p.device_peak, &p.trainable_elements, n));
    let report = Report {
        budget,
        notes: &target.notes,
        vocab,
        precision: precision.to_string(),
        recompute_setting: &cfg.train.recompute,
        plan: &p,
        fits: budget.fits(&p),
        layers: plan::layer_table(&request),
        largest_micro_batch: plan::largest_by_variant(&base, budget)?
            .into_iter()
            .map(|(variant, micro_batch)| Largest {
                variant,
                micro_batch,
            })
            .collect(),
        misaligned: plan::misaligned_dimensions(&request, vocab, elem_bytes),
        advice: plan::one_sequence_advice(&base, budget)?,
        trials,
        data_parallel,
    };
    if a.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| KilnError::Setting(format!("cannot encode the plan as JSON: {e}")))?;
        println!("{text}");
    } else {
        print_report(&report, &cfg);
        if let Some(d) = &report.data_parallel {
            print_data_parallel(d);
        }
    }
    Ok(())
}

/// `--gpus N`, refusing 0.
fn gpus(a: &PlanArgs) -> Result<Option<usize>> {
    match a.gpus {
        Some(0) => Err(KilnError::Setting(
            "--gpus 0 plans no GPU; give 1 or more".into(),
        )),
        n => Ok(n),
    }
}

/// What `kiln plan` reports for a step planned by running it on a meta device.
#[derive(Serialize)]
struct MetaReport<'a> {
    budget: &'a Budget,
    notes: &'a [String],
    precision: String,
    micro_batch: usize,
    seq_len: usize,
    recompute: &'a str,
    params: usize,
    trainable_params: usize,
    /// Weights, compute copies, gradients and optimizer state, before the first batch.
    resident_bytes: usize,
    pool_peak: usize,
    /// Kernel scratch and the GEMM workspace outside the pool, at the device's peak.
    outside_pool: usize,
    device_peak: usize,
    usable_bytes: usize,
    fits: bool,
    largest_micro_batch: Option<usize>,
    planning_seconds: f64,
    /// The device peak by purpose (weights, gradients, optimizer state, activations).
    breakdown: plan::Breakdown,
    /// Each layer's parameters, FLOPs and saved bytes (the Llama family; empty otherwise).
    layers: Vec<plan::LayerLine>,
    /// The operation running at the peak.
    peak_at: String,
    /// The step's live bytes at the peak by the operation that booked them, largest first.
    largest_at_peak: Vec<(String, usize)>,
    /// A low-rank fine-tune's frozen base (with `lora.enabled`).
    finetune_base: Option<plan::finetune::FinetuneWeights>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_parallel: Option<DataParallelPlan>,
}

/// Plans a step of any model family by running it on a meta device standing in for the
/// target (see `plan::meta`): the pool peak the real step books, the scratch outside it, and
/// the largest micro-batch whose device peak fits.
fn plan_by_meta_step(a: &PlanArgs, cfg: &Config) -> Result<()> {
    let target = target(a, cfg)?;
    let budget = &target.budget;
    let device = budget.device;
    let (precision, note) =
        Precision::parse(&cfg.train.precision)?.check_device(device, budget.compute_capability)?;
    let mut notes = target.notes.clone();
    notes.extend(note);
    let vocab = crate::train::model_vocab(cfg)?;
    let step = |micro_batch: usize| {
        let mut c = cfg.clone();
        c.train.micro_batch = micro_batch;
        plan::meta::meta_step(&c, vocab, device, precision)
    };
    let fits = |m: &plan::meta::MetaStep| budget.holds(m.pool_peak, m.device_peak);
    let p = step(cfg.train.micro_batch)?;
    let data_parallel =
        gpus(a)?.map(|n| data_parallel_plan(p.pool_peak, p.device_peak, &p.trainable_elements, n));
    let mut largest = None;
    if fits(&step(1)?) {
        // Doubling, then bisection: memory grows with the micro-batch.
        let (mut lo, mut hi) = (1usize, 2usize);
        while hi <= 1 << 16 && fits(&step(hi)?) {
            (lo, hi) = (hi, hi * 2);
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(&step(mid)?) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        largest = Some(lo);
    }
    let finetune_base = crate::models::llama::LlamaConfig::from_model(&cfg.model, vocab)
        .filter(|_| cfg.lora.enabled)
        .map(|m| {
            let compute = precision.compute_dtype().unwrap_or(DType::F32);
            plan::finetune::finetune_weights(&m, vocab, compute, device, cfg.lora.quantize == "nf4")
        });
    let r = MetaReport {
        budget,
        notes: &notes,
        precision: precision.to_string(),
        micro_batch: cfg.train.micro_batch,
        seq_len: cfg.train.seq_len,
        recompute: &cfg.train.recompute,
        params: p.params,
        trainable_params: p.trainable,
        resident_bytes: p.resident,
        pool_peak: p.pool_peak,
        outside_pool: p.device_peak - p.pool_peak,
        device_peak: p.device_peak,
        usable_bytes: budget.usable(),
        fits: fits(&p),
        largest_micro_batch: largest,
        planning_seconds: p.seconds,
        breakdown: plan::Breakdown::of(&p),
        layers: crate::models::llama::LlamaConfig::from_model(&cfg.model, vocab)
            .map(|l| {
                let layout = crate::nn::ActLayout {
                    device,
                    weights: precision.compute_dtype().unwrap_or(DType::F32),
                };
                plan::llama_layer_table(&l, cfg.train.micro_batch, cfg.train.seq_len, layout)
            })
            .unwrap_or_default(),
        peak_at: p.at_peak.op.to_string(),
        largest_at_peak: plan::largest_at_peak(&p.at_peak),
        finetune_base,
        data_parallel,
    };
    if a.json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| KilnError::Setting(format!("cannot encode the plan as JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    let m = &cfg.model;
    println!(
        "plan: model.kind={} ({}, vocabulary {vocab}), micro-batch {} x {} tokens, {}, recompute {}, on {} ({device})",
        m.kind(),
        (m.entry().describe)(m),
        r.micro_batch,
        r.seq_len,
        r.precision,
        r.recompute,
        budget.name,
    );
    for n in &notes {
        println!("note: {n}");
    }
    println!(
        "  planned by running construction and one optimizer step on a meta device ({:.2} s, no memory touched)",
        p.seconds
    );
    println!(
        "  parameters             {:>12}  ({} trained)",
        p.params, p.trainable
    );
    println!(
        "  weights, gradients, optimizer state {:>12}  (held before the first batch)",
        gib(p.resident)
    );
    println!(
        "  activations at the peak {:>11}",
        gib(p.pool_peak - p.resident)
    );
    print_peaks(budget, p.pool_peak, p.device_peak, r.fits);
    print_meta_breakdown(&r, precision);
    match largest {
        Some(b) => println!("  largest micro-batch that fits: {b}"),
        None => println!(
            "  not even one sequence fits: shorten train.seq_len, recompute blocks (train.recompute=blocks), offload the optimizer or use adapters"
        ),
    }
    if let Some(w) = &r.finetune_base {
        print_finetune_base(w, cfg, precision);
    }
    if let Some(d) = &r.data_parallel {
        print_data_parallel(d);
    }
    if !r.layers.is_empty() {
        println!(
            "\nactivations per layer (micro-batch {} x {}; from the layers' own costs):",
            r.micro_batch, r.seq_len
        );
        print_layer_table(&r.layers);
        let tokens = (r.micro_batch * r.seq_len) as f64;
        let sum = |f: fn(&plan::LayerLine) -> u64| {
            r.layers.iter().map(|l| f(l) * l.count as u64).sum::<u64>() as f64 / tokens / 1e6
        };
        let (fwd, bwd) = (sum(|l| l.flops_forward), sum(|l| l.flops_backward));
        println!(
            "FLOPs per token: forward {fwd:.2} M, backward {bwd:.2} M (total {:.2} M)",
            fwd + bwd
        );
    }
    Ok(())
}

/// The per-layer table: parameters, saved bytes with and without recomputation, FLOPs.
fn print_layer_table(layers: &[plan::LayerLine]) {
    println!(
        "| layer | count | params | saved | saved with recompute=blocks | forward GFLOP | backward GFLOP |"
    );
    println!("|---|---|---|---|---|---|---|");
    for l in layers {
        println!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} |",
            l.layer,
            l.count,
            l.params,
            gib(l.saved_bytes),
            gib(l.saved_bytes_recompute),
            l.flops_forward as f64 / 1e9,
            l.flops_backward as f64 / 1e9
        );
    }
}

/// The device peak by purpose, and the operations that booked most of what is live there.
fn print_meta_breakdown(r: &MetaReport, precision: Precision) {
    let bd = &r.breakdown;
    let trains_all = r.trainable_params == r.params;
    println!("  at the peak, by purpose:");
    let row = |what: &str, bytes: usize| {
        if bytes > 0 {
            println!("    {what:<52} {:>12}", gib(bytes));
        }
    };
    row(
        if trains_all {
            "weights (fp32 masters)"
        } else {
            "weights (the frozen base as stored, adapters in fp32)"
        },
        bd.master_weights,
    );
    if let Some(dt) = precision.compute_dtype() {
        row(&format!("compute copies ({dt:?})"), bd.compute_copies);
    }
    row("gradients (fp32, trained weights only)", bd.gradients);
    row("optimizer state and fixed buffers", bd.optimizer_state);
    row(
        "saved by the forward for the backward",
        bd.saved_activations,
    );
    row(
        &format!("transient (the peak is reached at: {})", r.peak_at),
        bd.transient,
    );
    row("outside the pool", bd.outside_pool);
    if !r.largest_at_peak.is_empty() {
        let largest: Vec<String> = r
            .largest_at_peak
            .iter()
            .map(|(w, n)| format!("{w} {}", gib(*n)))
            .collect();
        println!(
            "  largest at the peak, by the operation that booked them: {}",
            largest.join(", ")
        );
    }
}

/// The pool peak, the scratch outside the pool (on a GPU) and the device peak against the
/// usable memory.
fn print_peaks(budget: &Budget, pool_peak: usize, device_peak: usize, fits: bool) {
    println!("  pool peak              {:>12}", gib(pool_peak));
    if budget.device != Device::Cpu {
        println!(
            "  outside the pool       {:>12}  (GEMM workspace and kernel scratch)",
            gib(device_peak - pool_peak)
        );
    }
    println!(
        "  device peak            {:>12}  of {} usable: {}",
        gib(device_peak),
        gib(budget.usable()),
        if fits { "fits" } else { "does NOT fit" }
    );
}

/// What `kiln plan --generate` reports.
#[derive(Serialize)]
struct GenerateReport<'a> {
    budget: &'a Budget,
    notes: &'a [String],
    precision: &'static str,
    shape: plan::generate::GenerateShape,
    plan: &'a plan::generate::GeneratePlan,
    usable_bytes: usize,
    fits: bool,
    /// The most sequences at once whose call fits (`None`: not even one).
    largest_at_once: Option<usize>,
}

/// Plans one generation call by running it on a meta device (see `plan::generate`).
fn plan_generation(a: &PlanArgs, cfg: &Config) -> Result<()> {
    let (model, vocab, source) = match &a.init_from {
        Some(path) => {
            let p = crate::models::import::pretrained::open(path)?;
            (p.model, p.vocab, format!("{}", path.display()))
        }
        None => (
            cfg.model.clone(),
            crate::train::model_vocab(cfg)?,
            "the configured model".to_string(),
        ),
    };
    let target = target(a, cfg)?;
    let budget = &target.budget;
    let device = budget.device;
    let dtype = crate::generate::load::generation_dtype(device, a.precision.as_deref())?;
    let shape = plan::generate::GenerateShape {
        prompts: a.prompts,
        samples: a.num_samples,
        prompt_tokens: a.prompt_tokens,
        new_tokens: a.tokens,
        max_batch: a.max_batch,
    };
    if a.tokens == 0 {
        return Err(KilnError::Setting(
            "--tokens 0: plan at least one new token".into(),
        ));
    }
    if a.max_batch == Some(0) {
        return Err(KilnError::Setting(
            "--max-batch 0: give 1 or more sequences at once".into(),
        ));
    }
    let fits = |p: &plan::generate::GeneratePlan| budget.holds(p.pool_peak, p.device_peak);
    let p = plan::generate::meta_generate(&model, vocab, device, dtype, &shape)?;
    let all = shape.most_at_once();
    let largest = plan::generate::largest_at_once(&model, vocab, device, dtype, &shape, &fits)?;
    let precision = if dtype.is_some() { "bf16" } else { "fp32" };
    let r = GenerateReport {
        budget,
        notes: &target.notes,
        precision,
        shape,
        plan: &p,
        usable_bytes: budget.usable(),
        fits: fits(&p),
        largest_at_once: largest,
    };
    if a.json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| KilnError::Setting(format!("cannot encode the plan as JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    println!(
        "plan: generate with model.kind={} (d_model {}, {} layers, vocabulary {vocab}) from {source}: {} prompt(s) x {} sample(s), {} prompt tokens + {} new, {precision}, on {} ({device})",
        model.kind(),
        model.d_model,
        model.n_layers,
        shape.prompts,
        shape.samples,
        shape.prompt_tokens,
        shape.new_tokens,
        budget.name,
    );
    for n in &target.notes {
        println!("note: {n}");
    }
    println!(
        "  planned by running the prefill and every decode step on a meta device ({:.2} s, no memory touched)",
        p.seconds
    );
    println!("  weights as generation keeps them {:>10}", gib(p.weights));
    if p.slots > 0 {
        println!(
            "  key/value cache        {:>12}  ({} sequence(s) at once x {} positions)",
            gib(p.cache_bytes),
            p.slots,
            p.max_len
        );
    } else {
        println!(
            "  key/value cache              none  (model.kind={} re-runs its window for each token)",
            model.kind()
        );
    }
    println!(
        "  prefill, decode and sampling buffers {:>6}  at the peak",
        gib(p.pool_peak - p.weights - p.cache_bytes)
    );
    print_peaks(budget, p.pool_peak, p.device_peak, r.fits);
    match largest {
        Some(n) if n >= all => println!("  all {all} sequence(s) fit at once"),
        Some(n) => println!(
            "  at most {n} sequence(s) fit at once: kiln generate runs that many and starts the others as slots free up (--max-batch {n})"
        ),
        None => println!(
            "  not even one sequence fits beside the weights: ask for fewer --tokens, use shorter prompts, or bf16"
        ),
    }
    Ok(())
}

/// The frozen base of a low-rank fine-tune: bytes in the compute dtype or NF4, the
/// dequantisation workspace, and the saving against the same base in bf16.
fn print_finetune_base(w: &plan::finetune::FinetuneWeights, cfg: &Config, precision: Precision) {
    let compute = precision.compute_dtype().unwrap_or(DType::F32);
    let nf4 = cfg.lora.quantize == "nf4";
    let dt = format!("{compute:?}").to_lowercase();
    println!(
        "  frozen base of the fine-tune, lora.quantize = {}:",
        cfg.lora.quantize
    );
    println!(
        "  frozen base            {:>12}  ({} projection weights in {}: {}; embeddings, norms and head in {dt}: {})",
        gib(w.base_bytes),
        w.projection_values,
        if nf4 { "NF4".to_string() } else { dt.clone() },
        gib(w.projection_bytes),
        gib(w.other_bytes)
    );
    println!("  the same base in bf16  {:>12}", gib(w.bf16_base_bytes));
    let saved = w.bf16_base_bytes as f64 - w.base_bytes as f64;
    println!(
        "  saving against bf16    {:>12}  ({:.0}%)",
        if saved >= 0.0 {
            gib(saved as usize)
        } else {
            format!("-{}", gib(-saved as usize))
        },
        100.0 * saved / w.bf16_base_bytes as f64
    );
    if nf4 {
        println!(
            "  dequant workspace      {:>12}  (the largest projection in {dt}, shared by all)",
            gib(w.workspace_bytes)
        );
    }
}

/// The named GPU, this machine's GPU, or the CPU with its RAM.
fn target(a: &PlanArgs, cfg: &Config) -> Result<Target> {
    let limit = crate::config::parse_bytes(&cfg.train.memory_limit).map_err(|e| {
        KilnError::Setting(format!(
            "train.memory_limit='{}': {e}",
            cfg.train.memory_limit
        ))
    })?;
    let with_limit = |b: Budget| limit.map_or(b.clone(), |l| b.with_pool_limit(l));
    if let Some(name) = &a.gpu {
        let g = gpus::lookup(name).map_err(KilnError::Setting)?;
        let budget = Budget::gpu(
            g.description.into(),
            g.memory_bytes(),
            None,
            g.compute_capability,
        );
        return Ok(Target {
            budget: with_limit(budget),
            pool: None,
            notes: vec![format!(
                "planning for {} (--gpu {}); the CUDA context is an estimate",
                g.description, g.name
            )],
        });
    }
    let cpu = |why: Option<String>| -> Result<Target> {
        let ram = plan::machine_ram().ok_or_else(|| {
            KilnError::Setting(
                "cannot read this machine's RAM from /proc/meminfo; name a GPU with --gpu NAME or set train.memory_limit".into(),
            )
        })?;
        let mut notes: Vec<String> = why.into_iter().collect();
        notes.push(format!(
            "planning for the CPU with this machine's RAM ({})",
            gib(ram)
        ));
        Ok(Target {
            budget: with_limit(Budget::cpu(ram)),
            pool: Some(MemoryPool::new(Device::Cpu)),
            notes,
        })
    };
    let request: DeviceRequest = cfg.train.device.parse().map_err(KilnError::Setting)?;
    if request == DeviceRequest::Exact(Device::Cpu) {
        return cpu(None);
    }
    // `auto` falls back to the CPU with a one-line reason; a named GPU must open.
    let (pool, why) = engine::open(request)?;
    let Ok(g) = pool.cuda() else {
        return cpu(why);
    };
    let info = g.info().clone();
    let (free, total) = g.memory().map_err(EngineError::from)?;
    // What the context, the loaded kernels and other processes hold before any tensor; the
    // GEMM workspace is a line of the plan.
    let context = (total - free).saturating_sub(crate::engine::cuda::GEMM_WORKSPACE_BYTES);
    let budget = Budget::gpu(
        info.name.clone(),
        total,
        Some(context),
        info.compute_capability,
    );
    Ok(Target {
        budget: with_limit(budget),
        pool: Some(pool),
        notes: vec![format!("planning for {info} found in this machine")],
    })
}

/// Runs one real step at the predicted largest micro-batch and at the next size up; a size
/// fits when its step ran in one pass, without an out-of-memory split.
fn find_batch(
    cfg: &Config,
    vocab: usize,
    precision: Precision,
    r: &PlanRequest,
    t: &Target,
) -> Result<Vec<Trial>> {
    let budget = &t.budget;
    if budget.device == Device::Cpu && budget.pool_limit.is_none() {
        return Err(KilnError::Setting(
            "--find-batch on the CPU needs train.memory_limit (e.g. train.memory_limit=256MiB): without a cap the trials would fill this machine's RAM".into(),
        ));
    }
    let Some(pool) = &t.pool else {
        return Err(KilnError::Setting(
            "--find-batch runs on this machine's device; leave out --gpu".into(),
        ));
    };
    let predicted = plan::largest_micro_batch(r, budget)?;
    let sizes = match predicted {
        Some(b) => vec![b, b + 1],
        None => vec![1],
    };
    let mut trials = Vec::new();
    for b in sizes {
        let pool = if pool.device() == Device::Cpu {
            MemoryPool::new(Device::Cpu)
        } else {
            pool.clone()
        };
        pool.set_limit(budget.pool_limit.unwrap_or(0));
        pool.reset_peak();
        let outcome = plan::trial_step(cfg, vocab, precision, &pool, b);
        let fits = match outcome {
            Ok(in_one_pass) => in_one_pass,
            Err(KilnError::Engine(EngineError::OutOfMemory { .. }))
            | Err(KilnError::DoesNotFit(_)) => false,
            Err(e) => return Err(e),
        };
        let gpu = pool.cuda().ok();
        let planned = plan::plan(&r.with_batch(b))?;
        trials.push(Trial {
            micro_batch: b,
            fits,
            planned_pool_peak: planned.pool_peak,
            measured_pool_peak: pool.stats().peak,
            planned_device_peak: planned.device_peak,
            measured_reserved: gpu.map(|_| pool.stats().reserved),
            measured_device_used: gpu
                .and_then(|g| g.memory().ok())
                .map(|(free, total)| total - free),
        });
    }
    Ok(trials)
}

fn print_data_parallel(d: &DataParallelPlan) {
    println!(
        "data parallel over {} GPUs, per GPU (the fullest rank; NCCL's own buffers not included):",
        d.gpus
    );
    for s in &d.stages {
        println!(
            "  dist.zero={}: pool peak {:>10}, device peak {:>10}  (optimizer moments {}, gradients after the reduction {})",
            s.zero,
            gib(s.pool_peak),
            gib(s.device_peak),
            gib(s.optimizer_moments),
            gib(s.gradients_after_reduce)
        );
    }
    println!(
        "  ZeRO-2 frees the gradients other ranks own after the reduction; every gradient is held through backward, so its peak is ZeRO-1's"
    );
}

fn print_report(r: &Report, cfg: &Config) {
    let p = r.plan;
    let q = &p.request;
    let m = &q.model;
    let b = r.budget;
    let gpu = q.device != Device::Cpu;
    let family = cfg.model.entry();
    let shape = format!(
        "{} of {:.2}M parameters ({}",
        family.name,
        p.params as f64 / 1e6,
        (family.describe)(&cfg.model)
    );
    println!(
        "kiln plan: {shape}, vocabulary {}{}), micro-batch {} x {} tokens, {}, on {} ({})",
        r.vocab,
        if m.vocab != r.vocab {
            format!(" padded to {}", m.vocab)
        } else {
            String::new()
        },
        q.micro_batch,
        q.seq_len,
        r.precision,
        b.name,
        gib(b.capacity)
    );
    r.notes.iter().for_each(|n| println!("note: {n}"));
    if matches!(q.arch, plan::Arch::ResnetBk { .. }) {
        println!(
            "note: the experts are planned at their worst-case loads (every slot kept, experts filled to capacity in turn); a real step's routing needs at most this"
        );
    }
    let dt = |d: DType| format!("{d:?}").to_lowercase();
    let bd = &p.breakdown;
    println!(
        "\nmemory at the peak of one step (recompute {}, optimizer offload {}):",
        if q.recompute { "blocks" } else { "none" },
        if q.offload_optimizer { "on" } else { "off" }
    );
    println!("| part | bytes |\n|---|---|");
    let row = |what: &str, bytes: usize| println!("| {what} | {} |", gib(bytes));
    row("master weights (fp32)", bd.master_weights);
    if bd.compute_copies > 0 {
        row(
            &format!("compute copies ({})", dt(q.compute)),
            bd.compute_copies,
        );
    }
    row("gradients (fp32)", bd.gradients);
    row("optimizer state (AdamW, 2 x fp32)", bd.optimizer_state);
    row("saved activations", bd.saved_activations);
    row(
        &format!("transient (the peak is reached at: {})", p.peak_at),
        bd.transient,
    );
    if gpu {
        row(
            "outside the pool (cuBLASLt workspace, kernel scratch)",
            bd.outside_pool,
        );
        row(
            "allocator rounding (512 B per buffer, 2 MiB granules)",
            p.allocator_rounding,
        );
    }
    row("= kiln's peak on the device", p.device_peak);
    row("  of which the memory pool books", p.pool_peak);
    if gpu {
        let how = if b.context_measured {
            "measured: total - free after opening the GPU"
        } else {
            "estimate"
        };
        row(
            &format!("CUDA context and other processes ({how})"),
            b.context,
        );
    }
    row("safety margin", b.margin);
    row(&format!("available: {}", b.name), b.capacity);
    println!(
        "{} with {} to spare",
        if r.fits { "fits" } else { "DOES NOT FIT" },
        if r.fits {
            gib(b.usable() - p.device_peak)
        } else {
            "nothing".into()
        }
    );
    let largest: Vec<String> = p
        .largest_at_peak
        .iter()
        .map(|(w, n)| format!("{w} {}", gib(*n)))
        .collect();
    println!(
        "largest at the peak, by the operation that booked them: {}",
        largest.join(", ")
    );
    if p.host_offload > 0 {
        println!(
            "host memory (pinned) for the offloaded masters and moments: {}",
            gib(p.host_offload)
        );
    }

    println!(
        "\nactivations per layer (micro-batch {} x {}):",
        q.micro_batch, q.seq_len
    );
    print_layer_table(&r.layers);
    let per = |f: u64| f as f64 / p.tokens as f64 / 1e6;
    let accum = cfg.train.grad_accum as f64;
    println!(
        "\nFLOPs per token: forward {:.2} M, backward {:.2} M{} (total {:.2} M)",
        per(p.cost.flops_forward),
        per(p.cost.flops_backward),
        if p.recompute_flops > 0 {
            format!(", recomputation {:.2} M", per(p.recompute_flops))
        } else {
            String::new()
        },
        p.flops_per_token() / 1e6
    );
    println!(
        "FLOPs per optimizer step ({} micro-batches): forward {:.3} TFLOP, backward {:.3} TFLOP",
        cfg.train.grad_accum,
        p.cost.flops_forward as f64 * accum / 1e12,
        (p.cost.flops_backward + p.recompute_flops) as f64 * accum / 1e12
    );

    println!(
        "\nlargest micro-batch of {} tokens that fits {} ({} usable after the context and margin):",
        q.seq_len,
        b.name,
        gib(b.usable())
    );
    println!("| variant | micro-batch |\n|---|---|");
    for l in &r.largest_micro_batch {
        println!(
            "| {} | {} |",
            l.variant,
            l.micro_batch.map_or("none".into(), |n| n.to_string())
        );
    }
    if let Some(advice) = &r.advice {
        println!("\n{advice}");
    }
    if r.misaligned.is_empty() {
        println!("\ntensor-core alignment: every GEMM dimension is a multiple of 8");
    } else {
        println!(
            "\ntensor-core alignment: these GEMM dimensions are not multiples of the tensor cores' tile:"
        );
        for x in &r.misaligned {
            println!(
                "  {} = {} (not a multiple of {}): pad to {}",
                x.dimension, x.value, x.multiple, x.padded
            );
        }
    }
    if !r.trials.is_empty() {
        println!("\n--find-batch: one real step at each size on this machine's device:");
        println!(
            "| micro-batch | result | planned pool peak | measured pool peak | planned device peak | reserved by the driver | device used (cudaMemGetInfo) |"
        );
        println!("|---|---|---|---|---|---|---|");
        let opt = |v: Option<usize>| v.map_or("-".into(), gib);
        for t in &r.trials {
            println!(
                "| {} | {} | {} | {} | {} | {} | {} |",
                t.micro_batch,
                if t.fits { "fits" } else { "out of memory" },
                gib(t.planned_pool_peak),
                if t.fits {
                    gib(t.measured_pool_peak)
                } else {
                    format!("{} at failure", gib(t.measured_pool_peak))
                },
                gib(t.planned_device_peak),
                opt(t.measured_reserved),
                opt(t.measured_device_used)
            );
        }
    }
}

/// What the plan leaves out under `train.fused_kernels=false`: it models kiln's fused
/// kernels, the unfused loss holds two more logits-sized buffers at its peak, and the unfused
/// attention keeps its probabilities P for the backward (the GPU's fused kernel keeps one
/// log-sum-exp per row; the CPU's keeps P in both modes).
fn unfused_note(cfg: &Config, vocab: usize, r: &PlanRequest) -> String {
    let rows = cfg.train.micro_batch * cfg.train.seq_len;
    let padded = crate::models::padded_vocab(vocab);
    let act = engine::ops::activation_dtype(r.device, r.compute).size_bytes();
    let extra = rows * padded * (4 + act);
    let layout = crate::nn::ActLayout {
        device: r.device,
        weights: r.compute,
    };
    let (heads, layers) = (r.model.n_heads, r.model.n_layers);
    let probs = crate::nn::attention::unfused_probs_bytes(heads, r.micro_batch, r.seq_len, layout);
    format!(
        "train.fused_kernels=false: this plan models the fused kernels; the unfused loss also holds f32 log-probabilities and a separate gradient beside the logits ({} more at the loss, {rows} x {padded} x (4 + {act}) bytes), the unfused AdamW an f32 copy of the largest parameter's gradient, and the unfused attention keeps P for its backward, {} per layer ({} x {heads} x {t} x {t} x {act} bytes; {} over {layers} layers without recompute) with up to two more such matrices while a layer runs",
        gib(extra),
        gib(probs),
        r.micro_batch,
        gib(probs * layers),
        t = r.seq_len,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's vocabulary at batch 8 x 1024 in bf16 on a GPU: 8192 rows x 50304 columns x
    /// (4 + 2) bytes = 2.30 GiB the plan does not count, and the attention probabilities.
    #[test]
    fn the_unfused_note_sizes_the_extra_loss_buffers() {
        let cfg = crate::config::ResolvedConfig::resolve(
            None,
            &[
                "train.fused_kernels=false",
                "model.context=1024",
                "train.seq_len=1024",
                "train.micro_batch=8",
            ]
            .map(String::from),
        )
        .unwrap()
        .config;
        let r = PlanRequest::for_config(&cfg, 50257, DType::BF16, Device::Cuda(0));
        let note = unfused_note(&cfg, 50257, &r);
        assert!(note.contains("2.30 GiB"), "{note}");
        assert!(note.contains("8192 x 50304 x (4 + 2)"), "{note}");
        // P of the default model (4 heads, 4 layers): 8 x 4 x 1024 x 1024 x 2 bytes = 64 MiB
        // per layer, 256 MiB over the four.
        assert!(note.contains("8 x 4 x 1024 x 1024 x 2 bytes"), "{note}");
        assert!(note.contains("64.0 MiB per layer"), "{note}");
        assert!(note.contains("256.0 MiB over 4 layers"), "{note}");
    }
}

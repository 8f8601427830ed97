//! The training loop and everything it owns: precision policy, loss scaling, gradient
//! accumulation, evaluation, checkpoints, metrics and the progress line.
//!
//! [`run`] is what `kiln train` calls: it takes the run directory's lock (one writer per run),
//! resolves the device and precision, restores a verified checkpoint when resuming (before
//! writing anything, so a bad checkpoint leaves the run directory untouched), checks the step
//! against the planner's memory figures, starts the background data loader, and loops over
//! [`Trainer::step`]. Checkpoints are copied to host memory at a step boundary and written by
//! a background thread; SIGTERM/SIGINT stop at a step boundary after saving one. A start that
//! fails before the run holds any data removes what it created.

pub mod checkpoint;
pub mod diversity;
pub mod early_stop;
pub mod lock;
pub mod metrics;
pub mod oom;
pub mod polychromic;
pub mod precision;
pub mod scaler;
pub mod scu;
pub mod signals;
pub mod trace;
pub mod trainer;

pub use precision::Precision;
pub use trainer::{StepReport, TrainState, Trainer};

use crate::config::ResolvedConfig;
use crate::data::{self, Batch, DataSpec, Prefetcher};
use crate::engine::device::DeviceRequest;
use crate::engine::{self, Device, MemoryPool};
use crate::error::{KilnError, Result};
use metrics::{MetricsWriter, Progress, format_bytes, format_duration};
use serde::Serialize;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to run: the resolved configuration and where the run lives.
pub struct RunOptions {
    pub config: ResolvedConfig,
    pub run_dir: PathBuf,
    /// Continue from the run directory's latest checkpoint.
    pub resume: bool,
    /// Resume from this checkpoint (`step_N`) instead of the latest.
    pub checkpoint: Option<String>,
    /// Stop after this optimizer step even if `train.steps` is larger (the schedule still
    /// spans `train.steps`), to split a run into parts.
    pub stop_after: Option<u64>,
    pub quiet: bool,
    /// A Chrome trace of the phases of some steps (`kiln train --trace`).
    pub trace: Option<trace::TraceOptions>,
    /// Steps (1-based, end exclusive) run under an attached profiler's collection (`kiln
    /// train --profile-steps`).
    pub profile_steps: Option<std::ops::Range<u64>>,
    /// Weights to start from (`kiln train --init-from`); the config already has its shape.
    pub init: Option<crate::models::import::Pretrained>,
    /// This process's place in a data-parallel run (`None`: a single process).
    pub world: Option<crate::dist::World>,
}

/// The outcome of a run, also written as `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: u64,
    pub tokens: u64,
    pub params: usize,
    pub device: String,
    pub precision: String,
    pub train_loss: f64,
    pub val_loss: f64,
    pub val_bits_per_token: f64,
    pub unigram_val_loss: f64,
    pub elapsed_s: f64,
    pub tokens_per_s: f64,
    pub skipped_steps: u64,
    pub data_wait_s: f64,
    pub peak_memory_bytes: usize,
    /// Peak host bytes of the offloaded optimizer (masters, moments, staging), when offloaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_optimizer_peak_bytes: Option<usize>,
    /// Sequences per forward/backward pass at the end: `train.micro_batch`, or fewer after
    /// out-of-memory splits.
    pub effective_micro_batch: usize,
    pub checkpoint: Option<String>,
    /// Polychromic fine-tuning: D of sampled replies to held-out prompts at the last eval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_diversity: Option<f64>,
    /// Early stopping (`train.early_stop_patience`): the best evaluation and whether the run
    /// stopped for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub early_stop: Option<early_stop::EarlyStopReport>,
}

/// Opens the device and checks the precision against it; returns the precision that will
/// run (bf16-mixed becomes fp16-mixed on GPUs without bf16) and notes for the user.
pub fn open_device(
    device: &str,
    precision: &str,
) -> Result<(Arc<MemoryPool>, Precision, Vec<String>)> {
    let request: DeviceRequest = device.parse().map_err(KilnError::Setting)?;
    let precision = Precision::parse(precision)?;
    // A GPU that is not there is a setting this machine cannot honour (exit 2), not a failure.
    let (pool, note) = engine::open(request).map_err(|e| match e {
        crate::engine::EngineError::Unavailable(..) => KilnError::Setting(e.to_string()),
        other => KilnError::Engine(other),
    })?;
    let mut notes: Vec<String> = note.into_iter().collect();
    let cc = pool.cuda().ok().map(|g| g.info().compute_capability);
    let (precision, note) = precision.check_device(pool.device(), cc)?;
    notes.extend(note);
    pool.set_tf32(precision == Precision::Tf32);
    Ok((pool, precision, notes))
}

/// Applies `train.memory_limit` to the pool (validated with the configuration).
pub fn set_memory_limit(pool: &MemoryPool, cfg: &crate::config::Config) -> Result<()> {
    if let Some(limit) = crate::config::parse_bytes(&cfg.train.memory_limit)
        .map_err(|rule| KilnError::Setting(format!("train.memory_limit: {rule}")))?
    {
        pool.set_limit(limit);
    }
    Ok(())
}

pub fn data_spec(cfg: &crate::config::Config) -> DataSpec {
    DataSpec {
        corpus: (!cfg.data.corpus.is_empty()).then(|| PathBuf::from(&cfg.data.corpus)),
        tokenizer: cfg.data.tokenizer.clone(),
        val_fraction: cfg.data.val_fraction,
        val_corpus: (!cfg.data.val_corpus.is_empty()).then(|| PathBuf::from(&cfg.data.val_corpus)),
        seed: cfg.train.seed,
        micro_batch: cfg.train.micro_batch,
        seq: cfg.train.seq_len,
        grad_accum: cfg.train.grad_accum,
        format: cfg.data.format.clone(),
        threads: match cfg.data.loader_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        },
        micro_offset: 0,
    }
}

/// The micro-batches each of `world` ranks accumulates: with `train.global_batch` set, the
/// global batch (sequences per optimizer step over all ranks) split evenly, else
/// `train.grad_accum` per rank. A global batch the ranks cannot split is refused with the
/// numbers of GPUs that could.
fn rank_grad_accum(cfg: &crate::config::Config, world: usize) -> Result<usize> {
    let t = &cfg.train;
    if t.global_batch == 0 {
        return Ok(t.grad_accum);
    }
    // Resolution made grad_accum = global_batch / micro_batch for one process.
    let passes = t.global_batch / t.micro_batch;
    if !passes.is_multiple_of(world) {
        let would: Vec<String> = (1..=passes)
            .filter(|n| passes.is_multiple_of(*n))
            .map(|n| n.to_string())
            .collect();
        return Err(KilnError::Setting(format!(
            "train.global_batch = {} is {passes} micro-batches of {}, which {world} ranks cannot share evenly; run on {} GPUs, or choose a global batch that is a multiple of {}",
            t.global_batch,
            t.micro_batch,
            would.join(", "),
            world * t.micro_batch
        )));
    }
    Ok(passes / world)
}

/// The device a rank trains on: `cuda:LOCAL_RANK` where the setting asks for a GPU (or
/// `auto` finds one), else the setting as it is.
fn rank_device(setting: &str, world: &crate::dist::World) -> String {
    if setting != "cuda" && setting != "auto" {
        return setting.to_string();
    }
    let gpus = crate::engine::cuda::device_count().unwrap_or(0);
    // A launcher that shows each rank only its own GPU (srun --gpus-per-task 1) leaves one.
    let ordinal = if gpus == 1 { 0 } else { world.local_rank };
    match setting {
        "auto" if gpus == 0 => "cpu".into(),
        _ => format!("cuda:{ordinal}"),
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename; a failed write removes
/// the temporary file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let result = fs::write(&tmp, bytes)
        .map_err(|e| KilnError::output(&tmp, e))
        .and_then(|_| fs::rename(&tmp, path).map_err(|e| KilnError::output(path, e)));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[derive(Serialize)]
struct TrainRecord {
    kind: &'static str,
    step: u64,
    loss: f64,
    lr: f64,
    grad_norm: f64,
    loss_scale: f64,
    skipped: bool,
    tokens: u64,
    tokens_per_s: f64,
    mem_current: usize,
    mem_peak: usize,
    mem_reserved: usize,
    /// Host bytes of the offloaded optimizer (page-locked beside a GPU), when offloaded.
    #[serde(skip_serializing_if = "Option::is_none")]
    mem_host_optimizer: Option<usize>,
    elapsed_s: f64,
    /// Mixture-of-experts routing of this step: slots, dropped slots, per-expert load, aux loss.
    #[serde(skip_serializing_if = "Option::is_none")]
    moe: Option<crate::models::RoutingStats>,
    /// Pool peak of every rank of a data-parallel run, in rank order.
    #[serde(skip_serializing_if = "Option::is_none")]
    mem_peak_ranks: Option<Vec<usize>>,
}

/// A pass that ran out of memory and the smaller one the run continues with.
#[derive(Serialize)]
struct OomRecord {
    kind: &'static str,
    step: u64,
    micro_batch_from: usize,
    micro_batch_to: usize,
}

/// A checkpoint that reached the disk: its size, how long writing it took, and how long
/// training stood still for it (`stall_s`): waiting for the previous write (`wait_s`, whose
/// staging the copy reuses), copying the state to host memory (`snapshot_s`), and, saved in
/// line, the write itself.
#[derive(Serialize)]
struct CheckpointRecord {
    kind: &'static str,
    step: u64,
    bytes: usize,
    write_s: f64,
    snapshot_s: f64,
    wait_s: f64,
    stall_s: f64,
    /// "background" (`train.checkpoint_async`) or "inline".
    mode: &'static str,
    /// "pinned" (page-locked staging, all copies queued at once) or "pageable".
    staging: &'static str,
}

/// What a save cost the training loop before its write, kept until the write is done.
#[derive(Clone, Copy, Default)]
struct SaveTiming {
    wait_s: f64,
    snapshot_s: f64,
    inline: bool,
    pinned: bool,
}

#[derive(Serialize)]
struct EvalRecord {
    kind: &'static str,
    step: u64,
    val_loss: f64,
    val_bits_per_token: f64,
}

pub fn run(opts: RunOptions) -> Result<Summary> {
    let run_dir = opts.run_dir.clone();
    if opts.resume && !run_dir.join("config.toml").is_file() {
        return Err(not_a_run(&run_dir));
    }
    // In a data-parallel run rank 0 alone holds the lock and writes the run directory.
    if opts.world.as_ref().is_some_and(|w| !w.is_root()) {
        return run_locked(opts, None);
    }
    // The directories this start creates, outermost first, so a failed start removes them.
    let created: Vec<PathBuf> = run_dir
        .ancestors()
        .filter(|a| !a.as_os_str().is_empty() && !a.exists())
        .map(Path::to_path_buf)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let existed: Vec<PathBuf> = ["config.toml", "metrics.jsonl", "checkpoints"]
        .iter()
        .map(|f| run_dir.join(f))
        .filter(|p| p.exists())
        .collect();
    let locked = fs::create_dir_all(&run_dir)
        .map_err(|e| KilnError::output(&run_dir, e))
        .and_then(|_| lock::RunLock::acquire(&run_dir));
    let lock = match locked {
        Ok(lock) => lock,
        Err(e) => {
            remove_created(&created);
            return Err(e);
        }
    };
    let result = run_locked(opts, Some(&lock));
    if result.is_err() && !holds_data(&run_dir) {
        if created.is_empty() {
            for f in ["config.toml", "metrics.jsonl", "checkpoints"] {
                let p = run_dir.join(f);
                if !existed.contains(&p) {
                    let _ = fs::remove_file(&p).or_else(|_| fs::remove_dir_all(&p));
                }
            }
            if lock.created {
                let _ = fs::remove_file(lock.path());
            }
        } else {
            remove_created(&created);
        }
    }
    result
}

/// The error for a `--resume` or `--run` directory that `kiln train` did not write.
pub fn not_a_run(dir: &Path) -> KilnError {
    let reason = if dir.is_dir() {
        "has no config.toml, so it is not a directory `kiln train` wrote; pass the --out directory of the run (runs/LATEST names the most recent)"
    } else {
        "does not exist; pass the --out directory of a run `kiln train` wrote (runs/LATEST names the most recent)"
    };
    KilnError::run_dir(dir, reason)
}

/// Removes the directories a failed start created (the innermost, the run directory, with
/// everything in it; its new parents only if empty).
fn remove_created(created: &[PathBuf]) {
    if let Some(run_dir) = created.last() {
        let _ = fs::remove_dir_all(run_dir);
    }
    for dir in created.iter().rev().skip(1) {
        let _ = fs::remove_dir(dir);
    }
}

/// Whether a run directory holds anything worth keeping: a checkpoint, or metrics of at least
/// one step (a run that diverged before its first checkpoint says so there).
fn holds_data(run_dir: &Path) -> bool {
    !checkpoint::list(run_dir).is_empty()
        || fs::metadata(run_dir.join("metrics.jsonl")).is_ok_and(|m| m.len() > 0)
}

/// Starts or stops an attached profiler's collection on the trainer's GPU (nothing on the CPU).
fn profiler_collect(trainer: &Trainer, on: bool) -> Result<()> {
    match trainer.pool.cuda() {
        Ok(g) => g
            .profiler_collect(on)
            .map_err(|e| KilnError::Engine(crate::engine::EngineError::Cuda(e))),
        Err(_) => Ok(()),
    }
}

fn run_locked(opts: RunOptions, lock: Option<&lock::RunLock>) -> Result<Summary> {
    // Installed first: a stop asked for while the run starts is honoured after its first step.
    let _handlers = signals::install();
    let mut cfg = opts.config.config.clone();
    let world = opts.world.clone();
    let root = world.as_ref().is_none_or(|w| w.is_root());
    // Only rank 0 reports; the others print their errors only.
    let mut progress = Progress::new(opts.quiet || !root);
    if let Some(holder) = lock.and_then(|l| l.stale_holder.as_ref()) {
        progress.message(&format!(
            "note: {} was last held by {holder}, which is no longer running; taking it over",
            lock.map_or(PathBuf::new(), |l| l.path().to_path_buf())
                .display()
        ));
    }
    if let Some(w) = &world {
        cfg.train.device = rank_device(&cfg.train.device, w);
        cfg.train.grad_accum = rank_grad_accum(&cfg, w.world_size)?;
    }
    if cfg.train.epochs > 0.0 {
        let rows = crate::data::epoch_rows(&data_spec(&cfg))?;
        let world_size = world.as_ref().map_or(1, |w| w.world_size);
        let per_step = match cfg.train.global_batch {
            0 => cfg.train.micro_batch * cfg.train.grad_accum * world_size,
            n => n,
        };
        cfg.train.steps = ((cfg.train.epochs * rows as f64) / per_step as f64)
            .ceil()
            .max(1.0) as usize;
        progress.message(&format!(
            "train.epochs={}: {} steps of {per_step} rows over the {rows} training rows of {} tokens",
            cfg.train.epochs, cfg.train.steps, cfg.train.seq_len
        ));
    }
    let (pool, precision, notes) = open_device(&cfg.train.device, &cfg.train.precision)?;
    set_memory_limit(&pool, &cfg)?;
    let device = pool.device();
    for n in notes {
        progress.message(&format!("note: {n}"));
    }
    let vocab = model_vocab(&cfg)?;
    if let Some(ram) = crate::plan::machine_ram() {
        let limit = (pool.stats().limit != 0).then(|| pool.stats().limit);
        if let oom::HostFit::CapAt { usable, planned } =
            oom::check_host(&cfg, vocab, precision, device, limit, ram)?
        {
            pool.set_limit(usable);
            progress.message(&format!(
                "note: the step of train.micro_batch={} needs {} by the plan, more than the {} of RAM kiln may use; the pool is capped there, so forward/backward passes split to fit",
                cfg.train.micro_batch,
                format_bytes(planned),
                format_bytes(usable)
            ));
        }
    }
    let stage = crate::dist::ZeroStage::from_setting(cfg.dist.zero).ok_or_else(|| {
        KilnError::Setting(format!("dist.zero = {} is not 0, 1 or 2", cfg.dist.zero))
    })?;
    let shard = world.as_ref().map(|w| trainer::Shard {
        rank: w.rank,
        world_size: w.world_size,
        stage,
    });
    let mut trainer =
        Trainer::with_base_sharded(&cfg, vocab, &pool, precision, opts.init.as_ref(), shard)
            .map_err(|e| match e {
                KilnError::Engine(e) if e.is_out_of_memory() => {
                    oom::does_not_fit(oom::DoesNotFit::Model, &e, &pool, &cfg, precision)
                }
                other => other,
            })?;
    if let Some(w) = &world {
        join_world(&mut trainer, w, stage, &mut progress)?;
    }

    // Restore before writing anything: a bad checkpoint must leave the run directory as it was.
    let run_dir = &opts.run_dir;
    let total = cfg.train.steps as u64;
    if opts.resume {
        let ckpt = checkpoint::resolve(run_dir, opts.checkpoint.as_deref())?;
        checkpoint::load_into(&mut trainer, &ckpt)
            .map_err(|e| checkpoint::explain(e, run_dir, &ckpt))?;
        if let Some(w) = checkpoint::legacy_warning(&ckpt) {
            progress.message(&format!("warning: {w}"));
        }
        let done = trainer.state.step;
        if done >= total {
            return Err(KilnError::Setting(format!(
                "the run in {} has done {done} steps and train.steps is {total}, so there is nothing to resume; to train it further, resume with a larger train.steps, e.g. kiln train --resume {} train.steps={}",
                run_dir.display(),
                run_dir.display(),
                done.max(total) * 2
            )));
        }
        if let Some(stop) = opts.stop_after.filter(|&s| s <= done) {
            return Err(KilnError::Setting(format!(
                "--stop-after {stop} is not after the resumed step {done}; give a later step (at most train.steps={total})"
            )));
        }
        let split = trainer.passes.learned().map_or(String::new(), |rows| {
            format!(", {rows} sequences per forward/backward pass (learned when memory ran out before the checkpoint)")
        });
        progress.message(&format!(
            "resumed from {} at step {}{split}",
            ckpt.display(),
            trainer.state.step
        ));
    } else if !checkpoint::list(run_dir).is_empty() {
        return Err(KilnError::Setting(format!(
            "{} already holds a run with checkpoints; add --resume to continue it or choose another --out",
            run_dir.display()
        )));
    }
    if let Some(init) = &opts.init {
        progress.message(&format!(
            "initialised from {} ({}, {})",
            init.source.path.display(),
            init.source.format,
            init.source.architecture
        ));
    }
    if root {
        fs::create_dir_all(run_dir).map_err(|e| KilnError::output(run_dir, e))?;
        write_atomic(
            &run_dir.join("config.toml"),
            opts.config.to_toml().as_bytes(),
        )?;
        if let Some(init) = &opts.init {
            let json = serde_json::to_vec_pretty(&init.source).unwrap_or_default();
            write_atomic(&run_dir.join("init_from.json"), &json)?;
        }
    }
    let mut metrics = if root {
        MetricsWriter::open(&run_dir.join("metrics.jsonl"))?
    } else {
        MetricsWriter::discard()
    };
    let mut scu_history = match trainer.state.scu {
        Some(_) if root => Some(MetricsWriter::open(&run_dir.join("scu_history.jsonl"))?),
        _ => None,
    };

    let mut spec = data_spec(&cfg);
    if let Some(w) = &world {
        spec.micro_offset =
            crate::dist::shard::rank_micro_batches(w.rank, w.world_size, cfg.train.grad_accum)
                .start;
    }
    let mut loader = Prefetcher::spawn(spec, trainer.state.data_step, cfg.data.prefetch);
    let splits = loader.splits()?;
    let val = match &splits.sft {
        Some(d) => {
            let s = &d.stats;
            progress.message(&format!(
                "fine-tuning data: {} training and {} validation examples in {} and {} rows of {} tokens; {} and {} tokens trained (completions only){}",
                s.examples,
                s.val_examples,
                d.train.len(),
                d.val.len(),
                cfg.train.seq_len,
                s.train_trained_tokens,
                s.val_trained_tokens,
                if s.truncated > 0 {
                    format!("; {} examples cut to train.seq_len + 1 tokens", s.truncated)
                } else {
                    String::new()
                }
            ));
            data::sft::val_batches(&d.val, cfg.train.eval_batches, cfg.train.micro_batch)
        }
        None => data::val_batches(
            &splits.val,
            cfg.train.eval_batches,
            cfg.train.micro_batch,
            cfg.train.seq_len,
        )?,
    };
    let unigram = data::unigram_cross_entropy(&splits.train, &splits.val, vocab);
    trainer.scu_tokens = splits.train.len() as f64;
    let params: usize = trainer.model.cost(1, 1).params;
    if !trainer.adapted.is_empty() {
        let trainable: usize = trainer
            .model
            .trainable_params()
            .iter()
            .map(|p| p.value.len())
            .sum();
        progress.message(&format!(
            "low-rank adapters (rank {}, alpha {}) on {} modules: {trainable} trainable parameters over a frozen base of {params}",
            cfg.lora.rank,
            cfg.lora.alpha,
            trainer.adapted.len()
        ));
    }
    if let Some(q) = &trainer.quantized {
        progress.message(&format!(
            "QLoRA: {} frozen projections ({} weights) in NF4: {} in place of {} in bf16, expanded for each GEMM into one {} workspace",
            q.weights,
            q.values,
            format_bytes(q.nf4_bytes),
            format_bytes(2 * q.values),
            format_bytes(q.workspace_bytes)
        ));
    }
    progress.message(&format!(
        "training {params} parameters on {device} in {precision}: {} train / {} val tokens; unigram val loss {unigram:.3}",
        splits.train.len(),
        splits.val.len()
    ));

    let polychromic = match cfg.polychromic.enabled {
        true => {
            let p = polychromic::Polychromic::open(&cfg, trainer.model.context())?;
            progress.message(&format!(
                "polychromic: CE - {} * D, {} replies to each of {} prompts every {} step(s), embedded by {}; held-out D over {} validation prompts",
                cfg.polychromic.lambda,
                cfg.polychromic.samples,
                cfg.polychromic.prompts,
                cfg.polychromic.every,
                p.embedder(),
                p.held_out_prompts()
            ));
            Some(p)
        }
        false => None,
    };
    let mut val_diversity = None;
    let mut poly_note = String::new();

    let last = opts.stop_after.map_or(total, |s| s.min(total));
    let every = |n: usize, step: u64| n > 0 && step.is_multiple_of(n as u64);
    let started = Instant::now();
    // NVML readings of the run's GPU, or of every GPU of rank 0's machine in a data-parallel
    // run (each reading names its GPU).
    let samplers: Vec<crate::hw::nvml::Sampler> = match (&world, device) {
        (_, _) if !root => Vec::new(),
        (Some(w), Device::Cuda(_)) => (0..w
            .local_world_size
            .min(crate::engine::cuda::device_count().unwrap_or(1)))
            .filter_map(|g| device_sampler(Device::Cuda(g), started, &mut progress))
            .collect(),
        _ => device_sampler(device, started, &mut progress)
            .into_iter()
            .collect(),
    };
    let mut window = (Instant::now(), 0u64);
    let mut last_ckpt: Option<PathBuf> = checkpoint::latest(run_dir)?;
    let mut train_loss = f64::NAN;
    let mut val_loss = f64::NAN;
    let start_tokens = trainer.state.tokens;
    let start_step = trainer.state.step;
    let mut early = early_stop::EarlyStop::new(
        cfg.train.early_stop_patience,
        cfg.train.early_stop_min_delta,
        cfg.train.keep_best,
    );
    if let Some(e) = early.as_mut().filter(|_| root) {
        e.replay(&run_dir.join("metrics.jsonl"), start_step);
    }
    let mut stopped_early = false;
    trainer.pool.reset_peak();
    if cfg.train.eval_at_start && start_step == 0 && root {
        let v = trainer.evaluate(&val)?;
        metrics.write(&EvalRecord {
            kind: "eval",
            step: 0,
            val_loss: v,
            val_bits_per_token: v / std::f64::consts::LN_2,
        })?;
        progress.message(&format!(
            "step     0: val loss {v:.4} ({:.3} bits/token) before training",
            v / std::f64::consts::LN_2
        ));
        if let Some(e) = &mut early {
            e.observe(0, v);
        }
    }

    // Rank 0 traces a data-parallel run (its file is the run's).
    let mut tracer = opts.trace.clone().filter(|_| root).map(trace::Trace::new);
    let background = cfg.train.checkpoint_async;
    // Allocated once, before the first step, so no save pays for pinning it.
    let staging = if background && root {
        checkpoint::pinned_staging(&trainer).unwrap_or_else(|notice| {
            progress.message(&format!("note: {notice}"));
            None
        })
    } else {
        None
    };
    let mut writer = checkpoint::Writer::new(run_dir, staging);
    // The save in flight on the background thread, reported once its write is done.
    let mut in_flight = SaveTiming::default();
    let mut ckpt_note = String::new();
    let mut stop_note_shown = false;
    while trainer.state.step < last {
        // Steps count from 1 in the trace and the profiler's range, as in the progress line.
        let step_number = trainer.state.step + 1;
        let traced = tracer
            .as_ref()
            .filter(|t| t.covers(step_number))
            .map(|_| step_number);
        trainer.mark_phases = traced.is_some();
        if let Some(range) = &opts.profile_steps
            && range.start == step_number
        {
            profiler_collect(&trainer, true)?;
        }
        if traced.is_some() {
            trainer.synchronize()?;
            crate::engine::profile::start_recording(trainer.pool.cuda().ok().map(|g| &**g))
                .map_err(|e| KilnError::Engine(crate::engine::EngineError::Cuda(e)))?;
        }
        let data_start = Instant::now();
        let mut micro: Vec<Batch> = Vec::with_capacity(cfg.train.grad_accum);
        for _ in 0..cfg.train.grad_accum {
            micro.push(loader.next()?.2);
        }
        let data_end = Instant::now();
        let sampled = match &polychromic {
            Some(p) => {
                let step = trainer.state.step + 1;
                p.prepare(&mut trainer, step)?
            }
            None => None,
        };
        // A sampling step times its forward and backward for the progress line.
        trainer.mark_phases |= sampled.is_some();
        let step_start = Instant::now();
        let report = match trainer.step(&micro) {
            Ok(report) => report,
            Err(e) => {
                // The note names the last checkpoint that is really on disk.
                if let Ok(Some(w)) = writer.wait() {
                    last_ckpt = Some(w.dir);
                }
                return Err(with_checkpoint_note(e, &last_ckpt));
            }
        };
        if let Some(s) = &sampled {
            let fb_end = trainer.fwd_bwd_end.unwrap_or_else(Instant::now);
            let record = polychromic::StepRecord {
                kind: "polychromic",
                step: trainer.state.step,
                diversity: s.diversity,
                lambda: cfg.polychromic.lambda,
                prompts: s.prompts,
                replies: s.replies,
                reply_tokens: s.reply_tokens,
                generate_s: s.generate_s(),
                embed_s: s.embed_s(),
                forward_backward_s: (fb_end - step_start).as_secs_f64(),
            };
            poly_note = format!(
                " | D {:.4} (gen {:.2}s, embed {:.2}s, fwd-bwd {:.2}s)",
                record.diversity, record.generate_s, record.embed_s, record.forward_backward_s
            );
            metrics.write(&record)?;
        }
        if let (Some(n), Some(t)) = (traced, tracer.as_mut()) {
            trainer.synchronize()?;
            let end = Instant::now();
            let fb_end = trainer.fwd_bwd_end.take().unwrap_or(end);
            t.span("data wait", n, data_start, data_end);
            if let Some(s) = &sampled {
                t.span("generate", n, s.generate.0, s.generate.1);
                t.span("embed", n, s.embed.0, s.embed.1);
            }
            t.span("forward+backward", n, step_start, fb_end);
            t.span("optimizer", n, fb_end, end);
            let ops = crate::engine::profile::finish_recording()
                .map_err(|e| KilnError::Engine(crate::engine::EngineError::Cuda(e)))?;
            for op in ops {
                t.op_span(op.name, n, op.launched, op.start, op.duration);
            }
        }
        if let Some(range) = &opts.profile_steps
            && range.end == step_number + 1
        {
            profiler_collect(&trainer, false)?;
        }
        for split in trainer.passes.take_splits() {
            progress.message(&format!(
                "step {}: out of memory with {} sequences per forward/backward pass; continuing with {} per pass (same global batch and gradient)",
                split.step, split.from, split.to
            ));
            metrics.write(&OomRecord {
                kind: "oom",
                step: split.step,
                micro_batch_from: split.from,
                micro_batch_to: split.to,
            })?;
        }
        if let (Some(r), Some(w)) = (&report.scu, scu_history.as_mut()) {
            w.write(r)?;
        }
        let step = trainer.state.step;
        train_loss = report.loss;
        window.1 += report.tokens;
        if report.skipped {
            progress.message(&format!(
                "step {}: gradients overflowed in fp16; skipped, loss scale now {}",
                step + 1,
                trainer.loss_scale()
            ));
        }
        let mem = trainer.pool.stats();
        let host = trainer.opt.host_memory();
        let logged = every(cfg.train.log_every, step) || step == last;
        // Every rank's pool peak, for rank 0's record (every rank logs at the same steps).
        let mem_peak_ranks = match (&mut trainer.dist, logged) {
            (Some(d), true) => Some(rank_peaks(d, mem.peak)?),
            _ => None,
        };
        if logged {
            let secs = window.0.elapsed().as_secs_f64();
            let tps = window.1 as f64 / secs.max(1e-9);
            let per_step = started.elapsed().as_secs_f64() / (step - start_step).max(1) as f64;
            let eta = Duration::from_secs_f64((last - step) as f64 * per_step);
            let host_note = host.map_or(String::new(), |h| {
                format!(" + host {}", format_bytes(h.current))
            });
            progress.update(&format!(
                "step {step:>5}/{total} | loss {:.4} | lr {:.2e} | {:.1}k tok/s | mem {} (peak {}, reserved {}){host_note}{poly_note}{ckpt_note} | eta {}",
                report.loss,
                report.lr,
                tps / 1000.0,
                format_bytes(mem.current),
                format_bytes(mem.peak),
                format_bytes(mem.reserved),
                format_duration(eta)
            ));
            for s in &samplers {
                metrics.write_device_samples(&s.drain())?;
            }
            metrics.write(&TrainRecord {
                kind: "train",
                step,
                loss: report.loss,
                lr: report.lr,
                grad_norm: report.grad_norm,
                loss_scale: report.loss_scale,
                skipped: report.skipped,
                tokens: trainer.state.tokens,
                tokens_per_s: tps,
                mem_current: mem.current,
                mem_peak: mem.peak,
                mem_reserved: mem.reserved,
                mem_host_optimizer: host.map(|h| h.current),
                elapsed_s: started.elapsed().as_secs_f64(),
                moe: report.routing.clone(),
                mem_peak_ranks,
            })?;
            window = (Instant::now(), 0);
        }
        if report.skipped {
            continue;
        }
        // Set by this step's evaluation when it is the best so far (train.keep_best).
        let mut best_now = false;
        if (every(cfg.train.eval_every, step) || step == last) && root {
            let eval_start = Instant::now();
            val_loss = trainer.evaluate(&val)?;
            if let (Some(n), Some(t)) = (traced, tracer.as_mut()) {
                trainer.synchronize()?;
                t.span("eval", n, eval_start, Instant::now());
            }
            metrics.write(&EvalRecord {
                kind: "eval",
                step,
                val_loss,
                val_bits_per_token: val_loss / std::f64::consts::LN_2,
            })?;
            progress.message(&format!(
                "step {step:>5}: val loss {val_loss:.4} ({:.3} bits/token)",
                val_loss / std::f64::consts::LN_2
            ));
            if let Some(e) = &mut early {
                let exhausted = e.observe(step, val_loss);
                best_now = cfg.train.keep_best && e.best_at(step);
                if exhausted && step < last {
                    let (best_step, best) = e.best();
                    progress.message(&format!(
                    "step {step}: {} evaluations without a val loss below {best:.4} (step {best_step}) by more than train.early_stop_min_delta={}; stopping early with a checkpoint",
                    e.stale(),
                    cfg.train.early_stop_min_delta
                ));
                    stopped_early = true;
                }
            }
            if let Some(p) = &polychromic {
                let d = p.held_out_diversity(trainer.model.as_ref())?;
                val_diversity = Some(d);
                metrics.write(&polychromic::EvalRecord {
                    kind: "polychromic_eval",
                    step,
                    val_diversity: d,
                    prompts: p.held_out_prompts(),
                })?;
                progress.message(&format!(
                    "step {step:>5}: held-out D {d:.4} over {} prompts",
                    p.held_out_prompts()
                ));
            }
        }
        let mut stop = signals::stop_requested();
        let mut save_request = signals::take_save_request();
        if let Some(d) = &mut trainer.dist {
            // Every rank stops and saves at the same step, or none does; rank 0, which
            // evaluates, decides an early stop.
            let mut flags = [
                stop.is_some() as u8 as f64,
                save_request as u8 as f64,
                stopped_early as u8 as f64,
                best_now as u8 as f64,
            ];
            d.control
                .all_reduce_max(&mut flags, "the stop and save requests")
                .map_err(KilnError::Dist)?;
            if flags[0] > 0.0 && stop.is_none() {
                stop = Some("a stop request to another rank");
            }
            save_request = flags[1] > 0.0;
            stopped_early = flags[2] > 0.0;
            best_now = flags[3] > 0.0;
        }
        if stop.is_some() && !stop_note_shown {
            progress.message(&format!(
                "step {step}: {} received; saving a checkpoint and stopping (Ctrl-C again stops at once, without saving)",
                stop.unwrap_or_default()
            ));
            stop_note_shown = true;
        }
        let scheduled = every(cfg.train.checkpoint_every, step)
            || ((step == last || stopped_early) && cfg.train.save_final)
            || best_now;
        let mut written_inline = None;
        if (scheduled || stop.is_some() || save_request) && trainer.dist.is_some() {
            gather_for_checkpoint(&mut trainer)?;
        }
        if (scheduled || stop.is_some() || save_request) && root {
            let ckpt_start = Instant::now();
            // The write in flight reads the staging this snapshot fills: it finishes first.
            if let Some(w) = writer.wait()? {
                record_checkpoint(&mut metrics, &mut ckpt_note, &w, &in_flight)?;
                last_ckpt = Some(w.dir);
            }
            let snapshot_start = Instant::now();
            let mut snap = writer.snapshot(&trainer)?;
            snap.best = best_now;
            let timing = SaveTiming {
                wait_s: (snapshot_start - ckpt_start).as_secs_f64(),
                snapshot_s: snapshot_start.elapsed().as_secs_f64(),
                inline: !background,
                pinned: snap.pinned(),
            };
            if background {
                writer.submit(snap)?;
                in_flight = timing;
            } else {
                let w = checkpoint::write(&snap, run_dir)?;
                record_checkpoint(&mut metrics, &mut ckpt_note, &w, &timing)?;
                last_ckpt = Some(w.dir.clone());
                written_inline = Some(w);
            }
            if let (Some(n), Some(t)) = (traced, tracer.as_mut()) {
                t.span("checkpoint", n, ckpt_start, Instant::now());
            }
        }
        trainer.opt.gathered.clear();
        if let Some(signal) = stop
            && !root
        {
            if let Some(d) = &mut trainer.dist {
                d.control.finish().map_err(KilnError::Dist)?;
            }
            return Err(KilnError::Stopped {
                signal,
                step,
                checkpoint: checkpoint::checkpoints_dir(run_dir).join(checkpoint::step_name(step)),
                run_dir: run_dir.clone(),
            });
        }
        if let Some(signal) = stop {
            let w = match writer.wait()? {
                Some(w) => {
                    record_checkpoint(&mut metrics, &mut ckpt_note, &w, &in_flight)?;
                    w
                }
                None => written_inline.ok_or_else(|| {
                    KilnError::output(
                        checkpoint::checkpoints_dir(run_dir),
                        "no checkpoint was written",
                    )
                })?,
            };
            progress.finish();
            if let Some(d) = &mut trainer.dist {
                d.control.finish().map_err(KilnError::Dist)?;
            }
            return Err(KilnError::Stopped {
                signal,
                step: w.step,
                checkpoint: w.dir,
                run_dir: run_dir.clone(),
            });
        }
        if stopped_early {
            break;
        }
    }
    if let Some(w) = writer.wait()? {
        record_checkpoint(&mut metrics, &mut ckpt_note, &w, &in_flight)?;
        last_ckpt = Some(w.dir);
    }
    trainer.mark_phases = false;
    if let Some(t) = &tracer {
        t.write()?;
    }
    progress.finish();
    for s in samplers {
        metrics.write_device_samples(&s.drain())?;
    }
    if val_loss.is_nan() && root {
        val_loss = trainer.evaluate(&val)?;
    }
    if let Some(d) = &mut trainer.dist {
        d.control.finish().map_err(KilnError::Dist)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let tokens = trainer.state.tokens - start_tokens;
    let summary = Summary {
        steps: trainer.state.step,
        tokens: trainer.state.tokens,
        params,
        device: device.to_string(),
        precision: precision.to_string(),
        train_loss,
        val_loss,
        val_bits_per_token: val_loss / std::f64::consts::LN_2,
        unigram_val_loss: unigram,
        elapsed_s: elapsed,
        tokens_per_s: tokens as f64 / elapsed.max(1e-9),
        skipped_steps: trainer.state.scaler.map_or(0, |s| s.skipped),
        data_wait_s: loader.wait_stats().as_secs_f64(),
        peak_memory_bytes: trainer.pool.stats().peak,
        host_optimizer_peak_bytes: trainer.opt.host_memory().map(|h| h.peak),
        effective_micro_batch: trainer.passes.largest(cfg.train.micro_batch),
        checkpoint: last_ckpt.map(|p| p.display().to_string()),
        val_diversity,
        early_stop: early.and_then(|e| e.report(stopped_early)),
    };
    if root {
        let json =
            serde_json::to_vec_pretty(&summary).map_err(|e| KilnError::output(run_dir, e))?;
        write_atomic(&run_dir.join("summary.json"), &json)?;
    }
    Ok(summary)
}

/// Joins the data-parallel job as `world.rank`: rendezvous, NCCL on a GPU, the gradient
/// buckets and ZeRO ownership; then checks that every rank runs the same batch shape (a rank
/// whose hardware profile chose differently would make the collectives disagree).
fn join_world(
    trainer: &mut Trainer,
    world: &crate::dist::World,
    stage: crate::dist::ZeroStage,
    progress: &mut Progress,
) -> Result<()> {
    let cfg = &trainer.cfg;
    let settings = crate::dist::DistSettings {
        stage,
        bucket_bytes: (cfg.dist.bucket_mb * 1024.0 * 1024.0) as usize,
        timeout: Duration::from_secs_f64(cfg.dist.timeout_s),
        on_failure: crate::dist::control::OnPeerFailure::Exit,
    };
    let mut dp = crate::dist::DataParallel::start(
        world.clone(),
        &trainer.pool,
        &trainer.model.trainable_params(),
        settings,
    )
    .map_err(KilnError::Dist)?;
    let t = &cfg.train;
    let shape = format!(
        "train.micro_batch={} train.grad_accum={} train.seq_len={} train.steps={} dist.zero={} train.precision={}",
        t.micro_batch, t.grad_accum, t.seq_len, t.steps, cfg.dist.zero, t.precision
    );
    let all = dp
        .control
        .all_gather(shape.as_bytes(), "the batch shape")
        .map_err(KilnError::Dist)?;
    for (r, other) in all.iter().enumerate() {
        if other.as_slice() != shape.as_bytes() {
            return Err(KilnError::Dist(format!(
                "rank {r} runs {} but rank {} runs {shape}; give every rank the same settings (on mixed GPUs, set train.micro_batch for the smallest)",
                String::from_utf8_lossy(other),
                world.rank
            )));
        }
    }
    let devices: Vec<&str> = dp
        .control
        .members
        .iter()
        .map(|m| m.device.as_str())
        .collect();
    if devices.iter().any(|d| *d != devices[0]) {
        let smallest = dp
            .control
            .members
            .iter()
            .min_by_key(|m| m.device_memory)
            .map_or(String::new(), |m| m.device.clone());
        progress.message(&format!(
            "warning: the ranks train on different devices ({}); every rank runs the same batch, so plan for the smallest ({smallest}), e.g. with kiln plan --gpu for it",
            devices.join(", ")
        ));
    }
    let global = t.micro_batch * t.grad_accum * world.world_size;
    progress.message(&format!(
        "data parallel: {} ranks on {} machine(s) (launched by {}), ZeRO-{}, global batch {global} sequences ({} per rank per step), {} gradient buckets{}",
        world.world_size,
        world.nnodes,
        world.launcher,
        stage.number(),
        t.micro_batch * t.grad_accum,
        dp.buckets.len(),
        match &dp.nccl {
            Some(_) => format!(
                " over NCCL {}",
                crate::dist::nccl::version().unwrap_or_default()
            ),
            None => " over TCP (CPU)".into(),
        }
    ));
    dp.control.barrier("the start").map_err(KilnError::Dist)?;
    trainer.dist = Some(dp);
    Ok(())
}

/// Every rank's pool peak, gathered for rank 0's metrics.
fn rank_peaks(d: &mut crate::dist::DataParallel, peak: usize) -> Result<Vec<usize>> {
    let all = d
        .control
        .all_gather(&(peak as u64).to_le_bytes(), "the ranks' memory")
        .map_err(KilnError::Dist)?;
    Ok(all
        .iter()
        .map(|b| {
            b.get(..8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
        })
        .collect())
}

/// Under ZeRO, brings the moments of the parameters rank 0 does not own to rank 0, so its
/// checkpoint holds every moment (and resumes on any number of ranks).
fn gather_for_checkpoint(trainer: &mut Trainer) -> Result<()> {
    let Some(d) = &mut trainer.dist else {
        return Ok(());
    };
    let params = trainer.model.trainable_params();
    let gathered = d
        .gather_moments(&params, &trainer.opt.m, &trainer.opt.v)
        .map_err(KilnError::Dist)?;
    drop(params);
    trainer.opt.gathered = gathered;
    Ok(())
}

/// Logs a checkpoint that reached the disk, in metrics.jsonl and on the progress line.
fn record_checkpoint(
    metrics: &mut MetricsWriter,
    note: &mut String,
    w: &checkpoint::Written,
    t: &SaveTiming,
) -> Result<()> {
    let stall_s = t.wait_s + t.snapshot_s + if t.inline { w.write_s } else { 0.0 };
    *note = format!(
        " | ckpt {} written in {:.2}s, stalled {:.2}s",
        format_bytes(w.bytes),
        w.write_s,
        stall_s
    );
    metrics.write(&CheckpointRecord {
        kind: "checkpoint",
        step: w.step,
        bytes: w.bytes,
        write_s: w.write_s,
        snapshot_s: t.snapshot_s,
        wait_s: t.wait_s,
        stall_s,
        mode: if t.inline { "inline" } else { "background" },
        staging: if t.pinned { "pinned" } else { "pageable" },
    })
}

/// A once-a-second NVML sampler of the run's GPU, or `None` on the CPU or without NVML (said
/// once, since the run goes on without device records).
fn device_sampler(
    device: Device,
    started: Instant,
    progress: &mut Progress,
) -> Option<crate::hw::nvml::Sampler> {
    let Device::Cuda(ordinal) = device else {
        return None;
    };
    crate::hw::nvml::Sampler::spawn(ordinal, Duration::from_secs(1), started)
        .map_err(|e| progress.message(&format!("note: no GPU readings in metrics.jsonl: {e}")))
        .ok()
}

/// Adds where the last good checkpoint is to a divergence error.
fn with_checkpoint_note(e: KilnError, last: &Option<PathBuf>) -> KilnError {
    match e {
        KilnError::NonFinite {
            what, step, value, ..
        } => KilnError::NonFinite {
            what,
            step,
            value,
            kept: checkpoint_note(last),
        },
        KilnError::LayerNonFinite { step, source, .. } => KilnError::LayerNonFinite {
            step,
            source,
            kept: checkpoint_note(last),
        },
        other => other,
    }
}

fn checkpoint_note(last: &Option<PathBuf>) -> String {
    match last {
        Some(p) => format!("the last good checkpoint is kept at {}", p.display()),
        None => "no checkpoint had been written yet".into(),
    }
}

/// A trained model read back from a run directory, for evaluation and generation.
pub struct LoadedRun {
    pub config: crate::config::Config,
    pub model: Box<dyn crate::models::Model>,
    pub step: u64,
    pub checkpoint: PathBuf,
    /// Set when the checkpoint could not be verified (a legacy one without a manifest): the
    /// one-line warning to show.
    pub unverified: Option<String>,
}

/// Rows of the model's embedding: `model.vocab`, or the tokenizer's vocabulary when it is 0.
pub fn model_vocab(cfg: &crate::config::Config) -> Result<usize> {
    let tokens = data::tokenizer_vocab_size(&cfg.data.tokenizer)?;
    match cfg.model.vocab {
        0 => Ok(tokens),
        v if v >= tokens => Ok(v),
        v => Err(KilnError::Setting(format!(
            "model.vocab = {v} is smaller than the tokenizer's {tokens} tokens; use 0 (the tokenizer's size) or at least {tokens}"
        ))),
    }
}

/// Loads a run's saved configuration and the weights of its latest checkpoint, or of
/// `choice` (`step_N`), verified against the checkpoint's manifest (fp32, CPU).
pub fn load_run(run_dir: &Path, choice: Option<&str>) -> Result<LoadedRun> {
    let config_path = run_dir.join("config.toml");
    if !config_path.is_file() {
        return Err(not_a_run(run_dir));
    }
    let config = ResolvedConfig::resolve(Some(&config_path), &[])?.config;
    let ckpt = checkpoint::resolve(run_dir, choice)?;
    let vocab = model_vocab(&config)?;
    let trainer = Trainer::new(
        &config,
        vocab,
        &MemoryPool::new(Device::Cpu),
        Precision::Fp32,
    )?;
    let mut model = trainer.model;
    let meta = checkpoint::load_weights(&ckpt, model.as_mut(), &config.model, vocab)
        .map_err(|e| checkpoint::explain(e, run_dir, &ckpt))?;
    Ok(LoadedRun {
        config,
        model,
        step: meta.state.step,
        unverified: checkpoint::legacy_warning(&ckpt),
        checkpoint: ckpt,
    })
}

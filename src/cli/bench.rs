//! `kiln bench`: performance measurements (benchmarks, never timed tests).

use crate::data::{self, Batch, Corpus};
use crate::engine::profile;
use crate::error::{KilnError, Result};
use crate::train::{self, StepReport, Trainer};
use clap::{Args, Subcommand};
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Training throughput (tokens/s) of a model configuration.
    Train(BenchTrainArgs),
    /// Time of each GPU kernel at GPT-2 small sizes, against the measured memory and GEMM rates.
    Kernels(super::bench_kernels::BenchKernelsArgs),
    /// BK-Core forward and backward over batch x N, against the DRAM roofline, cuSPARSE's
    /// batched tridiagonal solve and a PyTorch determinant recurrence.
    Bk(super::bench_bk::BenchBkArgs),
    /// One model trained in fp32, tf32, bf16-mixed and fp16-mixed: tokens/s, speedup, peak
    /// memory and the loss reached.
    Amp(super::bench_amp::BenchAmpArgs),
    /// Tokens/s of reading, tokenising, batching and copying, beside a training step's rate.
    Dataloader(super::bench_dataloader::BenchDataloaderArgs),
    /// Planned against measured pool peak across micro-batch sizes, and the out-of-memory
    /// boundary predicted against the one found by trial.
    Memory(super::bench_memory::BenchMemoryArgs),
}

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench train --device cpu
  kiln bench train --steps 20 model.n_layers=6 train.micro_batch=8
  kiln bench train train.recompute=blocks        memory saved and time cost of recomputation
  kiln bench train train.memory_limit=2GiB       a cap that makes the micro-batch split")]
pub struct BenchTrainArgs {
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Timed optimizer steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Settings file, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Hardware profile, as for `kiln train`; `none` by default so a benchmark measures
    /// exactly the settings it is given.
    #[arg(long, value_name = "NAME", default_value = "none")]
    pub profile: String,
    /// Overrides on dotted keys, as for `kiln train`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(a) => bench_train(a),
        BenchCommand::Kernels(a) => super::bench_kernels::run(a),
        BenchCommand::Bk(a) => super::bench_bk::run(a),
        BenchCommand::Amp(a) => super::bench_amp::run(a),
        BenchCommand::Dataloader(a) => super::bench_dataloader::run(a),
        BenchCommand::Memory(a) => super::bench_memory::run(a),
    }
}

fn bench_train(a: BenchTrainArgs) -> Result<()> {
    let mut overrides = a.overrides.clone();
    overrides.push(format!("train.device={}", a.device));
    let cfg = super::settings::resolve(&a.profile, a.config.as_deref(), &overrides)?
        .config
        .config;
    let (pool, precision, notes) = train::open_device(&cfg.train.device, &cfg.train.precision)?;
    train::set_memory_limit(&pool, &cfg)?;
    let device = pool.device();
    notes.iter().for_each(|n| println!("note: {n}"));
    let tokenizer = data::tokenizer_by_name(&cfg.data.tokenizer)?;
    let corpus = Corpus::load(train::data_spec(&cfg).corpus.as_deref())?;
    let tokens = tokenizer.encode(&corpus.text);
    data::check_train_len(&tokens, cfg.train.seq_len)?;
    let mut trainer = Trainer::new(&cfg, tokenizer.vocab_size(), &pool, precision)?;
    let (b, t, k) = (
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
    );
    let cost = trainer.model.cost(b, t);
    let timed = timed_steps(&mut trainer, &tokens, 2, a.steps)?;
    let mut times: Vec<f64> = timed.iter().map(|s| s.seconds).collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens_per_step = (b * t * k) as f64;
    let flops_per_token = cost.flops_per_token(b * t);
    let flops_per_step = flops_per_token * tokens_per_step;
    println!(
        "kiln bench train: {} params, d_model {}, {} layers, batch {b} x {t} x accum {k}, {precision}, recompute {} on {device}{}",
        cost.params,
        cfg.model.d_model,
        cfg.model.n_layers,
        trainer.model.recompute(),
        if cfg.train.offload_optimizer {
            ", optimizer offloaded to the host"
        } else {
            ""
        }
    );
    for split in trainer.passes.take_splits() {
        println!(
            "note: out of memory with {} sequences per pass in step {}; ran {} per pass from then on",
            split.from, split.step, split.to
        );
    }
    println!("| metric | value |\n|---|---|");
    println!("| median step time | {:.1} ms |", median * 1e3);
    println!("| tokens/s | {:.0} |", tokens_per_step / median);
    println!(
        "| model FLOP/s | {:.2} GFLOP/s |",
        flops_per_step / median / 1e9
    );
    println!(
        "| FLOPs per token (fwd+bwd) | {:.3} M |",
        flops_per_token / 1e6
    );
    println!(
        "| peak memory | {:.1} MiB |",
        trainer.pool.stats().peak as f64 / (1024.0 * 1024.0)
    );
    println!(
        "| memory reserved by the allocator | {:.1} MiB |",
        trainer.pool.stats().reserved as f64 / (1024.0 * 1024.0)
    );
    if let Some(host) = trainer.opt.host_memory() {
        println!(
            "| host memory of the offloaded optimizer{} | {:.1} MiB |",
            if pool.cuda().is_ok() {
                " (page-locked)"
            } else {
                ""
            },
            host.current as f64 / (1024.0 * 1024.0)
        );
    }
    if let Some(peak) = pool
        .cuda()
        .ok()
        .and_then(|g| dense_peak_flops(&g.info().name, precision))
    {
        println!(
            "| MFU (of {:.0} TFLOP/s dense peak) | {:.1}% |",
            peak / 1e12,
            100.0 * flops_per_step / median / peak
        );
    }
    let table = profile::report();
    if !table.is_empty() {
        println!(
            "\nper-op time over the timed steps (KILN_PROFILE=1; each op synchronised):\n{table}"
        );
    }
    Ok(())
}

/// One timed optimizer step.
pub(crate) struct TimedStep {
    pub seconds: f64,
    pub report: StepReport,
}

/// Runs `warmup` then `steps` optimizer steps on the batches of `train.seed`, synchronising
/// the device after each so the wall clock covers the step's work; returns the timed steps.
/// The pool's peak and the per-op profile are reset after warm-up (which may have run out
/// of memory and split the micro-batch), so they describe the timed steps only.
pub(crate) fn timed_steps(
    trainer: &mut Trainer,
    tokens: &[u32],
    warmup: usize,
    steps: usize,
) -> Result<Vec<TimedStep>> {
    if steps == 0 {
        return Err(KilnError::Setting(
            "--steps must be at least 1: a benchmark needs a timed step".into(),
        ));
    }
    let cfg = &trainer.cfg.train;
    let (b, t, k, seed) = (cfg.micro_batch, cfg.seq_len, cfg.grad_accum, cfg.seed);
    let pool = trainer.pool.clone();
    let mut out = Vec::with_capacity(steps);
    for step in 0..(warmup + steps) as u64 {
        let batches: Vec<Batch> = (0..k as u64)
            .map(|m| data::train_batch(tokens, seed, step, m, b, t))
            .collect();
        if step == warmup as u64 {
            profile::reset();
            pool.reset_peak();
        }
        let t0 = Instant::now();
        let report = trainer.step(&batches)?;
        if let Ok(g) = pool.cuda() {
            g.synchronize().map_err(crate::engine::EngineError::from)?;
        }
        if step >= warmup as u64 {
            out.push(TimedStep {
                seconds: t0.elapsed().as_secs_f64(),
                report,
            });
        }
    }
    Ok(out)
}

/// Dense tensor-core peak of known GPUs for the precision's math (datasheet figures, SXM).
pub(crate) fn dense_peak_flops(name: &str, precision: train::Precision) -> Option<f64> {
    let hopper = name.contains("H100") || name.contains("H200");
    let ampere = name.contains("A100");
    let per_precision = |bf16: f64, tf32: f64, fp32: f64| match precision {
        train::Precision::Bf16Mixed | train::Precision::Fp16Mixed => bf16,
        train::Precision::Tf32 => tf32,
        train::Precision::Fp32 => fp32,
    };
    if hopper {
        Some(per_precision(989.4e12, 494.7e12, 66.9e12))
    } else if ampere {
        Some(per_precision(312e12, 156e12, 19.5e12))
    } else {
        None
    }
}

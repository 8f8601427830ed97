//! `kiln bench`: performance measurements (benchmarks, never timed tests).

use crate::data::{self, Batch};
use crate::engine::profile;
use crate::error::{KilnError, Result};
use crate::train::{self, StepReport, Trainer};
use clap::Subcommand;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Training throughput (tokens/s, MFU, peak memory) of a model configuration, its step
    /// split into phases, beside PyTorch on the same shape when torch and a GPU are there.
    Train(super::bench_train::BenchTrainArgs),
    /// Every CUDA kernel over a grid of row counts at GPT-2 small's width, against the memory
    /// and GEMM rates measured in the same run and the same operation in PyTorch.
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
    /// Generation: prefill and decode tokens/s at several batch sizes against the weight-
    /// and cache-read floor, beside transformers generate on the same model.
    Generate(super::bench_generate::BenchGenerateArgs),
    /// Fine-tuning: kiln LoRA over a bf16 base, kiln QLoRA over an NF4 base and
    /// transformers + PEFT LoRA on one shape: tokens/s, peak memory, base weight bytes, loss.
    Finetune(super::bench_finetune::BenchFinetuneArgs),
    /// The SCU controller against fixed penalty strengths on one base and data, over seeds:
    /// held-out bits per token, the final share S against its target, lambda over steps.
    Scu(super::bench_scu::BenchScuArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(a) => super::bench_train::run(a),
        BenchCommand::Kernels(a) => super::bench_kernels::run(a),
        BenchCommand::Bk(a) => super::bench_bk::run(a),
        BenchCommand::Amp(a) => super::bench_amp::run(a),
        BenchCommand::Dataloader(a) => super::bench_dataloader::run(a),
        BenchCommand::Memory(a) => super::bench_memory::run(a),
        BenchCommand::Generate(a) => super::bench_generate::run(a),
        BenchCommand::Finetune(a) => super::bench_finetune::run(a),
        BenchCommand::Scu(a) => super::bench_scu::run(a),
    }
}

/// One timed optimizer step.
pub(crate) struct TimedStep {
    pub seconds: f64,
    /// Seconds of the forward and backward passes (the rest is the optimizer), when phases
    /// were marked.
    pub fwd_bwd_seconds: Option<f64>,
    pub report: StepReport,
}

/// Runs `warmup` then `steps` optimizer steps on the batches of `train.seed`, synchronising
/// the device after each so the wall clock covers the step's work; returns the timed steps.
/// The pool's peak and the per-op profile are reset after warm-up (which may have run out
/// of memory and split the micro-batch), so they describe the timed steps only.
///
/// With `phases`, the timed steps also synchronise the device between the forward/backward
/// passes and the optimizer so each phase can be timed; warm-up steps never do.
pub(crate) fn timed_steps(
    trainer: &mut Trainer,
    tokens: &[u32],
    warmup: usize,
    steps: usize,
    phases: bool,
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
            trainer.mark_phases = phases;
        }
        let t0 = Instant::now();
        let stepped = trainer.step(&batches);
        let fwd_bwd_end = trainer.fwd_bwd_end.take();
        let report = match stepped {
            Ok(r) => r,
            Err(e) => {
                trainer.mark_phases = false;
                return Err(e);
            }
        };
        trainer.synchronize()?;
        if step >= warmup as u64 {
            out.push(TimedStep {
                seconds: t0.elapsed().as_secs_f64(),
                fwd_bwd_seconds: fwd_bwd_end.map(|t| t.duration_since(t0).as_secs_f64()),
                report,
            });
        }
    }
    trainer.mark_phases = false;
    Ok(out)
}

/// The script `bench/<name>` of the repository: from the working directory, else next to the
/// executable.
pub(crate) fn find_script(name: &str) -> std::result::Result<PathBuf, String> {
    let rel = PathBuf::from("bench").join(name);
    [
        rel.clone(),
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join(&rel)))
            .unwrap_or_default(),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .ok_or_else(|| format!("bench/{name} not found (run from the repository root)"))
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

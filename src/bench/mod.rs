//! The benchmark suites behind `kiln bench` (performance measurements, never timed tests):
//! one module per suite, each taking its options and writing its report; the helpers they
//! share (timed steps, the PyTorch scripts, peak FLOP rates) live here.

pub mod amp;
pub mod bk;
pub mod dataloader;
pub mod finetune;
pub mod generate;
pub mod kernels;
pub mod memory;
pub mod scu;
pub mod train;

use crate::data::{self, Batch};
use crate::engine::profile;
use crate::error::{KilnError, Result};
use crate::train::{self as training, StepReport, Trainer};
use std::path::PathBuf;
use std::time::Instant;

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
pub(crate) fn dense_peak_flops(name: &str, precision: training::Precision) -> Option<f64> {
    let hopper = name.contains("H100") || name.contains("H200");
    let ampere = name.contains("A100");
    let per_precision = |bf16: f64, tf32: f64, fp32: f64| match precision {
        training::Precision::Bf16Mixed | training::Precision::Fp16Mixed => bf16,
        training::Precision::Tf32 => tf32,
        training::Precision::Fp32 => fp32,
    };
    if hopper {
        Some(per_precision(989.4e12, 494.7e12, 66.9e12))
    } else if ampere {
        Some(per_precision(312e12, 156e12, 19.5e12))
    } else {
        None
    }
}

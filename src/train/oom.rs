//! Out-of-memory recovery: when a forward/backward pass runs out of memory, the trainer
//! halves the rows it runs per pass and redoes the step, so the global batch, and with it the
//! gradient, stays the same and no sequence is dropped.
//!
//! Why the whole step is redone rather than only the pass that failed: an out-of-memory
//! error in the middle of a backward may already have added part of that pass's gradient to
//! the parameters' `grad` buffers. Zeroing the gradients and re-running every micro-batch at
//! the smaller size is exact and needs no copy of the gradients (a copy would cost the memory
//! that just ran out). The repeated work is at most one step per halving, and a run halves
//! at most log2(micro-batch) times.
//!
//! Each token's loss is still weighted by the token count of the whole global batch, so the
//! gradient is the same sum over the same tokens; only the order of the additions changes,
//! so weights and losses may differ from an unsplit run in the last bits.

use super::Precision;
use super::metrics::format_bytes;
use crate::config::Config;
use crate::engine::{EngineError, MemoryPool};
use crate::error::KilnError;
use crate::models::Recompute;
use serde::Serialize;
use std::ops::Range;

/// One halving of the rows per pass, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PassSplit {
    /// The optimizer step being run when memory ran out (1-based, as logged).
    pub step: u64,
    /// Rows per pass that ran out of memory.
    pub from: usize,
    /// Rows per pass from now on.
    pub to: usize,
}

/// The rows per forward/backward pass that fit, learned from out-of-memory errors.
#[derive(Debug, Clone, Default)]
pub struct PassSize {
    /// `None` until memory first runs out: each micro-batch is one pass.
    rows: Option<usize>,
    unreported: Vec<PassSplit>,
}

impl PassSize {
    /// The row ranges a micro-batch of `rows` runs as: passes of the learned size (the last
    /// may be shorter), or one pass while none has been learned.
    pub fn passes(&self, rows: usize) -> impl Iterator<Item = Range<usize>> + use<> {
        let size = self.largest(rows).max(1);
        (0..rows)
            .step_by(size)
            .map(move |start| start..(start + size).min(rows))
    }

    /// Rows in the largest pass a micro-batch of `rows` runs.
    pub fn largest(&self, rows: usize) -> usize {
        self.rows.map_or(rows, |r| r.min(rows))
    }

    /// A size learned before a checkpoint, taken up again when the run resumes (no new
    /// split to report).
    pub fn resumed(rows: usize) -> PassSize {
        PassSize {
            rows: Some(rows.max(1)),
            unreported: Vec::new(),
        }
    }

    /// The learned rows per pass, once memory has run out.
    pub fn learned(&self) -> Option<usize> {
        self.rows
    }

    /// Records that passes of `at` rows ran out of memory during `step` and halves them
    /// (rounding up); `None` when a pass was one row already and cannot be split.
    pub fn halve(&mut self, step: u64, at: usize) -> Option<usize> {
        if at <= 1 {
            return None;
        }
        let to = at.div_ceil(2);
        self.rows = Some(to);
        self.unreported.push(PassSplit { step, from: at, to });
        Some(to)
    }

    /// The halvings since the last call, oldest first.
    pub fn take_splits(&mut self) -> Vec<PassSplit> {
        std::mem::take(&mut self.unreported)
    }
}

/// What ran out of memory with nothing left to split.
#[derive(Debug, Clone, Copy)]
pub enum DoesNotFit {
    /// A forward/backward pass of one sequence, with the model's recomputation.
    OneSequence(Recompute),
    /// The weights, gradients and optimizer state, before any step.
    Model,
}

/// The error for memory that ran out with nothing left to split: what was asked for, what
/// the device or the cap holds, and the settings that would use less.
pub fn does_not_fit(
    what: DoesNotFit,
    err: &EngineError,
    pool: &MemoryPool,
    cfg: &Config,
    precision: Precision,
) -> KilnError {
    let bytes = |b: usize| format!("{b} bytes ({})", format_bytes(b));
    let stats = pool.stats();
    let holder = if stats.limit != 0 {
        "the train.memory_limit cap"
    } else {
        "the device"
    };
    let why = match err {
        EngineError::OutOfMemory {
            requested,
            in_use,
            limit,
            ..
        } => format!(
            "it asked for {} more with {} in use, and {holder} has {}",
            bytes(*requested),
            bytes(*in_use),
            bytes(*limit)
        ),
        other => format!(
            "{other}, with {} in use of {}",
            bytes(stats.current),
            pool.capacity().map_or("unknown".into(), bytes)
        ),
    };
    let one_sequence = matches!(what, DoesNotFit::OneSequence(_));
    let mut remedies = Vec::new();
    if let DoesNotFit::OneSequence(Recompute::None) = what {
        remedies.push("train.recompute=blocks".to_string());
    }
    if !cfg.train.offload_optimizer {
        remedies.push("train.offload_optimizer=true".into());
    }
    // Activations shrink with bf16 and shorter sequences; the weights grow by the bf16 copies.
    if one_sequence && matches!(precision, Precision::Fp32 | Precision::Tf32) {
        remedies.push("train.precision=bf16-mixed".into());
    }
    if one_sequence && cfg.train.seq_len > 1 {
        remedies.push(format!(
            "a shorter train.seq_len (now {})",
            cfg.train.seq_len
        ));
    }
    remedies.push(format!(
        "a smaller model (now model.d_model={}, model.n_layers={})",
        cfg.model.d_model, cfg.model.n_layers
    ));
    if stats.limit != 0 {
        remedies.push(format!(
            "a larger train.memory_limit (now {})",
            format_bytes(stats.limit)
        ));
    }
    let subject = if one_sequence {
        format!("one sequence of {} tokens does", cfg.train.seq_len)
    } else {
        "the model's weights, gradients and optimizer state do".into()
    };
    KilnError::DoesNotFit(format!(
        "{subject} not fit on {}: {why}. To use less memory, try {}",
        pool.device(),
        remedies.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_cover_every_row_once_and_halving_stops_at_one() {
        let mut size = PassSize::default();
        assert_eq!(size.passes(8).collect::<Vec<_>>(), vec![0..8]);
        assert_eq!(size.halve(3, 8), Some(4));
        assert_eq!(size.passes(8).collect::<Vec<_>>(), vec![0..4, 4..8]);
        assert_eq!(size.halve(3, 4), Some(2));
        assert_eq!(size.halve(3, 2), Some(1));
        assert_eq!(size.halve(3, 1), None, "one row cannot be split");
        assert_eq!(size.learned(), Some(1));
        let splits = size.take_splits();
        assert_eq!(
            splits.iter().map(|s| (s.from, s.to)).collect::<Vec<_>>(),
            vec![(8, 4), (4, 2), (2, 1)]
        );
        assert!(size.take_splits().is_empty(), "each split is reported once");

        // An odd micro-batch halves rounding up; the last pass is the shorter one.
        let mut odd = PassSize::default();
        assert_eq!(odd.halve(1, 5), Some(3));
        assert_eq!(odd.passes(5).collect::<Vec<_>>(), vec![0..3, 3..5]);
        // A micro-batch smaller than the learned size is one pass.
        assert_eq!(odd.passes(2).collect::<Vec<_>>(), vec![0..2]);
        assert_eq!(odd.largest(2), 2);
    }
}

/// What the host-memory check before the first step decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostFit {
    /// The step fits the RAM (or the pool's cap, which the pool enforces anyway).
    Fits,
    /// The step as configured does not fit the RAM, one sequence per pass does: the pool is
    /// capped at the usable RAM so the split-and-retry path makes the passes fit.
    CapAt { usable: usize, planned: usize },
}

/// Host bytes of the token batches a run keeps: the prefetch queue, the step's micro-batches
/// and the one being built (inputs and targets, 4 bytes a token each), and the validation
/// batches. They live outside the pool, so the plan does not count them.
pub fn batch_bytes(cfg: &Config) -> usize {
    let t = &cfg.train;
    let per_batch = t
        .micro_batch
        .saturating_mul(t.seq_len)
        .saturating_mul(2 * 4);
    let live = cfg.data.prefetch.max(1) + t.grad_accum + 1;
    per_batch.saturating_mul(live.saturating_add(t.eval_batches))
}

/// Checks a run against the host's memory before anything large is allocated, so a
/// configuration that cannot fit is a typed out-of-memory error (exit 6) with the plan's
/// figures, never an aborted allocation: the token batches on every device, and on the CPU
/// the step itself. `ram` is the machine's total.
pub fn check_host(
    cfg: &Config,
    vocab: usize,
    precision: Precision,
    device: crate::engine::Device,
    limit: Option<usize>,
    ram: usize,
) -> Result<HostFit, KilnError> {
    use crate::engine::{DType, Device};
    use crate::plan::{self, Budget, PlanRequest};
    let batches = batch_bytes(cfg);
    let ram_usable = Budget::cpu(ram).usable();
    if batches > ram_usable {
        return Err(KilnError::DoesNotFit(format!(
            "the token batches alone take {} of host memory (train.micro_batch={} x train.seq_len={} tokens, inputs and targets, for {} prefetched and step batches and {} validation batches), and {} of this machine's {} RAM is usable; lower train.micro_batch and raise train.grad_accum to keep the global batch, or lower data.prefetch or train.eval_batches",
            format_bytes(batches),
            cfg.train.micro_batch,
            cfg.train.seq_len,
            cfg.data.prefetch.max(1) + cfg.train.grad_accum + 1,
            cfg.train.eval_batches,
            format_bytes(ram_usable),
            format_bytes(ram)
        )));
    }
    if device != Device::Cpu {
        return Ok(HostFit::Fits);
    }
    let ram = ram.saturating_sub(batches);
    let request = PlanRequest::for_config(
        cfg,
        vocab,
        precision.compute_dtype().unwrap_or(DType::F32),
        Device::Cpu,
    );
    let budget = Budget::cpu(ram);
    // A cap below the usable RAM is enforced by the pool before any allocation: the trainer
    // splits passes under it and reports what one sequence needs when that does not fit.
    // Only the RAM can make an allocation abort.
    if limit.is_some_and(|l| l <= budget.usable()) {
        return Ok(HostFit::Fits);
    }
    if let Some(advice) = plan::one_sequence_advice(&request, &budget)? {
        return Err(KilnError::DoesNotFit(format!(
            "the plan of this step on the CPU {advice}"
        )));
    }
    let planned = plan::plan(&request)?.pool_peak;
    if planned > budget.usable() {
        return Ok(HostFit::CapAt {
            usable: budget.usable(),
            planned,
        });
    }
    Ok(HostFit::Fits)
}

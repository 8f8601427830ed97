//! Planning by running the step itself on a meta device.
//!
//! A meta pool ([`MemoryPool::meta`]) stands in for a device: tensors are booked exactly as
//! they would be there and hold nothing, and operations compute nothing. So the real code —
//! `Trainer::new` (weights, compute copies, gradients, optimizer state, offload), then one
//! optimizer step (forward, loss, backward, gradient norm, AdamW) — runs once, and the pool's
//! books give the step's peak. Every model family, precision, recomputation, offload and
//! fused or unfused kernel choice is planned by the code that runs it, with no allocation
//! walk to keep in step. On a GPU, the scratch kernels take from the driver outside the pool
//! is booked apart by the same operations, and the device peak includes it.
//!
//! Data-dependent work is planned at what the synthetic batch gives: every target trained,
//! token ids spread over the vocabulary. A mixture of experts routes nothing on a meta
//! device (its router logits are all zero), so its expert buffers are booked at the sizes
//! its capacity factor fixes, which is its worst case.

use crate::config::Config;
use crate::data::Batch;
use crate::engine::pool::PeakLedger;
use crate::engine::{Device, MemoryPool, Tensor};
use crate::error::Result;
use crate::train::{Precision, Trainer};
use std::sync::Arc;
use std::time::Instant;

/// What a meta run of one optimizer step booked.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaStep {
    /// The pool's peak: construction and the step, what `MemoryPool::stats().peak` measures
    /// on a real run.
    pub pool_peak: usize,
    /// The pool's peak plus what kernels hold or take outside it at the same time (equal to
    /// `pool_peak` on the CPU).
    pub device_peak: usize,
    /// Bytes held after construction, before the first batch: weights, compute copies,
    /// gradients and optimizer state.
    pub resident: usize,
    /// Parameter elements, and those the optimizer trains.
    pub params: usize,
    pub trainable: usize,
    /// Elements of each trained parameter, in the model's order (what data parallelism
    /// shards).
    pub trainable_elements: Vec<usize>,
    /// Of `resident`, the device bytes of the parameters' values (f32 masters, or a frozen
    /// base in its dtype), their compute copies and their gradients; the rest of it is
    /// optimizer state and the model's fixed buffers.
    pub masters: usize,
    pub compute_copies: usize,
    pub gradients: usize,
    /// The pool's ledger at the device peak: live bytes by phase and by operation.
    pub at_peak: PeakLedger,
    /// What the forward kept for the backward: its live bytes when the backward began.
    pub saved_by_forward: usize,
    /// Seconds the meta run took.
    pub seconds: f64,
}

/// Bytes of `t` if it lives in `pool` (an offloaded master lives in the host's).
fn in_pool(t: &Tensor, pool: &Arc<MemoryPool>) -> usize {
    if Arc::ptr_eq(t.pool(), pool) {
        t.bytes()
    } else {
        0
    }
}

/// A batch of `batch x seq` tokens with every target trained, ids spread over `vocab`.
fn synthetic_batch(vocab: usize, batch: usize, seq: usize) -> Batch {
    let ids = |k: usize| -> Vec<u32> {
        (0..batch * seq)
            .map(|i| ((i * 7 + k * 13) % vocab.max(1)) as u32)
            .collect()
    };
    Batch {
        inputs: ids(1),
        targets: ids(2),
        batch,
        seq,
    }
}

/// Runs construction and one optimizer step of `cfg` (with `lora.enabled`, adapters and
/// `lora.quantize` over a frozen base of the configured shape; one micro-batch of
/// `train.micro_batch x train.seq_len`: accumulation reuses the activations, so more
/// micro-batches peak the same) on a meta device standing in for `device`.
pub fn meta_step(
    cfg: &Config,
    vocab: usize,
    device: Device,
    precision: Precision,
) -> Result<MetaStep> {
    let start = Instant::now();
    let pool = MemoryPool::meta(device);
    // Adapters go over a base whose values do not matter here: the seeded initialisation
    // books what a loaded base books.
    let mut trainer = if cfg.lora.enabled {
        Trainer::over_initialised_base(cfg, vocab, &pool, precision)?
    } else {
        Trainer::new(cfg, vocab, &pool, precision)?
    };
    let resident = pool.stats().current;
    let all = trainer.model.params();
    let params: usize = all.iter().map(|p| p.value.len()).sum();
    let masters = all.iter().map(|p| in_pool(&p.value, &pool)).sum();
    let compute_copies = all
        .iter()
        .filter_map(|p| p.compute.as_ref())
        .map(|t| in_pool(t, &pool))
        .sum();
    let gradients = all.iter().map(|p| in_pool(&p.grad, &pool)).sum();
    drop(all);
    let trainable_elements: Vec<usize> = trainer
        .model
        .trainable_params()
        .iter()
        .map(|p| p.value.len())
        .collect();
    let trainable = trainable_elements.iter().sum();
    let micro = [synthetic_batch(
        vocab,
        cfg.train.micro_batch,
        cfg.train.seq_len,
    )];
    trainer.step(&micro)?;
    Ok(MetaStep {
        pool_peak: pool.stats().peak,
        device_peak: pool.device_peak(),
        resident,
        params,
        trainable,
        trainable_elements,
        masters,
        compute_copies,
        gradients,
        at_peak: pool.peak_ledger().unwrap_or_default(),
        saved_by_forward: pool.forward_kept(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

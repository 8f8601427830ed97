//! One optimizer step, top to bottom: accumulate gradients over the micro-batches, check
//! them, clip, update, advance the schedule. A pass that runs out of memory is split and the
//! accumulation redone (see [`super::oom`]).

use super::oom::{self, PassSize};
use super::polychromic::WeightedBatch;
use super::precision::Precision;
use super::scaler::LossScaler;
use super::scu::{ScuRecord, ScuState};
use crate::config::Config;
use crate::data::Batch;
use crate::engine::ops::IGNORE_TARGET;
use crate::engine::{self, EngineError, MemoryPool};
use crate::error::{KilnError, Result};
use crate::models::import::{self, Pretrained};
use crate::models::{self, Model, Recompute, RoutingStats, StepPrecision};
use crate::nn::Kernels;
use crate::nn::lora::LoraSpec;
use crate::optim::adamw::{AdamW, AdamWConfig, OFFLOAD_CHUNK};
use crate::optim::schedule::{LrSchedule, ScheduleShape};
use crate::optim::{clip_coefficient, grad_sum_squares};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Everything besides tensors that a resumed run needs to continue exactly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps taken (the LR schedule's position).
    pub step: u64,
    /// Global batches drawn from the data stream (a skipped fp16 step consumes one too).
    pub data_step: u64,
    pub tokens: u64,
    pub scaler: Option<LossScaler>,
    /// The SCU controller (fine-tuning with `scu.enabled`).
    #[serde(default)]
    pub scu: Option<ScuState>,
}

/// What one call to [`Trainer::step`] did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Mean loss per token over the global batch.
    pub loss: f64,
    /// Global gradient norm before clipping (unscaled).
    pub grad_norm: f64,
    pub lr: f64,
    pub skipped: bool,
    pub loss_scale: f64,
    pub tokens: u64,
    /// Mixture-of-experts routing over the step's micro-batches (models that have it).
    pub routing: Option<RoutingStats>,
    /// Targets trained in the step (all of them, or the completions of fine-tuning data).
    pub trained_tokens: u64,
    /// The SCU controller's update, when it ran this step.
    pub scu: Option<ScuRecord>,
}

pub struct Trainer {
    pub cfg: Config,
    pub model: Box<dyn Model>,
    pub vocab: usize,
    pub opt: AdamW,
    pub precision: Precision,
    pub schedule: LrSchedule,
    pub state: TrainState,
    pub pool: Arc<MemoryPool>,
    /// Rows per forward/backward pass, smaller than the micro-batch after memory ran out.
    pub passes: PassSize,
    /// When set (by a trace), [`Trainer::step`] synchronises the device after the forward
    /// and backward passes and records the time in `fwd_bwd_end`.
    pub mark_phases: bool,
    pub fwd_bwd_end: Option<Instant>,
    /// Modules that carry low-rank adapters (empty when every weight trains).
    pub adapted: Vec<String>,
    /// The base kept in NF4 under the adapters (`lora.quantize = "nf4"`).
    pub quantized: Option<models::QuantizedBase>,
    /// N of the SCU penalty: training tokens per epoch (set once the data is loaded).
    pub scu_tokens: f64,
    /// This rank's part in a data-parallel run (`None` for a single process).
    pub dist: Option<crate::dist::DataParallel>,
    /// Trained targets in the whole global batch of the step being taken, over all ranks.
    global_trained: Option<usize>,
    /// Sequences whose token losses join the next steps' gradients with weights of their
    /// own (the polychromic surrogate); set before each step by whoever owns them.
    pub weighted: Vec<WeightedBatch>,
}

/// How a trainer's optimizer state is sharded: this rank, the world, the ZeRO stage.
#[derive(Debug, Clone, Copy)]
pub struct Shard {
    pub rank: usize,
    pub world_size: usize,
    pub stage: crate::dist::ZeroStage,
}

/// Counts the targets that are trained (not [`IGNORE_TARGET`]).
pub fn trained_targets(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
}

impl Trainer {
    pub fn new(
        cfg: &Config,
        vocab: usize,
        pool: &Arc<MemoryPool>,
        precision: Precision,
    ) -> Result<Trainer> {
        Self::with_base(cfg, vocab, pool, precision, None)
    }

    /// A trainer whose model starts from `base` when given. With `lora.enabled` the base is
    /// loaded (from `base`, or else from `lora.base`), frozen, and given adapters before the
    /// optimizer is built, so only the adapters get gradients and optimizer state.
    pub fn with_base(
        cfg: &Config,
        vocab: usize,
        pool: &Arc<MemoryPool>,
        precision: Precision,
        base: Option<&Pretrained>,
    ) -> Result<Trainer> {
        Self::with_base_sharded(cfg, vocab, pool, precision, base, None)
    }

    /// [`Trainer::with_base`] for one rank of a data-parallel run: under ZeRO-1/2 the
    /// optimizer keeps moments only for the parameters `shard` gives this rank.
    pub fn with_base_sharded(
        cfg: &Config,
        vocab: usize,
        pool: &Arc<MemoryPool>,
        precision: Precision,
        base: Option<&Pretrained>,
        shard: Option<Shard>,
    ) -> Result<Trainer> {
        let opened;
        let base = match base {
            None if cfg.lora.enabled => {
                opened = import::pretrained::open(Path::new(&cfg.lora.base))?;
                Some(&opened)
            }
            base => base,
        };
        Self::assemble(cfg, vocab, pool, precision, shard, base)
    }

    /// A trainer whose frozen base is the model's own seeded initialisation (with
    /// `lora.enabled`, adapters and `lora.quantize` as configured): fine-tuning benchmarks
    /// at a published shape without its weights. `lora.base` only labels the run.
    pub fn over_initialised_base(
        cfg: &Config,
        vocab: usize,
        pool: &Arc<MemoryPool>,
        precision: Precision,
    ) -> Result<Trainer> {
        Self::assemble(cfg, vocab, pool, precision, None, None)
    }

    /// Builds the model (its parameters loaded from `base` if given, else initialised), then
    /// attaches adapters, quantises the base and builds the optimizer as `cfg` says.
    fn assemble(
        cfg: &Config,
        vocab: usize,
        pool: &Arc<MemoryPool>,
        precision: Precision,
        shard: Option<Shard>,
        base: Option<&Pretrained>,
    ) -> Result<Trainer> {
        let pool = pool.clone();
        let nf4 = cfg.lora.enabled && cfg.lora.quantize == "nf4";
        // Imported weights fill the parameters as they are made: nothing is initialised
        // only to be overwritten. A base going to NF4 leaves its projections on the host, to
        // be quantised from there: the device never holds them dense.
        let mut model = match base {
            Some(b) => models::load_deferring(
                &cfg.model,
                vocab,
                &pool,
                &b.weights,
                &b.source.path,
                models::Role::Train,
                cfg.model.entry().nf4_weights.filter(|_| nf4),
            )?,
            None => models::build(&cfg.model, vocab, &pool, cfg.train.seed)?,
        };
        Recompute::from_setting(&cfg.train.recompute)
            .and_then(|policy| model.set_recompute(policy))
            .map_err(KilnError::Setting)?;
        let kernels = Kernels::from_setting(cfg.train.fused_kernels);
        model.set_kernels(kernels).map_err(KilnError::Setting)?;
        let mut adapted = Vec::new();
        let mut quantized = None;
        if cfg.lora.enabled {
            adapted = attach_adapters(model.as_mut(), cfg)?;
            if nf4 {
                // From the f32 values just loaded, before any rounding to the compute dtype.
                let compute = precision.compute_dtype().unwrap_or(engine::DType::F32);
                let host = base.map(|b| &b.weights);
                quantized = Some(model.quantize_base_nf4(compute, host)?.ok_or_else(|| {
                    KilnError::Setting(format!(
                        "lora.quantize = \"nf4\" keeps the block projections of a GPT or Llama-family base in NF4; model.kind = \"{}\" has none (use lora.quantize = \"none\")",
                        cfg.model.kind()
                    ))
                })?);
            }
        }
        let offload = cfg.train.offload_optimizer;
        if offload && cfg.lora.enabled {
            return Err(KilnError::Setting(
                "train.offload_optimizer with lora.enabled: the adapters' optimizer state is small, so there is nothing to offload; use train.offload_optimizer=false".into(),
            ));
        }
        for p in model.params_mut() {
            if p.frozen || !offload {
                p.set_compute_dtype(precision.compute_dtype())?;
            }
        }
        let o = &cfg.optim;
        let adamw = AdamWConfig {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
        };
        let mut opt = if offload {
            AdamW::offloaded(
                adamw,
                &mut model.trainable_params_mut(),
                &pool,
                precision.compute_dtype(),
                OFFLOAD_CHUNK,
            )?
        } else {
            match shard {
                Some(s) if s.stage != crate::dist::ZeroStage::Zero0 => {
                    let params = model.trainable_params();
                    let elements: Vec<usize> = params.iter().map(|p| p.value.len()).collect();
                    let owners = crate::dist::shard::owners(&elements, s.world_size);
                    let owned = owners.iter().map(|&o| o == s.rank).collect();
                    AdamW::sharded(adamw, &params, owned)?
                }
                _ => AdamW::new(adamw, &model.trainable_params())?,
            }
        };
        opt.set_kernels(kernels).map_err(KilnError::Setting)?;
        let scaler = precision.uses_loss_scaling().then(|| {
            LossScaler::new(
                cfg.train.loss_scale_init,
                cfg.train.loss_scale_growth_interval as u64,
            )
        });
        Ok(Trainer {
            cfg: cfg.clone(),
            model,
            vocab,
            opt,
            precision,
            schedule: LrSchedule {
                // Validated with the settings.
                shape: ScheduleShape::from_setting(&o.schedule).unwrap_or(ScheduleShape::Cosine),
                max_lr: o.lr,
                min_lr: o.min_lr,
                warmup_steps: o.warmup_steps as u64,
                total_steps: cfg.train.steps as u64,
            },
            state: TrainState {
                step: 0,
                data_step: 0,
                tokens: 0,
                scaler,
                scu: cfg.scu.enabled.then(|| ScuState::new(&cfg.scu)),
            },
            pool,
            passes: PassSize::default(),
            mark_phases: false,
            fwd_bwd_end: None,
            adapted,
            quantized,
            scu_tokens: 0.0,
            dist: None,
            global_trained: None,
            weighted: Vec::new(),
        })
    }

    /// Chooses activation recomputation (the memory planner's decision for
    /// `train.recompute=auto`).
    pub fn set_recompute(&mut self, policy: Recompute) -> Result<()> {
        self.model.set_recompute(policy).map_err(KilnError::Setting)
    }

    /// Bytes the frozen base holds in the pool: its dense frozen tensors in their dtype plus
    /// the NF4 weights (the workspace they expand into is not counted).
    pub fn base_weight_bytes(&self) -> usize {
        let dense: usize = self
            .model
            .params()
            .iter()
            .filter(|p| p.frozen)
            .map(|p| p.value.bytes())
            .sum();
        dense + self.quantized.map_or(0, |q| q.nf4_bytes)
    }

    pub fn loss_scale(&self) -> f64 {
        self.state.scaler.map_or(1.0, |s| s.scale)
    }

    /// Zeroes the gradients and accumulates those of all `micro` batches, each token's loss
    /// weighted by `loss_scale / tokens in the global batch`: the result is the gradient of
    /// the global batch's mean loss (times the scale), however the batch is split.
    /// Returns the summed token loss.
    ///
    /// When a pass runs out of memory, the rows per pass are halved and the accumulation
    /// starts over, until one sequence per pass does not fit either.
    pub fn accumulate(&mut self, micro: &[Batch]) -> Result<f64> {
        loop {
            let at = micro
                .iter()
                .map(|b| self.passes.largest(b.batch))
                .max()
                .unwrap_or(0);
            let mut result = self.accumulate_passes(micro);
            if self.dist.is_some() {
                result = self.agree_on_passes(result)?;
            }
            let err = match result {
                Ok(loss) => return Ok(loss),
                Err(e) if e.is_out_of_memory() => e,
                Err(e) => return Err(self.layer_non_finite(e)),
            };
            // The failed attempt's tensors are dropped by now; give the device back what its
            // allocator caches too, so the retry is not refused by fragmentation.
            self.pool.release_cached()?;
            if self.passes.halve(self.state.step + 1, at).is_none() {
                return Err(oom::does_not_fit(
                    oom::DoesNotFit::OneSequence(self.model.recompute()),
                    &err,
                    &self.pool,
                    &self.cfg,
                    self.precision,
                ));
            }
        }
    }

    /// One attempt at [`Trainer::accumulate`], each micro-batch in passes of the rows that fit.
    fn accumulate_passes(&mut self, micro: &[Batch]) -> engine::Result<f64> {
        if let Some(d) = &self.dist {
            d.restore_grads(&mut self.model.trainable_params_mut())?;
        }
        // Alone, each gradient's clear is left to its first writer (a product overwrites
        // instead of reading zeros back); data parallelism reads gradients mid-backward, so
        // there they are cleared now.
        let deferred = self.dist.is_none();
        for p in self.model.trainable_params_mut() {
            if deferred {
                p.defer_grad_clear()?;
            } else {
                p.clear_grad()?;
            }
        }
        // Statistics of a step that failed part-way are not this step's.
        self.model.take_routing_stats();
        let local: usize = micro.iter().map(|b| trained_targets(&b.targets)).sum();
        // Each rank scales by the global batch's count, so the summed gradients of all ranks
        // are the gradient of the global mean loss.
        let tokens = self.global_trained.unwrap_or(local).max(1);
        let p = StepPrecision {
            grad_scale: (self.loss_scale() / tokens as f64) as f32,
            grad_dtype: self.precision.grad_dtype(),
        };
        let passes: Vec<(usize, std::ops::Range<usize>)> = micro
            .iter()
            .enumerate()
            .flat_map(|(k, b)| self.passes.passes(b.batch).map(move |r| (k, r)))
            .collect();
        if let Some(d) = &mut self.dist {
            d.prepare(&self.model.trainable_params());
        }
        let mut loss = 0.0;
        for (n, (k, rows)) in passes.iter().enumerate() {
            let b = &micro[*k];
            // The last pass finishes every gradient: its backward sends them as they complete
            // (unless weighted sequences follow, whose gradients come after it).
            if n + 1 == passes.len()
                && self.weighted.is_empty()
                && let Some(hook) = self.dist.as_ref().and_then(|d| d.grad_ready_hook())
            {
                self.model.set_grad_ready(Some(hook));
            }
            let span = rows.start * b.seq..rows.end * b.seq;
            // Adapter dropout masks: a function of the seed, the step and the pass.
            let _dropout = crate::nn::lora::dropout_scope(crate::engine::rng::hash3(
                self.cfg.train.seed,
                crate::engine::rng::stream::DROPOUT,
                (self.state.step << 16) + n as u64,
            ));
            // A meta pool charges the pass's bookings to the forward until the model says its
            // backward began (the planner's breakdown of the peak).
            self.pool.set_phase(engine::Phase::Forward);
            let pass = self.model.forward_backward(
                &b.inputs[span.clone()],
                &b.targets[span],
                rows.len(),
                b.seq,
                p,
            );
            if self.dist.is_some() {
                self.model.set_grad_ready(None);
            }
            loss += pass?;
        }
        // Their own weights replace the CE's 1 / tokens; their losses are not the CE's.
        let weighted = StepPrecision {
            grad_scale: self.loss_scale() as f32,
            ..p
        };
        for w in &self.weighted {
            let b = &w.batch;
            for rows in self.passes.passes(b.batch) {
                let span = rows.start * b.seq..rows.end * b.seq;
                self.model.forward_backward_weighted(
                    &b.inputs[span.clone()],
                    &b.targets[span],
                    rows.len(),
                    b.seq,
                    weighted,
                    &w.row_weights[rows],
                )?;
            }
        }
        // A parameter no pass reached still owes its clear before anything reads it.
        for p in self.model.trainable_params_mut() {
            p.settle_grad()?;
        }
        Ok(loss)
    }

    /// Data parallelism after the passes: finishes the gradient reduction (every rank issues
    /// every collective, even after a failed pass, so none waits forever), then the ranks
    /// agree on the outcome: if memory ran out on any rank, every rank splits and retries;
    /// if any other error happened, every rank stops.
    fn agree_on_passes(&mut self, result: engine::Result<f64>) -> Result<engine::Result<f64>> {
        let d = self.dist.as_mut().expect("data-parallel trainer");
        d.finish_reduce(&mut self.model.trainable_params_mut())
            .map_err(KilnError::Dist)?;
        let mine = match &result {
            Ok(_) => 0.0,
            Err(e) if e.is_out_of_memory() => 1.0,
            Err(_) => 2.0,
        };
        let mut worst = [mine];
        d.control
            .all_reduce_max(&mut worst, "the outcome of the step's passes")
            .map_err(KilnError::Dist)?;
        Ok(match (worst[0] as u8, result) {
            (0, Ok(loss)) => Ok(loss),
            (1, Ok(_)) => {
                // Another rank ran out of memory: split here too, so every rank runs the same
                // passes and the same collectives.
                let s = self.pool.stats();
                Err(EngineError::OutOfMemory {
                    device: self.pool.device(),
                    requested: 0,
                    in_use: s.current,
                    limit: self.pool.capacity().unwrap_or(s.limit),
                })
            }
            (_, Ok(_)) => {
                return Err(KilnError::Dist(format!(
                    "another rank failed during step {} (its own message says why); this rank stops with it",
                    self.state.step + 1
                )));
            }
            (_, Err(e)) => Err(e),
        })
    }

    /// One optimizer step on the global batch made of `micro`.
    pub fn step(&mut self, micro: &[Batch]) -> Result<StepReport> {
        let mut tokens: u64 = micro.iter().map(|b| b.inputs.len() as u64).sum();
        let mut trained: u64 = micro
            .iter()
            .map(|b| trained_targets(&b.targets) as u64)
            .sum();
        if let Some(d) = &mut self.dist {
            let mut counts = [trained as f64, tokens as f64];
            d.control
                .all_reduce_sum(&mut counts, "the step's token count")
                .map_err(KilnError::Dist)?;
            (trained, tokens) = (counts[0] as u64, counts[1] as u64);
            self.global_trained = Some(trained as usize);
        }
        let mut loss_sum = self.accumulate(micro)?;
        self.pool.set_phase(engine::Phase::Optimizer);
        if let Some(d) = &mut self.dist {
            let mut l = [loss_sum];
            d.control
                .all_reduce_sum(&mut l, "the step's loss")
                .map_err(KilnError::Dist)?;
            loss_sum = l[0];
            d.release_unowned_grads(&mut self.model.trainable_params_mut())
                .map_err(KilnError::Dist)?;
        }
        let loss = loss_sum / trained.max(1) as f64;
        let routing = self.model.take_routing_stats();
        if self.mark_phases {
            self.synchronize()?;
            self.fwd_bwd_end = Some(Instant::now());
        }
        let step = self.state.step;
        if !loss.is_finite() {
            return Err(self.non_finite("loss", loss));
        }
        let scale = self.loss_scale();
        let param_bpt = self.add_scu_penalty(scale)?;
        let mut grad_sq = grad_sum_squares(&self.model.trainable_params())?;
        if let Some(d) = &mut self.dist {
            grad_sq = global_grad_squares(d, grad_sq)?;
        }
        let grad_norm = grad_sq.sqrt() / scale;
        self.state.data_step += 1;
        self.state.tokens += tokens;
        let lr = self.schedule.lr(step);
        if let Some(scaler) = &mut self.state.scaler {
            if scaler.update(!grad_norm.is_finite()) {
                return Ok(StepReport {
                    loss,
                    grad_norm,
                    lr,
                    skipped: true,
                    loss_scale: scale,
                    tokens,
                    routing,
                    trained_tokens: trained,
                    scu: None,
                });
            }
        } else if !grad_norm.is_finite() {
            return Err(self.non_finite("gradient norm", grad_norm));
        }
        let coef = clip_coefficient(grad_norm, self.cfg.optim.grad_clip);
        self.opt.step(
            &mut self.model.trainable_params_mut(),
            lr as f32,
            (coef / scale) as f32,
        )?;
        if let Some(d) = &mut self.dist {
            d.broadcast_updates(&mut self.model.trainable_params_mut())
                .map_err(KilnError::Dist)?;
        }
        self.state.step += 1;
        let scu = match (&mut self.state.scu, param_bpt) {
            (Some(state), Some(param_bpt))
                if self.state.step.is_multiple_of(self.cfg.scu.every as u64) =>
            {
                let data_bpt = loss / std::f64::consts::LN_2;
                Some(state.update(&self.cfg.scu, self.state.step, data_bpt, param_bpt))
            }
            _ => None,
        };
        Ok(StepReport {
            loss,
            grad_norm,
            lr,
            skipped: false,
            loss_scale: scale,
            tokens,
            routing,
            trained_tokens: trained,
            scu,
        })
    }

    /// With the SCU on: adds the penalty's gradient `lambda * w / (sigma^2 N)` (times the loss
    /// scale) to every adapter weight's gradient, and returns the weights' ParamBPT before the
    /// update.
    fn add_scu_penalty(&mut self, loss_scale: f64) -> Result<Option<f64>> {
        let Some(state) = self.state.scu else {
            return Ok(None);
        };
        let scu = &self.cfg.scu;
        let n = if scu.tokens_per_epoch > 0.0 {
            scu.tokens_per_epoch
        } else {
            self.scu_tokens.max(1.0)
        };
        let params = self.model.trainable_params();
        let values: Vec<&crate::engine::Tensor> = params.iter().map(|p| &p.value).collect();
        let sum_sq = crate::engine::ops::sum_squares(&values)?;
        drop(params);
        let coef = (state.grad_coefficient(scu, n) * loss_scale) as f32;
        if coef != 0.0 {
            for p in self.model.trainable_params_mut() {
                // Under ZeRO-2 another rank owns this gradient (released here).
                if p.grad.len() != p.value.len() {
                    continue;
                }
                let (value, grad) = (&p.value, &mut p.grad);
                crate::engine::ops::add_cols_scaled(grad, value, 0, coef)?;
            }
        }
        Ok(Some(ScuState::param_bpt(scu, sum_sq, n)))
    }

    /// Waits for the device's queued work (nothing to wait for on the CPU).
    pub fn synchronize(&self) -> Result<()> {
        if let Ok(g) = self.pool.cuda() {
            g.synchronize().map_err(crate::engine::EngineError::from)?;
        }
        Ok(())
    }

    fn non_finite(&self, what: &'static str, value: f64) -> KilnError {
        KilnError::NonFinite {
            what,
            step: self.state.step + 1,
            value,
            kept: "no checkpoint was written for this step".into(),
        }
    }

    /// A layer that met inf/NaN names itself; this adds the step it happened at.
    fn layer_non_finite(&self, e: EngineError) -> KilnError {
        match e {
            e @ EngineError::NonFinite { .. } => KilnError::LayerNonFinite {
                step: self.state.step + 1,
                source: Box::new(e),
                kept: "no checkpoint was written for this step".into(),
            },
            other => other.into(),
        }
    }

    /// Mean loss per token over `batches`, in passes of the rows that fit in training (a
    /// forward alone needs less than a forward and backward of the same rows).
    pub fn evaluate(&self, batches: &[Batch]) -> Result<f64> {
        let mut loss = 0.0;
        let mut tokens = 0usize;
        for b in batches {
            tokens += trained_targets(&b.targets);
            for rows in self.passes.passes(b.batch) {
                let span = rows.start * b.seq..rows.end * b.seq;
                loss += self.model.loss(
                    &b.inputs[span.clone()],
                    &b.targets[span],
                    rows.len(),
                    b.seq,
                )?;
            }
        }
        Ok(loss / tokens.max(1) as f64)
    }
}

/// The squared gradient norm every rank agrees on: with replicated gradients (ZeRO-0/1) rank
/// 0's (NCCL gives every rank the same sum, and this makes it certain, so no rank clips or
/// skips differently); with ZeRO-2 the sum of the owners' parts.
fn global_grad_squares(d: &mut crate::dist::DataParallel, local: f64) -> Result<f64> {
    if d.stage == crate::dist::ZeroStage::Zero2 {
        let mut v = [local];
        d.control
            .all_reduce_sum(&mut v, "the gradient norm")
            .map_err(KilnError::Dist)?;
        return Ok(v[0]);
    }
    let got = d
        .control
        .broadcast(0, &local.to_le_bytes(), "the gradient norm")
        .map_err(KilnError::Dist)?;
    Ok(f64::from_le_bytes(got[..8].try_into().map_err(|_| {
        KilnError::Dist("rank 0 sent a malformed gradient norm".into())
    })?))
}

/// Adds the adapters `lora.*` describes to `model` (freezing the rest); refuses a rank larger
/// than a layer allows and targets that match nothing, listing the modules there are.
pub fn attach_adapters(model: &mut dyn Model, cfg: &Config) -> Result<Vec<String>> {
    let l = &cfg.lora;
    let spec = LoraSpec::from_config(l);
    let modules = model.lora_modules();
    let mut names: Vec<String> = modules
        .iter()
        .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
        .collect();
    names.sort();
    names.dedup();
    let adapted = model
        .attach_lora(&spec, cfg.train.seed)
        .map_err(KilnError::Setting)?;
    if adapted.is_empty() {
        return Err(KilnError::Setting(format!(
            "lora.targets = \"{}\" matches no module of this model; its modules are {} (or use all-linear)",
            l.targets,
            names.join(", ")
        )));
    }
    if cfg.scu.enabled {
        // Under the SCU the penalty is the adapters' regulariser; weight decay would be a
        // second one the controller cannot see.
        for p in model.trainable_params_mut() {
            p.decay = false;
        }
    }
    // An adapter's rank is bounded by its layer's inputs (A) and its block's outputs (B).
    let smallest = model
        .adapters()
        .iter()
        .map(|ad| ad.a.value.shape()[1].min(ad.block.cols))
        .min()
        .unwrap_or(usize::MAX);
    if l.rank > smallest {
        return Err(KilnError::Setting(format!(
            "lora.rank = {} is larger than the smallest side ({smallest}) of an adapted layer; use at most {smallest}",
            l.rank
        )));
    }
    Ok(adapted)
}

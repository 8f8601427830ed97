//! Models: compositions of `nn` layers with a loss, behind one interface the trainer uses.

pub mod gpt;

use crate::engine::{DType, Result};
use crate::nn::{Cost, Param};

/// What the trainer asks of a model.
pub trait Model: Send {
    /// Every parameter in a fixed order (checkpoints and the optimizer rely on it).
    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// Forward and backward on one micro-batch of `inputs`/`targets` (`[batch, seq]`),
    /// accumulating parameter gradients of `grad_scale * sum(token losses)`. Returns the sum
    /// of the token losses (unscaled, in f64).
    fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        step: StepPrecision,
    ) -> Result<f64>;

    /// Sum of token losses without touching gradients (evaluation).
    fn loss(&self, inputs: &[u32], targets: &[u32], batch: usize, seq: usize) -> Result<f64>;

    /// Logits `[vocab]` for the token after the last of `tokens` (generation).
    fn next_logits(&self, tokens: &[u32]) -> Result<Vec<f32>>;

    /// Longest sequence the model accepts.
    fn context(&self) -> usize;

    /// Cost of one micro-batch.
    fn cost(&self, batch: usize, seq: usize) -> Cost;

    /// The activation recomputation the backward runs with (the planner counts saved
    /// activations from it).
    fn recompute(&self) -> Recompute {
        Recompute::None
    }

    /// Chooses activation recomputation. A model without a recomputing backward accepts only
    /// [`Recompute::None`] and says so for anything else.
    fn set_recompute(&mut self, policy: Recompute) -> std::result::Result<(), String> {
        match policy {
            Recompute::None => Ok(()),
            other => Err(format!(
                "this model has no {other} recomputation; use train.recompute=none"
            )),
        }
    }
}

/// Which activations the backward rebuilds instead of keeping them from the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep everything the backward needs: fastest, most memory.
    #[default]
    None,
    /// Keep only each block's input and re-run the block's forward right before its
    /// backward, so one block's activations are alive at a time, for about one more forward
    /// pass of compute.
    Blocks,
}

impl Recompute {
    /// The policy a `train.recompute` value asks for. `auto` leaves the choice to the memory
    /// planner; until the planner chooses, it means no recomputation.
    pub fn from_setting(value: &str) -> std::result::Result<Recompute, String> {
        match value {
            "none" | "auto" => Ok(Recompute::None),
            "blocks" => Ok(Recompute::Blocks),
            other => Err(format!(
                "train.recompute = \"{other}\" is not a recomputation policy; use none, blocks or auto"
            )),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Recompute::None => "none",
            Recompute::Blocks => "blocks",
        })
    }
}

/// How one backward pass treats precision.
#[derive(Debug, Clone, Copy)]
pub struct StepPrecision {
    /// Weight of each token's loss in the gradient: the loss scale over the global batch's
    /// token count, so accumulated micro-batches sum to the global mean.
    pub grad_scale: f32,
    /// The dtype the output gradient is stored in; f16 overflows to inf exactly as on a GPU,
    /// which is what the dynamic loss scaler exists to catch.
    pub grad_dtype: DType,
}

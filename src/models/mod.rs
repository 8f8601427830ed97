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

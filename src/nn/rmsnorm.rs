//! RMS normalisation with a learned gain (no bias), optionally fused with a residual add.

use super::{ActLayout, Cost, Init, Param, ParamBuilder, f32_bytes, params};
use crate::engine::{Result, Tensor, ops};

pub struct RmsNorm {
    pub gamma: Param,
    pub c: usize,
    pub eps: f32,
}

params!(RmsNorm { gamma });

impl RmsNorm {
    /// Gain `weight` (ones) in `b`'s scope.
    pub fn new(b: &mut ParamBuilder, c: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm {
            gamma: b.param("weight", &[c], Init::Ones)?,
            c,
            eps,
        })
    }

    /// `(normed, rstd)`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        ops::rmsnorm_forward(x, self.gamma.weight(), self.eps)
    }

    /// `sum = x + delta` and its norm: `(sum, normed, rstd)`.
    pub fn forward_residual(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        ops::residual_rmsnorm_forward(x, delta, self.gamma.weight(), self.eps)
    }

    /// Accumulates into `dx` the gradient of the normalised input `x` (for the fused form,
    /// of the sum, which is also the gradient of both addends).
    pub fn backward(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        rstd: &Tensor,
    ) -> Result<()> {
        self.gamma.settle_grad()?;
        let gamma = self.gamma.compute.as_ref().unwrap_or(&self.gamma.value);
        // A frozen gain (under adapters) takes no gradient: none is formed.
        let dgamma = (!self.gamma.frozen).then_some(&mut self.gamma.grad);
        ops::rmsnorm_backward(dx, dgamma, dout, x, gamma, rstd)
    }

    /// Saves its input (the residual stream), its output and one f32 statistic per row.
    pub fn cost_of(c: usize, tokens: usize, layout: ActLayout) -> Cost {
        let elems = (tokens * c) as u64;
        Cost {
            params: c,
            flops_forward: 4 * elems,
            flops_backward: 8 * elems,
            saved_bytes: layout.act_bytes(2 * tokens * c) + f32_bytes(tokens),
        }
    }
}

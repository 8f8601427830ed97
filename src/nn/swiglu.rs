//! The gated feed-forward of Llama-family models: `down(silu(gate(x)) * up(x))`.
//!
//! The gate and up projections are one `[2F, C]` weight (gate rows first), so they run as one
//! GEMM; imports concatenate the checkpoint's two matrices and exports split them.

use super::linear::Linear;
use super::{ActLayout, Cost, ParamBuilder, params};
use crate::engine::{Result, Tensor, ops};

pub struct SwiGlu {
    pub gate_up: Linear,
    pub down: Linear,
    pub hidden: usize,
}

/// What the backward needs: both projections' outputs and the gated product.
pub struct SwiGluSaved {
    pub gate_up: Tensor,
    pub act: Tensor,
}

params!(SwiGlu { gate_up, down });

impl SwiGlu {
    pub fn new(b: &mut ParamBuilder, c: usize, hidden: usize, down_std: f32) -> Result<SwiGlu> {
        Ok(SwiGlu {
            gate_up: Linear::new(&mut b.scope("gate_up"), c, 2 * hidden, false, 0.02)?,
            down: Linear::new(&mut b.scope("down"), hidden, c, false, down_std)?,
            hidden,
        })
    }

    /// The forward short of the output projection: what a recomputing backward rebuilds.
    pub fn activations(&self, x: &Tensor) -> Result<SwiGluSaved> {
        let gate_up = self.gate_up.forward(x)?;
        let act = ops::swiglu_forward(&gate_up)?;
        Ok(SwiGluSaved { gate_up, act })
    }

    pub fn output(&self, saved: &SwiGluSaved) -> Result<Tensor> {
        self.down.forward(&saved.act)
    }

    /// Returns `dx`; `x` is the forward's input.
    pub fn backward(&mut self, dout: &Tensor, x: &Tensor, saved: &SwiGluSaved) -> Result<Tensor> {
        let dact = self.down.backward(dout, &saved.act)?;
        let dgu = ops::swiglu_backward(&saved.gate_up, &dact)?;
        drop(dact);
        self.gate_up.backward(&dgu, x)
    }

    /// Saves both projections' outputs `[.., 2F]` and the product `[.., F]`.
    pub fn cost_of(c: usize, hidden: usize, tokens: usize, layout: ActLayout) -> Cost {
        let act = Cost {
            params: 0,
            flops_forward: 4 * (tokens * hidden) as u64,
            flops_backward: 8 * (tokens * hidden) as u64,
            saved_bytes: layout.act_bytes(3 * tokens * hidden),
        };
        Linear::cost_of(c, 2 * hidden, false, tokens)
            + act
            + Linear::cost_of(hidden, c, false, tokens)
    }
}

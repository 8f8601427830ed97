//! The gated feed-forward of Llama-family models: `down(silu(gate(x)) * up(x))`.
//!
//! The gate and up projections are one `[2F, C]` weight (gate rows first), so they run as one
//! GEMM; imports concatenate the checkpoint's two matrices and exports split them.

use super::linear::Linear;
use super::{ActLayout, Cost, Param};
use crate::engine::rng::Rng;
use crate::engine::{MemoryPool, Result, Tensor, ops};
use std::sync::Arc;

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

impl SwiGlu {
    pub fn new(
        pool: &Arc<MemoryPool>,
        name: &str,
        c: usize,
        hidden: usize,
        down_std: f32,
        rng: &mut Rng,
    ) -> Result<SwiGlu> {
        Ok(SwiGlu {
            gate_up: Linear::new(
                pool,
                &format!("{name}.gate_up"),
                c,
                2 * hidden,
                false,
                0.02,
                rng,
            )?,
            down: Linear::new(
                pool,
                &format!("{name}.down"),
                hidden,
                c,
                false,
                down_std,
                rng,
            )?,
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

    pub fn params(&self) -> Vec<&Param> {
        [self.gate_up.params(), self.down.params()].concat()
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.gate_up.params_mut();
        v.extend(self.down.params_mut());
        v
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

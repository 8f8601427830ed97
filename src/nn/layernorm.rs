//! Layer normalisation with learned gain and bias, optionally fused with a residual add.

use super::{ActLayout, Cost, Init, Param, f32_bytes};
use crate::engine::ops::{self, NormStats};
use crate::engine::rng::Rng;
use crate::engine::{MemoryPool, Result, Tensor};
use std::sync::Arc;

pub struct LayerNorm {
    pub gamma: Param,
    pub beta: Param,
    pub c: usize,
}

impl LayerNorm {
    pub fn new(pool: &Arc<MemoryPool>, name: &str, c: usize, rng: &mut Rng) -> Result<LayerNorm> {
        Ok(LayerNorm {
            gamma: Param::new(pool, format!("{name}.weight"), &[c], Init::Ones, rng)?,
            beta: Param::new(pool, format!("{name}.bias"), &[c], Init::Zeros, rng)?,
            c,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, NormStats)> {
        ops::layernorm_forward(x, self.gamma.weight(), self.beta.weight())
    }

    /// `sum = x + delta` and `layernorm(sum)`: returns `(sum, normed, stats)`.
    pub fn forward_residual(
        &self,
        x: &Tensor,
        delta: &Tensor,
    ) -> Result<(Tensor, Tensor, NormStats)> {
        ops::residual_layernorm_forward(x, delta, self.gamma.weight(), self.beta.weight())
    }

    /// Accumulates into `dx`, the gradient of the normalised input (for the fused form, of
    /// the sum, which is also the gradient of both addends).
    pub fn backward(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        stats: &NormStats,
    ) -> Result<()> {
        let gamma = self.gamma.compute.as_ref().unwrap_or(&self.gamma.value);
        ops::layernorm_backward(
            dx,
            &mut self.gamma.grad,
            &mut self.beta.grad,
            dout,
            x,
            gamma,
            stats,
        )
    }

    pub fn params(&self) -> Vec<&Param> {
        vec![&self.gamma, &self.beta]
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }

    pub fn cost(&self, tokens: usize) -> Cost {
        Self::cost_of(self.c, tokens, ActLayout::CPU_F32)
    }

    /// Saves its input (the residual stream), its output and two f32 statistics per row.
    pub fn cost_of(c: usize, tokens: usize, layout: ActLayout) -> Cost {
        let elems = (tokens * c) as u64;
        Cost {
            params: 2 * c,
            flops_forward: 8 * elems,
            flops_backward: 12 * elems,
            saved_bytes: layout.act_bytes(2 * tokens * c) + f32_bytes(2 * tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    #[test]
    fn fused_backward_matches_finite_differences() {
        let p = pool();
        let mut ln = LayerNorm::new(&p, "ln", 8, &mut rng(1)).unwrap();
        ln.gamma
            .value
            .copy_from_host(&random_tensor(&p, &[8], 7).to_vec().unwrap())
            .unwrap();
        ln.beta
            .value
            .copy_from_host(&random_tensor(&p, &[8], 8).to_vec().unwrap())
            .unwrap();
        let x = random_tensor(&p, &[3, 8], 2);
        let delta = random_tensor(&p, &[3, 8], 3);
        let w_norm = random_tensor(&p, &[3, 8], 4);
        let w_sum = random_tensor(&p, &[3, 8], 5);
        // loss = sum(w_norm * layernorm(x + delta)) + sum(w_sum * (x + delta))
        let loss = |ln: &LayerNorm, x: &Tensor, d: &Tensor| {
            let (sum, out, _) = ln.forward_residual(x, d).unwrap();
            weighted_sum(&out, &w_norm) + weighted_sum(&sum, &w_sum)
        };
        let (sum, _, stats) = ln.forward_residual(&x, &delta).unwrap();
        let mut dsum = w_sum.try_clone().unwrap();
        ln.backward(&mut dsum, &w_norm, &sum, &stats).unwrap();
        check("dx", &x, dsum.host(), 100, |x| loss(&ln, x, &delta));
        check("ddelta", &delta, dsum.host(), 100, |d| loss(&ln, &x, d));
        let (dg, db) = (
            ln.gamma.grad.to_vec().unwrap(),
            ln.beta.grad.to_vec().unwrap(),
        );
        let g0 = ln.gamma.value.try_clone().unwrap();
        check("dgamma", &g0, &dg, 100, |g| {
            let (s, o, _) = ops::residual_layernorm_forward(&x, &delta, g, &ln.beta.value).unwrap();
            weighted_sum(&o, &w_norm) + weighted_sum(&s, &w_sum)
        });
        let b0 = ln.beta.value.try_clone().unwrap();
        check("dbeta", &b0, &db, 100, |b| {
            let (s, o, _) =
                ops::residual_layernorm_forward(&x, &delta, &ln.gamma.value, b).unwrap();
            weighted_sum(&o, &w_norm) + weighted_sum(&s, &w_sum)
        });
    }
}

//! Causal multi-head self-attention: a fused QKV projection, attention, an output projection.

use super::linear::Linear;
use super::{ActLayout, Cost, Param, f32_bytes};
use crate::engine::cpu::attention::AttnShape;
use crate::engine::rng::Rng;
use crate::engine::{MemoryPool, Result, Tensor, ops};
use std::sync::Arc;

pub struct CausalSelfAttention {
    pub qkv: Linear,
    pub proj: Linear,
    pub n_heads: usize,
}

/// What the backward needs: the QKV activations, the attention output that fed the
/// projection, and the softmax statistics (probabilities on the CPU, one log-sum-exp per row
/// on the GPU).
pub struct AttnSaved {
    pub qkv: Tensor,
    pub stats: Tensor,
    pub att: Tensor,
}

impl CausalSelfAttention {
    pub fn new(
        pool: &Arc<MemoryPool>,
        name: &str,
        c: usize,
        n_heads: usize,
        proj_std: f32,
        rng: &mut Rng,
    ) -> Result<Self> {
        Ok(CausalSelfAttention {
            qkv: Linear::new(pool, &format!("{name}.qkv"), c, 3 * c, true, 0.02, rng)?,
            proj: Linear::new(pool, &format!("{name}.proj"), c, c, true, proj_std, rng)?,
            n_heads,
        })
    }

    fn shape(&self, x: &Tensor) -> AttnShape {
        let s = x.shape();
        AttnShape {
            batch: s[0],
            seq: s[1],
            heads: self.n_heads,
            channels: s[2],
        }
    }

    /// `x` is `[B, T, C]`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, AttnSaved)> {
        let qkv = self.qkv.forward(x)?;
        let (att, stats) = ops::attention_forward(&qkv, self.shape(x))?;
        let out = self.proj.forward(&att)?;
        Ok((out, AttnSaved { qkv, stats, att }))
    }

    pub fn backward(&mut self, dout: &Tensor, x: &Tensor, saved: &AttnSaved) -> Result<Tensor> {
        let datt = self.proj.backward(dout, &saved.att)?;
        let dqkv = ops::attention_backward(&datt, &saved.qkv, &saved.stats, self.shape(x))?;
        self.qkv.backward(&dqkv, x)
    }

    pub fn params(&self) -> Vec<&Param> {
        [self.qkv.params(), self.proj.params()].concat()
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.qkv.params_mut();
        v.extend(self.proj.params_mut());
        v
    }

    pub fn cost(&self, batch: usize, seq: usize) -> Cost {
        Self::cost_of(self.qkv.c_in, self.n_heads, batch, seq, ActLayout::CPU_F32)
    }

    /// Saves the QKV activations, the attention output and the softmax statistics (whose
    /// size depends on the device, see `ops::attention_stats_shape`). FLOPs count the QK^T
    /// and PV products over the causal half (T^2/2 per head).
    pub fn cost_of(c: usize, heads: usize, batch: usize, seq: usize, layout: ActLayout) -> Cost {
        let tokens = batch * seq;
        let pairs = (batch * heads * seq * (seq + 1) / 2) as u64;
        let hs = (c / heads) as u64;
        let stats = AttnShape {
            batch,
            seq,
            heads,
            channels: c,
        };
        let stats: usize = ops::attention_stats_shape(layout.device, stats)
            .iter()
            .product();
        let core = Cost {
            params: 0,
            flops_forward: 4 * pairs * hs,
            flops_backward: 8 * pairs * hs,
            saved_bytes: layout.act_bytes(tokens * 3 * c + tokens * c) + f32_bytes(stats),
        };
        Linear::cost_of(c, 3 * c, true, tokens) + core + Linear::cost_of(c, c, true, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut attn = CausalSelfAttention::new(&p, "attn", 8, 2, 0.3, &mut rng(5)).unwrap();
        let x = random_tensor(&p, &[2, 5, 8], 6);
        let w = random_tensor(&p, &[2, 5, 8], 7);
        let (_, saved) = attn.forward(&x).unwrap();
        let dx = attn.backward(&w, &x, &saved).unwrap();
        check("dx", &x, dx.host(), 80, |x| {
            weighted_sum(&attn.forward(x).unwrap().0, &w)
        });
        let dq = attn.qkv.weight.grad.to_vec().unwrap();
        let q0 = attn.qkv.weight.value.try_clone().unwrap();
        let s = attn.shape(&x);
        check("dWqkv", &q0, &dq, 60, |wt| {
            let qkv =
                ops::linear_forward(&x, wt, Some(&attn.qkv.bias.as_ref().unwrap().value)).unwrap();
            let (att, _) = ops::attention_forward(&qkv, s).unwrap();
            weighted_sum(&attn.proj.forward(&att).unwrap(), &w)
        });
    }
}

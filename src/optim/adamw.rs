//! AdamW over a model's parameters, with fp32 moments kept beside each parameter.

use crate::engine::cpu::adamw::AdamWStep;
use crate::engine::{DType, Result, Tensor, ops};
use crate::nn::Param;

#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// First and second moments per parameter, in the model's parameter order.
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Updates applied so far (bias correction uses it; skipped steps do not count).
    pub t: u64,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: &[&Param]) -> Result<AdamW> {
        let zeros = |p: &&Param| Tensor::zeros(p.value.pool(), p.value.shape(), DType::F32);
        Ok(AdamW {
            cfg,
            m: params.iter().map(zeros).collect::<Result<_>>()?,
            v: params.iter().map(zeros).collect::<Result<_>>()?,
            t: 0,
        })
    }

    /// Applies one update with `grad_scale` multiplying every stored gradient first, and
    /// refreshes each parameter's compute copy in the same pass.
    pub fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()> {
        self.t += 1;
        for ((p, m), v) in params.iter_mut().zip(&mut self.m).zip(&mut self.v) {
            let h = AdamWStep {
                lr,
                beta1: self.cfg.beta1,
                beta2: self.cfg.beta2,
                eps: self.cfg.eps,
                weight_decay: if p.decay { self.cfg.weight_decay } else { 0.0 },
                t: self.t,
                grad_scale,
            };
            let Param {
                value,
                grad,
                compute,
                ..
            } = &mut **p;
            ops::adamw_update(value, grad, m, v, compute.as_mut(), h)?;
        }
        Ok(())
    }
}

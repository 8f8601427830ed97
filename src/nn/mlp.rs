//! The transformer feed-forward: `proj(gelu(fc(x)))`, widening the stream four times. The
//! GELU rides on the products around it where the layers are plain (on the GPU, cuBLASLt
//! epilogues: `fc` applies it, `proj`'s input gradient applies its derivative).

use super::linear::Linear;
use super::{ActLayout, Cost, ParamBuilder, params};
use crate::engine::{Result, Tensor};

pub struct Mlp {
    pub fc: Linear,
    pub proj: Linear,
}

/// Activations the backward needs: the pre-activation and the GELU output.
pub struct MlpSaved {
    pub pre: Tensor,
    pub act: Tensor,
}

params!(Mlp { fc, proj });

impl Mlp {
    /// `proj_std` is smaller than the default init: it scales the residual contributions so
    /// the stream's variance does not grow with depth (GPT-2's 1/sqrt(2 * layers) rule).
    pub fn new(b: &mut ParamBuilder, c: usize, proj_std: f32) -> Result<Mlp> {
        Mlp::with_hidden(b, c, 4 * c, proj_std)
    }

    /// An MLP `c -> hidden -> c` (mixture-of-experts experts are often narrower than 4c).
    pub fn with_hidden(
        b: &mut ParamBuilder,
        c: usize,
        hidden: usize,
        proj_std: f32,
    ) -> Result<Mlp> {
        Ok(Mlp {
            fc: Linear::new(&mut b.scope("fc"), c, hidden, true, 0.02)?,
            proj: Linear::new(&mut b.scope("proj"), hidden, c, true, proj_std)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, MlpSaved)> {
        let saved = self.activations(x)?;
        Ok((self.output(&saved)?, saved))
    }

    /// The forward up to what the backward needs, without the output projection: all that
    /// a recomputing backward has to rebuild.
    pub fn activations(&self, x: &Tensor) -> Result<MlpSaved> {
        let (pre, act) = self.fc.forward_gelu(x)?;
        Ok(MlpSaved { pre, act })
    }

    /// The layer's output from its saved activations.
    pub fn output(&self, saved: &MlpSaved) -> Result<Tensor> {
        self.proj.forward(&saved.act)
    }

    /// Returns `dx`; `x` is the forward's input.
    pub fn backward(&mut self, dout: &Tensor, x: &Tensor, saved: &MlpSaved) -> Result<Tensor> {
        let dpre = self.proj.backward_gelu(dout, &saved.act, &saved.pre)?;
        self.fc.backward(&dpre, x)
    }

    pub fn cost(&self, tokens: usize) -> Cost {
        Self::cost_of(self.fc.c_in, self.fc.c_out, tokens, ActLayout::CPU_F32)
    }

    /// A `c -> hidden -> c` MLP over `tokens` rows. Saves the pre-activation and the GELU
    /// output (the input is the norm's output).
    pub fn cost_of(c: usize, hidden: usize, tokens: usize, layout: ActLayout) -> Cost {
        let elems = (tokens * hidden) as u64;
        let gelu = Cost {
            flops_forward: 8 * elems,
            flops_backward: 12 * elems,
            saved_bytes: layout.act_bytes(2 * elems as usize),
            ..Cost::default()
        };
        Linear::cost_of(c, hidden, true, tokens) + gelu + Linear::cost_of(hidden, c, true, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ops;
    use crate::nn::gradcheck::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut mlp = build(&p, "mlp", 3, |b| Mlp::new(b, 4, 0.3));
        let x = random_tensor(&p, &[5, 4], 4);
        let w = random_tensor(&p, &[5, 4], 5);
        let (_, saved) = mlp.forward(&x).unwrap();
        let dx = mlp.backward(&w, &x, &saved).unwrap();
        check("dx", &x, dx.host(), 100, |x| {
            weighted_sum(&mlp.forward(x).unwrap().0, &w)
        });
        let dfc = mlp.fc.weight.grad.to_vec().unwrap();
        let fc0 = mlp.fc.weight.value.try_clone().unwrap();
        check("dfc", &fc0, &dfc, 40, |wt| {
            let pre =
                ops::linear_forward(&x, wt, Some(&mlp.fc.bias.as_ref().unwrap().value)).unwrap();
            weighted_sum(
                &mlp.proj.forward(&ops::gelu_forward(&pre).unwrap()).unwrap(),
                &w,
            )
        });
    }
}

//! Layer normalisation with learned gain and bias, optionally fused with a residual add.
//!
//! With [`Kernels::Unfused`] the residual add is a kernel of its own before the plain norm,
//! and in the backward the norm's input gradient goes to a buffer of its own that a second
//! kernel adds into the residual stream's gradient.

use super::{ActLayout, Cost, Init, Kernels, Param, ParamBuilder, f32_bytes, params};
use crate::engine::ops::{self, NormStats};
use crate::engine::{DType, Result, Tensor};

pub struct LayerNorm {
    pub gamma: Param,
    pub beta: Param,
    pub c: usize,
}

params!(LayerNorm { gamma, beta });

impl LayerNorm {
    /// Gain `weight` (ones) and shift `bias` (zeros) in `b`'s scope.
    pub fn new(b: &mut ParamBuilder, c: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            gamma: b.param("weight", &[c], Init::Ones)?,
            beta: b.param("bias", &[c], Init::Zeros)?,
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

    /// [`Self::forward_residual`] run by `kernels`: fused, or an add kernel then the norm.
    pub fn forward_residual_with(
        &self,
        x: &Tensor,
        delta: &Tensor,
        kernels: Kernels,
    ) -> Result<(Tensor, Tensor, NormStats)> {
        match kernels {
            Kernels::Fused => self.forward_residual(x, delta),
            Kernels::Unfused => {
                let sum = ops::add(x, delta)?;
                let (out, stats) = self.forward(&sum)?;
                Ok((sum, out, stats))
            }
        }
    }

    /// [`Self::backward`] run by `kernels`: accumulating into `dx` inside the norm's kernel,
    /// or writing the norm's input gradient to a zeroed buffer of its own that an add kernel
    /// then adds into `dx` (the residual stream's two gradients meeting).
    pub fn backward_with(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        stats: &NormStats,
        kernels: Kernels,
    ) -> Result<()> {
        match kernels {
            Kernels::Fused => self.backward(dx, dout, x, stats),
            Kernels::Unfused => {
                let mut d_norm = Tensor::zeros(dx.pool(), dx.shape(), dx.dtype())?;
                self.backward(&mut d_norm, dout, x, stats)?;
                ops::add_in_place(dx, &d_norm)
            }
        }
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
        // The kernel always produces both parameter gradients; a frozen one's goes to scratch.
        let scratch = |p: &Param| -> Result<Option<Tensor>> {
            p.frozen
                .then(|| Tensor::zeros(x.pool(), &[self.c], DType::F32))
                .transpose()
        };
        let (mut g_scratch, mut b_scratch) = (scratch(&self.gamma)?, scratch(&self.beta)?);
        ops::layernorm_backward(
            dx,
            g_scratch.as_mut().unwrap_or(&mut self.gamma.grad),
            b_scratch.as_mut().unwrap_or(&mut self.beta.grad),
            dout,
            x,
            gamma,
            stats,
        )
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
    use crate::engine::cpu::testutil::assert_close;
    use crate::nn::gradcheck::*;

    /// The add-then-norm chain computes what the fused kernel does: the sum is the same f32
    /// addition, so the sum, the output and the statistics are equal; the backward adds the
    /// norm's gradient to the stream's after rounding it once more (the f32 sum of two values
    /// instead of one fused accumulation), so the stream gradient may differ by an ulp of its
    /// larger addend: 1e-6 relative; the parameter gradients are the same kernel, exact.
    #[test]
    fn unfused_residual_norm_matches_fused() {
        let p = pool();
        let (n, c) = (6, 40);
        let mut fused = build(&p, "ln", 3, |b| LayerNorm::new(b, c));
        let mut unfused = build(&p, "ln", 3, |b| LayerNorm::new(b, c));
        for ln in [&mut fused, &mut unfused] {
            // Non-trivial gains and biases, the same in both.
            let g = random_tensor(&p, &[c], 4);
            ln.gamma.value.host_mut().copy_from_slice(g.host());
            let b = random_tensor(&p, &[c], 5);
            ln.beta.value.host_mut().copy_from_slice(b.host());
        }
        let x = random_tensor(&p, &[n, c], 6);
        let delta = random_tensor(&p, &[n, c], 7);
        let dout = random_tensor(&p, &[n, c], 8);
        let stream = random_tensor(&p, &[n, c], 9).to_vec().unwrap();
        let mut results = Vec::new();
        for (ln, k) in [
            (&mut fused, Kernels::Fused),
            (&mut unfused, Kernels::Unfused),
        ] {
            let (sum, out, stats) = ln.forward_residual_with(&x, &delta, k).unwrap();
            let mut dx =
                Tensor::from_vec(&p, &[n, c], crate::engine::DType::F32, stream.clone()).unwrap();
            ln.backward_with(&mut dx, &dout, &sum, &stats, k).unwrap();
            results.push([
                sum.to_vec().unwrap(),
                out.to_vec().unwrap(),
                stats.rstd.to_vec().unwrap(),
                dx.to_vec().unwrap(),
                ln.gamma.grad.to_vec().unwrap(),
                ln.beta.grad.to_vec().unwrap(),
            ]);
        }
        let names = ["sum", "out", "rstd", "dx", "dgamma", "dbeta"];
        for (i, what) in names.iter().enumerate() {
            let tol = if *what == "dx" { 1e-6 } else { 0.0 };
            assert_close(&results[1][i], &results[0][i], tol, what);
        }
        assert_ne!(
            results[1][3], stream,
            "the backward reached the stream gradient"
        );
    }

    #[test]
    fn fused_backward_matches_finite_differences() {
        let p = pool();
        let mut ln = build(&p, "ln", 1, |b| LayerNorm::new(b, 8));
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

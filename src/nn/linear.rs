//! Fully connected layer, `y = x W^T + b`, weights stored `[out, in]`.

use super::{Cost, Init, Param};
use crate::engine::rng::Rng;
use crate::engine::{MemoryPool, Result, Tensor, ops};
use std::sync::Arc;

pub struct Linear {
    pub weight: Param,
    pub bias: Option<Param>,
    pub c_in: usize,
    pub c_out: usize,
}

impl Linear {
    pub fn new(
        pool: &Arc<MemoryPool>,
        name: &str,
        c_in: usize,
        c_out: usize,
        bias: bool,
        std: f32,
        rng: &mut Rng,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: Param::new(
                pool,
                format!("{name}.weight"),
                &[c_out, c_in],
                Init::Normal(std),
                rng,
            )?,
            bias: if bias {
                Some(Param::new(
                    pool,
                    format!("{name}.bias"),
                    &[c_out],
                    Init::Zeros,
                    rng,
                )?)
            } else {
                None
            },
            c_in,
            c_out,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear_forward(
            x,
            self.weight.weight(),
            self.bias.as_ref().map(Param::weight),
        )
    }

    /// Returns `dx`; accumulates the parameter gradients. `x` is the forward's input.
    pub fn backward(&mut self, dout: &Tensor, x: &Tensor) -> Result<Tensor> {
        let (w, dw) = self.weight.weight_and_grad();
        ops::linear_backward(dout, x, w, dw, self.bias.as_mut().map(|b| &mut b.grad))
    }

    pub fn params(&self) -> Vec<&Param> {
        std::iter::once(&self.weight)
            .chain(self.bias.as_ref())
            .collect()
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        std::iter::once(&mut self.weight)
            .chain(self.bias.as_mut())
            .collect()
    }

    pub fn cost(&self, tokens: usize) -> Cost {
        Self::cost_of(self.c_in, self.c_out, self.bias.is_some(), tokens)
    }

    /// The input is saved for the weight gradient; the layer that produced it counts those bytes.
    pub fn cost_of(c_in: usize, c_out: usize, bias: bool, tokens: usize) -> Cost {
        let mac = (tokens * c_in * c_out) as u64;
        Cost {
            params: c_in * c_out + if bias { c_out } else { 0 },
            flops_forward: 2 * mac,
            flops_backward: 4 * mac,
            saved_bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut lin = Linear::new(&p, "fc", 6, 5, true, 0.5, &mut rng(1)).unwrap();
        lin.bias
            .as_mut()
            .unwrap()
            .value
            .copy_from_host(&random_tensor(&p, &[5], 9).to_vec().unwrap())
            .unwrap();
        let x = random_tensor(&p, &[2, 3, 6], 2);
        let w = random_tensor(&p, &[2, 3, 5], 3);
        let dx = lin.backward(&w, &x).unwrap();
        check("dx", &x, dx.host(), 100, |x| {
            weighted_sum(&lin.forward(x).unwrap(), &w)
        });
        let dw = lin.weight.grad.to_vec().unwrap();
        let weight = lin.weight.value.try_clone().unwrap();
        check("dW", &weight, &dw, 100, |wt| {
            weighted_sum(
                &ops::linear_forward(&x, wt, lin.bias.as_ref().map(|b| &b.value)).unwrap(),
                &w,
            )
        });
        let db = lin.bias.as_ref().unwrap().grad.to_vec().unwrap();
        let bias = lin.bias.as_ref().unwrap().value.try_clone().unwrap();
        check("db", &bias, &db, 100, |b| {
            weighted_sum(&ops::linear_forward(&x, &weight, Some(b)).unwrap(), &w)
        });
        assert_eq!(lin.cost(6).params, 35);
        assert_eq!(lin.cost(6).flops_forward, 2 * 6 * 30);
    }
}

//! Layers with explicit forward and backward passes.
//!
//! A layer owns its parameters, runs its forward through `engine::ops` (so it works on any
//! device), returns what its backward needs, and reports its [`Cost`]: parameter count, FLOPs
//! and saved-activation bytes for a given batch, which is what makes memory planning and MFU
//! exact rather than estimated.

pub mod attention;
pub mod bk_core;
pub mod builder;
pub mod embedding;
pub mod gqa;
pub mod layernorm;
pub mod linear;
pub mod lora;
pub mod mlp;
pub mod moe;
pub mod params;
pub mod rmsnorm;
pub mod swiglu;

use crate::engine::rng::Rng;
use crate::engine::{DType, Device, MemoryPool, Result, Tensor, ops};
use std::ops::Add;
use std::sync::Arc;

pub use builder::ParamBuilder;
pub use params::Params;
pub(crate) use params::params;

/// One trainable tensor: the fp32 master value, its gradient, and under mixed precision the
/// rounded copy the forward and backward compute with. With the optimizer offloaded the
/// master lives in host memory and the compute copy (f32 under fp32/tf32) is the only weight
/// on the device.
pub struct Param {
    pub name: String,
    pub value: Tensor,
    pub grad: Tensor,
    pub compute: Option<Tensor>,
    /// Whether weight decay applies (matrices yes; biases and norm gains no).
    pub decay: bool,
    /// A frozen parameter (the base model under low-rank adapters) takes no gradient: its
    /// `grad` is empty, the optimizer never sees it, and the layers skip its weight-gradient
    /// GEMMs. Its value is kept only in the compute dtype (no f32 master).
    pub frozen: bool,
    /// Read by its layer's kernels as the f32 master whatever the compute dtype (the
    /// BK-Core's `z` and off-diagonals): freezing keeps its value in f32.
    pub master_read: bool,
    /// Every write of the gradient goes through [`Param::weight_and_grad_target`] or
    /// [`Param::grad_mut`], or follows [`Param::settle_grad`] (set by the layer that owns it), so
    /// the trainer may leave the step's clear to the first writer ([`Param::defer_grad_clear`]).
    pub lazy_grad: bool,
    /// The gradient is zero by definition but its buffer still holds older values: the first
    /// writer overwrites it whole, or clears it before adding.
    grad_stale: bool,
}

/// Which implementation of the operations kiln fuses a layer runs (`train.fused_kernels`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Kernels {
    /// kiln's fused kernels: cross-entropy with its backward in place, the residual add
    /// inside the layernorm, AdamW in one pass.
    #[default]
    Fused,
    /// The same mathematics as the chains of single-purpose kernels a framework without
    /// custom kernels launches (each intermediate in a buffer of its own): the baseline a
    /// benchmark measures the fusion against.
    Unfused,
}

impl Kernels {
    pub fn from_setting(fused: bool) -> Kernels {
        if fused {
            Kernels::Fused
        } else {
            Kernels::Unfused
        }
    }
}

/// How to fill a new parameter.
#[derive(Clone, Copy)]
pub enum Init {
    Zeros,
    Ones,
    Normal(f32),
    /// Uniform on `[-bound, bound]`.
    Uniform(f32),
}

/// [`Param::grad_target`] on a parameter's fields, so that its weight can be borrowed beside it.
fn grad_target_of<'a>(
    grad: &'a mut Tensor,
    stale: &mut bool,
    frozen: bool,
) -> Option<ops::WeightGrad<'a>> {
    let overwrite = std::mem::take(stale);
    (!frozen).then_some(ops::WeightGrad { grad, overwrite })
}

impl Param {
    /// A parameter drawn from `init`, frozen from the start (no gradient buffer is ever
    /// allocated) when `frozen`.
    pub fn initialised(
        pool: &Arc<MemoryPool>,
        name: String,
        shape: &[usize],
        init: Init,
        rng: &mut Rng,
        frozen: bool,
    ) -> Result<Param> {
        // Planning: the booking is what counts, and drawing a large model's values would
        // cost seconds and gigabytes.
        if pool.is_meta() {
            return Param::holding(pool, name, shape, Vec::new(), frozen);
        }
        let n: usize = shape.iter().product();
        let values: Vec<f32> = match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal(std) => rng.normals(n, std),
            Init::Uniform(bound) => rng.uniforms(n, bound),
        };
        Param::holding(pool, name, shape, values, frozen)
    }

    /// A parameter holding `values`, with a zero gradient, frozen from the start when `frozen`
    /// (an empty gradient); on the meta device only the booking (the values are not read).
    pub fn holding(
        pool: &Arc<MemoryPool>,
        name: String,
        shape: &[usize],
        values: Vec<f32>,
        frozen: bool,
    ) -> Result<Param> {
        let value = if pool.is_meta() {
            Tensor::zeros(pool, shape, DType::F32)?
        } else {
            Tensor::from_vec(pool, shape, DType::F32, values)?
        };
        let grad_shape: &[usize] = if frozen { &[0] } else { shape };
        Ok(Param {
            name,
            value,
            grad: Tensor::zeros(pool, grad_shape, DType::F32)?,
            compute: None,
            decay: shape.len() >= 2,
            frozen,
            master_read: false,
            lazy_grad: false,
            grad_stale: false,
        })
    }

    /// Marks every write of the gradient as going through this type's accessors (see
    /// [`Param::lazy_grad`]).
    pub fn with_lazy_grad(mut self) -> Param {
        self.lazy_grad = true;
        self
    }

    /// Freezes the parameter: drops its gradient buffer. [`Param::set_compute_dtype`] then
    /// converts the value itself instead of adding a copy.
    pub fn freeze(&mut self) -> Result<()> {
        self.frozen = true;
        self.grad_stale = false;
        self.grad = Tensor::zeros(self.value.pool(), &[0], DType::F32)?;
        Ok(())
    }

    /// Clears the gradient now: every element zero.
    pub fn clear_grad(&mut self) -> Result<()> {
        self.grad_stale = false;
        self.grad.fill_zero()
    }

    /// Clears the gradient by the next write instead of a pass over the buffer now: the first
    /// weight-gradient product overwrites it (`beta = 0`) rather than reading zeros back, and
    /// any other first writer clears it before adding. Only for a [`Param::lazy_grad`]
    /// parameter; others are cleared at once.
    pub fn defer_grad_clear(&mut self) -> Result<()> {
        if !self.lazy_grad {
            return self.clear_grad();
        }
        self.grad_stale = !self.frozen && !self.grad.is_empty();
        Ok(())
    }

    /// Finishes a deferred clear that no writer made (a parameter this step did not reach),
    /// so that the gradient may be read.
    pub fn settle_grad(&mut self) -> Result<()> {
        if self.grad_stale {
            self.clear_grad()?;
        }
        Ok(())
    }

    /// The gradient to accumulate into, or `None` for a frozen parameter.
    pub fn grad_mut(&mut self) -> Result<Option<&mut Tensor>> {
        self.settle_grad()?;
        Ok((!self.frozen).then_some(&mut self.grad))
    }

    /// The tensor the forward and backward read: the compute copy if there is one.
    pub fn weight(&self) -> &Tensor {
        self.compute.as_ref().unwrap_or(&self.value)
    }

    /// The gradient for a write that covers every element of it, or `None` for a frozen
    /// parameter: to be overwritten when a deferred clear is pending (which this ends), else
    /// added to.
    pub fn grad_target(&mut self) -> Option<ops::WeightGrad<'_>> {
        grad_target_of(&mut self.grad, &mut self.grad_stale, self.frozen)
    }

    /// The weight to read and the gradient for a product that writes every element of it:
    /// to be overwritten when a deferred clear is pending (which this ends), else added to.
    pub fn weight_and_grad_target(&mut self) -> (&Tensor, Option<ops::WeightGrad<'_>>) {
        let grad = grad_target_of(&mut self.grad, &mut self.grad_stale, self.frozen);
        (self.compute.as_ref().unwrap_or(&self.value), grad)
    }

    /// Rewrites the compute copy, if there is one, from the master (after loading the master).
    pub fn refresh_compute(&mut self) -> Result<()> {
        if let Some(c) = &mut self.compute {
            c.copy_from_host(&self.value.to_vec()?)?;
        }
        Ok(())
    }

    /// Moves the fp32 master into `host` (a host pool), leaving the device with only the
    /// compute copy; where the forward read the master itself (fp32, tf32), the device's
    /// master tensor stays behind as an f32 compute copy.
    pub fn offload_master(&mut self, host: &Arc<MemoryPool>) -> Result<()> {
        let master = self.value.converted(host, DType::F32)?;
        let on_device = std::mem::replace(&mut self.value, master);
        if self.compute.is_none() {
            self.compute = Some(on_device);
        }
        Ok(())
    }

    /// Creates or refreshes the compute copy (`None` keeps computing on the master). A frozen
    /// parameter has no master to keep: its value is converted in place.
    pub fn set_compute_dtype(&mut self, dtype: Option<DType>) -> Result<()> {
        if self.frozen {
            let want = match dtype {
                Some(d) if !self.master_read => d,
                _ => DType::F32,
            };
            if self.value.dtype() != want {
                self.value = self.value.converted(self.value.pool(), want)?;
            }
            self.compute = None;
            return Ok(());
        }
        self.compute = match dtype {
            None | Some(DType::F32) => None,
            Some(d) => Some(self.value.converted(self.value.pool(), d)?),
        };
        Ok(())
    }
}

/// What a layer costs for one micro-batch of `batch x seq` tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Cost {
    pub params: usize,
    pub flops_forward: u64,
    pub flops_backward: u64,
    /// Bytes of activations kept from the forward for the backward.
    pub saved_bytes: usize,
}

impl Cost {
    pub fn flops_per_token(&self, tokens: usize) -> f64 {
        (self.flops_forward + self.flops_backward) as f64 / tokens as f64
    }
}

impl Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            params: self.params + o.params,
            flops_forward: self.flops_forward + o.flops_forward,
            flops_backward: self.flops_backward + o.flops_backward,
            saved_bytes: self.saved_bytes + o.saved_bytes,
        }
    }
}

impl std::iter::Sum for Cost {
    fn sum<I: Iterator<Item = Cost>>(iter: I) -> Cost {
        iter.fold(Cost::default(), |a, b| a + b)
    }
}

/// Where a layer's activations live and the dtype of the weights it computes with, which
/// together decide the bytes it saves: the CPU keeps f32 activations and the full attention
/// probabilities, a GPU keeps activations in the compute dtype and one log-sum-exp per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActLayout {
    pub device: Device,
    /// The dtype of the weights compute reads (the compute copy under mixed precision).
    pub weights: DType,
}

impl ActLayout {
    /// fp32 on the CPU: what a layer's `cost` without a layout reports.
    pub const CPU_F32: ActLayout = ActLayout {
        device: Device::Cpu,
        weights: DType::F32,
    };

    /// Bytes of `n` activation elements, in the dtype the kernels give them.
    pub fn act_bytes(&self, n: usize) -> usize {
        n * ops::activation_dtype(self.device, self.weights).size_bytes()
    }
}

/// Bytes of `n` f32 values (statistics kept in f32 under every policy).
pub(crate) fn f32_bytes(n: usize) -> usize {
    n * 4
}

#[cfg(test)]
pub(crate) mod gradcheck {
    //! Finite-difference checks shared by the layer tests.
    use super::ParamBuilder;
    pub use super::Params;
    use crate::engine::rng::{Rng, stream};
    use crate::engine::{DType, Device, MemoryPool, Tensor};
    use std::sync::Arc;

    pub fn pool() -> Arc<MemoryPool> {
        MemoryPool::new(Device::Cpu)
    }

    pub fn rng(seed: u64) -> Rng {
        Rng::new(seed, stream::INIT)
    }

    /// What `f` builds in the scope `name`, initialised from a fresh RNG seeded with `seed`.
    pub fn build<T>(
        pool: &Arc<MemoryPool>,
        name: &str,
        seed: u64,
        f: impl FnOnce(&mut ParamBuilder) -> crate::engine::Result<T>,
    ) -> T {
        let mut rng = rng(seed);
        f(&mut ParamBuilder::init(pool, &mut rng).scope(name)).unwrap()
    }

    pub fn random_tensor(pool: &Arc<MemoryPool>, shape: &[usize], seed: u64) -> Tensor {
        let mut r = rng(seed);
        let n = shape.iter().product();
        Tensor::from_vec(
            pool,
            shape,
            DType::F32,
            (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect(),
        )
        .unwrap()
    }

    /// Checks `analytic` (d loss / d x) against central differences of `loss` at `x`,
    /// on every element (or a strided sample of at most `max_checks`).
    pub fn check(
        name: &str,
        x: &Tensor,
        analytic: &[f32],
        max_checks: usize,
        mut loss: impl FnMut(&Tensor) -> f64,
    ) {
        let h = 1e-2f32;
        let n = x.len();
        let stride = n.div_ceil(max_checks).max(1);
        for i in (0..n).step_by(stride) {
            let mut v = x.to_vec().unwrap();
            v[i] += h;
            let plus = loss(&Tensor::from_vec(x.pool(), x.shape(), DType::F32, v.clone()).unwrap());
            v[i] -= 2.0 * h;
            let minus = loss(&Tensor::from_vec(x.pool(), x.shape(), DType::F32, v).unwrap());
            let fd = ((plus - minus) / (2.0 * h as f64)) as f32;
            let err = (analytic[i] - fd).abs() / fd.abs().max(1.0);
            assert!(
                err < 1e-2,
                "{name}[{i}]: analytic {} vs finite difference {fd}",
                analytic[i]
            );
        }
    }

    /// `sum(out * w)` in f64: a scalar loss that weights every output differently.
    pub fn weighted_sum(out: &Tensor, w: &Tensor) -> f64 {
        out.host()
            .iter()
            .zip(w.host())
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum()
    }
}

//! Fused AdamW on the GPU; reference: [`crate::engine::cpu::adamw`]. Reads the fp32 master
//! weights and gradient, updates both moments and the master, and writes the compute copy
//! (f32, bf16 or f16) in the same pass. [`CudaBackend::adamw_update_unfused`] runs the same
//! update as five kernels over whole tensors (the baseline `train.fused_kernels=false`).

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, check_len,
    elementwise_grid,
};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

pub use crate::engine::cpu::adamw::AdamWStep;

pub(super) const PROGRAM: Program = Program {
    name: "adamw",
    source: include_str!("adamw.cu"),
    kernels: &[
        Kernel::AdamwMasterOnly,
        Kernel::AdamwScaleGrad,
        Kernel::AdamwFirstMoment,
        Kernel::AdamwSecondMoment,
        Kernel::AdamwApply,
    ],
    elem_kernels: &[ElemKernel::AdamwCompute, ElemKernel::AdamwRoundCompute],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

/// The kernel's `AdamW` struct, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelStep {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    bc1: f32,
    bc2: f32,
    grad_scale: f32,
}

// SAFETY: eight f32 fields, `repr(C)`, the same layout as the CUDA struct.
unsafe impl DeviceRepr for KernelStep {}

impl KernelStep {
    fn new(h: &AdamWStep) -> Self {
        // Bias corrections computed exactly as the CPU does, so both see the same constants.
        let (bc1, bc2) = h.bias_corrections();
        KernelStep {
            lr: h.lr,
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            weight_decay: h.weight_decay,
            bc1,
            bc2,
            grad_scale: h.grad_scale,
        }
    }
}

impl CudaBackend {
    /// Updates `param`, `m`, `v` (all f32, `n` values) in place and writes `compute`, the
    /// compute copy rounded to `C`, if given.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update<C: Elem>(
        &self,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        compute: Option<&mut CudaSlice<C>>,
        n: usize,
        h: AdamWStep,
    ) -> Result<()> {
        const OP: &str = "adamw_update";
        check_len(OP, "param", param, n)?;
        check_len(OP, "grad", grad, n)?;
        check_len(OP, "m", m, n)?;
        check_len(OP, "v", v, n)?;
        if n == 0 {
            return Ok(());
        }
        let step = KernelStep::new(&h);
        let n64 = n as i64;
        let cfg = grid(n);
        match compute {
            None => {
                let f = self.function(Kernel::AdamwMasterOnly)?;
                let mut b = self.stream.launch_builder(f);
                b.arg(param).arg(grad).arg(m).arg(v).arg(&n64).arg(&step);
                // SAFETY: all buffers hold at least `n` values.
                unsafe { b.launch(cfg) }?;
            }
            Some(c) => {
                check_len(OP, "compute", c, n)?;
                let f = self.elem_function::<C>(ElemKernel::AdamwCompute)?;
                let mut b = self.stream.launch_builder(f);
                b.arg(param)
                    .arg(grad)
                    .arg(m)
                    .arg(v)
                    .arg(c)
                    .arg(&n64)
                    .arg(&step);
                // SAFETY: all buffers hold at least `n` values.
                unsafe { b.launch(cfg) }?;
            }
        }
        Ok(())
    }

    /// The update of [`Self::adamw_update`] as five kernels, each over the whole tensor:
    /// `scaled = grad * grad_scale` (`scaled` is scratch of `n` values), the first moment,
    /// the second moment, the master, and the compute copy if given.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update_unfused<C: Elem>(
        &self,
        param: &mut CudaSlice<f32>,
        grad: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        scaled: &mut CudaSlice<f32>,
        compute: Option<&mut CudaSlice<C>>,
        n: usize,
        h: AdamWStep,
    ) -> Result<()> {
        const OP: &str = "adamw_update_unfused";
        check_len(OP, "param", param, n)?;
        check_len(OP, "grad", grad, n)?;
        check_len(OP, "m", m, n)?;
        check_len(OP, "v", v, n)?;
        check_len(OP, "scaled gradient", scaled, n)?;
        if let Some(c) = &compute {
            check_len(OP, "compute", c, n)?;
        }
        if n == 0 {
            return Ok(());
        }
        let step = KernelStep::new(&h);
        let n64 = n as i64;
        // SAFETY (every launch below): all buffers hold at least `n` values (checked above),
        // the kernels are grid-stride loops that stop at `n`.
        let f = self.function(Kernel::AdamwScaleGrad)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *scaled).arg(grad).arg(&n64).arg(&step);
        unsafe { b.launch(grid(n)) }?;
        let f = self.function(Kernel::AdamwFirstMoment)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *m).arg(&*scaled).arg(&n64).arg(&step);
        unsafe { b.launch(grid(n)) }?;
        let f = self.function(Kernel::AdamwSecondMoment)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *v).arg(&*scaled).arg(&n64).arg(&step);
        unsafe { b.launch(grid(n)) }?;
        let f = self.function(Kernel::AdamwApply)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *param).arg(&*m).arg(&*v).arg(&n64).arg(&step);
        unsafe { b.launch(grid(n)) }?;
        if let Some(c) = compute {
            let f = self.elem_function::<C>(ElemKernel::AdamwRoundCompute)?;
            let mut b = self.stream.launch_builder(f);
            b.arg(c).arg(&*param).arg(&n64);
            unsafe { b.launch(grid(n)) }?;
        }
        Ok(())
    }
}

/// One thread per element in a grid-stride loop.
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elementwise_grid(n, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

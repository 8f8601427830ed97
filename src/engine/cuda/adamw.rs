//! Fused AdamW on the GPU; reference: [`crate::engine::cpu::adamw`]. Reads the fp32 master
//! weights and gradient, updates both moments and the master, and writes the compute copy
//! (f32, bf16 or f16) in the same pass, over all of a step's tensors in one launch.
//! [`CudaBackend::adamw_update_unfused`] runs the same update as five kernels over whole
//! tensors (the baseline `train.fused_kernels=false`).

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32,
    check_len, elementwise_grid, raw_ptr,
};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

pub use crate::engine::cpu::adamw::AdamWStep;

pub(super) const PROGRAM: Program = Program {
    name: "adamw",
    source: include_str!("adamw.cu"),
    kernels: &[
        Kernel::AdamwManyMasterOnly,
        Kernel::AdamwScaleGrad,
        Kernel::AdamwFirstMoment,
        Kernel::AdamwSecondMoment,
        Kernel::AdamwApply,
    ],
    elem_kernels: &[ElemKernel::AdamwManyCompute, ElemKernel::AdamwRoundCompute],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;
/// Elements a block of the fused kernel updates (the kernel's ADAMW_CHUNK).
const CHUNK: usize = 16384;
/// 64-bit words of one tensor's entry in the fused kernel's table (its `AdamWTensor`).
const TABLE_WORDS: usize = 8;
/// Bytes of one tensor's entry in that table, which each launch uploads (for the planner).
pub const ADAMW_TABLE_BYTES_PER_TENSOR: usize = 8 * TABLE_WORDS;

/// One tensor of [`CudaBackend::adamw_update_many`]: the f32 master, gradient and moments of
/// `n` values, the compute copy if the launch writes them, and the tensor's weight decay.
pub struct AdamWSlices<'a, C> {
    pub param: &'a mut CudaSlice<f32>,
    pub grad: &'a CudaSlice<f32>,
    pub m: &'a mut CudaSlice<f32>,
    pub v: &'a mut CudaSlice<f32>,
    pub compute: Option<&'a mut CudaSlice<C>>,
    pub n: usize,
    pub weight_decay: f32,
}

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
    /// compute copy rounded to `C`, if given: [`Self::adamw_update_many`] with one tensor.
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
        let one = AdamWSlices {
            param,
            grad,
            m,
            v,
            compute,
            n,
            weight_decay: h.weight_decay,
        };
        self.adamw_update_many(&mut [one], h)
    }

    /// One fused AdamW step over many tensors in a single launch (a model's 150-400 tensors
    /// cost one launch instead of one each, most of which are too small to fill the GPU).
    /// `h` holds for all of them except the weight decay, which each brings. Every tensor has
    /// a compute copy to write, or none has (one launch writes all or none).
    pub fn adamw_update_many<C: Elem>(
        &self,
        tensors: &mut [AdamWSlices<'_, C>],
        h: AdamWStep,
    ) -> Result<()> {
        const OP: &str = "adamw_update";
        let with_compute = tensors.first().is_some_and(|t| t.compute.is_some());
        let mut table: Vec<u64> = Vec::with_capacity(tensors.len() * TABLE_WORDS);
        let mut blocks = 0usize;
        for t in tensors.iter() {
            let n = t.n;
            check_len(OP, "param", t.param, n)?;
            check_len(OP, "grad", t.grad, n)?;
            check_len(OP, "m", t.m, n)?;
            check_len(OP, "v", t.v, n)?;
            match &t.compute {
                Some(c) if with_compute => check_len(OP, "compute", c, n)?,
                None if !with_compute => {}
                _ => {
                    return Err(CudaError::Shape {
                        op: OP,
                        detail: "every tensor of one launch must have a compute copy, or none"
                            .into(),
                    });
                }
            }
            if n == 0 {
                continue;
            }
            let compute = t.compute.as_ref().map_or(0, |c| raw_ptr(c, &self.stream));
            table.extend([
                raw_ptr(t.param, &self.stream),
                raw_ptr(t.grad, &self.stream),
                raw_ptr(t.m, &self.stream),
                raw_ptr(t.v, &self.stream),
                compute,
                n as u64,
                blocks as u64,
                t.weight_decay.to_bits() as u64,
            ]);
            blocks += n.div_ceil(CHUNK);
        }
        if blocks == 0 {
            return Ok(());
        }
        let count = as_i32(OP, "tensors", table.len() / TABLE_WORDS)?;
        let grid_blocks = u32::try_from(blocks).map_err(|_| CudaError::Shape {
            op: OP,
            detail: format!("{blocks} blocks exceed the grid"),
        })?;
        let table = self.upload(&table)?;
        let step = KernelStep::new(&h);
        let f = match with_compute {
            false => self.function(Kernel::AdamwManyMasterOnly)?,
            true => self.elem_function::<C>(ElemKernel::AdamwManyCompute)?,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&table).arg(&count).arg(&step);
        let cfg = LaunchConfig {
            grid_dim: (grid_blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the table lists buffers whose lengths were checked above, each tensor's
        // blocks cover `n.div_ceil(CHUNK)` pieces of CHUNK values and stop at `n`; the
        // buffers outlive the launch on this stream (the table is freed in stream order).
        unsafe { b.launch(cfg) }?;
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

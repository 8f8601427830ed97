//! GELU forward and backward on the GPU, in its tanh form (GPT-2's) and its exact erf form
//! (BERT's); references: [`crate::engine::cpu::gelu`] and [`crate::engine::cpu::gelu_erf`].
//! Each form is its own program (`gelu.cu`, `gelu_erf.cu`); their kernels take the same
//! arguments, so both forms launch through the same two functions.

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, check_len, elementwise_grid,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "gelu",
    source: include_str!("gelu.cu"),
    kernels: &[],
    elem_kernels: &[ElemKernel::GeluForward, ElemKernel::GeluBackward],
    dtypes: ELEM_DTYPES,
};

pub(super) const ERF_PROGRAM: Program = Program {
    name: "gelu_erf",
    source: include_str!("gelu_erf.cu"),
    kernels: &[],
    elem_kernels: &[ElemKernel::GeluErfForward, ElemKernel::GeluErfBackward],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

impl CudaBackend {
    /// `out = gelu(inp)` (tanh form) over the first `n` elements.
    pub fn gelu_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        self.gelu_forward_with("gelu_forward", ElemKernel::GeluForward, out, inp, n)
    }

    /// Overwrites `dinp` with `dout * gelu'(inp)` (tanh form).
    pub fn gelu_backward<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        let kernel = ElemKernel::GeluBackward;
        self.gelu_backward_with("gelu_backward", kernel, dinp, inp, dout, n)
    }

    /// `out = x * Phi(x)` over the first `n` elements.
    pub fn gelu_erf_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        self.gelu_forward_with("gelu_erf_forward", ElemKernel::GeluErfForward, out, inp, n)
    }

    /// Overwrites `dinp` with `dout * gelu_erf'(inp)`.
    pub fn gelu_erf_backward<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        let kernel = ElemKernel::GeluErfBackward;
        self.gelu_backward_with("gelu_erf_backward", kernel, dinp, inp, dout, n)
    }

    /// A forward kernel of either form: `(out, inp, n)`.
    fn gelu_forward_with<T: Elem>(
        &self,
        op: &'static str,
        kernel: ElemKernel,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len(op, "out", out, n)?;
        check_len(op, "inp", inp, n)?;
        let f = self.elem_function::<T>(kernel)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(inp).arg(&n64);
        // SAFETY: both buffers hold at least `n` elements of the kernel's element type.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// A backward kernel of either form: `(dinp, inp, dout, n)`.
    fn gelu_backward_with<T: Elem>(
        &self,
        op: &'static str,
        kernel: ElemKernel,
        dinp: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len(op, "dinp", dinp, n)?;
        check_len(op, "inp", inp, n)?;
        check_len(op, "dout", dout, n)?;
        let f = self.elem_function::<T>(kernel)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(dinp).arg(inp).arg(dout).arg(&n64);
        // SAFETY: all buffers hold at least `n` elements of the kernel's element type.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }
}

/// Each thread takes four elements per access.
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elementwise_grid(n.div_ceil(4), BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

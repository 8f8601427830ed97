//! GELU (tanh form) forward and backward on the GPU; reference: [`crate::engine::cpu::gelu`].

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

const BLOCK: u32 = 256;

impl CudaBackend {
    /// `out = gelu(inp)` over the first `n` elements.
    pub fn gelu_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len("gelu_forward", "out", out, n)?;
        check_len("gelu_forward", "inp", inp, n)?;
        let f = self.elem_function::<T>(ElemKernel::GeluForward)?;
        let n64 = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(inp).arg(&n64);
        // SAFETY: both buffers hold at least `n` elements of the kernel's element type.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// Overwrites `dinp` with `dout * gelu'(inp)`.
    pub fn gelu_backward<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        dout: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len("gelu_backward", "dinp", dinp, n)?;
        check_len("gelu_backward", "inp", inp, n)?;
        check_len("gelu_backward", "dout", dout, n)?;
        let f = self.elem_function::<T>(ElemKernel::GeluBackward)?;
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

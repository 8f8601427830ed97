//! Inverted dropout on the GPU; reference: [`crate::engine::cpu::dropout`].

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, check_len, elementwise_grid,
};
use crate::engine::cpu::dropout::threshold;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "dropout",
    source: include_str!("dropout.cu"),
    kernels: &[],
    elem_kernels: &[ElemKernel::Dropout],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

impl CudaBackend {
    /// `out = x / (1 - p)` on the kept elements of the first `n`, 0 elsewhere; the mask is
    /// that of [`crate::engine::cpu::dropout::keeps`] under `seed`.
    pub fn dropout<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        x: &CudaSlice<T>,
        n: usize,
        p: f32,
        seed: u64,
    ) -> Result<()> {
        check_len("dropout", "out", out, n)?;
        check_len("dropout", "x", x, n)?;
        let f = self.elem_function::<T>(ElemKernel::Dropout)?;
        let (n64, t, scale) = (n as i64, threshold(p), 1.0f32 / (1.0 - p));
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(x).arg(&n64).arg(&seed).arg(&t).arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (elementwise_grid(n, BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both buffers hold at least `n` elements of the kernel's element type.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

//! Elementwise addition on the GPU; reference: [`crate::engine::cpu::add`].

use super::{CudaBackend, Elem, Program, Result, check_len, elementwise_grid};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "add",
    source: include_str!("add.cu"),
    kernels: &[
        "add_f32",
        "add_bf16",
        "add_f16",
        "add_assign_f32",
        "add_assign_bf16",
        "add_assign_f16",
    ],
};

const BLOCK: u32 = 256;

/// Each thread takes four elements per access.
fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elementwise_grid(n.div_ceil(4), BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// `out = a + b` over the first `n` elements.
    pub fn add<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        a: &CudaSlice<T>,
        b: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len("add", "out", out, n)?;
        check_len("add", "a", a, n)?;
        check_len("add", "b", b, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("add_{}", T::SUFFIX))?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(out).arg(a).arg(b).arg(&n64);
        // SAFETY: every buffer holds at least `n` elements of the kernel's element type.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `dst += src` over the first `n` elements.
    pub fn add_assign<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        check_len("add_assign", "dst", dst, n)?;
        check_len("add_assign", "src", src, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(&format!("add_assign_{}", T::SUFFIX))?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(dst).arg(src).arg(&n64);
        // SAFETY: both buffers hold at least `n` elements of the kernel's element type.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
}

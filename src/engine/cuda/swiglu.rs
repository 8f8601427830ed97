//! SwiGLU forward and backward on the GPU; reference: [`crate::engine::cpu::swiglu`]. Rows of
//! the input are `[gate: F | up: F]` in `T`; the output has rows of `F`.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "swiglu",
    source: include_str!("swiglu.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::SwigluForward,
        ElemKernel::SwigluForwardNormed,
        ElemKernel::SwigluBackward,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;
/// Accesses of four columns a thread takes at once (the kernels' SWIGLU_GROUPS).
const GROUPS: usize = 2;

/// A row's accesses of four columns over x, rows over y (strided past 65535).
fn grid(rows: usize, f: usize) -> LaunchConfig {
    let per_block = BLOCK as usize * GROUPS;
    LaunchConfig {
        grid_dim: (
            f.div_ceil(4).div_ceil(per_block) as u32,
            rows.min(65_535) as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks the width and returns it as the kernels' int.
fn check_width(op: &'static str, f: usize) -> Result<i32> {
    if f == 0 {
        return Err(CudaError::Shape {
            op,
            detail: "rows of width 0 have no gate and up halves".into(),
        });
    }
    as_i32(op, "width", f)
}

impl CudaBackend {
    /// `h[r, i] = silu(gate_up[r, i]) * gate_up[r, f + i]` for `rows` rows of `f`.
    pub fn swiglu_forward<T: Elem>(
        &self,
        h: &mut CudaSlice<T>,
        gate_up: &CudaSlice<T>,
        rows: usize,
        f: usize,
    ) -> Result<()> {
        const OP: &str = "swiglu_forward";
        let width = check_width(OP, f)?;
        let n = rows * f;
        check_len(OP, "h", h, n)?;
        check_len(OP, "gate_up", gate_up, 2 * n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.elem_function::<T>(ElemKernel::SwigluForward)?;
        let rows32 = as_i32(OP, "rows", rows)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(h).arg(gate_up).arg(&rows32).arg(&width);
        // SAFETY: `h` holds `rows * f` elements and `gate_up` twice that (checked above); the
        // two are distinct buffers, as the kernel's restrict-qualified pointers require.
        unsafe { b.launch(grid(rows, f)) }?;
        Ok(())
    }

    /// [`Self::swiglu_forward`] of the projection of an unnormalised stream `x` (`rows` of `c`):
    /// both halves of each row scaled first by `1 / sqrt(mean(x_row^2) + eps)`.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_forward_normed<T: Elem>(
        &self,
        h: &mut CudaSlice<T>,
        gate_up: &CudaSlice<T>,
        x: &CudaSlice<T>,
        rows: usize,
        f: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "swiglu_forward_normed";
        let width = check_width(OP, f)?;
        let n = rows * f;
        check_len(OP, "h", h, n)?;
        check_len(OP, "gate_up", gate_up, 2 * n)?;
        check_len(OP, "x", x, rows * c)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.elem_function::<T>(ElemKernel::SwigluForwardNormed)?;
        let (rows32, c32) = (as_i32(OP, "rows", rows)?, as_i32(OP, "c", c)?);
        let mut b = self.stream.launch_builder(func);
        b.arg(h)
            .arg(gate_up)
            .arg(&rows32)
            .arg(&width)
            .arg(x)
            .arg(&c32)
            .arg(&eps);
        // SAFETY: as swiglu_forward; `x` holds `rows * c` elements and is read only.
        unsafe { b.launch(grid(rows, f)) }?;
        Ok(())
    }

    /// Overwrites both halves of `dgate_up` from `dh` (rows of `f`).
    pub fn swiglu_backward<T: Elem>(
        &self,
        dgate_up: &mut CudaSlice<T>,
        gate_up: &CudaSlice<T>,
        dh: &CudaSlice<T>,
        rows: usize,
        f: usize,
    ) -> Result<()> {
        const OP: &str = "swiglu_backward";
        let width = check_width(OP, f)?;
        let n = rows * f;
        check_len(OP, "dgate_up", dgate_up, 2 * n)?;
        check_len(OP, "gate_up", gate_up, 2 * n)?;
        check_len(OP, "dh", dh, n)?;
        if n == 0 {
            return Ok(());
        }
        let func = self.elem_function::<T>(ElemKernel::SwigluBackward)?;
        let rows32 = as_i32(OP, "rows", rows)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(dgate_up)
            .arg(gate_up)
            .arg(dh)
            .arg(&rows32)
            .arg(&width);
        // SAFETY: `dh` holds `rows * f` elements, the other two twice that (checked above);
        // the three are distinct buffers (restrict-qualified in the kernel).
        unsafe { b.launch(grid(rows, f)) }?;
        Ok(())
    }
}

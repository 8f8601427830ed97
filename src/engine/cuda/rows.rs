//! Row gather, scaled scatter-add and gathered row dot products on the GPU (mixture-of-experts
//! routing); reference: [`crate::engine::cpu::rows`]. Rows are `T`; gate weights and dot
//! products are f32. Indices are `u32` row numbers already on the device.

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len, raw_ptr,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "rows",
    source: include_str!("rows.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::GatherRows,
        ElemKernel::ScatterAddRows,
        ElemKernel::GatheredRowDot,
    ],
    dtypes: ELEM_DTYPES,
};

/// Threads per row; a multiple of 32 (the dot product reduces over the block).
const BLOCK: u32 = 128;

/// One block per indexed row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The scale's device address, or null for "weight 1" (the kernels test for it).
fn scale_ptr(g: &CudaBackend, scale: Option<&CudaSlice<f32>>) -> u64 {
    scale.map_or(0, |s| raw_ptr(s, &g.stream))
}

impl CudaBackend {
    /// `out[s, :] = scale[s] * src[idx[s], :]` for the `rows` entries of `idx`; `src` has
    /// `src_rows` rows of width `c`. An index outside `src` gives a row of NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        idx: &CudaSlice<u32>,
        scale: Option<&CudaSlice<f32>>,
        rows: usize,
        src_rows: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "gather_rows";
        let c32 = as_i32(OP, "columns", c)?;
        let src_rows32 = as_i32(OP, "source rows", src_rows)? as u32;
        as_i32(OP, "rows", rows)?;
        check_len(OP, "out", out, rows * c)?;
        check_len(OP, "src", src, src_rows * c)?;
        check_len(OP, "idx", idx, rows)?;
        if let Some(s) = scale {
            check_len(OP, "scale", s, rows)?;
        }
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let scale = scale_ptr(self, scale);
        let f = self.elem_function::<T>(ElemKernel::GatherRows)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(src)
            .arg(idx)
            .arg(&scale)
            .arg(&c32)
            .arg(&src_rows32);
        // SAFETY: lengths checked above; indices are bounds-checked in the kernel; `scale` is
        // null or holds `rows` values.
        unsafe { b.launch(per_row(rows)) }?;
        Ok(())
    }

    /// `dst[idx[s], :] += scale[s] * src[s, :]` for the `rows` entries of `idx`, which must be
    /// distinct (one writer per destination row); `dst` has `dst_rows` rows. Indices outside
    /// `dst` are skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter_add_rows<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        idx: &CudaSlice<u32>,
        scale: Option<&CudaSlice<f32>>,
        rows: usize,
        dst_rows: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "scatter_add_rows";
        let c32 = as_i32(OP, "columns", c)?;
        let dst_rows32 = as_i32(OP, "destination rows", dst_rows)? as u32;
        as_i32(OP, "rows", rows)?;
        check_len(OP, "dst", dst, dst_rows * c)?;
        check_len(OP, "src", src, rows * c)?;
        check_len(OP, "idx", idx, rows)?;
        if let Some(s) = scale {
            check_len(OP, "scale", s, rows)?;
        }
        if rows == 0 || c == 0 {
            return Ok(());
        }
        let scale = scale_ptr(self, scale);
        let f = self.elem_function::<T>(ElemKernel::ScatterAddRows)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dst)
            .arg(src)
            .arg(idx)
            .arg(&scale)
            .arg(&c32)
            .arg(&dst_rows32);
        // SAFETY: lengths checked above; the kernel skips indices outside `dst`, and the
        // caller guarantees distinct indices, so no two blocks write one row.
        unsafe { b.launch(per_row(rows)) }?;
        Ok(())
    }

    /// `out[s] = sum_j a[idx[s], j] * b[s, j]` for the `rows` entries of `idx`; `a` has
    /// `a_rows` rows. An index outside `a` gives NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn gathered_row_dot<T: Elem>(
        &self,
        out: &mut CudaSlice<f32>,
        a: &CudaSlice<T>,
        idx: &CudaSlice<u32>,
        b_rows: &CudaSlice<T>,
        rows: usize,
        a_rows: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "gathered_row_dot";
        let c32 = as_i32(OP, "columns", c)?;
        let a_rows32 = as_i32(OP, "rows of a", a_rows)? as u32;
        as_i32(OP, "rows", rows)?;
        check_len(OP, "out", out, rows)?;
        check_len(OP, "a", a, a_rows * c)?;
        check_len(OP, "b", b_rows, rows * c)?;
        check_len(OP, "idx", idx, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::GatheredRowDot)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(a)
            .arg(idx)
            .arg(b_rows)
            .arg(&c32)
            .arg(&a_rows32);
        // SAFETY: lengths checked above; indices are bounds-checked in the kernel.
        unsafe { b.launch(per_row(rows)) }?;
        Ok(())
    }
}

//! Elementwise addition on the GPU; reference: [`crate::engine::cpu::add`].

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, check_len, elementwise_grid,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "add",
    source: include_str!("add.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::Add,
        ElemKernel::AddAssign,
        ElemKernel::AddColsScaled,
        ElemKernel::ColsScaled,
        ElemKernel::SetBlock,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

/// One thread per element of an `n x c` block, grid-strided (the column-block kernels).
fn block_grid(elems: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elementwise_grid(elems, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
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
        let f = self.elem_function::<T>(ElemKernel::Add)?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(out).arg(a).arg(b).arg(&n64);
        // SAFETY: every buffer holds at least `n` elements of the kernel's element type.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `dst[offset .. offset + src.len()] = src`: a device-to-device copy into part of a
    /// buffer (no kernel).
    pub fn copy_into_at<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        offset: usize,
        src: &CudaSlice<T>,
    ) -> Result<()> {
        check_len("copy_into_at", "dst", dst, offset + src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut part = dst.slice_mut(offset..offset + src.len());
        self.stream.memcpy_dtod(src, &mut part)?;
        Ok(())
    }

    /// `dst = src[offset .. offset + dst.len()]`.
    pub fn copy_from_at<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        offset: usize,
    ) -> Result<()> {
        let n = dst.len();
        check_len("copy_from_at", "src", src, offset + n)?;
        if n == 0 {
            return Ok(());
        }
        self.stream
            .memcpy_dtod(&src.slice(offset..offset + n), dst)?;
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
        let f = self.elem_function::<T>(ElemKernel::AddAssign)?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(dst).arg(src).arg(&n64);
        // SAFETY: both buffers hold at least `n` elements of the kernel's element type.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `dst += src[offset .. offset + n]` over the first `n` elements of `dst`.
    pub fn add_assign_from<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        offset: usize,
        n: usize,
    ) -> Result<()> {
        check_len("add_assign_from", "dst", dst, n)?;
        check_len("add_assign_from", "src", src, offset + n)?;
        if n == 0 {
            return Ok(());
        }
        let part = src.slice(offset..offset + n);
        let f = self.elem_function::<T>(ElemKernel::AddAssign)?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(f);
        l.arg(dst).arg(&part).arg(&n64);
        // SAFETY: `dst` and the view hold at least `n` elements of the kernel's element type.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }

    /// `dst[r, col0 + j] += alpha * src[r, j]` over `n` rows of `row` (dst) and `c` (src)
    /// elements; reference: [`crate::engine::cpu::add::add_cols_scaled`].
    #[allow(clippy::too_many_arguments)]
    pub fn add_cols_scaled<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        n: usize,
        row: usize,
        col0: usize,
        c: usize,
        alpha: f32,
    ) -> Result<()> {
        self.cols_kernel(
            ElemKernel::AddColsScaled,
            dst,
            src,
            (n, row, col0, c),
            alpha,
        )
    }

    /// `out[r, j] = alpha * src[r, col0 + j]`; reference:
    /// [`crate::engine::cpu::add::cols_scaled`].
    #[allow(clippy::too_many_arguments)]
    pub fn cols_scaled<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        n: usize,
        row: usize,
        col0: usize,
        c: usize,
        alpha: f32,
    ) -> Result<()> {
        self.cols_kernel(ElemKernel::ColsScaled, out, src, (n, row, col0, c), alpha)
    }

    /// `dst[row0 + r, col0 + j] = src[r, j]` over `n` rows of `c` (src) into rows of `row`
    /// (dst); reference: [`crate::engine::cpu::add::set_block`].
    #[allow(clippy::too_many_arguments)]
    pub fn set_block<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        n: usize,
        row: usize,
        row0: usize,
        col0: usize,
        c: usize,
    ) -> Result<()> {
        if col0 + c > row || dst.len() < (row0 + n) * row || src.len() < n * c {
            return Err(super::CudaError::Shape {
                op: "set_block",
                detail: format!(
                    "rows {row0}..{} and columns {col0}..{} of rows of {row} do not fit buffers of {} and {}",
                    row0 + n,
                    col0 + c,
                    dst.len(),
                    src.len()
                ),
            });
        }
        if n * c == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::SetBlock)?;
        let (n64, row32, row0_64, col32, c32) =
            (n as i64, row as i32, row0 as i64, col0 as i32, c as i32);
        let mut l = self.stream.launch_builder(f);
        l.arg(dst)
            .arg(src)
            .arg(&n64)
            .arg(&row32)
            .arg(&row0_64)
            .arg(&col32)
            .arg(&c32);
        // SAFETY: the checks above keep every index inside both buffers.
        unsafe { l.launch(block_grid(n * c)) }?;
        Ok(())
    }

    /// Launches one of the column-block kernels; `(n, row, col0, c)` as they take them. The
    /// first buffer is the `[N, row]` one for `add_cols_scaled`, the `[N, c]` one for
    /// `cols_scaled`.
    fn cols_kernel<T: Elem>(
        &self,
        kernel: ElemKernel,
        a: &mut CudaSlice<T>,
        b: &CudaSlice<T>,
        (n, row, col0, c): (usize, usize, usize, usize),
        alpha: f32,
    ) -> Result<()> {
        let (wide, narrow) = if kernel == ElemKernel::ColsScaled {
            (b.len(), a.len())
        } else {
            (a.len(), b.len())
        };
        if col0 + c > row || wide < n * row || narrow < n * c {
            return Err(super::CudaError::Shape {
                op: kernel.op(),
                detail: format!(
                    "columns {col0}..{} of {n} rows of {row} do not fit buffers of {wide} and {narrow}",
                    col0 + c
                ),
            });
        }
        if n * c == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(kernel)?;
        let (n64, row32, col32, c32) = (n as i64, row as i32, col0 as i32, c as i32);
        let mut l = self.stream.launch_builder(f);
        l.arg(a)
            .arg(b)
            .arg(&n64)
            .arg(&row32)
            .arg(&col32)
            .arg(&c32)
            .arg(&alpha);
        // SAFETY: the checks above keep every index inside both buffers.
        unsafe { l.launch(block_grid(n * c)) }?;
        Ok(())
    }
}

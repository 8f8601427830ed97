//! Root-mean-square normalisation on the GPU, residual add fused in; reference:
//! [`crate::engine::cpu::rmsnorm`]. Activations are `T` (f32, bf16 or f16), gamma is the
//! parameter's compute copy in `T`, and the saved reciprocal RMS and the gain gradient are f32.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
    reduce,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "rmsnorm",
    source: include_str!("rmsnorm.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::RmsnormForward,
        ElemKernel::ResidualRmsnormForward,
        ElemKernel::RmsnormBackwardInput,
        ElemKernel::RmsnormParamGradPartial,
        ElemKernel::RmsnormBackwardFused,
    ],
    dtypes: ELEM_DTYPES,
};

/// One block per row, about eight elements per thread: 96 threads for SmolLM2's 576
/// channels, 256 for Llama-3.2-1B's 2048, at most 512.
fn one_block_per_row(n: usize, c: usize) -> LaunchConfig {
    let threads = reduce::norm_threads(c);
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks the shared shape of an RMSNorm call and returns `c` as the kernels' int.
fn check_rows(op: &'static str, n: usize, c: usize) -> Result<i32> {
    as_i32(op, "rows", n)?;
    let c32 = as_i32(op, "channels", c)?;
    if c == 0 {
        return Err(CudaError::Shape {
            op,
            detail: "rows of width 0 have no mean square".into(),
        });
    }
    Ok(c32)
}

/// A row stride of at least `c`, as the kernels' int.
fn check_stride(op: &'static str, what: &str, c: usize, ld: usize) -> Result<i32> {
    if ld < c {
        return Err(CudaError::Shape {
            op,
            detail: format!("{what}'s rows are {ld} apart, narrower than their {c} values"),
        });
    }
    as_i32(op, "row stride", ld)
}

impl CudaBackend {
    /// `out = x / sqrt(mean(x^2) + eps) * gamma` per row of width `c`, `out`'s rows `ldo`
    /// apart (at least `c`); writes `rstd`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        n: usize,
        c: usize,
        ldo: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_forward";
        let c32 = check_rows(OP, n, c)?;
        let ldo32 = check_stride(OP, "out", c, ldo)?;
        check_len(OP, "out", out, n * ldo)?;
        check_len(OP, "x", x, n * c)?;
        check_len(OP, "rstd", rstd, n)?;
        check_len(OP, "gamma", gamma, c)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::RmsnormForward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(rstd)
            .arg(x)
            .arg(gamma)
            .arg(&c32)
            .arg(&ldo32)
            .arg(&eps);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(one_block_per_row(n, c)) }?;
        Ok(())
    }

    /// `sum = x + delta; out = rmsnorm(sum) * gamma`, in one pass over the rows; `out`'s
    /// rows `ldo` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn residual_rmsnorm_forward<T: Elem>(
        &self,
        sum: &mut CudaSlice<T>,
        out: &mut CudaSlice<T>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        delta: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        n: usize,
        c: usize,
        ldo: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "residual_rmsnorm_forward";
        let c32 = check_rows(OP, n, c)?;
        let ldo32 = check_stride(OP, "out", c, ldo)?;
        check_len(OP, "sum", sum, n * c)?;
        check_len(OP, "out", out, n * ldo)?;
        check_len(OP, "x", x, n * c)?;
        check_len(OP, "delta", delta, n * c)?;
        check_len(OP, "rstd", rstd, n)?;
        check_len(OP, "gamma", gamma, c)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::ResidualRmsnormForward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(sum)
            .arg(out)
            .arg(rstd)
            .arg(x)
            .arg(delta)
            .arg(gamma)
            .arg(&c32)
            .arg(&ldo32)
            .arg(&eps);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(one_block_per_row(n, c)) }?;
        Ok(())
    }

    /// Backward: ACCUMULATES into `dx` (the fused residual backward: pass the residual
    /// stream's incoming gradient as `dx`) and `dgamma`; without `dgamma` (a frozen gain) the
    /// gain's gradient is not formed at all. `dout`'s rows are `ldd` apart.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward<T: Elem>(
        &self,
        dx: &mut CudaSlice<T>,
        dgamma: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<T>,
        x: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
        ldd: usize,
    ) -> Result<()> {
        const OP: &str = "rmsnorm_backward";
        let c32 = check_rows(OP, n, c)?;
        let ldd32 = check_stride(OP, "dout", c, ldd)?;
        check_len(OP, "dx", dx, n * c)?;
        check_len(OP, "dout", dout, n * ldd)?;
        check_len(OP, "x", x, n * c)?;
        if let Some(dg) = &dgamma {
            check_len(OP, "dgamma", *dg, c)?;
        }
        check_len(OP, "gamma", gamma, c)?;
        check_len(OP, "rstd", rstd, n)?;
        if n == 0 {
            return Ok(());
        }
        let n32 = n as i32;
        let row = one_block_per_row(n, c);
        if ldd.is_multiple_of(4) && self.norm_backward_fuses([&*dx, dout, x, gamma], c) {
            let grid = reduce::fused_norm_grid(n, c, 1);
            let chunks = grid.grid_dim.0 as usize;
            let rpc = reduce::FUSED_NORM_ROWS as i32;
            // A frozen gain's kernel writes no partial sums (a null pointer).
            let mut partial = match dgamma {
                Some(_) => Some(self.alloc::<f32>(chunks * c)?),
                None => None,
            };
            let none = 0u64;
            let f = self.elem_function::<T>(ElemKernel::RmsnormBackwardFused)?;
            let mut b = self.stream.launch_builder(f);
            b.arg(dx);
            match partial.as_mut() {
                Some(p) => b.arg(p),
                None => b.arg(&none),
            };
            b.arg(dout)
                .arg(x)
                .arg(gamma)
                .arg(rstd)
                .arg(&n32)
                .arg(&c32)
                .arg(&ldd32)
                .arg(&rpc);
            // SAFETY: lengths checked above; block x covers FUSED_NORM_ROWS rows of the n,
            // writes partial row x (chunks x c values) if given and takes c f32 of shared
            // memory.
            unsafe { b.launch(grid) }?;
            return match (dgamma, &partial) {
                (Some(dg), Some(p)) => self.accumulate_partials(dg, p, chunks, c),
                _ => Ok(()),
            };
        }
        let f = self.elem_function::<T>(ElemKernel::RmsnormBackwardInput)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dx)
            .arg(dout)
            .arg(x)
            .arg(gamma)
            .arg(rstd)
            .arg(&c32)
            .arg(&ldd32);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(row) }?;
        let Some(dgamma) = dgamma else {
            return Ok(());
        };
        let (chunks, rows_per_chunk) = reduce::row_chunks(n);
        let rpc = rows_per_chunk as i32;
        let mut partial = self.alloc::<f32>(chunks * c)?;
        let f = self.elem_function::<T>(ElemKernel::RmsnormParamGradPartial)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut partial)
            .arg(dout)
            .arg(x)
            .arg(rstd)
            .arg(&n32)
            .arg(&c32)
            .arg(&ldd32)
            .arg(&rpc);
        // SAFETY: the partial buffer holds `chunks * c` values; the grid is `chunks` rows of
        // column blocks.
        unsafe { b.launch(reduce::column_grid(c, chunks)) }?;
        self.accumulate_partials(dgamma, &partial, chunks, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_whole_warps_sized_to_the_row() {
        let threads = |c| one_block_per_row(1, c).block_dim.0;
        assert_eq!(threads(576), 96);
        assert_eq!(threads(2048), 256);
        assert_eq!(threads(1), 32);
        assert_eq!(threads(1 << 20), 512);
    }
}

//! Layer normalisation on the GPU, residual add fused in; reference:
//! [`crate::engine::cpu::layernorm`]. Activations are `T` (f32, bf16 or f16), gamma and beta are
//! the parameters' compute copies in `T`, and the saved statistics and parameter gradients
//! are f32.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
    reduce,
};
use crate::engine::cpu::layernorm::EPS;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "layernorm",
    source: include_str!("layernorm.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::LayernormForward,
        ElemKernel::ResidualLayernormForward,
        ElemKernel::LayernormBackwardInput,
        ElemKernel::LayernormParamGradPartial,
        ElemKernel::LayernormBackwardFused,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

/// The forward's launch: one block per row of [`reduce::norm_threads`] threads (96 for GPT-2's
/// 768 channels), so that the kernel holds a row of up to 8 values a thread in registers.
fn forward_rows(n: usize, c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (reduce::norm_threads(c) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn one_block_per_row(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks the shared shape of a layernorm call and returns `c` as the kernels' int.
fn check_rows(op: &'static str, n: usize, c: usize) -> Result<i32> {
    as_i32(op, "rows", n)?;
    let c32 = as_i32(op, "channels", c)?;
    if c == 0 {
        return Err(CudaError::Shape {
            op,
            detail: "rows of width 0 have no mean".into(),
        });
    }
    Ok(c32)
}

impl CudaBackend {
    /// `out = layernorm(inp) * gamma + beta` per row of width `c`; writes `mean` and `rstd`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        beta: &CudaSlice<T>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        self.layernorm_forward_eps(out, mean, rstd, inp, gamma, beta, n, c, EPS)
    }

    /// [`Self::layernorm_forward`] with `eps` added to the variance.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_forward_eps<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        beta: &CudaSlice<T>,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "layernorm_forward";
        let c32 = check_rows(OP, n, c)?;
        check_len(OP, "out", out, n * c)?;
        check_len(OP, "inp", inp, n * c)?;
        check_len(OP, "mean", mean, n)?;
        check_len(OP, "rstd", rstd, n)?;
        check_len(OP, "gamma", gamma, c)?;
        check_len(OP, "beta", beta, c)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::LayernormForward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(mean)
            .arg(rstd)
            .arg(inp)
            .arg(gamma)
            .arg(beta)
            .arg(&c32)
            .arg(&eps);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(forward_rows(n, c)) }?;
        Ok(())
    }

    /// `sum = x + delta; out = layernorm(sum) * gamma + beta`, in one pass over the rows.
    #[allow(clippy::too_many_arguments)]
    pub fn residual_layernorm_forward<T: Elem>(
        &self,
        sum: &mut CudaSlice<T>,
        out: &mut CudaSlice<T>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        delta: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        beta: &CudaSlice<T>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        self.residual_layernorm_forward_eps(sum, out, mean, rstd, x, delta, gamma, beta, n, c, EPS)
    }

    /// [`Self::residual_layernorm_forward`] with `eps` added to the variance.
    #[allow(clippy::too_many_arguments)]
    pub fn residual_layernorm_forward_eps<T: Elem>(
        &self,
        sum: &mut CudaSlice<T>,
        out: &mut CudaSlice<T>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        delta: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        beta: &CudaSlice<T>,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "residual_layernorm_forward";
        let c32 = check_rows(OP, n, c)?;
        check_len(OP, "sum", sum, n * c)?;
        check_len(OP, "out", out, n * c)?;
        check_len(OP, "x", x, n * c)?;
        check_len(OP, "delta", delta, n * c)?;
        check_len(OP, "mean", mean, n)?;
        check_len(OP, "rstd", rstd, n)?;
        check_len(OP, "gamma", gamma, c)?;
        check_len(OP, "beta", beta, c)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::ResidualLayernormForward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(sum)
            .arg(out)
            .arg(mean)
            .arg(rstd)
            .arg(x)
            .arg(delta)
            .arg(gamma)
            .arg(beta)
            .arg(&c32)
            .arg(&eps);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(forward_rows(n, c)) }?;
        Ok(())
    }

    /// Backward: ACCUMULATES into `dinp` (the fused residual backward: pass the residual
    /// stream's incoming gradient as `dinp`), `dgamma` and `dbeta`.
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_backward<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        dgamma: &mut CudaSlice<f32>,
        dbeta: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        inp: &CudaSlice<T>,
        gamma: &CudaSlice<T>,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "layernorm_backward";
        let c32 = check_rows(OP, n, c)?;
        check_len(OP, "dinp", dinp, n * c)?;
        check_len(OP, "dout", dout, n * c)?;
        check_len(OP, "inp", inp, n * c)?;
        check_len(OP, "dgamma", dgamma, c)?;
        check_len(OP, "dbeta", dbeta, c)?;
        check_len(OP, "gamma", gamma, c)?;
        check_len(OP, "mean", mean, n)?;
        check_len(OP, "rstd", rstd, n)?;
        if n == 0 {
            return Ok(());
        }
        let n32 = n as i32;
        // The fused kernel holds a row in registers: at most two 4-value groups a thread of
        // whole warps (96 threads for 768 channels).
        if self.norm_backward_fuses([&*dinp, dout, inp, gamma], c) {
            let grid = reduce::fused_norm_grid(n, c, 2);
            let chunks = grid.grid_dim.0 as usize;
            let rpc = reduce::FUSED_NORM_ROWS as i32;
            let mut partial_gamma = self.alloc::<f32>(chunks * c)?;
            let mut partial_beta = self.alloc::<f32>(chunks * c)?;
            let f = self.elem_function::<T>(ElemKernel::LayernormBackwardFused)?;
            let mut b = self.stream.launch_builder(f);
            b.arg(dinp)
                .arg(&mut partial_gamma)
                .arg(&mut partial_beta)
                .arg(dout)
                .arg(inp)
                .arg(gamma)
                .arg(mean)
                .arg(rstd)
                .arg(&n32)
                .arg(&c32)
                .arg(&rpc);
            // SAFETY: lengths checked above; block x covers FUSED_NORM_ROWS rows of the n,
            // writes row x of both partials (chunks x c values each) and takes 2c f32 of
            // shared memory.
            unsafe { b.launch(grid) }?;
            return self.accumulate_partials_with(
                (dgamma, &partial_gamma),
                Some((dbeta, &partial_beta)),
                chunks,
                c,
            );
        }
        let (chunks, rows_per_chunk) = reduce::row_chunks(n);
        let rpc = rows_per_chunk as i32;
        let mut partial_gamma = self.alloc::<f32>(chunks * c)?;
        let mut partial_beta = self.alloc::<f32>(chunks * c)?;
        let f = self.elem_function::<T>(ElemKernel::LayernormBackwardInput)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dinp)
            .arg(dout)
            .arg(inp)
            .arg(gamma)
            .arg(mean)
            .arg(rstd)
            .arg(&c32);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(one_block_per_row(n)) }?;
        let f = self.elem_function::<T>(ElemKernel::LayernormParamGradPartial)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut partial_gamma)
            .arg(&mut partial_beta)
            .arg(dout)
            .arg(inp)
            .arg(mean)
            .arg(rstd)
            .arg(&n32)
            .arg(&c32)
            .arg(&rpc);
        // SAFETY: the partial buffers hold `chunks * c` values; the grid is `chunks` rows of
        // column blocks.
        unsafe { b.launch(reduce::column_grid(c, chunks)) }?;
        self.accumulate_partials_with(
            (dgamma, &partial_gamma),
            Some((dbeta, &partial_beta)),
            chunks,
            c,
        )
    }
}

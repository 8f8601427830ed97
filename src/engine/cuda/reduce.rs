//! Deterministic reductions on the GPU: column sums over rows (bias gradients, and the second
//! stage of the layernorm parameter gradients) and the gradient sum of squares with an
//! inf/NaN flag (the global norm for clipping and the loss scaler's overflow check).
//!
//! Both are two-stage with a fixed split of the work, and no float atomics, so a run repeats
//! bit for bit on the same GPU.

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32, check_len,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "reduce",
    source: include_str!("reduce.cu"),
    kernels: &[
        Kernel::AccumulatePartials,
        Kernel::SumSquaresPartial,
        Kernel::SumSquaresFinish,
    ],
    elem_kernels: &[ElemKernel::ColumnSumPartial],
    dtypes: ELEM_DTYPES,
};

const COLUMN_BLOCK: u32 = 256;
const ROWS_PER_CHUNK: usize = 64;
const SUMSQ_BLOCK: u32 = 512;
const SUMSQ_MAX_BLOCKS: usize = 1024;
/// Threads of the block that adds the partials (a multiple of 32, at most 1024).
const SUMSQ_FINISH_BLOCK: u32 = 1024;

/// The split of `n` rows into chunks for the first stage: (chunks, rows per chunk).
pub(super) fn row_chunks(n: usize) -> (usize, usize) {
    (n.div_ceil(ROWS_PER_CHUNK).max(1), ROWS_PER_CHUNK)
}

/// Bytes of the f32 partials a column reduction of `n` rows by `c` columns takes from the
/// driver outside the pool (bias gradients, norm parameter gradients), for the meta device.
pub fn column_partials_bytes(n: usize, c: usize) -> usize {
    row_chunks(n).0 * c * 4
}

/// Bytes a gradient-norm reduction over tensors of `lens` elements takes outside the pool:
/// its f64 partials, the f64 accumulator and the u32 non-finite flag.
pub fn sum_squares_scratch_bytes(lens: &[usize]) -> usize {
    let partials: usize = lens
        .iter()
        .filter(|&&n| n > 0)
        .map(|&n| n.div_ceil(SUMSQ_BLOCK as usize).clamp(1, SUMSQ_MAX_BLOCKS))
        .sum();
    8 * partials + 8 + 4
}

/// Grid of column blocks by row chunks.
pub(super) fn column_grid(c: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(COLUMN_BLOCK as usize) as u32, chunks as u32, 1),
        block_dim: (COLUMN_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// `acc[j] += sum_k partial[k, j]`, chunks added in order.
    pub(super) fn accumulate_partials(
        &self,
        acc: &mut CudaSlice<f32>,
        partial: &CudaSlice<f32>,
        chunks: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "accumulate_partials";
        check_len(OP, "acc", acc, c)?;
        check_len(OP, "partial", partial, chunks * c)?;
        let (chunks32, c32) = (as_i32(OP, "chunks", chunks)?, as_i32(OP, "c", c)?);
        let f = self.function(Kernel::AccumulatePartials)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(acc).arg(partial).arg(&chunks32).arg(&c32);
        // 32 columns a block, 32 lanes over the chunks (the kernel's ACC_LANES).
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; the kernel guards columns past `c`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `acc[j] += sum_i x[i, j]` over `n` rows of width `c` (the bias gradient).
    pub fn column_sum_accumulate<T: Elem>(
        &self,
        acc: &mut CudaSlice<f32>,
        x: &CudaSlice<T>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "column_sum";
        let (n32, c32) = (as_i32(OP, "rows", n)?, as_i32(OP, "columns", c)?);
        check_len(OP, "acc", acc, c)?;
        check_len(OP, "x", x, n * c)?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (chunks, rows_per_chunk) = row_chunks(n);
        let mut partial = self.alloc::<f32>(chunks * c)?;
        let f = self.elem_function::<T>(ElemKernel::ColumnSumPartial)?;
        let rpc = rows_per_chunk as i32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut partial).arg(x).arg(&n32).arg(&c32).arg(&rpc);
        // SAFETY: `partial` holds `chunks * c` values; `x` holds `n * c`.
        unsafe { b.launch(column_grid(c, chunks)) }?;
        self.accumulate_partials(acc, &partial, chunks, c)
    }

    /// `acc[0] += sum(x^2)` over the first `n` values, in f64, and `nonfinite[0] = 1` if any
    /// value is inf or NaN (it is never cleared here, so one flag can cover many tensors).
    pub fn sum_squares_accumulate(
        &self,
        acc: &mut CudaSlice<f64>,
        nonfinite: &mut CudaSlice<u32>,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        self.sum_squares_many(acc, nonfinite, &[(x, n)])
    }

    /// `acc[0] +=` the sum of squares of the first `n` values of every `(x, n)`, in f64, with
    /// one partial buffer and one final reduction for all of them (a gradient norm over a
    /// model's 148 tensors is then 149 launches, not 296 and 148 allocations); the flag as in
    /// [`Self::sum_squares_accumulate`]. The order of the sums depends only on the sizes, so
    /// the result is the same on every run.
    pub fn sum_squares_many(
        &self,
        acc: &mut CudaSlice<f64>,
        nonfinite: &mut CudaSlice<u32>,
        xs: &[(&CudaSlice<f32>, usize)],
    ) -> Result<()> {
        const OP: &str = "sum_squares";
        check_len(OP, "acc", acc, 1)?;
        check_len(OP, "nonfinite", nonfinite, 1)?;
        for &(x, n) in xs {
            check_len(OP, "x", x, n)?;
        }
        // Each tensor's block count depends on its size only.
        let blocks: Vec<usize> = xs
            .iter()
            .map(|&(_, n)| n.div_ceil(SUMSQ_BLOCK as usize).clamp(1, SUMSQ_MAX_BLOCKS))
            .collect();
        let total: usize = xs
            .iter()
            .zip(&blocks)
            .filter(|((_, n), _)| *n > 0)
            .map(|(_, b)| b)
            .sum();
        if total == 0 {
            return Ok(());
        }
        let mut partial = self.alloc::<f64>(total)?;
        let mut at = 0;
        for (&(x, n), &b) in xs.iter().zip(&blocks) {
            if n == 0 {
                continue;
            }
            let mut slot = partial.slice_mut(at..at + b);
            at += b;
            let n64 = n as i64;
            let f = self.function(Kernel::SumSquaresPartial)?;
            let mut l = self.stream.launch_builder(f);
            l.arg(&mut slot).arg(&mut *nonfinite).arg(x).arg(&n64);
            let cfg = LaunchConfig {
                grid_dim: (b as u32, 1, 1),
                block_dim: (SUMSQ_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `slot` holds one value per block; `x` holds `n`.
            unsafe { l.launch(cfg) }?;
        }
        let total32 = as_i32(OP, "partial sums", total)?;
        let f = self.function(Kernel::SumSquaresFinish)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(acc).arg(&partial).arg(&total32);
        // SAFETY: one block reads `total` partials and thread 0 writes `acc[0]`.
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (SUMSQ_FINISH_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { l.launch(one_block) }?;
        Ok(())
    }
}

//! Deterministic reductions on the GPU: column sums over rows (bias gradients, and the second
//! stage of the layernorm parameter gradients) and the gradient sum of squares with an
//! inf/NaN flag (the global norm for clipping and the loss scaler's overflow check).
//!
//! Both are two-stage with a fixed split of the work, and no float atomics, so a run repeats
//! bit for bit on the same GPU.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32,
    check_len, raw_ptr,
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
/// Values a thread of the sum of squares takes at least (four 4-value accesses): fewer
/// blocks, each with enough work to outweigh its start and its reduction. At one value a
/// thread, a gradient norm over SmolLM2-135M's tensors ran 216k blocks.
const SUMSQ_PER_THREAD: usize = 16;

/// Blocks of the sum of squares over a tensor of `n` values (from its size alone, so the
/// order of the sums is too).
fn sum_squares_blocks(n: usize) -> usize {
    n.div_ceil(SUMSQ_BLOCK as usize * SUMSQ_PER_THREAD)
        .clamp(1, SUMSQ_MAX_BLOCKS)
}
/// Threads of the block that adds the partials (a multiple of 32, at most 1024).
const SUMSQ_FINISH_BLOCK: u32 = 1024;

/// The split of `n` rows into chunks for the first stage: (chunks, rows per chunk).
pub(super) fn row_chunks(n: usize) -> (usize, usize) {
    (n.div_ceil(ROWS_PER_CHUNK).max(1), ROWS_PER_CHUNK)
}

/// Rows a block of a fused norm backward (RMSNorm, layernorm) sums its parameter gradients
/// over: fewer than [`row_chunks`]'s, so that SmolLM2's 16384 rows make 1024 blocks, enough
/// to keep memory busy while each block waits on its rows' reductions.
pub(super) const FUSED_NORM_ROWS: usize = 16;

/// Whether a norm backward over rows of `c` channels holds each row in registers (and fuses
/// its parameter gradients): `c` a multiple of 4 with at most 8 values for each of
/// `norm_threads(c)` threads. The buffers must also be aligned to 4 values, as the pool's are.
pub(super) fn norm_row_held(c: usize) -> bool {
    c.is_multiple_of(4) && c <= 8 * norm_threads(c)
}

/// Rows a block of a fused norm backward works on at once (the kernels' blockDim.y, at most
/// their RMS_BWD_LANES and LN_BWD_LANES of 4): up to 512 threads, so that the registers that
/// hold the rows suffice (four lanes of 256 threads did not launch). Rows of 256 threads or
/// more take one lane: at the kernels' 80 registers a thread one block of 512 fits an SM (a
/// quarter of its warps, Nsight Compute on Llama-3.2-1B's 2048 channels) where three of 256 do.
fn fused_lanes(threads: usize) -> u32 {
    if threads >= 256 {
        1
    } else {
        (512 / threads).clamp(1, 4) as u32
    }
}

/// Launch shape of a fused norm backward over rows of `c` channels: a block per chunk of
/// [`FUSED_NORM_ROWS`] of the `n` rows, [`norm_threads`] over a row by [`fused_lanes`] rows,
/// and `tensors` rows of `c` f32 in shared memory for the lanes' parameter-gradient sums.
pub(super) fn fused_norm_grid(n: usize, c: usize, tensors: usize) -> LaunchConfig {
    let threads = norm_threads(c);
    LaunchConfig {
        grid_dim: (n.div_ceil(FUSED_NORM_ROWS) as u32, 1, 1),
        block_dim: (threads as u32, fused_lanes(threads), 1),
        shared_mem_bytes: (tensors * c * 4) as u32,
    }
}

impl CudaBackend {
    /// Whether the fused norm backward takes rows of `c` channels from `bufs`: rows it holds
    /// ([`norm_row_held`]) and every buffer aligned to a group of 4 values.
    pub(super) fn norm_backward_fuses<T>(&self, bufs: [&CudaSlice<T>; 4], c: usize) -> bool {
        let group = 4 * std::mem::size_of::<T>() as u64;
        norm_row_held(c) && bufs.iter().all(|b| raw_ptr(b, &self.stream) % group == 0)
    }
}

/// Threads over a norm's row: whole warps of about eight values each, at most 512.
pub(super) fn norm_threads(c: usize) -> usize {
    c.div_ceil(8).next_multiple_of(32).clamp(32, 512)
}

/// Bytes of f32 partials (`tensors` of them: 1 for RMSNorm's gain, 2 for layernorm's gain
/// and bias) a norm backward over `n` rows of `c` channels takes outside the pool.
pub fn norm_partials_bytes(n: usize, c: usize, tensors: usize) -> usize {
    let chunks = match norm_row_held(c) {
        true => n.div_ceil(FUSED_NORM_ROWS).max(1),
        false => row_chunks(n).0,
    };
    tensors * chunks * c * 4
}

/// Bytes of the f32 partials a column reduction of `n` rows by `c` columns takes from the
/// driver outside the pool (bias gradients, norm parameter gradients), for the meta device.
pub fn column_partials_bytes(n: usize, c: usize) -> usize {
    row_chunks(n).0 * c * 4
}

/// Bytes a gradient-norm reduction over tensors of `lens` elements takes outside the pool:
/// its table of tensors, its f64 partials, the f64 accumulator and the u32 non-finite flag.
pub fn sum_squares_scratch_bytes(lens: &[usize]) -> usize {
    let nonempty = lens.iter().filter(|&&n| n > 0);
    let partials: usize = nonempty.clone().map(|&n| sum_squares_blocks(n)).sum();
    32 * nonempty.count() + 8 * partials + 8 + 4
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
        self.accumulate_partials_with((acc, partial), None, chunks, c)
    }

    /// [`Self::accumulate_partials`] for `first` and, in the same launch, `second` of the same
    /// shape (a layernorm's gain and bias gradients).
    pub(super) fn accumulate_partials_with(
        &self,
        first: (&mut CudaSlice<f32>, &CudaSlice<f32>),
        second: Option<(&mut CudaSlice<f32>, &CudaSlice<f32>)>,
        chunks: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "accumulate_partials";
        let (acc, partial) = first;
        check_len(OP, "acc", acc, c)?;
        check_len(OP, "partial", partial, chunks * c)?;
        // The kernel reads the second pair only in blocks with blockIdx.y = 1.
        let (tensors, acc1, partial1) = match &second {
            Some((a, p)) => {
                check_len(OP, "second acc", *a, c)?;
                check_len(OP, "second partial", *p, chunks * c)?;
                (2, raw_ptr(*a, &self.stream), raw_ptr(*p, &self.stream))
            }
            None => (1, 0u64, 0u64),
        };
        let (chunks32, c32) = (as_i32(OP, "chunks", chunks)?, as_i32(OP, "c", c)?);
        let f = self.function(Kernel::AccumulatePartials)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(acc)
            .arg(partial)
            .arg(&acc1)
            .arg(&partial1)
            .arg(&chunks32)
            .arg(&c32);
        // 32 columns a block, 32 lanes over the chunks (the kernel's ACC_LANES), a row of
        // blocks a tensor.
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(32) as u32, tensors, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above (the second pair's too, when there is one); the kernel
        // guards columns past `c`; the second pair is borrowed until the launch is queued and
        // its buffers outlive the launch on this stream.
        unsafe { b.launch(cfg) }?;
        let _ = second;
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
        // SAFETY: `partial` holds `chunks * c` values; `x` holds `n * c`. A thread takes four
        // columns (the kernel's column_sum_partial).
        unsafe { b.launch(column_grid(c.div_ceil(4), chunks)) }?;
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

    /// `acc[0] +=` the sum of squares of the first `n` values of every `(x, n)`, in f64: one
    /// launch for the partial sums of all of them and one for their total (a gradient norm
    /// over a model's 148 tensors was 149 launches, most too small to fill the GPU); the flag
    /// as in [`Self::sum_squares_accumulate`]. The order of the sums depends only on the sizes, so
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
        // Each tensor's block count depends on its size only; `total` counts them all.
        let mut table: Vec<u64> = Vec::with_capacity(4 * xs.len());
        let mut total = 0;
        for &(x, n) in xs.iter().filter(|&&(_, n)| n > 0) {
            let b = sum_squares_blocks(n);
            table.extend([raw_ptr(x, &self.stream), n as u64, total as u64, b as u64]);
            total += b;
        }
        if total == 0 {
            return Ok(());
        }
        let tensors = as_i32(OP, "tensors", table.len() / 4)?;
        let grid_blocks = u32::try_from(total).map_err(|_| CudaError::Shape {
            op: OP,
            detail: format!("{total} blocks exceed the grid"),
        })?;
        let table = self.upload(&table)?;
        let mut partial = self.alloc::<f64>(total)?;
        let f = self.function(Kernel::SumSquaresPartial)?;
        let mut l = self.stream.launch_builder(f);
        l.arg(&mut partial)
            .arg(&mut *nonfinite)
            .arg(&table)
            .arg(&tensors);
        let cfg = LaunchConfig {
            grid_dim: (grid_blocks, 1, 1),
            block_dim: (SUMSQ_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the table lists buffers of at least `n` values (checked above) and their
        // block counts, which add up to `total`, the partials' length and the grid.
        unsafe { l.launch(cfg) }?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_norm_blocks_stay_within_512_threads_and_book_what_they_allocate() {
        // SmolLM2's 576 channels: 96 threads by 4 rows, 1024 chunks of 16 rows.
        let g = fused_norm_grid(16384, 576, 1);
        assert_eq!((g.grid_dim.0, g.block_dim.0, g.block_dim.1), (1024, 96, 4));
        assert_eq!(g.shared_mem_bytes, 576 * 4);
        // Llama-3.2-1B's 2048: 256 threads by 1 row (three such blocks an SM); 4096: 512 by 1.
        let g = fused_norm_grid(70, 2048, 2);
        assert_eq!((g.grid_dim.0, g.block_dim.0, g.block_dim.1), (5, 256, 1));
        assert_eq!(g.shared_mem_bytes, 2 * 2048 * 4);
        assert_eq!(fused_norm_grid(1, 4096, 1).block_dim.1, 1);
        // Rows it cannot hold take the two-kernel path and its 64-row chunks.
        assert!(norm_row_held(576) && norm_row_held(4096));
        assert!(!norm_row_held(1001) && !norm_row_held(8192));
        assert_eq!(norm_partials_bytes(16384, 576, 1), 1024 * 576 * 4);
        assert_eq!(norm_partials_bytes(100, 1001, 2), 2 * 2 * 1001 * 4);
    }

    #[test]
    fn the_gradient_norm_gives_each_thread_at_least_sixteen_values() {
        assert_eq!(sum_squares_blocks(1), 1);
        assert_eq!(sum_squares_blocks(512 * 16), 1);
        assert_eq!(sum_squares_blocks(512 * 16 + 1), 2);
        assert_eq!(sum_squares_blocks(1 << 30), SUMSQ_MAX_BLOCKS);
        // The table's entry, the partials, the accumulator and the flag.
        assert_eq!(sum_squares_scratch_bytes(&[0, 10]), 32 + 8 + 8 + 4);
    }
}

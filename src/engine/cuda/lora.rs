//! A LoRA adapter's two backward products from one read of the output gradient (lora.cu):
//! `dH = s dy B` and `dB = beta dB + s dy^T H`, on column blocks of wider matrices. Reference:
//! one call of [`crate::engine::cpu::gemm::sgemm_strided`] per product. The launcher answers
//! `Ok(false)` for a call the kernels do not take (f32, a rank other than
//! [`LORA_FUSED_RANKS`], a GPU older than sm_80 or short of shared memory, an empty product),
//! and the caller runs the two products as GEMMs instead.

use super::{
    CudaBackend, CudaError, Elem, ElemKernel, Program, Result, as_i32, check_len, elementwise_grid,
    raw_ptr,
};
use crate::engine::{DType, LoraGradShape, MatrixView};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "lora",
    source: concat!(include_str!("attention_tc.cu"), include_str!("lora.cu")),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::LoraGradsPartialR8,
        ElemKernel::LoraGradsPartialR16,
        ElemKernel::LoraGradsPartialR32,
        ElemKernel::LoraGradsPartialR64,
        ElemKernel::LoraGradsFinish,
    ],
    dtypes: &[DType::BF16, DType::F16],
};

/// The ranks the kernels take.
pub const LORA_FUSED_RANKS: [usize; 4] = [8, 16, 32, 64];

/// Whether the kernels take an adapter of rank `rank` with operands of `dtype`, on a GPU that
/// has them (sm_80 or newer with the shared memory: [`CudaBackend::lora_grads_fit`]).
pub fn lora_kernels_take(dtype: DType, rank: usize) -> bool {
    dtype != DType::F32 && LORA_FUSED_RANKS.contains(&rank)
}

/// Rows of a sub-tile (lora.cu's LORA_TR); a stripe is a multiple of it.
const TILE_ROWS: usize = 32;
/// Threads of a partial block (LORA_WARPS warps).
const BLOCK: u32 = 256;
/// The finishing kernel's threads a block.
const FINISH_BLOCK: u32 = 256;
/// The blocks a call's grid aims for at `rank`: two an SM of an H100 or H200 (132 SMs) where
/// two fit (ranks 8 and 16 on sm_90: their shared memory and registers), so that one block's
/// barriers and products overlap the other's loads; else one an SM. The grid of chunks x
/// stripes then runs in one wave. A fixed count rather than the GPU's own, so that the
/// workspace is a function of the shape alone and a meta pass books what the GPU allocates;
/// elsewhere (an A100's 108 SMs) the last blocks take a second wave.
const fn target_blocks(rank: usize) -> usize {
    if rank <= 16 { 264 } else { 132 }
}
/// The fewest rows a stripe takes where there are rows enough: each stripe adds a dB partial
/// (cols x rank f32) to the workspace, which for one narrow chunk (a key or value projection)
/// would otherwise rival dy itself, and a block of a few sub-tiles spends its time filling its
/// pipeline.
const MIN_STRIPE_ROWS: usize = 256;

/// The most columns a block owns (LoraShape::chunk).
const fn max_chunk(rank: usize) -> usize {
    if rank == 64 { 256 } else { 512 }
}

/// Dynamic shared memory of the partial kernel at `rank` (LoraShape::bytes): three buffers of a
/// dy sub-tile and H's rows beside it (rows padded by 8 elements), then the f32 sums of
/// product 1's four column groups.
const fn shared_bytes(rank: usize) -> usize {
    let stage = TILE_ROWS * ((max_chunk(rank) + 8) + (rank + 8));
    3 * stage * 2 + 4 * TILE_ROWS * rank * 4
}

/// How a call's work is split: `chunks` blocks of `chunk` columns (a multiple of 16, the
/// last one shorter) by `stripes` stripes of `stripe_rows` rows (a multiple of 32, the last
/// one shorter). Each block writes a partial dH for its rows and a partial dB for its columns,
/// so the f32 workspace holds `chunks` dH's and `stripes` dB's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraGrid {
    pub chunk: usize,
    pub chunks: usize,
    pub stripe_rows: usize,
    pub stripes: usize,
}

impl LoraGrid {
    /// Chunks as wide as the kernel allows (workspace traffic for dH falls with the width)
    /// and of even widths; then as many stripes as fill [`target_blocks`] with them, of at
    /// least [`MIN_STRIPE_ROWS`] rows where the shape has them.
    pub fn new(s: LoraGradShape) -> LoraGrid {
        let (rows, cols) = (s.rows.max(1), s.cols.max(1));
        let chunk = cols
            .div_ceil(cols.div_ceil(max_chunk(s.rank)))
            .next_multiple_of(16);
        let chunks = cols.div_ceil(chunk);
        let want = (target_blocks(s.rank) / chunks)
            .min(rows.div_ceil(MIN_STRIPE_ROWS))
            .clamp(1, rows.div_ceil(TILE_ROWS));
        let stripe_rows = rows.div_ceil(want).next_multiple_of(TILE_ROWS);
        LoraGrid {
            chunk,
            chunks,
            stripe_rows,
            stripes: rows.div_ceil(stripe_rows),
        }
    }

    /// f32 elements of the workspace for `s`: the dH partials, then the dB partials when
    /// there is a dB.
    pub fn workspace_len(&self, s: LoraGradShape, with_db: bool) -> usize {
        let db = if with_db { self.stripes * s.cols } else { 0 };
        (self.chunks * s.rows + db) * s.rank
    }
}

impl CudaBackend {
    /// Whether the kernels take an adapter of rank `rank` with operands of `dtype` on this GPU
    /// (the shape aside: any rows, columns, offsets and strides).
    pub fn lora_grads_fit(&self, dtype: DType, rank: usize) -> bool {
        lora_kernels_take(dtype, rank)
            && self.info.arch() >= 80
            && shared_bytes(rank) <= self.info.shared_memory_per_block_optin
    }

    /// `dh[:, view] = scale * dy[:, view] @ b` and, with `db`, `db = scale * dy[:, view]^T @
    /// h[:, view]` added to `db` or overwriting it (`db.1`): one read of dy, f32 sums in a fixed
    /// order (the same bits on every run), dH rounded once to `T`. `views` are dy's and the one
    /// that `h` and `dh` share (`[rows, R]` with the adapter at column `offset`); `b` is packed
    /// `[cols, rank]`. `workspace` holds at least [`LoraGrid::workspace_len`] f32 values, which
    /// it overwrites. `Ok(false)`: not taken (see the module's note), nothing written.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_grads<T: Elem>(
        &self,
        shape: LoraGradShape,
        scale: f32,
        views: [MatrixView; 2],
        dy: &CudaSlice<T>,
        b: &CudaSlice<T>,
        h: &CudaSlice<T>,
        dh: &mut CudaSlice<T>,
        db: Option<(&mut CudaSlice<f32>, bool)>,
        workspace: &mut CudaSlice<f32>,
    ) -> Result<bool> {
        const OP: &str = "lora_grads";
        let LoraGradShape { rows, cols, rank } = shape;
        if !self.lora_grads_fit(T::DTYPE, rank) || rows == 0 || cols == 0 {
            return Ok(false);
        }
        let [dy_view, h_view] = views;
        shape
            .check_views(
                views,
                [dy.len(), b.len(), h.len(), dh.len()],
                db.as_ref().map(|(d, _)| d.len()),
            )
            .map_err(|detail| CudaError::Shape { op: OP, detail })?;
        let grid = LoraGrid::new(shape);
        check_len(
            OP,
            "workspace",
            workspace,
            grid.workspace_len(shape, db.is_some()),
        )?;
        let kernel = match rank {
            8 => ElemKernel::LoraGradsPartialR8,
            16 => ElemKernel::LoraGradsPartialR16,
            32 => ElemKernel::LoraGradsPartialR32,
            _ => ElemKernel::LoraGradsPartialR64,
        };
        let (ldy, ldh) = (
            as_i32(OP, "dy's row stride", dy_view.ld)?,
            as_i32(OP, "h's row stride", h_view.ld)?,
        );
        let (rows32, cols32, rank32) = (
            as_i32(OP, "rows", rows)?,
            as_i32(OP, "columns", cols)?,
            as_i32(OP, "rank", rank)?,
        );
        let (chunk, chunks) = (
            as_i32(OP, "chunk", grid.chunk)?,
            as_i32(OP, "chunks", grid.chunks)?,
        );
        let (stripe_rows, stripes) = (
            as_i32(OP, "stripe rows", grid.stripe_rows)?,
            as_i32(OP, "stripes", grid.stripes)?,
        );
        let elem = std::mem::size_of::<T>() as u64;
        let at = |p: u64, view: MatrixView| p + view.offset as u64 * elem;
        let dy_p = at(raw_ptr(dy, &self.stream), dy_view);
        let h_p = at(raw_ptr(h, &self.stream), h_view);
        let dh_p = at(raw_ptr(&*dh, &self.stream), h_view);
        let b_p = raw_ptr(b, &self.stream);
        let ws = raw_ptr(&*workspace, &self.stream);
        // The dB partials follow the dH partials; null pointers say there is no dB.
        let (ws_b, db_p, add) = match &db {
            Some((d, overwrite)) => (
                ws + (grid.chunks * rows * rank * 4) as u64,
                raw_ptr(&**d, &self.stream),
                i32::from(!*overwrite),
            ),
            None => (0, 0, 0),
        };

        let shared = shared_bytes(rank);
        let func = self.elem_function::<T>(kernel)?;
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (grid.chunks as u32, grid.stripes as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let mut l = self.stream.launch_builder(func);
        l.arg(&ws)
            .arg(&ws_b)
            .arg(&dy_p)
            .arg(&ldy)
            .arg(&b_p)
            .arg(&h_p)
            .arg(&ldh)
            .arg(&rows32)
            .arg(&cols32)
            .arg(&stripe_rows)
            .arg(&chunk);
        // SAFETY: the pointers are the buffers' (offset by their views), whose lengths cover
        // every element the views place (checked above), and the workspace holds the partials
        // of the grid (checked above); the kernel reads dy, b and h at rows below `rows` and
        // columns below `cols` (or `rank`) only, and writes the workspace alone; the shared
        // memory is the layout's (lora.cu traps on less); `dh` and `db` are not touched here.
        unsafe { l.launch(cfg) }?;

        let outputs = rows * rank + if db.is_some() { cols * rank } else { 0 };
        let func = self.elem_function::<T>(ElemKernel::LoraGradsFinish)?;
        let mut l = self.stream.launch_builder(func);
        l.arg(&dh_p)
            .arg(&ldh)
            .arg(&db_p)
            .arg(&ws)
            .arg(&rows32)
            .arg(&cols32)
            .arg(&rank32)
            .arg(&chunks)
            .arg(&stripes)
            .arg(&scale)
            .arg(&add);
        // SAFETY: `dh` (a &mut, distinct from the inputs) holds `rows` rows of `rank` columns
        // where its view places them, `db` (a &mut) `cols * rank` values (both checked above);
        // the kernel writes those elements only and reads the workspace the first kernel wrote
        // (in stream order).
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (elementwise_grid(outputs, FINISH_BLOCK), 1, 1),
                block_dim: (FINISH_BLOCK, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rows: usize, cols: usize, rank: usize) -> LoraGradShape {
        LoraGradShape { rows, cols, rank }
    }

    #[test]
    fn grids_fill_the_target_with_even_chunks() {
        // Llama-3.2-1B's gate projection at 8 x 1024 tokens: 16 chunks of 512, 16 stripes of
        // 512 rows; 16 MiB of workspace against 128 MiB of dy.
        let s = shape(8192, 8192, 16);
        let g = LoraGrid::new(s);
        assert_eq!(
            g,
            LoraGrid {
                chunk: 512,
                chunks: 16,
                stripe_rows: 512,
                stripes: 16
            }
        );
        assert_eq!(g.workspace_len(s, true) * 4, 16 << 20);
        assert_eq!(g.workspace_len(s, false) * 4, 8 << 20);
        // SmolLM2-135M's 576 columns: two chunks of 288 rather than 512 and 64.
        let g = LoraGrid::new(shape(16384, 576, 16));
        assert_eq!(
            (g.chunk, g.chunks, g.stripe_rows, g.stripes),
            (288, 2, 256, 64)
        );
        // A key projection's 512 columns: one chunk, stripes of no fewer than 256 rows.
        let g = LoraGrid::new(shape(8192, 512, 16));
        assert_eq!(
            (g.chunk, g.chunks, g.stripe_rows, g.stripes),
            (512, 1, 256, 32)
        );
        // Rank 64 takes chunks of 256; few rows take one stripe of whole sub-tiles.
        let g = LoraGrid::new(shape(20, 1001, 64));
        assert_eq!(
            (g.chunk, g.chunks, g.stripe_rows, g.stripes),
            (256, 4, 32, 1)
        );
    }

    #[test]
    fn every_grid_covers_its_shape_within_the_kernel_limits() {
        for rank in LORA_FUSED_RANKS {
            for rows in [1, 31, 32, 33, 1000, 8192, 16384, 100_000] {
                for cols in [1, 15, 16, 17, 192, 576, 1001, 2048, 8192, 70_000] {
                    let g = LoraGrid::new(shape(rows, cols, rank));
                    assert!(g.chunk.is_multiple_of(16) && g.chunk <= max_chunk(rank));
                    assert!(g.chunks * g.chunk >= cols && (g.chunks - 1) * g.chunk < cols);
                    assert!(g.stripe_rows.is_multiple_of(TILE_ROWS));
                    assert!(g.stripes * g.stripe_rows >= rows);
                    assert!((g.stripes - 1) * g.stripe_rows < rows);
                    assert!(g.stripes <= 65_535);
                }
            }
        }
    }

    #[test]
    fn shared_memory_fits_sm80_and_sm90() {
        // sm_80 lets a block opt in to 163 KiB, sm_90 to 227 KiB.
        for rank in LORA_FUSED_RANKS {
            assert!(shared_bytes(rank) <= 163 << 10, "rank {rank}");
        }
        assert_eq!(shared_bytes(16), 3 * 32 * (520 + 24) * 2 + 4 * 32 * 16 * 4);
    }
}

//! Low-rank adapters' outputs on tensor cores, every adapter of a layer in one launch:
//! `y[:, block] = beta * y[:, block] + scale * H[:, k0..k0 + r] B^T` (see `lora_outputs.cu`).
//! Reference: the per-adapter products of [`crate::nn::lora`] through
//! [`crate::engine::cpu::gemm`]. The launcher answers `Ok(false)` for a call the kernel does
//! not take (f32, an older GPU, a rank or column block off the kernel's multiples, more
//! adapters than it holds), and the caller runs those products instead.

use super::{CudaBackend, CudaError, Elem, ElemKernel, Program, Result, as_i32, raw_ptr};
use crate::engine::DType;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "lora_outputs",
    source: concat!(
        include_str!("attention_tc.cu"),
        include_str!("lora_outputs.cu"),
        "\nLORA_OUTPUTS_ENTRY_POINT(TcBf16, bf16)\nLORA_OUTPUTS_ENTRY_POINT(TcF16, f16)\n",
    ),
    kernels: &[],
    elem_kernels: &[ElemKernel::LoraOutputs],
    dtypes: &[DType::BF16, DType::F16],
};

/// Adapters one launch holds (the kernel's LO_MAX_ADAPTERS).
pub const LORA_OUTPUTS_MAX: usize = 8;
/// Rows and columns of a block's tile (LO_ROWS, LO_COLS).
const TILE_ROWS: usize = 64;
const TILE_COLS: usize = 128;
/// Blocks an SM holds (the kernel's launch bound).
const BLOCKS_PER_SM: usize = 3;

/// Where one adapter's output goes: its columns of `y` and of `H`, and its scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterColumns {
    /// First column of `y` and how many (`B` has this many rows).
    pub col0: usize,
    pub cols: usize,
    /// First column of `H` and the rank (`B`'s row length).
    pub k0: usize,
    pub rank: usize,
    pub scale: f32,
}

/// The kernel's `LoraOutAdapter`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct KernelAdapter {
    b: u64,
    col0: i32,
    cols: i32,
    k0: i32,
    rank: i32,
    first_tile: i32,
    scale: f32,
}

/// The kernel's `LoraOutDims`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelDims {
    y: u64,
    h: u64,
    rows: i32,
    ld_y: i32,
    ld_h: i32,
    count: i32,
    accumulate: i32,
    pad: i32,
    adapters: [KernelAdapter; LORA_OUTPUTS_MAX],
}

// SAFETY: `repr(C)` structs of device pointers (u64), 32-bit ints and f32 in the order and
// alignment of the CUDA structs (every pointer on 8 bytes: KernelAdapter is 32 bytes, the
// adapters start 40 bytes into KernelDims).
unsafe impl DeviceRepr for KernelDims {}

/// Whether adapters of these columns and a `y` and `H` of these row strides have the
/// kernel's shapes (16-bit operands, sm_80 and the buffers' lengths aside).
pub fn lora_outputs_fit(adapters: &[AdapterColumns], ld_y: usize, ld_h: usize) -> bool {
    (1..=LORA_OUTPUTS_MAX).contains(&adapters.len())
        && ld_y.is_multiple_of(4)
        && ld_h.is_multiple_of(2)
        && adapters.iter().all(|a| {
            a.rank > 0
                && a.rank <= 64
                && a.rank.is_multiple_of(16)
                && a.cols > 0
                && a.col0.is_multiple_of(4)
                && a.cols.is_multiple_of(4)
                && a.col0 + a.cols <= ld_y
                && a.k0 + a.rank <= ld_h
        })
}

impl CudaBackend {
    /// `y[:, a.col0..][..a.cols] = scale * H[:, a.k0..][..a.rank] B_a^T`, plus the old values
    /// with `accumulate`, for every adapter `a` (its `B` in `bs`, `[cols, rank]`); `y` holds
    /// `rows` rows of `ld_y`, `h` rows of `ld_h`. `Ok(false)`: not taken, nothing written.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_outputs<T: Elem>(
        &self,
        y: &mut CudaSlice<T>,
        h: &CudaSlice<T>,
        bs: &[&CudaSlice<T>],
        adapters: &[AdapterColumns],
        (rows, ld_y, ld_h): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<bool> {
        const OP: &str = "lora_outputs";
        if T::DTYPE == DType::F32
            || self.info.arch() < 80
            || bs.len() != adapters.len()
            || !lora_outputs_fit(adapters, ld_y, ld_h)
            || !raw_ptr(y, &self.stream).is_multiple_of(8)
        {
            return Ok(false);
        }
        if rows == 0 {
            return Ok(true);
        }
        let short = |what: &str, have: usize, need: usize| CudaError::Shape {
            op: OP,
            detail: format!("{what} holds {have} values, {need} needed"),
        };
        if y.len() < rows * ld_y {
            return Err(short("y", y.len(), rows * ld_y));
        }
        if h.len() < rows * ld_h {
            return Err(short("H", h.len(), rows * ld_h));
        }
        let mut kernel = [KernelAdapter::default(); LORA_OUTPUTS_MAX];
        let mut tiles = 0usize;
        for ((k, a), b) in kernel.iter_mut().zip(adapters).zip(bs) {
            if b.len() < a.cols * a.rank {
                return Err(short("B", b.len(), a.cols * a.rank));
            }
            *k = KernelAdapter {
                b: raw_ptr(*b, &self.stream),
                col0: as_i32(OP, "col0", a.col0)?,
                cols: as_i32(OP, "cols", a.cols)?,
                k0: as_i32(OP, "k0", a.k0)?,
                rank: as_i32(OP, "rank", a.rank)?,
                first_tile: as_i32(OP, "tiles", tiles)?,
                scale: a.scale,
            };
            tiles += a.cols.div_ceil(TILE_COLS);
        }
        // One wave: as many blocks of each column tile as fit beside the others, each walking
        // its share of the row tiles (its B tile loaded once).
        let slots = BLOCKS_PER_SM * self.info.sm_count as usize;
        let row_blocks = (slots / tiles).clamp(1, rows.div_ceil(TILE_ROWS).min(65_535));
        let dims = KernelDims {
            y: raw_ptr(y, &self.stream),
            h: raw_ptr(h, &self.stream),
            rows: as_i32(OP, "rows", rows)?,
            ld_y: as_i32(OP, "ld_y", ld_y)?,
            ld_h: as_i32(OP, "ld_h", ld_h)?,
            count: adapters.len() as i32,
            accumulate: i32::from(accumulate),
            pad: 0,
            adapters: kernel,
        };
        let cfg = LaunchConfig {
            grid_dim: (as_i32(OP, "tiles", tiles)? as u32, row_blocks as u32, 1),
            block_dim: ((TILE_ROWS / 16 * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let func = self.elem_function::<T>(ElemKernel::LoraOutputs)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(&dims);
        // SAFETY: `y` holds `rows * ld_y` values and `h` `rows * ld_h`, each `B` its
        // `cols * rank` (checked above); every adapter's columns lie inside a row of each
        // (lora_outputs_fit), its 8-byte accesses of y on 8 bytes (y's start, ld_y and col0
        // multiples of 4 values) and its 4-byte loads of H and B on 4 bytes (ld_h, k0 and the
        // rank even); each block writes only its own tile of its adapter's columns; `y` is a
        // &mut, distinct from `h` and the `B`s.
        unsafe { b.launch(cfg) }?;
        Ok(true)
    }
}

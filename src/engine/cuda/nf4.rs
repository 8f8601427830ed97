//! NF4 dequantisation on the GPU; reference: [`crate::engine::cpu::nf4::dequantize`], layout:
//! [`crate::engine::quant::nf4`]. Output `T` is f32, bf16 or f16, equal to the CPU's bit for
//! bit.

use super::{CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, check_len};
use crate::engine::cpu::nf4::{ABSMAX_BLOCK, BLOCK_BYTES, NF4_CODE, blocks};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "nf4",
    source: include_str!("nf4.cu"),
    kernels: &[],
    elem_kernels: &[ElemKernel::Nf4Dequantize],
    dtypes: ELEM_DTYPES,
};

/// The device buffers of one NF4 weight, as [`crate::engine::quant::Nf4Weight`] holds them.
pub struct Nf4Device<'a> {
    /// `32 * blocks` bytes of codes.
    pub packed: &'a CudaSlice<u8>,
    /// One byte per block.
    pub absmax_codes: &'a CudaSlice<u8>,
    /// One f32 per 256 blocks.
    pub absmax_scales: &'a CudaSlice<f32>,
    /// The 16 NF4 values, then the 256 entries of the dynamic map.
    pub code_tables: &'a CudaSlice<f32>,
    pub offset: f32,
}

const THREADS: u32 = 256;
/// Thread blocks per SM: enough to keep every SM's memory pipes full; past that, each thread
/// expands more words rather than the grid reloading the tables more often.
const BLOCKS_PER_SM: usize = 8;

impl CudaBackend {
    /// Writes the first `n` values of `w` into `out` as `T`.
    pub fn nf4_dequantize<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        w: &Nf4Device,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "nf4_dequantize";
        let b = blocks(n);
        check_len(OP, "out", out, n)?;
        check_len(OP, "packed codes", w.packed, b * BLOCK_BYTES)?;
        check_len(OP, "absmax codes", w.absmax_codes, b)?;
        check_len(
            OP,
            "absmax scales",
            w.absmax_scales,
            b.div_ceil(ABSMAX_BLOCK),
        )?;
        check_len(OP, "code tables", w.code_tables, NF4_CODE.len() + 256)?;
        if n == 0 {
            return Ok(());
        }
        let words = n.div_ceil(8);
        let grid = words
            .div_ceil(THREADS as usize)
            .clamp(1, self.info.sm_count as usize * BLOCKS_PER_SM);
        let func = self.elem_function::<T>(ElemKernel::Nf4Dequantize)?;
        let n64 = n as i64;
        let mut l = self.stream.launch_builder(func);
        l.arg(out)
            .arg(w.packed)
            .arg(w.absmax_codes)
            .arg(w.absmax_scales)
            .arg(w.code_tables)
            .arg(&w.offset)
            .arg(&n64);
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `out` holds `n` elements, the packed codes cover every word of `n` values
        // (whole blocks of 32 bytes), and the absmax codes, scales and tables cover their
        // blocks (checked above); the device allocation is aligned for the 32-bit loads.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}

//! Bidirectional attention with a key padding mask on the GPU, forward only; reference:
//! [`crate::engine::cpu::attention_masked`] (same `qkv[B, T, 3C]` layout and results).
//! CUDA cores, one query row per thread, f32 arithmetic, head sizes 16, 32 and 64. For
//! training, the padded softmax and the whole-row softmax backward of the unfused route
//! (one warp per row), which batched GEMMs surround.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
};
use crate::engine::AttnShape;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "attention_masked",
    source: include_str!("attention_masked.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::MaskedAttentionForwardHs16,
        ElemKernel::MaskedAttentionForwardHs32,
        ElemKernel::MaskedAttentionForwardHs64,
        ElemKernel::PaddedSoftmax,
        ElemKernel::SoftmaxBackwardRows,
    ],
    dtypes: ELEM_DTYPES,
};

/// Query rows per block (MBR in the kernel), one thread each.
const ROWS: u32 = 64;

impl CudaBackend {
    /// Writes `out[B, T, C]` from `qkv[B, T, 3C]`, each sequence `b` attending to its first
    /// `lens[b]` keys (`lens` holds `B` values in `1 ..= T`).
    pub fn masked_attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        lens: &CudaSlice<i32>,
        s: AttnShape,
    ) -> Result<()> {
        const OP: &str = "masked_attention_forward";
        let hs = s.channels / s.heads.max(1);
        let kernel = match hs {
            16 => Some(ElemKernel::MaskedAttentionForwardHs16),
            32 => Some(ElemKernel::MaskedAttentionForwardHs32),
            64 => Some(ElemKernel::MaskedAttentionForwardHs64),
            _ => None,
        };
        let Some(kernel) = kernel.filter(|_| hs * s.heads == s.channels) else {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!(
                    "head size {} (width {} / {} heads) has no GPU kernel; use 16, 32 or 64",
                    s.channels as f64 / s.heads.max(1) as f64,
                    s.channels,
                    s.heads
                ),
            });
        };
        check_len(OP, "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
        check_len(OP, "out", out, s.batch * s.seq * s.channels)?;
        check_len(OP, "lens", lens, s.batch)?;
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let (t, c, nh) = (
            as_i32(OP, "seq", s.seq)?,
            as_i32(OP, "channels", s.channels)?,
            as_i32(OP, "heads", s.heads)?,
        );
        let f = self.elem_function::<T>(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv).arg(lens).arg(out).arg(&t).arg(&c).arg(&nh);
        let cfg = LaunchConfig {
            grid_dim: (
                s.seq.div_ceil(ROWS as usize) as u32,
                (s.batch * s.heads) as u32,
                1,
            ),
            block_dim: (ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffer sizes checked above; the grid covers B*NH x ceil(T/64) row tiles and
        // the kernel reads keys only below lens[b] <= T.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `probs = softmax(scores)` over each row of `scores[B, H, T, T]` restricted to its
    /// sequence's keys `0 .. lens[b]` (`lens` holds `B` values in `1 ..= T`); padded keys 0.
    pub fn padded_softmax<T: Elem>(
        &self,
        probs: &mut CudaSlice<T>,
        scores: &CudaSlice<T>,
        lens: &CudaSlice<i32>,
        s: AttnShape,
    ) -> Result<()> {
        const OP: &str = "padded_softmax";
        let rows = s.batch * s.heads * s.seq;
        check_len(OP, "probs", probs, rows * s.seq)?;
        check_len(OP, "scores", scores, rows * s.seq)?;
        check_len(OP, "lens", lens, s.batch)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::PaddedSoftmax)?;
        let (rows64, seq32, heads32) = (
            rows as i64,
            as_i32(OP, "seq", s.seq)?,
            as_i32(OP, "heads", s.heads)?,
        );
        let mut l = self.stream.launch_builder(f);
        l.arg(probs)
            .arg(scores)
            .arg(lens)
            .arg(&rows64)
            .arg(&seq32)
            .arg(&heads32);
        // SAFETY: both matrices hold `rows * seq` elements and `lens` one value per sequence;
        // each warp reads and writes its own row, and keys only below lens[b] <= seq.
        unsafe { l.launch(warp_rows(OP, rows)?) }?;
        Ok(())
    }

    /// `dscores = P * (dP - sum(P * dP))` over whole rows of `[rows, seq]`.
    pub fn softmax_backward_rows<T: Elem>(
        &self,
        dscores: &mut CudaSlice<T>,
        probs: &CudaSlice<T>,
        dprobs: &CudaSlice<T>,
        rows: usize,
        seq: usize,
    ) -> Result<()> {
        const OP: &str = "softmax_backward_rows";
        check_len(OP, "dscores", dscores, rows * seq)?;
        check_len(OP, "probs", probs, rows * seq)?;
        check_len(OP, "dprobs", dprobs, rows * seq)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::SoftmaxBackwardRows)?;
        let (rows64, seq32) = (rows as i64, as_i32(OP, "seq", seq)?);
        let mut l = self.stream.launch_builder(f);
        l.arg(dscores)
            .arg(probs)
            .arg(dprobs)
            .arg(&rows64)
            .arg(&seq32);
        // SAFETY: every buffer holds `rows * seq` elements; each warp reads and writes its row.
        unsafe { l.launch(warp_rows(OP, rows)?) }?;
        Ok(())
    }
}

/// Threads per block of the row kernels: 8 warps, one row each.
const WARP_BLOCK: u32 = 256;

/// One warp per row; the grid's x dimension reaches 2^31 - 1 blocks.
fn warp_rows(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let per_block = WARP_BLOCK as usize / 32;
    let blocks = u32::try_from(rows.div_ceil(per_block))
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| CudaError::Shape {
            op,
            detail: format!("{rows} rows exceed one grid of warps"),
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (WARP_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

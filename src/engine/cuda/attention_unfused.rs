//! The pieces of unfused attention on the GPU; reference:
//! [`crate::engine::cpu::attention_unfused`] (same layouts and results). The products between
//! them are [`CudaBackend::matmul_batched`].

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
    elementwise_grid,
};
use crate::engine::AttnShape;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "attention_unfused",
    source: include_str!("attention_unfused.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::HeadsFromRows,
        ElemKernel::HeadsToRows,
        ElemKernel::CausalSoftmax,
        ElemKernel::CausalSoftmaxBackward,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;
/// Rows of the softmax kernels per block: one warp each.
const ROWS_PER_BLOCK: usize = BLOCK as usize / 32;

/// One warp per row of `[rows, seq]`; the grid's x dimension reaches 2^31 - 1 blocks.
fn row_grid(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK))
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| CudaError::Shape {
            op,
            detail: format!("{rows} rows exceed one grid of warps"),
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Which way a head move goes.
#[derive(Clone, Copy)]
enum HeadMove {
    FromRows,
    ToRows,
}

impl CudaBackend {
    /// `dst[B, H, T, hs]` from the columns `col0 + h*hs + d` of `src`'s rows of width `row`.
    pub fn heads_from_rows<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        s: AttnShape,
        row: usize,
        col0: usize,
    ) -> Result<()> {
        self.move_heads(HeadMove::FromRows, dst, src, s, row, col0)
    }

    /// Writes `src[B, H, T, hs]` into columns `col0 .. col0 + C` of `dst`'s rows of width
    /// `row`; the other columns keep their contents.
    pub fn heads_to_rows<T: Elem>(
        &self,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        s: AttnShape,
        row: usize,
        col0: usize,
    ) -> Result<()> {
        self.move_heads(HeadMove::ToRows, dst, src, s, row, col0)
    }

    fn move_heads<T: Elem>(
        &self,
        dir: HeadMove,
        dst: &mut CudaSlice<T>,
        src: &CudaSlice<T>,
        s: AttnShape,
        row: usize,
        col0: usize,
    ) -> Result<()> {
        const OP: &str = "move_heads";
        let n = s.batch * s.seq * s.channels;
        let rows_len = s.batch * s.seq * row;
        if col0 + s.channels > row {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!(
                    "columns {col0}..{} outside rows of {row}",
                    col0 + s.channels
                ),
            });
        }
        let (kernel, dst_len, src_len) = match dir {
            HeadMove::FromRows => (ElemKernel::HeadsFromRows, n, rows_len),
            HeadMove::ToRows => (ElemKernel::HeadsToRows, rows_len, n),
        };
        check_len(OP, "dst", dst, dst_len)?;
        check_len(OP, "src", src, src_len)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(kernel)?;
        let (n64, row64, col64) = (n as i64, row as i64, col0 as i64);
        let seq = as_i32(OP, "seq", s.seq)?;
        let heads = as_i32(OP, "heads", s.heads)?;
        let hs = as_i32(OP, "head size", s.head_size())?;
        let mut l = self.stream.launch_builder(f);
        l.arg(dst).arg(src).arg(&n64).arg(&seq).arg(&heads).arg(&hs);
        l.arg(&row64).arg(&col64);
        let cfg = LaunchConfig {
            grid_dim: (elementwise_grid(n, BLOCK), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the head block holds `n` elements and the rows `B*T*row`, checked above;
        // every index the kernel forms is below those (col0 + C <= row).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// `probs = softmax(scores)` over each row's causal prefix (row `r` of `[rows, seq]` is
    /// query `r % seq`), masked entries zero.
    pub fn causal_softmax<T: Elem>(
        &self,
        probs: &mut CudaSlice<T>,
        scores: &CudaSlice<T>,
        rows: usize,
        seq: usize,
    ) -> Result<()> {
        const OP: &str = "causal_softmax";
        check_len(OP, "probs", probs, rows * seq)?;
        check_len(OP, "scores", scores, rows * seq)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::CausalSoftmax)?;
        let (rows64, seq32) = (rows as i64, as_i32(OP, "seq", seq)?);
        let mut l = self.stream.launch_builder(f);
        l.arg(probs).arg(scores).arg(&rows64).arg(&seq32);
        // SAFETY: both buffers hold `rows * seq` elements; each warp reads and writes its row.
        unsafe { l.launch(row_grid(OP, rows)?) }?;
        Ok(())
    }

    /// `dscores = P * (dP - sum(P * dP))` per row of `[rows, seq]`, masked entries zero.
    pub fn causal_softmax_backward<T: Elem>(
        &self,
        dscores: &mut CudaSlice<T>,
        probs: &CudaSlice<T>,
        dprobs: &CudaSlice<T>,
        rows: usize,
        seq: usize,
    ) -> Result<()> {
        const OP: &str = "causal_softmax_backward";
        check_len(OP, "dscores", dscores, rows * seq)?;
        check_len(OP, "probs", probs, rows * seq)?;
        check_len(OP, "dprobs", dprobs, rows * seq)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::CausalSoftmaxBackward)?;
        let (rows64, seq32) = (rows as i64, as_i32(OP, "seq", seq)?);
        let mut l = self.stream.launch_builder(f);
        l.arg(dscores)
            .arg(probs)
            .arg(dprobs)
            .arg(&rows64)
            .arg(&seq32);
        // SAFETY: every buffer holds `rows * seq` elements; each warp reads and writes its row.
        unsafe { l.launch(row_grid(OP, rows)?) }?;
        Ok(())
    }
}

//! Token plus position embedding on the GPU, with a deterministic backward; reference:
//! [`crate::engine::cpu::embedding`]. Tables and output are `T`; the gradients of the tables
//! are f32 and accumulate.

use super::{CudaBackend, Elem, Program, Result, as_i32, check_len};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "embedding",
    source: include_str!("embedding.cu"),
    kernels: &[
        "embedding_forward_f32",
        "embedding_forward_bf16",
        "embedding_forward_f16",
        "embedding_backward_wte_f32",
        "embedding_backward_wte_bf16",
        "embedding_backward_wte_f16",
        "embedding_backward_wpe_f32",
        "embedding_backward_wpe_bf16",
        "embedding_backward_wpe_f16",
    ],
};

const BLOCK: u32 = 256;
/// Vocabulary rows of `dwte` per block in the backward (`EMB_ROWS` in embedding.cu).
const WTE_ROWS_PER_BLOCK: usize = 64;

fn blocks(count: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// `out[i, :] = wte[tokens[i], :] + wpe[i % seq, :]` for `n` tokens; a token id outside
    /// `vocab` gives a row of NaN rather than an out-of-bounds read.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        tokens: &CudaSlice<u32>,
        wte: &CudaSlice<T>,
        wpe: &CudaSlice<T>,
        n: usize,
        vocab: usize,
        seq: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_forward";
        as_i32(OP, "tokens", n)?;
        let (seq32, c32) = (as_i32(OP, "seq", seq)?, as_i32(OP, "channels", c)?);
        let vocab32 = as_i32(OP, "vocab", vocab)? as u32;
        check_len(OP, "out", out, n * c)?;
        check_len(OP, "tokens", tokens, n)?;
        check_len(OP, "wte", wte, vocab * c)?;
        check_len(OP, "wpe", wpe, seq * c)?;
        if n == 0 || seq == 0 {
            return Ok(());
        }
        let f = self.function(&format!("embedding_forward_{}", T::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(tokens)
            .arg(wte)
            .arg(wpe)
            .arg(&seq32)
            .arg(&c32)
            .arg(&vocab32);
        // SAFETY: lengths checked above; token ids are bounds-checked in the kernel.
        unsafe { b.launch(blocks(n)) }?;
        Ok(())
    }

    /// Accumulates into `dwte` and `dwpe`, adding repeated tokens in position order (the
    /// CPU's order, so fp32 results match it exactly). Token ids must be below `vocab`; ids
    /// outside it are ignored.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_backward<T: Elem>(
        &self,
        dwte: &mut CudaSlice<f32>,
        dwpe: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        tokens: &CudaSlice<u32>,
        n: usize,
        vocab: usize,
        seq: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        let n32 = as_i32(OP, "tokens", n)?;
        let (seq32, c32) = (as_i32(OP, "seq", seq)?, as_i32(OP, "channels", c)?);
        as_i32(OP, "vocab", vocab)?;
        check_len(OP, "dwte", dwte, vocab * c)?;
        check_len(OP, "dwpe", dwpe, seq * c)?;
        check_len(OP, "dout", dout, n * c)?;
        check_len(OP, "tokens", tokens, n)?;
        if n == 0 || seq == 0 || c == 0 {
            return Ok(());
        }
        let f = self.function(&format!("embedding_backward_wte_{}", T::SUFFIX))?;
        let vocab32 = vocab as u32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *dwte)
            .arg(dout)
            .arg(tokens)
            .arg(&n32)
            .arg(&c32)
            .arg(&vocab32);
        // SAFETY: each block owns WTE_ROWS_PER_BLOCK rows of `dwte` (checked to hold
        // `vocab * c`); the kernel ignores token ids at or above `vocab`.
        unsafe { b.launch(blocks(vocab.div_ceil(WTE_ROWS_PER_BLOCK))) }?;

        let f = self.function(&format!("embedding_backward_wpe_{}", T::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dwpe).arg(dout).arg(&n32).arg(&seq32).arg(&c32);
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(BLOCK as usize) as u32, seq as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one thread per (position, channel) of `dwpe` (checked to hold `seq * c`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

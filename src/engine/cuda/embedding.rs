//! Token plus position embedding on the GPU, with a deterministic backward (also the token
//! table's alone, for models with rotary positions); reference:
//! [`crate::engine::cpu::embedding`]. Tables and output are `T`; the gradients of the tables
//! are f32 and accumulate.

use super::{CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg, sys::CUfunction_attribute};

pub(super) const PROGRAM: Program = Program {
    name: "embedding",
    source: include_str!("embedding.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::EmbeddingForward,
        ElemKernel::EmbeddingBackwardWte,
        ElemKernel::EmbeddingBackwardWteStaged,
        ElemKernel::EmbeddingBackwardWpe,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;
/// Vocabulary rows of `dwte` per block in the backward: at most this many (the staged
/// kernel's mask of hit rows holds 64), and as many as fit the shared memory when staged.
const WTE_ROWS_PER_BLOCK: usize = 64;
/// Threads of the staged backward: a larger token tile per pass over the token list.
const STAGED_BLOCK: u32 = 1024;
/// The staged backward's static shared memory (token tile and ballot masks), rounded up.
const STAGED_STATIC_BYTES: usize = 8 << 10;

/// A token this many times in one call makes its row hot: the backward then stages rows in
/// shared memory. Below it the unstaged kernel is faster (it scans the token list with more
/// blocks in flight: 99 us against 264 us for 8192 uniform tokens of GPT-2's vocabulary on
/// an H200), above it the staged one (a GPT-2 small step on Shakespeare, 24.7 -> 24.2 ms).
pub const HOT_ROW_HITS: usize = 32;

/// Whether some token occurs at least [`HOT_ROW_HITS`] times in `tokens`.
pub fn has_hot_rows(tokens: &[u32]) -> bool {
    let Some(&max) = tokens.iter().max() else {
        return false;
    };
    let mut counts = vec![0u32; max as usize + 1];
    tokens.iter().any(|&t| {
        counts[t as usize] += 1;
        counts[t as usize] as usize >= HOT_ROW_HITS
    })
}

/// Rows of `dwte` per block of the staged backward for `c` channels within `optin` bytes of
/// shared memory, or None when not one row fits.
fn staged_rows(c: usize, optin: usize) -> Option<usize> {
    let rows = optin.saturating_sub(STAGED_STATIC_BYTES) / (4 * c).max(1);
    (rows >= 1).then(|| rows.min(WTE_ROWS_PER_BLOCK))
}

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
        let f = self.elem_function::<T>(ElemKernel::EmbeddingForward)?;
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
        hot_rows: bool,
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
        self.token_embedding_backward(dwte, dout, tokens, n, vocab, c, hot_rows)?;
        let f = self.elem_function::<T>(ElemKernel::EmbeddingBackwardWpe)?;
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

    /// The token table's part of the backward (models with rotary positions have no position
    /// table): `dwte[tokens[i]] += dout[i]`, repeated tokens added in position order, as on
    /// the CPU. Token ids must be below `vocab`; ids outside it are ignored. `hot_rows`
    /// (see [`has_hot_rows`]) picks the kernel that stages rows in shared memory.
    #[allow(clippy::too_many_arguments)]
    pub fn token_embedding_backward<T: Elem>(
        &self,
        dwte: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        tokens: &CudaSlice<u32>,
        n: usize,
        vocab: usize,
        c: usize,
        hot_rows: bool,
    ) -> Result<()> {
        const OP: &str = "token_embedding_backward";
        let n32 = as_i32(OP, "tokens", n)?;
        let c32 = as_i32(OP, "channels", c)?;
        as_i32(OP, "vocab", vocab)?;
        check_len(OP, "dwte", dwte, vocab * c)?;
        check_len(OP, "dout", dout, n * c)?;
        check_len(OP, "tokens", tokens, n)?;
        if n == 0 || c == 0 || vocab == 0 {
            return Ok(());
        }
        let staged = staged_rows(c, self.info.shared_memory_per_block_optin).filter(|_| hot_rows);
        let (f, rows, cfg) = match staged {
            Some(rows) => {
                let f = self.elem_function::<T>(ElemKernel::EmbeddingBackwardWteStaged)?;
                let bytes = rows * c * 4;
                // Above 48 KiB a kernel must opt in to its dynamic shared memory.
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )?;
                let cfg = LaunchConfig {
                    grid_dim: (vocab.div_ceil(rows) as u32, 1, 1),
                    block_dim: (STAGED_BLOCK, 1, 1),
                    shared_mem_bytes: bytes as u32,
                };
                (f, rows, cfg)
            }
            None => (
                self.elem_function::<T>(ElemKernel::EmbeddingBackwardWte)?,
                WTE_ROWS_PER_BLOCK,
                blocks(vocab.div_ceil(WTE_ROWS_PER_BLOCK)),
            ),
        };
        let (vocab32, rows32) = (vocab as u32, rows as u32);
        let mut b = self.stream.launch_builder(f);
        b.arg(dwte)
            .arg(dout)
            .arg(tokens)
            .arg(&n32)
            .arg(&c32)
            .arg(&vocab32)
            .arg(&rows32);
        // SAFETY: block b owns rows [b * rows, min((b + 1) * rows, vocab)) of `dwte` (checked
        // to hold `vocab * c`), staged in `rows * c` floats of shared memory when staged; the
        // grid has no block past the vocabulary; token ids at or above `vocab` are ignored.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_rows_fill_the_shared_memory_and_fall_back_when_one_row_is_too_wide() {
        const H100_OPTIN: usize = 227 << 10;
        // GPT-2 small's 768 channels: 3 KiB a row, the 64-row cap binds (192 KiB).
        assert_eq!(staged_rows(768, H100_OPTIN), Some(64));
        // 4096 channels: 16 KiB a row, 13 rows fit beside the static tile.
        assert_eq!(staged_rows(4096, H100_OPTIN), Some(13));
        assert!(
            staged_rows(4096, H100_OPTIN).unwrap() * 4096 * 4 + STAGED_STATIC_BYTES <= H100_OPTIN
        );
        // A row wider than the shared memory uses the unstaged kernel.
        assert_eq!(staged_rows(60_000, H100_OPTIN), None);
        assert_eq!(staged_rows(768, 0), None);
    }

    #[test]
    fn a_row_is_hot_from_its_thirty_second_hit() {
        let mut tokens: Vec<u32> = (0..1000).collect();
        assert!(!has_hot_rows(&tokens) && !has_hot_rows(&[]));
        tokens.extend(std::iter::repeat_n(7, HOT_ROW_HITS - 2));
        assert!(
            !has_hot_rows(&tokens),
            "7 occurs {} times",
            HOT_ROW_HITS - 1
        );
        tokens.push(7);
        assert!(has_hot_rows(&tokens));
    }
}

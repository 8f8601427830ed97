//! Token plus position embedding on the GPU, with a deterministic backward (also the token
//! table's alone, for models with rotary positions); reference:
//! [`crate::engine::cpu::embedding`]. Tables and output are `T`; the gradients of the tables
//! are f32 and accumulate.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "embedding",
    source: include_str!("embedding.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::EmbeddingForward,
        ElemKernel::EmbeddingBackwardRows,
        ElemKernel::EmbeddingBackwardWpe,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

/// The backward's plan for `tokens`: `[rows | starts | positions]`, the distinct tokens in
/// ascending order (`unique` of them), where each one's positions start in `positions` (plus
/// the end), and the positions sorted by token, ascending within a token. Returns the plan
/// and `unique`.
///
/// A counting sort over the ids present (linear in the tokens and in the largest id): the host
/// builds this plan during every backward, and a comparison sort of 16384 positions took
/// 0.3-0.6 ms of it (the GPU, measured, was not waiting on that; the host time is saved).
pub fn row_plan(tokens: &[u32]) -> (Vec<u32>, usize) {
    let span = tokens.iter().max().map_or(0, |&t| t as usize + 1);
    // First how many positions carry each token, then where its positions start, then (while
    // placing them) where its next one goes.
    let mut next = vec![0u32; span];
    for &t in tokens {
        next[t as usize] += 1;
    }
    let mut rows = Vec::new();
    let mut starts = Vec::new();
    let mut at = 0u32;
    for (t, slot) in next.iter_mut().enumerate() {
        let count = *slot;
        if count > 0 {
            rows.push(t as u32);
            starts.push(at);
        }
        *slot = at;
        at += count;
    }
    starts.push(at);
    let unique = rows.len();
    let mut plan = rows;
    plan.extend(starts);
    let first = plan.len();
    plan.resize(first + tokens.len(), 0);
    // Positions in ascending order land in ascending order within their token.
    for (i, &t) in tokens.iter().enumerate() {
        let slot = &mut next[t as usize];
        plan[first + *slot as usize] = i as u32;
        *slot += 1;
    }
    (plan, unique)
}

/// Bytes of the plan [`row_plan`] uploads for `tokens` (outside the pool), for the meta device.
pub fn row_plan_bytes(tokens: &[u32]) -> usize {
    4 * row_plan(tokens).0.len()
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
        tokens: &[u32],
        vocab: usize,
        seq: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        let n = tokens.len();
        let n32 = as_i32(OP, "tokens", n)?;
        let (seq32, c32) = (as_i32(OP, "seq", seq)?, as_i32(OP, "channels", c)?);
        as_i32(OP, "vocab", vocab)?;
        check_len(OP, "dwte", dwte, vocab * c)?;
        check_len(OP, "dwpe", dwpe, seq * c)?;
        check_len(OP, "dout", dout, n * c)?;
        if n == 0 || seq == 0 || c == 0 {
            return Ok(());
        }
        self.token_embedding_backward(dwte, dout, tokens, vocab, c)?;
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
    /// the CPU. Token ids must be below `vocab` (an error otherwise). The tokens come from
    /// the host, which plans the work ([`row_plan`]) and uploads the plan.
    pub fn token_embedding_backward<T: Elem>(
        &self,
        dwte: &mut CudaSlice<f32>,
        dout: &CudaSlice<T>,
        tokens: &[u32],
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        const OP: &str = "token_embedding_backward";
        let n = tokens.len();
        as_i32(OP, "tokens", n)?;
        let c32 = as_i32(OP, "channels", c)?;
        check_len(OP, "dwte", dwte, vocab * c)?;
        check_len(OP, "dout", dout, n * c)?;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!("token id {t} outside the vocabulary of {vocab}"),
            });
        }
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (plan, unique) = row_plan(tokens);
        let plan = self.upload(&plan)?;
        let unique32 = as_i32(OP, "distinct tokens", unique)?;
        let f = self.elem_function::<T>(ElemKernel::EmbeddingBackwardRows)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dwte).arg(dout).arg(&plan).arg(&unique32).arg(&c32);
        let cfg = LaunchConfig {
            grid_dim: (unique as u32, 1, 1),
            block_dim: (c.next_multiple_of(32).min(1024) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block u adds into row rows[u] < vocab (checked above) of `dwte` (checked to
        // hold `vocab * c`), reading positions < n of `dout` (`n * c`); the plan holds
        // `2 unique + 1 + n` values.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_lists_each_tokens_positions_in_order() {
        let tokens = [4u32, 1, 4, 0, 4, 2, 1];
        let (plan, unique) = row_plan(&tokens);
        assert_eq!(unique, 4);
        let (rows, rest) = plan.split_at(unique);
        let (starts, positions) = rest.split_at(unique + 1);
        assert_eq!(rows, [0, 1, 2, 4]);
        assert_eq!(starts, [0, 1, 3, 4, 7]);
        assert_eq!(positions, [3, 1, 6, 5, 0, 2, 4]);
        assert_eq!(row_plan_bytes(&tokens), 4 * plan.len());
        assert_eq!(row_plan(&[]), (vec![0], 0));
    }

    #[test]
    fn the_counting_plan_equals_a_stable_sort_by_token() {
        let mut state = 7u64;
        let tokens: Vec<u32> = (0..5000)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                // Skewed ids: a few hot rows, many rare ones.
                let u = (state >> 40) as u32;
                if u.is_multiple_of(3) {
                    u % 7
                } else {
                    u % 40000
                }
            })
            .collect();
        let mut order: Vec<u32> = (0..tokens.len() as u32).collect();
        order.sort_by_key(|&i| tokens[i as usize]);
        let (plan, unique) = row_plan(&tokens);
        let mut rows: Vec<u32> = tokens.clone();
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(unique, rows.len());
        assert_eq!(&plan[..unique], &rows[..]);
        assert_eq!(&plan[2 * unique + 1..], &order[..]);
        for u in 0..unique {
            let (a, b) = (plan[unique + u] as usize, plan[unique + u + 1] as usize);
            assert!(a < b);
            assert!(order[a..b].iter().all(|&i| tokens[i as usize] == rows[u]));
        }
    }
}

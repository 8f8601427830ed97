//! Shapes that the CPU references and the CUDA kernels share: the engine's vocabulary for a
//! call, not either backend's.

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub channels: usize,
}

impl AttnShape {
    pub fn head_size(&self) -> usize {
        self.channels / self.heads
    }
}

/// Dimensions of a batched row-major product: `op(A)` is `m x k`, `op(B)` is `k x n`, and
/// `batch` of each are stored back to back (`A` is `[batch, m, k]`, or `[batch, k, m]` when
/// transposed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    pub trans_a: bool,
    pub trans_b: bool,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

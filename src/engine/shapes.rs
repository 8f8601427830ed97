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

/// Where the operands of a single product lie in their buffers: each is a row-major matrix
/// whose rows are `ld` elements apart, starting `offset` elements in. A packed operand has
/// `ld` equal to its row length and offset 0; a column block of a wider matrix (an adapter's
/// columns of a fused projection's output) has the wider row length as `ld`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixView {
    pub ld: usize,
    pub offset: usize,
}

impl MatrixView {
    /// A packed matrix whose stored rows hold `cols` elements.
    pub fn packed(cols: usize) -> MatrixView {
        MatrixView {
            ld: cols,
            offset: 0,
        }
    }
}

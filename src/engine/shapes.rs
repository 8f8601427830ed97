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

impl GemmShape {
    /// One product `op(A)[m, k] @ op(B)[k, n]` (a batch of 1).
    pub fn single(trans_a: bool, trans_b: bool, m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            trans_a,
            trans_b,
            batch: 1,
            m,
            n,
            k,
        }
    }

    /// The stored (rows, row length) of A, B and C: A is `[m, k]`, or `[k, m]` with
    /// `trans_a`; B is `[k, n]`, or `[n, k]` with `trans_b`; C is `[m, n]`.
    pub fn stored(&self) -> [(usize, usize); 3] {
        let GemmShape { m, n, k, .. } = *self;
        [
            if self.trans_a { (k, m) } else { (m, k) },
            if self.trans_b { (n, k) } else { (k, n) },
            (m, n),
        ]
    }

    /// Whether buffers of `lens` elements hold A, B and C where `views` place them (one
    /// product); if not, which operand falls short and by what.
    pub fn check_views(&self, views: [MatrixView; 3], lens: [usize; 3]) -> Result<(), String> {
        for ((what, v), ((rows, cols), len)) in ["A", "B", "C"]
            .into_iter()
            .zip(views)
            .zip(self.stored().into_iter().zip(lens))
        {
            let need = v.offset + rows.saturating_sub(1) * v.ld + cols;
            if v.ld < cols || (rows > 0 && len < need) {
                return Err(format!(
                    "{what} ({rows} x {cols}, rows {} apart, from element {}) needs {need} elements, has {len}",
                    v.ld, v.offset
                ));
            }
        }
        Ok(())
    }
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

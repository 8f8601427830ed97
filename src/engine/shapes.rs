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

/// One low-rank adapter's backward products over `rows` rows: its `cols` columns of a layer's
/// output gradient `dy` and its rank-`rank` slice of the forward's `H = x A^T` (`[rows, R]`
/// for the layer's adapters side by side, as is `dH`), with `B` `[cols, rank]` packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraGradShape {
    pub rows: usize,
    pub cols: usize,
    pub rank: usize,
}

impl LoraGradShape {
    /// `dH = dy B`: `[rows, cols] @ [cols, rank]`.
    pub fn dh_product(&self) -> GemmShape {
        GemmShape::single(false, false, self.rows, self.rank, self.cols)
    }

    /// `dB = dy^T H`: `[cols, rows] @ [rows, rank]`.
    pub fn db_product(&self) -> GemmShape {
        GemmShape::single(true, false, self.cols, self.rank, self.rows)
    }

    /// Whether buffers of `lens` elements (dy, B, H and dH, dB) hold the operands where the
    /// views place them (`[dy, h]`: the view of dy, and the one H and dH share); if not, which
    /// falls short. A missing dB (a frozen B) is `None`.
    pub fn check_views(
        &self,
        [dy, h]: [MatrixView; 2],
        [dy_len, b_len, h_len, dh_len]: [usize; 4],
        db_len: Option<usize>,
    ) -> Result<(), String> {
        let packed = MatrixView::packed(self.rank);
        self.dh_product()
            .check_views([dy, packed, h], [dy_len, b_len, dh_len])
            .map_err(|e| format!("dH = dy B: {e}"))?;
        match db_len {
            Some(db_len) => self
                .db_product()
                .check_views([dy, h, packed], [dy_len, h_len, db_len])
                .map_err(|e| format!("dB = dy^T H: {e}")),
            None => Ok(()),
        }
    }
}

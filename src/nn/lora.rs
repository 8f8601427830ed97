//! Low-rank adapters (LoRA): `y = x W^T + scale * (x A^T) B^T` on a block of a linear layer's
//! output columns, with `A` `[r, in]` and `B` `[out, r]`.
//!
//! kiln fuses some projections (query/key/value into one matrix, gate/up into one), while
//! adapters are defined per projection as Hugging Face names them (`q_proj`, `k_proj`, ...).
//! So a [`Linear`](super::linear::Linear) describes its output as named column blocks
//! ([`OutputBlock`]) and each adapter covers one block: its output is added into those
//! columns, and its gradient is read from them. Everything here runs through `engine::ops`
//! and works on any device and precision.
//!
//! Initialisation follows PEFT: `A` uniform on `[-1/sqrt(in), 1/sqrt(in)]` (Kaiming-uniform
//! with `a = sqrt(5)`), `B` zero, so a fresh adapter changes nothing. The scale is
//! `alpha / r`, or `alpha / sqrt(r)` with rank-stabilised scaling (rsLoRA).
//!
//! Dropout (`lora.dropout`, PEFT's `lora_dropout`) acts on each adapter's input only, inside
//! a training pass: the trainer opens a [`dropout_scope`] with the pass's seed around each
//! forward/backward, and every adapter draws its own mask from that seed and its name. The
//! mask is a function of the seed and element index, so the backward (and a recomputed
//! forward) sees the forward's mask, and evaluation and sampling, outside any scope, see none.

use super::{Init, Param, ParamBuilder, params};
use crate::engine::{GemmShape, MatrixView, Result, Tensor, ops};
use std::cell::Cell;

thread_local! {
    /// The seed of the training pass running on this thread, if adapter dropout is on.
    static DROPOUT_SEED: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Adapter dropout is live on this thread while the scope lives (see the module comment).
pub struct DropoutScope(Option<u64>);

/// Turns adapter dropout on for this thread's passes with masks drawn from `seed`.
pub fn dropout_scope(seed: u64) -> DropoutScope {
    DropoutScope(DROPOUT_SEED.with(|s| s.replace(Some(seed))))
}

impl Drop for DropoutScope {
    fn drop(&mut self) {
        DROPOUT_SEED.with(|s| s.set(self.0));
    }
}

/// A stable 64-bit hash of an adapter's name (FNV-1a), so each adapter draws its own mask.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A named block of a linear layer's output columns: the module it is in a Hugging Face
/// checkpoint (`model.layers.3.self_attn.k_proj`) and where its columns start and end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputBlock {
    pub module: String,
    pub col0: usize,
    pub cols: usize,
}

impl OutputBlock {
    /// The last component of the module path (`k_proj`), which target lists name.
    pub fn short_name(&self) -> &str {
        self.module.rsplit('.').next().unwrap_or(&self.module)
    }
}

/// The shape of the adapters of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub rank: usize,
    pub alpha: f64,
    pub rslora: bool,
    /// Probability of dropping an element of an adapter's input while training.
    pub dropout: f64,
    /// Module short names (`q_proj`) or `all-linear`.
    pub targets: Vec<String>,
}

impl LoraSpec {
    /// The adapters `[lora]` settings describe (targets comma-separated).
    pub fn from_config(l: &crate::config::LoraConfig) -> LoraSpec {
        LoraSpec {
            rank: l.rank,
            alpha: l.alpha,
            rslora: l.rslora,
            dropout: l.dropout,
            targets: l
                .targets
                .split(',')
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
                .collect(),
        }
    }

    pub fn scale(&self) -> f32 {
        let r = self.rank as f64;
        (if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }) as f32
    }

    pub fn matches(&self, block: &OutputBlock) -> bool {
        self.targets
            .iter()
            .any(|t| t == "all-linear" || t == block.short_name() || *t == block.module)
    }
}

/// One adapter on one output block.
pub struct Adapter {
    pub block: OutputBlock,
    /// `[r, in]`.
    pub a: Param,
    /// `[cols, r]`.
    pub b: Param,
    pub scale: f32,
    /// Drop probability of the input while training (0: none).
    pub dropout: f32,
    /// Mixed into the pass's seed so adapters draw different masks.
    mask_salt: u64,
}

params!(Adapter { a, b });

impl Adapter {
    /// A fresh adapter (named `{layer}.lora.{short name}.{A,B}`, `layer` being the layer's
    /// scope) on `block` of a layer with `c_in` inputs.
    pub fn new(
        layer: &mut ParamBuilder,
        block: OutputBlock,
        c_in: usize,
        spec: &LoraSpec,
    ) -> Result<Adapter> {
        let mut scope = layer.scope(format_args!("lora.{}", block.short_name()));
        let bound = 1.0 / (c_in as f32).sqrt();
        let a = scope.param("A", &[spec.rank, c_in], Init::Uniform(bound))?;
        let b = scope.param("B", &[block.cols, spec.rank], Init::Zeros)?;
        Ok(Adapter {
            mask_salt: name_hash(scope.prefix()),
            block,
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout as f32,
        })
    }

    /// The mask seed of this adapter in the current training pass, if dropout applies.
    fn mask_seed(&self) -> Option<u64> {
        if self.dropout <= 0.0 {
            return None;
        }
        DROPOUT_SEED.with(Cell::get).map(|s| s ^ self.mask_salt)
    }

    /// Adds the adapter's output for input `x` into its columns of `y`: `x A^T` (rank `r`),
    /// then `scale * h B^T` added straight into the block of `y` by the product itself.
    pub fn forward_into(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        let dropped = match self.mask_seed() {
            Some(seed) => Some(ops::dropout(x, self.dropout, seed)?),
            None => None,
        };
        let h = ops::linear_forward(dropped.as_ref().unwrap_or(x), self.a.weight(), None)?;
        drop(dropped);
        let (rows, row) = ops::rows_cols("lora forward", y)?;
        let r = self.a.value.shape()[0];
        ops::matmul_view(
            GemmShape::single(false, true, rows, self.block.cols, r),
            [
                MatrixView::packed(r),
                MatrixView::packed(r),
                self.columns_of(row),
            ],
            self.scale,
            &h,
            self.b.weight(),
            1.0,
            y,
        )
    }

    /// Accumulates the adapter's gradients from the layer's output gradient `dy` and adds
    /// its input gradient into `dx`. `x A^T` (and the dropped input) is recomputed, a rank-`r`
    /// GEMM, rather than kept. The products read the adapter's columns of `dy` in place and
    /// add into `dx` in place (with dropout, the input gradient is masked first).
    pub fn backward(&mut self, dy: &Tensor, x: &Tensor, dx: &mut Tensor) -> Result<()> {
        let seed = self.mask_seed();
        let dropped = match seed {
            Some(seed) => Some(ops::dropout(x, self.dropout, seed)?),
            None => None,
        };
        let input = dropped.as_ref().unwrap_or(x);
        let (rows, row) = ops::rows_cols("lora backward", dy)?;
        let (_, c_in) = ops::rows_cols("lora backward", x)?;
        let r = self.a.value.shape()[0];
        let cols = self.block.cols;
        let dy_block = self.columns_of(row);
        let h = ops::linear_forward(input, self.a.weight(), None)?;
        // dh = scale * dy[:, block] @ B   ([rows, r])
        let dh = ops::matmul_view_new(
            GemmShape::single(false, false, rows, r, cols),
            [dy_block, MatrixView::packed(r), MatrixView::packed(r)],
            self.scale,
            dy,
            self.b.weight(),
        )?;
        // dB += scale * dy[:, block]^T @ h   ([cols, r])
        let (_, db) = self.b.weight_and_grad();
        if let Some(db) = db {
            ops::matmul_view(
                GemmShape::single(true, false, cols, r, rows),
                [dy_block, MatrixView::packed(r), MatrixView::packed(r)],
                self.scale,
                dy,
                &h,
                1.0,
                db,
            )?;
        }
        drop(h);
        // dA += dh^T @ input   ([r, in])
        let (aw, da) = self.a.weight_and_grad();
        if let Some(da) = da {
            ops::matmul_view(
                GemmShape::single(true, false, r, c_in, rows),
                [
                    MatrixView::packed(r),
                    MatrixView::packed(c_in),
                    MatrixView::packed(c_in),
                ],
                1.0,
                &dh,
                input,
                1.0,
                da,
            )?;
        }
        drop(dropped);
        // dx += dh @ A   ([rows, in])
        let views = [
            MatrixView::packed(r),
            MatrixView::packed(c_in),
            MatrixView::packed(c_in),
        ];
        let shape = GemmShape::single(false, false, rows, c_in, r);
        match seed {
            // The mask's derivative is the mask itself, with the same scale.
            Some(seed) => {
                let dxa = ops::matmul_view_new(shape, views, 1.0, &dh, aw)?;
                ops::add_in_place(dx, &ops::dropout(&dxa, self.dropout, seed)?)
            }
            None => ops::matmul_view(shape, views, 1.0, &dh, aw, 1.0, dx),
        }
    }

    /// This adapter's block of the columns of a `[rows, row]` output.
    fn columns_of(&self, row: usize) -> MatrixView {
        MatrixView {
            ld: row,
            offset: self.block.col0,
        }
    }

    /// `scale * B A` (`[cols, in]`, f32 on the host): what merging adds to the base weight's
    /// rows of this block.
    pub fn delta(&self) -> Result<Vec<f32>> {
        let a = self.a.value.to_vec()?;
        let b = self.b.value.to_vec()?;
        let (r, c_in) = (self.a.value.shape()[0], self.a.value.shape()[1]);
        let mut out = vec![0.0f32; self.block.cols * c_in];
        for (row, brow) in out.chunks_mut(c_in).zip(b.chunks(r)) {
            for (k, &bk) in brow.iter().enumerate() {
                let s = bk * self.scale;
                row.iter_mut()
                    .zip(&a[k * c_in..(k + 1) * c_in])
                    .for_each(|(o, &av)| *o += s * av);
            }
        }
        Ok(out)
    }
}

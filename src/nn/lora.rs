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
use crate::engine::{Result, Tensor, ops};
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

    /// Adds the adapter's output for input `x` into its columns of `y`.
    pub fn forward_into(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        let dropped = match self.mask_seed() {
            Some(seed) => Some(ops::dropout(x, self.dropout, seed)?),
            None => None,
        };
        let h = ops::linear_forward(dropped.as_ref().unwrap_or(x), self.a.weight(), None)?;
        drop(dropped);
        let z = ops::linear_forward(&h, self.b.weight(), None)?;
        ops::add_cols_scaled(y, &z, self.block.col0, self.scale)
    }

    /// Accumulates the adapter's gradients from the layer's output gradient `dy` and adds
    /// its input gradient into `dx`. `x A^T` (and the dropped input) is recomputed, a rank-`r`
    /// GEMM, rather than kept.
    pub fn backward(&mut self, dy: &Tensor, x: &Tensor, dx: &mut Tensor) -> Result<()> {
        let seed = self.mask_seed();
        let dropped = match seed {
            Some(seed) => Some(ops::dropout(x, self.dropout, seed)?),
            None => None,
        };
        let input = dropped.as_ref().unwrap_or(x);
        let dz = ops::cols_scaled(dy, self.block.col0, self.block.cols, self.scale)?;
        let h = ops::linear_forward(input, self.a.weight(), None)?;
        let (bw, db) = self.b.weight_and_grad();
        let dh = ops::linear_backward(&dz, &h, bw, db, None)?;
        drop((dz, h));
        let (aw, da) = self.a.weight_and_grad();
        let dxa = ops::linear_backward(&dh, input, aw, da, None)?;
        drop(dropped);
        match seed {
            // The mask's derivative is the mask itself, with the same scale.
            Some(seed) => ops::add_in_place(dx, &ops::dropout(&dxa, self.dropout, seed)?),
            None => ops::add_in_place(dx, &dxa),
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

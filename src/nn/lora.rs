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
//!
//! Without dropout, a layer's adapters all read the same input, so inside a training pass
//! they run together ([`forward_layer`], [`backward_layer`]): their `A`s stacked into one
//! `[R, in]` matrix, the input is read once for every `x A^T` and once for every `A`
//! gradient, and the input gradient gets one rank-`R` product instead of one per adapter.
//! The forward keeps `H = x A^T` (`[rows, R]`: at rank 16, 3.5 MB a SmolLM2 layer for a batch
//! of 16 x 1024 in bf16) for the backward rather than reading the input again to recompute it.
//!
//! A frozen layer fed by an RMSNorm can go further and fold its adapters into its own product
//! ([`fold_width`]): the norm writes its rows `R` columns wide, `scale * x A^T` fills the last
//! `R` ([`fold_inputs`]), and one GEMM against `[W | B]` ([`FoldedWeight`]) gives
//! `x W^T + scale * (x A^T) B^T`, with no pass of the adapters over the layer's output. In the
//! backward the same GEMM's input gradient `dY [W | B]` carries `dY B` in its last `R`
//! columns, which is the adapters' `dH` without a product of their own ([`fold_backward`]).

use super::{Init, Param, ParamBuilder, params};
use crate::engine::{DType, GemmShape, MatrixView, Result, Tensor, ops};
use std::cell::Cell;
use std::sync::{Mutex, OnceLock};

thread_local! {
    /// The seed of the training pass running on this thread, if adapter dropout is on.
    static DROPOUT_SEED: Cell<Option<u64>> = const { Cell::new(None) };
    /// Adapters kept apart from their layers' products on this thread (tests compare both).
    static FOLD_OFF: Cell<bool> = const { Cell::new(false) };
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

/// The seed of the training pass running on this thread, if one is.
fn training_pass() -> Option<u64> {
    DROPOUT_SEED.with(Cell::get)
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

    /// Adapters of rank `rank` on `targets` with `alpha = 2 * rank`, no dropout, plain
    /// scaling (what the tests build).
    #[cfg(test)]
    pub fn plain(rank: usize, targets: &[&str]) -> LoraSpec {
        LoraSpec {
            rank,
            alpha: 2.0 * rank as f64,
            rslora: false,
            dropout: 0.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
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
        // Their gradients are cleared by their first write of a step (`gradients` overwrites
        // then), not by a launch per adapter before it.
        let a = scope
            .param("A", &[spec.rank, c_in], Init::Uniform(bound))?
            .with_lazy_grad();
        let b = scope
            .param("B", &[block.cols, spec.rank], Init::Zeros)?
            .with_lazy_grad();
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
        training_pass().map(|s| s ^ self.mask_salt)
    }

    fn rank(&self) -> usize {
        self.a.value.shape()[0]
    }

    /// Adds the adapter's output for input `x` (dropped out inside a training pass) into its
    /// columns of `y`: `x A^T` (rank `r`), then `scale * h B^T` added straight into the block
    /// of `y` by the product itself.
    pub fn forward_into(&self, y: &mut Tensor, x: &Tensor) -> Result<()> {
        let dropped = self.dropped(x)?;
        let h = ops::linear_forward(dropped.as_ref().unwrap_or(x), self.a.weight(), None)?;
        drop(dropped);
        add_outputs(std::slice::from_ref(self), &h, y, 1.0)
    }

    /// Accumulates the adapter's gradients from the layer's output gradient `dy` and adds
    /// its input gradient into `dx`. `x A^T` (and the dropped input) is recomputed, a rank-`r`
    /// GEMM, rather than kept. The products read the adapter's columns of `dy` in place and
    /// add into `dx` in place (with dropout, the input gradient is masked first).
    pub fn backward(&mut self, dy: &Tensor, x: &Tensor, dx: &mut Tensor) -> Result<()> {
        let dropped = self.dropped(x)?;
        let input = dropped.as_ref().unwrap_or(x);
        let h = ops::linear_forward(input, self.a.weight(), None)?;
        let dh = gradients(std::slice::from_mut(self), dy, input, h)?;
        drop(dropped);
        // dx += dH @ A   ([rows, in])
        let (rows, c_in) = ops::rows_cols("lora backward", x)?;
        let r = self.rank();
        let views = [
            MatrixView::packed(r),
            MatrixView::packed(c_in),
            MatrixView::packed(c_in),
        ];
        let shape = GemmShape::single(false, false, rows, c_in, r);
        let aw = self.a.weight();
        match self.mask_seed() {
            // The mask's derivative is the mask itself, with the same scale.
            Some(seed) => {
                let dxa = ops::matmul_view_new(shape, views, 1.0, &dh, aw)?;
                ops::add_in_place(dx, &ops::dropout(&dxa, self.dropout, seed)?)
            }
            None => ops::matmul_view(shape, views, 1.0, &dh, aw, 1.0, dx),
        }
    }

    /// `x` with this adapter's dropout mask applied, inside a training pass with dropout.
    fn dropped(&self, x: &Tensor) -> Result<Option<Tensor>> {
        self.mask_seed()
            .map(|seed| ops::dropout(x, self.dropout, seed))
            .transpose()
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

/// What a layer's forward in a training pass keeps for its backward (see the module
/// comment): the stacked `A`s (none for a single adapter) and `H = x A^T`.
pub struct Kept {
    /// The pass it belongs to and its input's length: a backward of another pass or input
    /// recomputes instead.
    pass: u64,
    len: usize,
    stacked: Option<Tensor>,
    h: Tensor,
}

/// A layer's slot for [`Kept`]; a `Mutex` so the layer stays `Sync` (it is never contended).
#[derive(Default)]
pub struct KeptSlot(Mutex<Option<Kept>>);

impl KeptSlot {
    fn put(&self, kept: Option<Kept>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = kept;
    }

    fn take(&self) -> Option<Kept> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The adapters' ranks added: the rows of their stacked `A`s.
fn total_rank(adapters: &[Adapter]) -> usize {
    adapters.iter().map(Adapter::rank).sum()
}

/// Whether a layer's adapters run together: they share an input unless dropout masks it per
/// adapter.
fn grouped(adapters: &[Adapter]) -> bool {
    !adapters.is_empty() && adapters.iter().all(|a| a.dropout <= 0.0)
}

/// The adapters' `A`s stacked along their rows (`[R, in]`), or `None` for one adapter (its
/// own `A` serves).
fn stack_a(adapters: &[Adapter]) -> Result<Option<Tensor>> {
    if adapters.len() < 2 {
        return Ok(None);
    }
    let first = adapters[0].a.weight();
    let c_in = first.shape()[1];
    let rows = total_rank(adapters);
    let mut stacked = Tensor::uninit(first.pool(), &[rows, c_in], first.dtype())?;
    let mut at = 0;
    for ad in adapters {
        let a = ad.a.weight();
        ops::copy_into_at(&mut stacked, at, a)?;
        at += a.len();
    }
    Ok(Some(stacked))
}

/// The `A` that serves all the adapters at once: the stacked one, or a lone adapter's own.
fn all_a<'t>(adapters: &'t [Adapter], stacked: &'t Option<Tensor>) -> &'t Tensor {
    stacked.as_ref().unwrap_or(adapters[0].a.weight())
}

/// The stacked `A`s (see [`stack_a`]) and `H = x A^T` for all the adapters at once.
fn stacked_h(adapters: &[Adapter], x: &Tensor) -> Result<(Option<Tensor>, Tensor)> {
    let stacked = stack_a(adapters)?;
    let h = ops::linear_forward(x, all_a(adapters, &stacked), None)?;
    Ok((stacked, h))
}

/// `dx[:, :in] = beta * dx[:, :in] + dH @ A` (`[rows, in]`), `A` all the adapters' (see
/// [`all_a`]) and `dx`'s rows `ld` elements apart.
fn input_gradient(a: &Tensor, dh: &Tensor, dx: &mut Tensor, ld: usize, beta: f32) -> Result<()> {
    let (rows, big_r) = ops::rows_cols("lora backward", dh)?;
    let c_in = a.shape()[1];
    ops::matmul_view(
        GemmShape::single(false, false, rows, c_in, big_r),
        [
            MatrixView::packed(big_r),
            MatrixView::packed(c_in),
            MatrixView { ld, offset: 0 },
        ],
        1.0,
        dh,
        a,
        beta,
        dx,
    )
}

/// Whether a layer's adapters run together in this pass: a training pass, and no dropout.
/// A frozen layer's backward then writes their input gradient first and adds its own
/// product into it (one write of the gradient instead of a write, a read and a write; the
/// `beta = 1` input costs the GEMM less than that second pass at every projection of the
/// Llama-3.2-1B shape on an H100).
pub fn together(adapters: &[Adapter]) -> bool {
    training_pass().is_some() && grouped(adapters)
}

/// Whether the layer's product should run after its adapters: they run [`together`], cover
/// every output column, and the output is at least twice as wide as the input. Then the
/// adapters write their columns and the layer's product adds into them as its GEMM's
/// `beta = 1` input, instead of each adapter's output being read and written again after the
/// product. Reading `C` costs the GEMM's epilogue time of its own, so this pays only where
/// the output is wide: measured on an H100 at the Llama-3.2-1B shape (bf16, 8 x 1024), the
/// gate/up projection (output 8x its input) saved about 120 us a layer, query/key/value
/// (1.5x) broke even, and the output and down projections (1x, 0.25x) lost 4 and 11 us.
pub fn adapters_first(adapters: &[Adapter], c_in: usize, c_out: usize) -> bool {
    together(adapters)
        && c_out >= 2 * c_in
        && adapters.iter().map(|a| a.block.cols).sum::<usize>() == c_out
}

/// Every adapter's output for input `x` into its columns of `y`: added to them (`beta` 1),
/// or written over them (`beta` 0, only with [`adapters_first`]). In a training pass without
/// dropout one `x A^T` serves them all and is kept in `slot` for the backward; otherwise each
/// adapter runs alone.
pub fn forward_layer(
    adapters: &[Adapter],
    y: &mut Tensor,
    x: &Tensor,
    slot: &KeptSlot,
    beta: f32,
) -> Result<()> {
    if adapters.is_empty() {
        return Ok(());
    }
    slot.put(None);
    let pass = training_pass();
    let Some(pass) = pass.filter(|_| grouped(adapters)) else {
        debug_assert_eq!(beta, 1.0, "adapters run alone add into the output");
        return adapters.iter().try_for_each(|ad| ad.forward_into(y, x));
    };
    let (stacked, h) = stacked_h(adapters, x)?;
    add_outputs(adapters, &h, y, beta)?;
    slot.put(Some(Kept {
        pass,
        len: x.len(),
        stacked,
        h,
    }));
    Ok(())
}

/// The backward of [`forward_layer`]: accumulates every adapter's gradients from the layer's
/// output gradient `dy` and adds their input gradient into `dx` (`beta` 1) or writes it
/// there (`beta` 0, only when they run [`together`]), with `H` from `slot` when the forward
/// of this pass kept it.
pub fn backward_layer(
    adapters: &mut [Adapter],
    dy: &Tensor,
    x: &Tensor,
    dx: &mut Tensor,
    slot: &KeptSlot,
    beta: f32,
) -> Result<()> {
    if adapters.is_empty() {
        return Ok(());
    }
    let kept = slot.take();
    if !grouped(adapters) {
        debug_assert_eq!(beta, 1.0, "adapters run alone add into the input gradient");
        return adapters
            .iter_mut()
            .try_for_each(|ad| ad.backward(dy, x, dx));
    }
    let (stacked, h) = match kept {
        Some(k) if Some(k.pass) == training_pass() && k.len == x.len() => (k.stacked, k.h),
        _ => stacked_h(adapters, x)?,
    };
    let dh = gradients(adapters, dy, x, h)?;
    let (_, c_in) = ops::rows_cols("lora backward", x)?;
    input_gradient(all_a(adapters, &stacked), &dh, dx, c_in, beta)
}

/// `scale * H[:, k] B^T` of every adapter into its columns of `y` (`beta` 1: added; 0:
/// written), `H` holding the adapters' `x A^T` side by side (`[rows, R]`).
fn add_outputs(adapters: &[Adapter], h: &Tensor, y: &mut Tensor, beta: f32) -> Result<()> {
    let (rows, row) = ops::rows_cols("lora forward", y)?;
    let big_r = h.shape()[h.shape().len() - 1];
    let mut k0 = 0;
    for ad in adapters {
        let r = ad.rank();
        ops::matmul_view(
            GemmShape::single(false, true, rows, ad.block.cols, r),
            [
                MatrixView {
                    ld: big_r,
                    offset: k0,
                },
                MatrixView::packed(r),
                ad.columns_of(row),
            ],
            ad.scale,
            h,
            ad.b.weight(),
            beta,
            y,
        )?;
        k0 += r;
    }
    Ok(())
}

/// `dA = dH^T @ x` (`[R, in]`) for every adapter that trains: straight into a single adapter's
/// gradient, else into an f32 scratch whose rows each adapter adds to its own (or copies, on a
/// step's first write). `x` is read through `x_view` (its rows may be wider than `c_in`).
fn a_gradients(
    adapters: &mut [Adapter],
    dh: &Tensor,
    x: &Tensor,
    x_view: MatrixView,
    c_in: usize,
) -> Result<()> {
    let (rows, big_r) = ops::rows_cols("lora backward", dh)?;
    let views = [MatrixView::packed(big_r), x_view, MatrixView::packed(c_in)];
    let shape = GemmShape::single(true, false, big_r, c_in, rows);
    if let [ad] = adapters {
        if let Some(da) = ad.a.grad_target() {
            ops::matmul_view(shape, views, 1.0, dh, x, da.beta(), da.grad)?;
        }
    } else if adapters.iter().any(|ad| !ad.a.frozen) {
        // The product writes every element (beta = 0).
        let mut da_all = Tensor::uninit(dh.pool(), &[big_r, c_in], DType::F32)?;
        ops::matmul_view(shape, views, 1.0, dh, x, 0.0, &mut da_all)?;
        let mut k0 = 0;
        for ad in adapters.iter_mut() {
            let n = ad.rank() * c_in;
            if let Some(da) = ad.a.grad_target() {
                if da.overwrite {
                    ops::copy_from_at(da.grad, &da_all, k0)?;
                } else {
                    ops::add_from_at(da.grad, &da_all, k0)?;
                }
            }
            k0 += n;
        }
    }
    Ok(())
}

/// Accumulates every adapter's `A` and `B` gradients from the layer's output gradient `dy`,
/// their input `x` and `H = x A^T` (side by side, `[rows, R]`), and returns
/// `dH = scale * dy[:, block] @ B` for each adapter's columns (`[rows, R]`), from which the
/// caller makes the input gradient.
fn gradients(adapters: &mut [Adapter], dy: &Tensor, x: &Tensor, h: Tensor) -> Result<Tensor> {
    let (rows, row) = ops::rows_cols("lora backward", dy)?;
    let (_, c_in) = ops::rows_cols("lora backward", x)?;
    let big_r = total_rank(adapters);
    let mut dh = Tensor::uninit(dy.pool(), &[rows, big_r], h.dtype())?;
    let mut k0 = 0;
    for ad in adapters.iter_mut() {
        let (r, cols) = (ad.rank(), ad.block.cols);
        let dy_block = ad.columns_of(row);
        let own = MatrixView {
            ld: big_r,
            offset: k0,
        };
        ops::matmul_view(
            GemmShape::single(false, false, rows, r, cols),
            [dy_block, MatrixView::packed(r), own],
            ad.scale,
            dy,
            ad.b.weight(),
            0.0,
            &mut dh,
        )?;
        // dB += scale * dy[:, block]^T @ H[:, k]   ([cols, r]); = on a step's first write.
        if let Some(db) = ad.b.grad_target() {
            ops::matmul_view(
                GemmShape::single(true, false, cols, r, rows),
                [dy_block, own, MatrixView::packed(r)],
                ad.scale,
                dy,
                &h,
                db.beta(),
                db.grad,
            )?;
        }
        k0 += r;
    }
    drop(h);
    a_gradients(adapters, &dh, x, MatrixView::packed(c_in), c_in)?;
    Ok(dh)
}

/// Whether adapters may be folded into their layers' products (`KILN_LORA_FOLD=0` keeps them
/// apart, so that one binary can be measured both ways).
fn fold_switched_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    !FOLD_OFF.with(Cell::get)
        && *ON.get_or_init(|| std::env::var("KILN_LORA_FOLD").map_or(true, |v| v != "0"))
}

/// Keeps this thread's adapters apart from their layers' products (`off`) or lets them fold.
#[cfg(test)]
pub(crate) fn keep_apart_on_this_thread(off: bool) {
    FOLD_OFF.with(|f| f.set(off));
}

/// The columns by which a frozen layer's input is widened when its adapters are folded into
/// its product (see the module comment), or 0 when they are not: in a training pass with the
/// adapters [`together`], one scale for all of them (it goes into `x A^T`), a total rank that
/// keeps 16-bit rows 16-byte aligned, and a widened input no wider than the power of two at or
/// above the layer's input width `c_in`. That last bound is measured, not derived: cuBLASLt's
/// products slow by about a sixth once their reduction passes 2048 (an H200, bf16: the
/// Llama-3.2-1B gate/up product 681 us at 2048, 802 us at 2080 and 2112), which took the whole
/// gain of the fold at that shape, while SmolLM2-135M's 576 widened to 608 and 624 gained
/// (`docs/perf-log.md`, "LoRA adapters folded into their frozen products").
pub fn fold_width(adapters: &[Adapter], c_in: usize) -> usize {
    if !fold_switched_on() || !together(adapters) {
        return 0;
    }
    let scale = adapters[0].scale;
    let big_r = total_rank(adapters);
    if adapters.iter().any(|a| a.scale != scale)
        || !big_r.is_multiple_of(8)
        || c_in + big_r > c_in.next_power_of_two()
    {
        return 0;
    }
    big_r
}

/// Adds `scale * x A^T` of every adapter into the last `R` columns of the widened input `x`
/// (`[rows, in + R]`, zeros there as its norm writes them).
pub fn fold_inputs(adapters: &[Adapter], x: &mut Tensor) -> Result<()> {
    let (rows, wide) = ops::rows_cols("lora fold", x)?;
    let big_r = total_rank(adapters);
    let c_in = wide - big_r;
    let stacked = stack_a(adapters)?;
    let h = ops::matmul_view_new(
        GemmShape::single(false, true, rows, big_r, c_in),
        [
            MatrixView {
                ld: wide,
                offset: 0,
            },
            MatrixView::packed(c_in),
            MatrixView::packed(big_r),
        ],
        adapters[0].scale,
        x,
        all_a(adapters, &stacked),
    )?;
    ops::add_cols_scaled(x, &h, c_in, 1.0)
}

/// The backward of a folded layer's adapters. `dx` is the frozen product's input gradient
/// `dY [W | B]` (`[rows, in + R]`), whose last `R` columns are `dY B`, and `x` the widened
/// input, whose last `R` columns hold `scale * x A^T`: accumulates every adapter's gradients
/// and adds their input gradient `scale * dY B A` into `dx`'s first `in` columns.
pub fn fold_backward(
    adapters: &mut [Adapter],
    dy: &Tensor,
    x: &Tensor,
    dx: &mut Tensor,
) -> Result<()> {
    let (rows, wide) = ops::rows_cols("lora fold backward", x)?;
    let (_, row) = ops::rows_cols("lora fold backward", dy)?;
    let big_r = total_rank(adapters);
    let c_in = wide - big_r;
    let dh = ops::cols_scaled(dx, c_in, big_r, adapters[0].scale)?;
    let mut k0 = 0;
    for ad in adapters.iter_mut() {
        let (r, cols, dy_block) = (ad.rank(), ad.block.cols, ad.columns_of(row));
        // dB += dy[:, block]^T @ (scale * H[:, k])   ([cols, r]); = on a step's first write.
        if let Some(db) = ad.b.grad_target() {
            ops::matmul_view(
                GemmShape::single(true, false, cols, r, rows),
                [
                    dy_block,
                    MatrixView {
                        ld: wide,
                        offset: c_in + k0,
                    },
                    MatrixView::packed(r),
                ],
                1.0,
                dy,
                x,
                db.beta(),
                db.grad,
            )?;
        }
        k0 += r;
    }
    a_gradients(
        adapters,
        &dh,
        x,
        MatrixView {
            ld: wide,
            offset: 0,
        },
        c_in,
    )?;
    let stacked = stack_a(adapters)?;
    input_gradient(all_a(adapters, &stacked), &dh, dx, wide, 1.0)
}

/// A frozen layer's weight widened by its adapters' `B`s, `[W | B]` (`[out, in + R]`): each
/// adapter's `B` in its block of rows at its columns of the last `R`, zeros elsewhere. Built
/// on a layer's first folded forward and kept (a second copy of the frozen weight).
#[derive(Default)]
pub struct FoldedWeight(Mutex<Option<Tensor>>);

impl FoldedWeight {
    /// Runs `f` on the widened weight of `w` and `adapters`; with `refresh` (each forward) the
    /// adapters' current `B`s are copied in first.
    pub fn with<T>(
        &self,
        adapters: &[Adapter],
        w: &Tensor,
        refresh: bool,
        f: impl FnOnce(&Tensor) -> Result<T>,
    ) -> Result<T> {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (c_out, c_in) = (w.shape()[0], w.shape()[1]);
        let big_r = total_rank(adapters);
        let wide = c_in + big_r;
        let stale = held
            .as_ref()
            .is_none_or(|t| t.shape() != [c_out, wide].as_slice() || t.dtype() != w.dtype());
        if stale {
            let mut t = Tensor::zeros(w.pool(), &[c_out, wide], w.dtype())?;
            ops::add_cols_scaled(&mut t, w, 0, 1.0)?;
            *held = Some(t);
        }
        let t = held.as_mut().expect("built above");
        if refresh || stale {
            let mut k0 = 0;
            for ad in adapters {
                ops::set_block(t, ad.b.weight(), ad.block.col0, c_in + k0)?;
                k0 += ad.rank();
            }
        }
        f(t)
    }

    /// Drops the widened copy (the adapters were merged or removed).
    pub fn clear(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

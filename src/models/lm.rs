//! The language-model skeleton every decoder family shares: a token embedding, a stack of
//! pre-norm [`Block`]s, a final norm, a head (tied to the embedding table or not) and the
//! cross-entropy loss.
//!
//! Each block opens with a norm of the residual stream ([`Block::norm`]). The forward runs
//! that norm of the first block on the embedding; every later one, and the final norm, runs
//! fused with the residual add that closes the block before it, so a block hands the next its
//! input and that input's norm at once. The backward walks the blocks in reverse with one
//! gradient buffer for the residual stream and tells a data-parallel hook, as each block
//! finishes, which gradients are final.
//!
//! With [`Recompute::Blocks`] the forward keeps only each block's input and the backward
//! rebuilds the block's activations right before its backward, so one block's activations are
//! alive at a time. The rebuilt activations are bit-identical to kept ones: the same kernels
//! run on the same inputs, and the block's first norm, fused with the previous residual add in
//! the forward, normalises the same stored sum when re-run on its own.
//!
//! A family supplies the block (its layers, forward and backward), the per-pass inputs its
//! blocks share ([`Block::Pass`]: positions and rotary tables, the weight of an auxiliary loss)
//! and what sets it apart outside the stack (a cached decoder, adapters, auxiliary losses).

use super::{GradReady, Recompute, StepPrecision, padded_vocab};
use crate::engine::ops::{self, NormStats};
use crate::engine::{Phase, Result, Tensor};
use crate::nn::embedding::Embedding;
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::rmsnorm::RmsNorm;
use crate::nn::{ActLayout, Cost, Kernels, Param, Params, params};

/// A norm of the residual stream, alone or fused with the residual add before it.
pub trait StreamNorm: Params + Send {
    /// What the norm's backward needs besides its input.
    type Stats;
    /// Whether the norm writes rows wider than its input (for a projection whose adapters are
    /// folded into it, `nn::lora`) and reads its output gradient from such rows.
    const WIDENS: bool = false;

    /// `(normed, stats)` of `x`.
    fn normalize(&self, x: &Tensor) -> Result<(Tensor, Self::Stats)>;

    /// [`StreamNorm::normalize`] into rows `pad` columns wider (zeros there); only norms that
    /// [`StreamNorm::WIDENS`] take a `pad` above 0.
    fn normalize_widened(&self, x: &Tensor, pad: usize) -> Result<(Tensor, Self::Stats)> {
        debug_assert_eq!(pad, 0, "this norm does not widen its rows");
        self.normalize(x)
    }

    /// [`StreamNorm::add_normalize`] into rows `pad` columns wider (see
    /// [`StreamNorm::normalize_widened`]).
    fn add_normalize_widened(
        &self,
        x: &Tensor,
        delta: &Tensor,
        pad: usize,
        kernels: Kernels,
    ) -> Result<(Tensor, Tensor, Self::Stats)> {
        debug_assert_eq!(pad, 0, "this norm does not widen its rows");
        self.add_normalize(x, delta, kernels)
    }

    /// `sum = x + delta` and its norm: `(sum, normed, stats)`.
    fn add_normalize(
        &self,
        x: &Tensor,
        delta: &Tensor,
        kernels: Kernels,
    ) -> Result<(Tensor, Tensor, Self::Stats)>;

    /// Accumulates into `dx` the gradient of the norm's input `x` (for the fused form, of the
    /// sum, which is also the gradient of both addends).
    fn backward_into(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        stats: &Self::Stats,
        kernels: Kernels,
    ) -> Result<()>;
}

impl StreamNorm for LayerNorm {
    type Stats = NormStats;

    fn normalize(&self, x: &Tensor) -> Result<(Tensor, NormStats)> {
        self.forward(x)
    }

    fn add_normalize(
        &self,
        x: &Tensor,
        delta: &Tensor,
        kernels: Kernels,
    ) -> Result<(Tensor, Tensor, NormStats)> {
        self.forward_residual_with(x, delta, kernels)
    }

    fn backward_into(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        stats: &NormStats,
        kernels: Kernels,
    ) -> Result<()> {
        self.backward_with(dx, dout, x, stats, kernels)
    }
}

/// RMSNorm has no unfused path: the kernel choice does not reach it.
impl StreamNorm for RmsNorm {
    /// The reciprocal root mean square of each row.
    type Stats = Tensor;
    const WIDENS: bool = true;

    fn normalize(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        self.forward(x)
    }

    fn normalize_widened(&self, x: &Tensor, pad: usize) -> Result<(Tensor, Tensor)> {
        ops::rmsnorm_forward_padded(x, self.gamma.weight(), self.eps, pad)
    }

    fn add_normalize_widened(
        &self,
        x: &Tensor,
        delta: &Tensor,
        pad: usize,
        _kernels: Kernels,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        ops::residual_rmsnorm_forward_padded(x, delta, self.gamma.weight(), self.eps, pad)
    }

    fn add_normalize(
        &self,
        x: &Tensor,
        delta: &Tensor,
        _kernels: Kernels,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.forward_residual(x, delta)
    }

    fn backward_into(
        &mut self,
        dx: &mut Tensor,
        dout: &Tensor,
        x: &Tensor,
        rstd: &Tensor,
        _kernels: Kernels,
    ) -> Result<()> {
        self.backward(dx, dout, x, rstd)
    }
}

/// The layer that turns token ids into the residual stream, whose token table a tied head
/// shares.
pub trait TokenEmbedding: Params + Send {
    fn embed(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Tensor>;

    /// Accumulates into the table gradients (of those that train); the tokens are the
    /// forward's.
    fn embed_backward(&mut self, dstream: &Tensor, tokens: &[u32], seq: usize) -> Result<()>;

    /// The `[padded vocab, C]` token table.
    fn table(&self) -> &Param;
    fn table_mut(&mut self) -> &mut Param;
}

/// Token and learned position embeddings.
impl TokenEmbedding for Embedding {
    fn embed(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Tensor> {
        self.forward(tokens, batch, seq)
    }

    fn embed_backward(&mut self, dstream: &Tensor, tokens: &[u32], seq: usize) -> Result<()> {
        self.backward(dstream, tokens, seq)
    }

    fn table(&self) -> &Param {
        &self.wte
    }

    fn table_mut(&mut self) -> &mut Param {
        &mut self.wte
    }
}

/// A token table alone (positions enter inside the blocks, as rotary embeddings); a frozen
/// table gets no gradient.
impl TokenEmbedding for Param {
    fn embed(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Tensor> {
        ops::token_embedding_forward(tokens, batch, seq, self.weight())
    }

    fn embed_backward(&mut self, dstream: &Tensor, tokens: &[u32], _seq: usize) -> Result<()> {
        match self.grad_mut()? {
            Some(dtable) => ops::token_embedding_backward(dtable, dstream, tokens),
            None => Ok(()),
        }
    }

    fn table(&self) -> &Param {
        self
    }

    fn table_mut(&mut self) -> &mut Param {
        self
    }
}

/// One block of the stack: a norm of the stream that opens it, then branches that add to the
/// stream. The last branch's output is added by the skeleton, fused with the next norm.
pub trait Block: Params + Send + Sized {
    type Norm: StreamNorm;
    /// What the block's backward needs beyond its input and its first norm.
    type Saved;
    /// What the model hands every block in a pass (positions, scales of auxiliary losses).
    type Pass<'p>;
    /// What the forward tells the model of each block (routing statistics), from the
    /// training forward only: recomputation does not report again.
    type Report;

    /// The norm that opens the block.
    fn norm(&self) -> &Self::Norm;

    /// The columns by which the opening norm's output is widened for the block's first
    /// projection (its adapters folded into it: `nn::lora`), 0 for none.
    fn input_fold_width(&self) -> usize {
        0
    }

    /// Fills the widened columns of the opening norm's output (see
    /// [`Block::input_fold_width`]); a no-op on an output that was not widened.
    fn fold_inputs(&self, _normed: &mut Tensor) -> Result<()> {
        Ok(())
    }

    /// Runs the block on its input and that input's norm, short of its last branch's output.
    fn forward(
        &self,
        input: &Tensor,
        normed: &Tensor,
        kernels: Kernels,
        pass: &Self::Pass<'_>,
    ) -> Result<Self::Saved>;

    /// The output of the block's last branch, which the skeleton adds to
    /// [`Block::last_residual`] fused with the next norm.
    fn last_branch(&self, saved: &mut Self::Saved) -> Result<Tensor>;

    /// The stream the last branch adds to.
    fn last_residual(acts: &BlockActs<Self>) -> &Tensor;

    fn report(saved: &Self::Saved) -> Self::Report;

    /// The backward of the whole block, its first norm included: accumulates every parameter
    /// gradient and adds the gradient of the block's input into `dstream`.
    fn backward(
        &mut self,
        dstream: &mut Tensor,
        acts: BlockActs<Self>,
        kernels: Kernels,
        pass: &Self::Pass<'_>,
    ) -> Result<()>;
}

/// One block's activations: its input (the residual stream entering it), the input's norm
/// and what the rest of the block keeps.
pub struct BlockActs<B: Block> {
    pub input: Tensor,
    pub normed: Tensor,
    pub stats: <B::Norm as StreamNorm>::Stats,
    pub saved: B::Saved,
}

/// What the forward keeps of one block for its backward.
pub enum BlockKept<B: Block> {
    All(Box<BlockActs<B>>),
    /// Only the block's input, to recompute the rest from.
    Input(Tensor),
}

/// What the forward keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every block's activations (a backward without recomputation).
    All,
    /// Each block's input (a backward that recomputes blocks).
    BlockInputs,
    /// Only the final norm: evaluation and generation run no backward.
    Output,
}

pub struct Activations<B: Block> {
    pub blocks: Vec<BlockKept<B>>,
    /// One report per block, from a forward that keeps anything.
    pub reports: Vec<B::Report>,
    /// Residual stream after the last block, and its final norm.
    pub last: Tensor,
    pub normed: Tensor,
    pub stats: <B::Norm as StreamNorm>::Stats,
}

/// The skeleton's layers and how it runs.
pub struct Lm<E: TokenEmbedding, B: Block> {
    pub embed: E,
    pub blocks: Vec<B>,
    pub ln_f: B::Norm,
    /// Present only when the head is untied.
    pub head: Option<Linear>,
    /// The real vocabulary (the logits past it are padding).
    pub vocab: usize,
    /// Longest sequence the model accepts.
    pub context: usize,
    /// The family's name, in errors.
    name: &'static str,
    pub recompute: Recompute,
    pub kernels: Kernels,
    grad_ready: Option<GradReady>,
}

params!(impl[E: TokenEmbedding, B: Block] Lm<E, B> { embed, blocks, ln_f, head });

impl<E: TokenEmbedding, B: Block> Lm<E, B> {
    pub fn new(
        name: &'static str,
        embed: E,
        blocks: Vec<B>,
        ln_f: B::Norm,
        head: Option<Linear>,
        vocab: usize,
        context: usize,
    ) -> Lm<E, B> {
        Lm {
            embed,
            blocks,
            ln_f,
            head,
            vocab,
            context,
            name,
            recompute: Recompute::None,
            kernels: Kernels::Fused,
            grad_ready: None,
        }
    }

    pub fn set_grad_ready(&mut self, hook: Option<GradReady>) {
        self.grad_ready = hook;
    }

    /// Index of the first trainable parameter of each block, then of the final norm.
    fn grad_block_starts(&self) -> Vec<usize> {
        super::block_starts(
            self.embed.trainable_count(),
            self.blocks.iter().map(Params::trainable_count),
        )
    }

    /// Tells the hook, if any, that the parameters from index `k` on are final.
    fn grads_final_from(&mut self, k: usize) {
        if let Some(h) = &mut self.grad_ready {
            h(k);
        }
    }

    /// The norm that follows block `l`: the next block's first, or the final one.
    pub fn norm_after(&self, l: usize) -> &B::Norm {
        self.blocks.get(l + 1).map_or(&self.ln_f, |b| b.norm())
    }

    /// How much wider block `l`'s opening norm writes its rows (0 past the last block: the
    /// final norm feeds the head).
    fn fold_width_of(&self, l: usize) -> usize {
        self.blocks.get(l).map_or(0, Block::input_fold_width)
    }

    /// The norm of the stream entering the stack: the first block's, or the final one.
    pub fn first_norm(&self) -> &B::Norm {
        self.blocks.first().map_or(&self.ln_f, |b| b.norm())
    }

    pub fn forward(
        &self,
        tokens: &[u32],
        batch: usize,
        seq: usize,
        keep: Keep,
        pass: &B::Pass<'_>,
    ) -> Result<Activations<B>> {
        super::check_context(self.name, seq, self.context)?;
        let kernels = self.kernels;
        let mut input = self.embed.embed(tokens, batch, seq)?;
        let (mut normed, mut stats) = self
            .first_norm()
            .normalize_widened(&input, self.fold_width_of(0))?;
        let mut kept = Vec::with_capacity(self.blocks.len());
        let mut reports = Vec::with_capacity(self.blocks.len());
        for (l, block) in self.blocks.iter().enumerate() {
            block.fold_inputs(&mut normed)?;
            let mut saved = block.forward(&input, &normed, kernels, pass)?;
            let out = block.last_branch(&mut saved)?;
            let acts = BlockActs {
                input,
                normed,
                stats,
                saved,
            };
            let (next, next_normed, next_stats) = self.norm_after(l).add_normalize_widened(
                B::last_residual(&acts),
                &out,
                self.fold_width_of(l + 1),
                kernels,
            )?;
            drop(out);
            if keep != Keep::Output {
                reports.push(B::report(&acts.saved));
            }
            match keep {
                Keep::All => kept.push(BlockKept::All(Box::new(acts))),
                Keep::BlockInputs => kept.push(BlockKept::Input(acts.input)),
                Keep::Output => {}
            }
            (input, normed, stats) = (next, next_normed, next_stats);
        }
        Ok(Activations {
            blocks: kept,
            reports,
            last: input,
            normed,
            stats,
        })
    }

    pub fn head_weight(&self) -> &Tensor {
        self.head
            .as_ref()
            .map_or(self.embed.table().weight(), |h| h.weight.weight())
    }

    pub fn logits(&self, acts: &Activations<B>) -> Result<Tensor> {
        ops::linear_forward(&acts.normed, self.head_weight(), None)
    }

    /// Forward and backward on one micro-batch, every token's loss weighted by
    /// `p.grad_scale`, times `token_weights[t]` when given. Returns the sum of the token
    /// losses and the blocks' reports.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        p: StepPrecision,
        pass: &B::Pass<'_>,
        token_weights: Option<&[f32]>,
    ) -> Result<(f64, Vec<B::Report>)> {
        let keep = match self.recompute {
            Recompute::None => Keep::All,
            Recompute::Blocks => Keep::BlockInputs,
        };
        let acts = self.forward(inputs, batch, seq, keep, pass)?;
        // What the forward kept is saved; the head, the loss and the backward are transient.
        acts.normed.pool().set_phase(Phase::Backward);
        let kernels = self.kernels;
        let (losses, mut dlogits) = match kernels {
            Kernels::Fused => {
                let mut dlogits = self.logits(&acts)?;
                let losses =
                    ops::cross_entropy_fused(&mut dlogits, targets, self.vocab, p.grad_scale)?;
                (losses, dlogits)
            }
            Kernels::Unfused => {
                let logits = self.logits(&acts)?;
                ops::cross_entropy_unfused(&logits, targets, self.vocab, p.grad_scale)?
            }
        };
        ops::round_in_place(&mut dlogits, p.grad_dtype)?;
        // Token weights scale rows of the logits' gradient. The head is linear, so the same
        // result comes from scaling the head's input rows for its weight gradient and the
        // rows of its input gradient: two tensors of the model's width instead of a second
        // one of the vocabulary's.
        let scale_rows = |t: &Tensor, w: &[f32]| -> Result<Tensor> {
            let all: Vec<u32> = (0..w.len() as u32).collect();
            Ok(ops::gather_rows(t, &all, Some(w))?.reshaped(t.shape()))
        };
        let scaled_normed = token_weights
            .map(|w| scale_rows(&acts.normed, w))
            .transpose()?;
        let head_input = scaled_normed.as_ref().unwrap_or(&acts.normed);
        let d_normed = match &mut self.head {
            Some(head) => head.backward(&dlogits, head_input)?,
            None => {
                let (w, dw) = self.embed.table_mut().weight_and_grad_target();
                ops::linear_backward(&dlogits, head_input, w, dw, None)?
            }
        };
        drop((dlogits, scaled_normed));
        let d_normed = match token_weights {
            Some(w) => scale_rows(&d_normed, w)?,
            None => d_normed,
        };
        let Activations {
            blocks: mut kept,
            reports,
            last,
            normed,
            stats,
        } = acts;
        drop(normed);
        // `dstream` is the gradient of the residual stream, carried down through the blocks.
        let mut dstream = Tensor::zeros(last.pool(), last.shape(), last.dtype())?;
        // The final norm (fused with the last block's residual add) comes first.
        self.ln_f
            .backward_into(&mut dstream, &d_normed, &last, &stats, kernels)?;
        drop((d_normed, last));
        let starts = self.grad_ready.as_ref().map(|_| self.grad_block_starts());
        if let Some(s) = &starts {
            self.grads_final_from(s[self.blocks.len()]);
        }
        while let Some(block_kept) = kept.pop() {
            let block = &mut self.blocks[kept.len()];
            let acts = match block_kept {
                BlockKept::All(a) => *a,
                BlockKept::Input(input) => {
                    let (mut normed, stats) = block
                        .norm()
                        .normalize_widened(&input, block.input_fold_width())?;
                    block.fold_inputs(&mut normed)?;
                    let saved = block.forward(&input, &normed, kernels, pass)?;
                    BlockActs {
                        input,
                        normed,
                        stats,
                        saved,
                    }
                }
            };
            block.backward(&mut dstream, acts, kernels, pass)?;
            if let Some(s) = &starts {
                self.grads_final_from(s[kept.len()]);
            }
        }
        self.embed.embed_backward(&dstream, inputs, seq)?;
        if starts.is_some() {
            self.grads_final_from(0);
        }
        Ok((losses.iter().map(|&l| l as f64).sum(), reports))
    }

    /// Sum of token losses without touching gradients (evaluation).
    pub fn loss(
        &self,
        inputs: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        pass: &B::Pass<'_>,
    ) -> Result<f64> {
        let acts = self.forward(inputs, batch, seq, Keep::Output, pass)?;
        let logits = self.logits(&acts)?;
        Ok(ops::cross_entropy(&logits, targets, self.vocab)?
            .iter()
            .map(|&l| l as f64)
            .sum())
    }

    /// Logits `[vocab]` for the token after the last of `tokens`, from the logits of every
    /// position.
    pub fn next_logits(&self, tokens: &[u32], pass: &B::Pass<'_>) -> Result<Vec<f32>> {
        let acts = self.forward(tokens, 1, tokens.len(), Keep::Output, pass)?;
        let logits = self.logits(&acts)?.to_vec()?;
        let row = (tokens.len() - 1) * padded_vocab(self.vocab);
        Ok(logits[row..row + self.vocab].to_vec())
    }
}

/// The cost of the head for `tokens` rows of `c` features over `padded_vocab` logits: its
/// weight only when untied, and the logits buffer (reused in place for its gradient) among
/// the saved bytes.
pub fn head_cost(
    c: usize,
    padded_vocab: usize,
    tied: bool,
    tokens: usize,
    layout: ActLayout,
) -> Cost {
    let head = Linear::cost_of(c, padded_vocab, false, tokens);
    Cost {
        params: if tied { 0 } else { head.params },
        saved_bytes: layout.act_bytes(tokens * padded_vocab),
        ..head
    }
}

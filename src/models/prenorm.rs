//! The pre-norm transformer block the GPT and Llama families share: a norm, a mixer over
//! positions (attention), the residual add fused with a second norm, and a feed-forward.
//!
//! A family picks the three layer kinds (LayerNorm or RMSNorm, causal or grouped-query
//! attention, GELU MLP or SwiGLU) and gets the forward, the backward and their order of
//! frees once. The order matters beyond the arithmetic: each activation is dropped as soon as
//! the backward is past it, so the memory planner's meta run and a real run book the same
//! peak.

use super::lm::{Block, BlockActs, StreamNorm};
use crate::engine::{Result, Tensor};
use crate::nn::attention::{AttnSaved, CausalSelfAttention};
use crate::nn::mlp::{Mlp, MlpSaved};
use crate::nn::swiglu::{SwiGlu, SwiGluSaved};
use crate::nn::{Kernels, Params, params};

/// The sublayer that mixes positions: attention of one kind or another.
pub trait Mixer: Params + Send {
    /// What the backward needs.
    type Saved;
    /// What every block of a pass shares (positions and rotary tables, or nothing).
    type Pass<'p>;

    /// `(output, saved)` of the normed stream `x`.
    fn mix(
        &self,
        x: &Tensor,
        kernels: Kernels,
        pass: &Self::Pass<'_>,
    ) -> Result<(Tensor, Self::Saved)>;

    /// Accumulates the parameter gradients and returns the gradient of `x`.
    fn mix_backward(
        &mut self,
        dout: &Tensor,
        x: &Tensor,
        pass: &Self::Pass<'_>,
        saved: &Self::Saved,
    ) -> Result<Tensor>;

    /// The columns by which the normed input is widened for a projection whose adapters are
    /// folded into it (`nn::lora`), 0 for none; [`Mixer::fold_inputs`] fills them (and leaves
    /// an input that was not widened alone).
    fn fold_width(&self) -> usize {
        0
    }

    fn fold_inputs(&self, _x: &mut Tensor) -> Result<()> {
        Ok(())
    }
}

/// The position-wise feed-forward, split before its output projection so the skeleton can
/// fuse that projection's residual add with the next block's norm.
pub trait FeedForward: Params + Send {
    type Saved;

    /// Everything short of the output projection.
    fn hidden(&self, x: &Tensor) -> Result<Self::Saved>;

    /// The output projection of `saved`'s hidden activations.
    fn project(&self, saved: &Self::Saved) -> Result<Tensor>;

    /// Accumulates the parameter gradients and returns the gradient of `x`.
    fn ff_backward(&mut self, dout: &Tensor, x: &Tensor, saved: &Self::Saved) -> Result<Tensor>;

    /// As [`Mixer::fold_width`], for the feed-forward's input projection.
    fn fold_width(&self) -> usize {
        0
    }

    fn fold_inputs(&self, _x: &mut Tensor) -> Result<()> {
        Ok(())
    }
}

/// `x + mixer(norm1(x))`, then `+ ff(norm2(...))`, the second add left to the skeleton.
pub struct PreNormBlock<N, A, F> {
    pub ln1: N,
    pub attn: A,
    pub ln2: N,
    pub mlp: F,
}

params!(impl[N: Params, A: Params, F: Params] PreNormBlock<N, A, F> {
    ln1,
    attn,
    ln2,
    mlp
});

/// What a block keeps beyond its input and first norm: `mid` is the stream after the
/// attention add, `ln2` its norm.
pub struct PreNormSaved<N: StreamNorm, A: Mixer, F: FeedForward> {
    attn: A::Saved,
    mid: Tensor,
    ln2: Tensor,
    ln2_stats: N::Stats,
    mlp: F::Saved,
}

impl<N: StreamNorm, A: Mixer, F: FeedForward> Block for PreNormBlock<N, A, F> {
    type Norm = N;
    type Saved = PreNormSaved<N, A, F>;
    type Pass<'p> = A::Pass<'p>;
    type Report = ();

    fn norm(&self) -> &N {
        &self.ln1
    }

    fn input_fold_width(&self) -> usize {
        if N::WIDENS { self.attn.fold_width() } else { 0 }
    }

    fn fold_inputs(&self, normed: &mut Tensor) -> Result<()> {
        self.attn.fold_inputs(normed)
    }

    /// Attention, the residual add fused with the second norm, and the feed-forward short
    /// of its output projection.
    fn forward(
        &self,
        input: &Tensor,
        ln1: &Tensor,
        kernels: Kernels,
        pass: &A::Pass<'_>,
    ) -> Result<Self::Saved> {
        let (attn_out, attn) = self.attn.mix(ln1, kernels, pass)?;
        let pad = if N::WIDENS { self.mlp.fold_width() } else { 0 };
        let (mid, mut ln2, ln2_stats) = self
            .ln2
            .add_normalize_widened(input, &attn_out, pad, kernels)?;
        drop(attn_out);
        self.mlp.fold_inputs(&mut ln2)?;
        let mlp = self.mlp.hidden(&ln2)?;
        Ok(PreNormSaved {
            attn,
            mid,
            ln2,
            ln2_stats,
            mlp,
        })
    }

    fn last_branch(&self, saved: &mut Self::Saved) -> Result<Tensor> {
        self.mlp.project(&saved.mlp)
    }

    fn last_residual(acts: &BlockActs<Self>) -> &Tensor {
        &acts.saved.mid
    }

    fn report(_saved: &Self::Saved) {}

    fn backward(
        &mut self,
        dstream: &mut Tensor,
        a: BlockActs<Self>,
        kernels: Kernels,
        pass: &A::Pass<'_>,
    ) -> Result<()> {
        let s = &a.saved;
        let d_ln2 = self.mlp.ff_backward(dstream, &s.ln2, &s.mlp)?;
        self.ln2
            .backward_into(dstream, &d_ln2, &s.mid, &s.ln2_stats, kernels)?;
        drop(d_ln2);
        let d_ln1 = self.attn.mix_backward(dstream, &a.normed, pass, &s.attn)?;
        self.ln1
            .backward_into(dstream, &d_ln1, &a.input, &a.stats, kernels)
    }
}

/// The GPT's causal attention: positions come from the embedding, so a pass shares nothing.
impl Mixer for CausalSelfAttention {
    type Saved = AttnSaved;
    type Pass<'p> = ();

    fn mix(&self, x: &Tensor, kernels: Kernels, _pass: &()) -> Result<(Tensor, AttnSaved)> {
        self.forward(x, kernels)
    }

    fn mix_backward(
        &mut self,
        dout: &Tensor,
        x: &Tensor,
        _pass: &(),
        saved: &AttnSaved,
    ) -> Result<Tensor> {
        self.backward(dout, x, saved)
    }
}

impl FeedForward for Mlp {
    type Saved = MlpSaved;

    fn hidden(&self, x: &Tensor) -> Result<MlpSaved> {
        self.activations(x)
    }

    fn project(&self, saved: &MlpSaved) -> Result<Tensor> {
        self.output(saved)
    }

    fn ff_backward(&mut self, dout: &Tensor, x: &Tensor, saved: &MlpSaved) -> Result<Tensor> {
        self.backward(dout, x, saved)
    }
}

impl FeedForward for SwiGlu {
    type Saved = SwiGluSaved;

    fn fold_width(&self) -> usize {
        self.gate_up.fold_width()
    }

    fn fold_inputs(&self, x: &mut Tensor) -> Result<()> {
        self.gate_up.fold_inputs(x)
    }

    fn hidden(&self, x: &Tensor) -> Result<SwiGluSaved> {
        self.activations(x)
    }

    fn project(&self, saved: &SwiGluSaved) -> Result<Tensor> {
        self.output(saved)
    }

    fn ff_backward(&mut self, dout: &Tensor, x: &Tensor, saved: &SwiGluSaved) -> Result<Tensor> {
        self.backward(dout, x, saved)
    }
}

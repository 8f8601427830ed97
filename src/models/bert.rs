//! A BERT-family encoder (BERT, MiniLM and most sentence-transformers checkpoints): word,
//! position and token-type embeddings summed and normalised, then post-norm blocks of
//! bidirectional attention with a key padding mask and an exact-erf GELU feed-forward.
//!
//! Each block computes, for the residual stream `x` of a right-padded batch:
//!
//! ```text
//! h = LayerNorm(x + Attn(x))        attention over each sequence's real tokens only
//! y = LayerNorm(h + W2 gelu(W1 h))  gelu(x) = x * Phi(x), transformers' "gelu"
//! ```
//!
//! [`Bert::forward`] is the frozen feature extractor (`kiln embed`, `kiln classify`): it
//! keeps no activations. [`Bert::forward_train`] keeps what [`Bert::backward`] needs to
//! fine-tune the encoder, fully or through low-rank adapters ([`Bert::attach_lora`]); its
//! attention runs unfused (batched GEMMs around a padded softmax whose `[B, H, T, T]`
//! probabilities it keeps), which works on every device, and there is no dropout. Weights use
//! kiln's names (`layers.N.attn.qkv.weight` with the query, key and value projections fused);
//! `models::import::bert` maps Hugging Face checkpoints onto them, and the linear layers name
//! their output blocks as Hugging Face does (`encoder.layer.N.attention.self.query`, ...) so
//! adapters target them as PEFT does.

use crate::engine::AttnShape;
use crate::engine::GemmShape;
use crate::engine::ops::NormStats;
use crate::engine::rng::{Rng, stream};
use crate::engine::{DType, EngineError, MemoryPool, Result, Tensor, ops};
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::lora::LoraSpec;
use crate::nn::{Cost, Init, Param, ParamBuilder, Params, params};
use std::sync::Arc;

/// The shape of a BERT-family encoder (transformers' `BertConfig` names in the comments).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct BertConfig {
    /// `vocab_size`
    pub vocab: usize,
    /// `hidden_size`
    pub d_model: usize,
    /// `num_hidden_layers`
    pub n_layers: usize,
    /// `num_attention_heads`
    pub n_heads: usize,
    /// `intermediate_size`
    pub ffn_hidden: usize,
    /// `max_position_embeddings`: the longest sequence, special tokens included.
    pub max_positions: usize,
    /// `type_vocab_size`: segment ids (2 for sentence pairs).
    pub type_vocab: usize,
    /// `layer_norm_eps` (1e-12 for BERT).
    pub norm_eps: f32,
}

impl BertConfig {
    /// Why this shape cannot be built, if it cannot.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return Err(format!(
                "width {} does not split into {} attention heads",
                self.d_model, self.n_heads
            ));
        }
        if self.vocab == 0 || self.max_positions == 0 || self.type_vocab == 0 {
            return Err("the vocabulary, position and token-type tables must be non-empty".into());
        }
        Ok(())
    }
}

/// One post-norm block.
pub struct BertLayer {
    pub qkv: Linear,
    pub attn_out: Linear,
    pub ln_attn: LayerNorm,
    pub fc_in: Linear,
    pub fc_out: Linear,
    pub ln_mlp: LayerNorm,
}

params!(BertLayer {
    qkv,
    attn_out,
    ln_attn,
    fc_in,
    fc_out,
    ln_mlp
});

pub struct Bert {
    pub cfg: BertConfig,
    pub word: Param,
    pub position: Param,
    pub token_type: Param,
    pub ln_embed: LayerNorm,
    pub layers: Vec<BertLayer>,
}

params!(Bert {
    word,
    position,
    token_type,
    ln_embed,
    layers
});

/// Right-padded token sequences: `tokens` and `type_ids` are `[batch, seq]`, and sequence
/// `b` holds `lens[b]` real tokens followed by padding (whose ids are never attended to).
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderBatch {
    pub tokens: Vec<u32>,
    pub type_ids: Vec<u32>,
    pub lens: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
}

impl EncoderBatch {
    /// Pads `seqs` (token ids with their token types) on the right with `pad` to the longest.
    pub fn pad(seqs: &[(&[u32], &[u32])], pad: u32) -> EncoderBatch {
        EncoderBatch::pad_to(seqs, pad, 1, 0)
    }

    /// As [`EncoderBatch::pad`], with the padded length rounded up to a multiple of
    /// `multiple` but not past `cap` (unless the longest sequence is longer). Batches of
    /// texts sorted by length then share a few shapes, so GEMM algorithms chosen for one
    /// batch serve the next instead of being searched for again.
    pub fn pad_to(
        seqs: &[(&[u32], &[u32])],
        pad: u32,
        multiple: usize,
        cap: usize,
    ) -> EncoderBatch {
        let longest = seqs.iter().map(|(t, _)| t.len()).max().unwrap_or(0);
        let seq = longest
            .next_multiple_of(multiple.max(1))
            .min(cap.max(longest));
        let mut b = EncoderBatch {
            tokens: Vec::with_capacity(seqs.len() * seq),
            type_ids: Vec::with_capacity(seqs.len() * seq),
            lens: Vec::with_capacity(seqs.len()),
            batch: seqs.len(),
            seq,
        };
        for (ids, types) in seqs {
            b.tokens.extend_from_slice(ids);
            b.tokens.resize(b.tokens.len() + seq - ids.len(), pad);
            b.type_ids.extend_from_slice(types);
            b.type_ids.resize(b.type_ids.len() + seq - types.len(), 0);
            b.lens.push(ids.len() as u32);
        }
        b
    }
}

impl Bert {
    /// An encoder of shape `cfg` with BERT's initialisation (normal 0.02, unit norms), to
    /// be overwritten by imported weights.
    pub fn new(pool: &Arc<MemoryPool>, cfg: BertConfig, seed: u64) -> Result<Bert> {
        super::initialised(pool, seed, |b| Bert::build(b, cfg))
    }

    /// The encoder with its parameters named and filled by `b` (initialised or loaded).
    pub fn build(b: &mut ParamBuilder, cfg: BertConfig) -> Result<Bert> {
        cfg.check()
            .map_err(|detail| EngineError::Shape { op: "bert", detail })?;
        let (c, f) = (cfg.d_model, cfg.ffn_hidden);
        let mut embeddings = b.scope("embeddings");
        let mut table = |name: &str, rows: usize| {
            embeddings
                .scope(name)
                .param("weight", &[rows, c], Init::Normal(0.02))
        };
        let word = table("word", cfg.vocab)?;
        let position = table("position", cfg.max_positions)?;
        let token_type = table("token_type", cfg.type_vocab)?;
        let ln_embed = LayerNorm::new(&mut embeddings.scope("ln"), c)?;
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let mut b = b.scope(format_args!("layers.{l}"));
                let hf = |part: &str| format!("encoder.layer.{l}.{part}");
                let mut layer = BertLayer {
                    qkv: Linear::new(&mut b.scope("attn.qkv"), c, 3 * c, true, 0.02)?,
                    attn_out: Linear::new(&mut b.scope("attn.out"), c, c, true, 0.02)?,
                    ln_attn: LayerNorm::new(&mut b.scope("ln_attn"), c)?,
                    fc_in: Linear::new(&mut b.scope("mlp.fc_in"), c, f, true, 0.02)?,
                    fc_out: Linear::new(&mut b.scope("mlp.fc_out"), f, c, true, 0.02)?,
                    ln_mlp: LayerNorm::new(&mut b.scope("ln_mlp"), c)?,
                };
                layer.qkv.set_blocks(&[
                    (hf("attention.self.query"), c),
                    (hf("attention.self.key"), c),
                    (hf("attention.self.value"), c),
                ]);
                layer
                    .attn_out
                    .set_blocks(&[(hf("attention.output.dense"), c)]);
                layer.fc_in.set_blocks(&[(hf("intermediate.dense"), f)]);
                layer.fc_out.set_blocks(&[(hf("output.dense"), c)]);
                Ok(layer)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            cfg,
            word,
            position,
            token_type,
            ln_embed,
            layers,
        })
    }

    /// The last hidden states `[batch, seq, C]` of a padded batch (rows past a sequence's
    /// length are computed too, attending to its real tokens, and are for the caller to
    /// ignore).
    pub fn forward(&self, b: &EncoderBatch) -> Result<Tensor> {
        self.check_batch(b)?;
        let eps = self.cfg.norm_eps;
        let (_, mut x, _) = self.embed(b)?;
        let shape = self.attn_shape(b);
        for l in &self.layers {
            let qkv = l.qkv.forward(&x)?;
            let att = ops::masked_attention_forward(&qkv, &b.lens, shape)?;
            drop(qkv);
            let att = l.attn_out.forward(&att)?;
            let (_, h, _) = ops::residual_layernorm_forward_eps(
                &x,
                &att,
                l.ln_attn.gamma.weight(),
                l.ln_attn.beta.weight(),
                eps,
            )?;
            drop(att);
            let mlp = l
                .fc_out
                .forward(&ops::gelu_erf_forward(&l.fc_in.forward(&h)?)?)?;
            (_, x, _) = ops::residual_layernorm_forward_eps(
                &h,
                &mlp,
                l.ln_mlp.gamma.weight(),
                l.ln_mlp.beta.weight(),
                eps,
            )?;
        }
        Ok(x)
    }

    /// Freezes every base parameter and adds adapters on the projections `spec` targets
    /// (Hugging Face short names `query`, `key`, `value`, `dense`, full module paths, or
    /// `all-linear`), computing in `compute` like the base. Returns the adapted modules.
    pub fn attach_lora(
        &mut self,
        pool: &Arc<MemoryPool>,
        spec: &LoraSpec,
        compute: Option<DType>,
        seed: u64,
    ) -> Result<Vec<String>> {
        for p in self.params_mut() {
            p.freeze()?;
        }
        let mut rng = Rng::new(seed, stream::INIT);
        let mut b = ParamBuilder::init(pool, &mut rng);
        let mut adapted = Vec::new();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let mut b = b.scope(format_args!("layers.{l}"));
            for (part, lin) in [
                ("attn.qkv", &mut layer.qkv),
                ("attn.out", &mut layer.attn_out),
                ("mlp.fc_in", &mut layer.fc_in),
                ("mlp.fc_out", &mut layer.fc_out),
            ] {
                adapted.extend(lin.attach_lora(&mut b.scope(part), spec)?);
                for ad in &mut lin.adapters {
                    ad.a.set_compute_dtype(compute)?;
                    ad.b.set_compute_dtype(compute)?;
                }
            }
        }
        Ok(adapted)
    }

    /// [`Bert::forward`] keeping what [`Bert::backward`] needs: the last hidden states
    /// `[batch, seq, C]` and the saved activations.
    pub fn forward_train(&self, b: &EncoderBatch) -> Result<(Tensor, BertActs)> {
        self.check_batch(b)?;
        let eps = self.cfg.norm_eps;
        let (sum_embed, mut x, stats_embed) = self.embed(b)?;
        let shape = self.attn_shape(b);
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let qkv = l.qkv.forward(&x)?;
            let (att, probs) = padded_attention_forward(&qkv, &b.lens, shape)?;
            let att_proj = l.attn_out.forward(&att)?;
            let (sum_attn, h, stats_attn) = ops::residual_layernorm_forward_eps(
                &x,
                &att_proj,
                l.ln_attn.gamma.weight(),
                l.ln_attn.beta.weight(),
                eps,
            )?;
            drop(att_proj);
            let pre = l.fc_in.forward(&h)?;
            let act = ops::gelu_erf_forward(&pre)?;
            let mlp = l.fc_out.forward(&act)?;
            let (sum_mlp, out, stats_mlp) = ops::residual_layernorm_forward_eps(
                &h,
                &mlp,
                l.ln_mlp.gamma.weight(),
                l.ln_mlp.beta.weight(),
                eps,
            )?;
            layers.push(BertLayerActs {
                x: std::mem::replace(&mut x, out),
                qkv,
                probs,
                att,
                sum_attn,
                stats_attn,
                h,
                pre,
                act,
                sum_mlp,
                stats_mlp,
            });
        }
        Ok((
            x,
            BertActs {
                batch: b.clone(),
                sum_embed,
                stats_embed,
                layers,
            },
        ))
    }

    /// Accumulates the gradients of every trainable parameter from `dhidden`, the gradient
    /// of [`Bert::forward_train`]'s hidden states. With the embeddings frozen (LoRA) the
    /// backward stops at the first block's input projections.
    pub fn backward(&mut self, dhidden: &Tensor, acts: &BertActs) -> Result<()> {
        let shape = self.attn_shape(&acts.batch);
        let mut dx = dhidden.try_clone()?;
        for (l, a) in self.layers.iter_mut().zip(&acts.layers).rev() {
            // out = LN(h + W2 gelu(W1 h)): d(sum_mlp) reaches h directly and through the MLP.
            let mut d_sum_mlp = Tensor::zeros(dx.pool(), dx.shape(), a.sum_mlp.dtype())?;
            norm_backward(&mut l.ln_mlp, &mut d_sum_mlp, &dx, &a.sum_mlp, &a.stats_mlp)?;
            let d_act = l.fc_out.backward(&d_sum_mlp, &a.act)?;
            let d_pre = ops::gelu_erf_backward(&a.pre, &d_act)?;
            drop(d_act);
            let d_h_mlp = l.fc_in.backward(&d_pre, &a.h)?;
            drop(d_pre);
            ops::add_in_place(&mut d_sum_mlp, &d_h_mlp)?;
            drop(d_h_mlp);
            // h = LN(x + Wo attn(Wqkv x)).
            let mut d_sum_attn = Tensor::zeros(dx.pool(), dx.shape(), a.sum_attn.dtype())?;
            norm_backward(
                &mut l.ln_attn,
                &mut d_sum_attn,
                &d_sum_mlp,
                &a.sum_attn,
                &a.stats_attn,
            )?;
            drop(d_sum_mlp);
            let d_att = l.attn_out.backward(&d_sum_attn, &a.att)?;
            let d_qkv = padded_attention_backward(&d_att, &a.qkv, &a.probs, shape)?;
            drop(d_att);
            let mut d_in = l.qkv.backward(&d_qkv, &a.x)?;
            ops::add_in_place(&mut d_in, &d_sum_attn)?;
            dx = d_in;
        }
        if self.word.frozen && self.ln_embed.gamma.frozen {
            return Ok(());
        }
        let mut d_sum = Tensor::zeros(dx.pool(), dx.shape(), acts.sum_embed.dtype())?;
        norm_backward(
            &mut self.ln_embed,
            &mut d_sum,
            &dx,
            &acts.sum_embed,
            &acts.stats_embed,
        )?;
        let b = &acts.batch;
        if !self.word.frozen {
            ops::embedding_backward(
                &mut self.word.grad,
                &mut self.position.grad,
                &d_sum,
                &b.tokens,
                b.seq,
            )?;
            ops::token_embedding_backward(&mut self.token_type.grad, &d_sum, &b.type_ids)?;
        }
        Ok(())
    }

    fn attn_shape(&self, b: &EncoderBatch) -> AttnShape {
        AttnShape {
            batch: b.batch,
            seq: b.seq,
            heads: self.cfg.n_heads,
            channels: self.cfg.d_model,
        }
    }

    /// The embedding stage: word plus position plus token-type rows through the embedding
    /// layernorm; returns the pre-norm sum, the normalised rows and the norm's statistics
    /// (the training forward keeps the first and last for the backward).
    fn embed(&self, b: &EncoderBatch) -> Result<(Tensor, Tensor, NormStats)> {
        let words = ops::embedding_forward(
            &b.tokens,
            b.batch,
            b.seq,
            self.word.weight(),
            self.position.weight(),
        )?;
        let types = ops::gather_rows(self.token_type.weight(), &b.type_ids, None)?;
        ops::residual_layernorm_forward_eps(
            &words,
            &types,
            self.ln_embed.gamma.weight(),
            self.ln_embed.beta.weight(),
            self.cfg.norm_eps,
        )
    }

    fn check_batch(&self, b: &EncoderBatch) -> Result<()> {
        super::check_context("bert", b.seq, self.cfg.max_positions)?;
        if let Some(&t) = b
            .type_ids
            .iter()
            .find(|&&t| t as usize >= self.cfg.type_vocab)
        {
            return Err(EngineError::Shape {
                op: "bert",
                detail: format!(
                    "token type {t} outside the model's {} segment types",
                    self.cfg.type_vocab
                ),
            });
        }
        Ok(())
    }

    /// Parameters and forward FLOPs of one batch of `batch x seq` tokens (no backward, no
    /// saved activations: the encoder runs frozen).
    pub fn cost(&self, batch: usize, seq: usize) -> Cost {
        let (c, f, tokens) = (self.cfg.d_model, self.cfg.ffn_hidden, batch * seq);
        let linear = |c_in, c_out| Linear::cost_of(c_in, c_out, true, tokens);
        let attention = (4 * batch * seq * seq * c) as u64;
        let block = linear(c, 3 * c) + linear(c, c) + linear(c, f) + linear(f, c);
        let norms = (2 * self.cfg.n_layers + 1) * 2 * c;
        let tables = (self.cfg.vocab + self.cfg.max_positions + self.cfg.type_vocab) * c;
        Cost {
            params: tables + norms + self.cfg.n_layers * block.params,
            flops_forward: self.cfg.n_layers as u64 * (block.flops_forward + attention),
            flops_backward: 0,
            saved_bytes: 0,
        }
    }
}

/// What one block's backward needs.
pub struct BertLayerActs {
    x: Tensor,
    qkv: Tensor,
    probs: Tensor,
    att: Tensor,
    sum_attn: Tensor,
    stats_attn: NormStats,
    h: Tensor,
    pre: Tensor,
    act: Tensor,
    sum_mlp: Tensor,
    stats_mlp: NormStats,
}

/// The activations [`Bert::forward_train`] keeps for [`Bert::backward`].
pub struct BertActs {
    batch: EncoderBatch,
    sum_embed: Tensor,
    stats_embed: NormStats,
    layers: Vec<BertLayerActs>,
}

/// A layernorm's input gradient into `dx`, and its parameter gradients unless it is frozen
/// (then into scratch that is dropped: the kernel always writes them).
fn norm_backward(
    ln: &mut LayerNorm,
    dx: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    stats: &NormStats,
) -> Result<()> {
    if !ln.gamma.frozen {
        return ln.backward(dx, dout, x, stats);
    }
    let mut dg = Tensor::zeros(dx.pool(), &[ln.c], DType::F32)?;
    let mut db = Tensor::zeros(dx.pool(), &[ln.c], DType::F32)?;
    ops::layernorm_backward(dx, &mut dg, &mut db, dout, x, ln.gamma.weight(), stats)
}

fn head_products(s: AttnShape) -> impl Fn(bool, bool, usize, usize, usize) -> GemmShape {
    move |trans_a, trans_b, m, n, k| GemmShape {
        trans_a,
        trans_b,
        batch: s.batch * s.heads,
        m,
        n,
        k,
    }
}

/// Bidirectional attention under the key padding mask as separate kernels: `S = Q K^T *
/// scale`, `P` = the padded softmax of `S`, `O = P V`. Returns `out[B, T, C]` and `P`.
pub fn padded_attention_forward(
    qkv: &Tensor,
    lens: &[u32],
    s: AttnShape,
) -> Result<(Tensor, Tensor)> {
    let (c, hs, t) = (s.channels, s.head_size(), s.seq);
    let products = head_products(s);
    let scale = 1.0 / (hs as f32).sqrt();
    let scores = {
        let q = ops::heads_from_rows(qkv, s, 0)?;
        let k = ops::heads_from_rows(qkv, s, c)?;
        ops::batched_matmul(products(false, true, t, t, hs), scale, &q, &k)?
    };
    let probs = ops::padded_softmax(&scores, lens, s)?;
    drop(scores);
    let v = ops::heads_from_rows(qkv, s, 2 * c)?;
    let o = ops::batched_matmul(products(false, false, t, hs, t), 1.0, &probs, &v)?;
    let mut out = Tensor::uninit(qkv.pool(), &[s.batch, s.seq, c], qkv.dtype())?;
    ops::heads_to_rows(&mut out, &o, s, 0)?;
    Ok((out, probs))
}

/// Backward of [`padded_attention_forward`]: `dqkv[B, T, 3C]` from `dout[B, T, C]`. `dV =
/// P^T dO`, `dP = dO V^T`, `dS = P * (dP - rowsum(dP * P))` (zero on padded keys, where `P`
/// is), `dQ = dS K * scale`, `dK = dS^T Q * scale`.
pub fn padded_attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    probs: &Tensor,
    s: AttnShape,
) -> Result<Tensor> {
    let (c, hs, t) = (s.channels, s.head_size(), s.seq);
    let products = head_products(s);
    let scale = 1.0 / (hs as f32).sqrt();
    let mut dqkv = Tensor::uninit(qkv.pool(), qkv.shape(), qkv.dtype())?;
    let dscores = {
        let dout = ops::heads_from_rows(dout, s, 0)?;
        let dv = ops::batched_matmul(products(true, false, t, hs, t), 1.0, probs, &dout)?;
        ops::heads_to_rows(&mut dqkv, &dv, s, 2 * c)?;
        drop(dv);
        let v = ops::heads_from_rows(qkv, s, 2 * c)?;
        let dprobs = ops::batched_matmul(products(false, true, t, t, hs), 1.0, &dout, &v)?;
        ops::softmax_backward(probs, &dprobs)?
    };
    let k = ops::heads_from_rows(qkv, s, c)?;
    let dq = ops::batched_matmul(products(false, false, t, hs, t), scale, &dscores, &k)?;
    drop(k);
    ops::heads_to_rows(&mut dqkv, &dq, s, 0)?;
    drop(dq);
    let q = ops::heads_from_rows(qkv, s, 0)?;
    let dk = ops::batched_matmul(products(true, false, t, hs, t), scale, &dscores, &q)?;
    ops::heads_to_rows(&mut dqkv, &dk, s, c)?;
    Ok(dqkv)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::{Device, MemoryPool};

    /// A two-layer encoder of 16 wide on the CPU (seed 7); the parameter-order record uses it too.
    pub(crate) fn tiny() -> Bert {
        let cfg = BertConfig {
            vocab: 50,
            d_model: 16,
            n_layers: 2,
            n_heads: 4,
            ffn_hidden: 24,
            max_positions: 12,
            type_vocab: 2,
            norm_eps: 1e-12,
        };
        Bert::new(&MemoryPool::new(Device::Cpu), cfg, 7).unwrap()
    }

    /// A sequence encoded alone gives the same hidden states as in a padded batch beside a
    /// longer one: the padding mask hides the padding, whatever its ids.
    #[test]
    fn padding_changes_nothing_a_sequence_computes() {
        let m = tiny();
        let (a, at): (&[u32], &[u32]) = (&[1, 5, 9, 2], &[0, 0, 1, 1]);
        let (b, bt): (&[u32], &[u32]) = (&[1, 7, 3, 8, 8, 4, 2], &[0; 7]);
        let alone = m.forward(&EncoderBatch::pad(&[(a, at)], 0)).unwrap();
        for (pad, multiple) in [(0, 1), (33, 1), (0, 8)] {
            let both = m
                .forward(&EncoderBatch::pad_to(
                    &[(a, at), (b, bt)],
                    pad,
                    multiple,
                    12,
                ))
                .unwrap()
                .to_vec()
                .unwrap();
            let got = &both[..a.len() * 16];
            for (g, w) in got.iter().zip(alone.to_vec().unwrap()) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
        // Token types matter: the same ids as one segment give other states.
        let one_segment = m.forward(&EncoderBatch::pad(&[(a, &[0; 4])], 0)).unwrap();
        assert_ne!(one_segment.to_vec().unwrap(), alone.to_vec().unwrap());
    }

    #[test]
    fn too_long_a_sequence_and_unknown_segments_are_refused() {
        let m = tiny();
        let long = vec![1u32; 13];
        let err = m
            .forward(&EncoderBatch::pad(&[(&long, &[0; 13])], 0))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("context of 12"), "{err}");
        let err = m
            .forward(&EncoderBatch::pad(&[(&[1, 2], &[0, 2])], 0))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("token type 2"), "{err}");
    }

    #[test]
    fn cost_counts_every_parameter() {
        let m = tiny();
        let n: usize = m.params().iter().map(|p| p.value.len()).sum();
        assert_eq!(m.cost(2, 8).params, n);
    }

    /// A tiny encoder with every parameter random and of order one (gains near one), so no
    /// gradient is small by construction.
    fn randomised() -> Bert {
        let mut m = tiny();
        let mut rng = Rng::new(11, stream::INIT);
        for p in m.params_mut() {
            let gain = p.name.contains("ln") && p.name.ends_with("weight");
            let v: Vec<f32> = (0..p.value.len())
                .map(|_| {
                    let u = rng.next_f32() * 2.0 - 1.0;
                    if gain { 1.0 + 0.3 * u } else { 0.5 * u }
                })
                .collect();
            p.value.copy_from_host(&v).unwrap();
        }
        m
    }

    fn batch() -> EncoderBatch {
        let (a, at): (&[u32], &[u32]) = (&[1, 5, 9, 2, 7, 3], &[0, 0, 0, 1, 1, 1]);
        let (b, bt): (&[u32], &[u32]) = (&[1, 7, 2], &[0, 0, 1]);
        EncoderBatch::pad(&[(a, at), (b, bt)], 4)
    }

    /// A loss weighting every real row's hidden states differently and the padded rows by
    /// zero, as poolers do: whatever the padding computes must not reach a gradient.
    fn loss_weights(b: &EncoderBatch, c: usize) -> Tensor {
        let pool = MemoryPool::new(Device::Cpu);
        let mut rng = Rng::new(12, stream::INIT);
        let w: Vec<f32> = (0..b.batch * b.seq * c)
            .map(|i| {
                let (row, t) = (i / (b.seq * c), (i / c) % b.seq);
                let u = rng.next_f32() * 2.0 - 1.0;
                if t < b.lens[row] as usize { u } else { 0.0 }
            })
            .collect();
        Tensor::from_vec(&pool, &[b.batch, b.seq, c], DType::F32, w).unwrap()
    }

    fn loss(m: &Bert, b: &EncoderBatch, w: &Tensor) -> f64 {
        let (h, _) = m.forward_train(b).unwrap();
        crate::nn::gradcheck::weighted_sum(&h, w)
    }

    /// Every parameter's gradient (a strided sample of each) against central differences,
    /// in fp32: embeddings, post-norm blocks, padded attention and the erf GELU.
    #[test]
    fn backward_matches_finite_differences() {
        let mut m = randomised();
        let b = batch();
        let w = loss_weights(&b, 16);
        let (h, acts) = m.forward_train(&b).unwrap();
        // The training forward computes what the frozen one does.
        let frozen = m.forward(&b).unwrap().to_vec().unwrap();
        crate::engine::cpu::testutil::assert_close(
            &h.to_vec().unwrap(),
            &frozen,
            1e-5,
            "training forward",
        );
        m.backward(&w, &acts).unwrap();
        let n = m.params().len();
        let mut checked = 0;
        for i in 0..n {
            let (name, value, grad) = {
                let p = &m.params()[i];
                (
                    p.name.clone(),
                    p.value.try_clone().unwrap(),
                    p.grad.to_vec().unwrap(),
                )
            };
            assert!(grad.iter().any(|&g| g != 0.0), "{name} got no gradient");
            crate::nn::gradcheck::check(&name, &value, &grad, 24, |t| {
                m.params_mut()[i].value.copy_from_host(t.host()).unwrap();
                loss(&m, &b, &w)
            });
            m.params_mut()[i]
                .value
                .copy_from_host(value.host())
                .unwrap();
            checked += 1;
        }
        assert_eq!(checked, 3 + 2 + 2 * 12);
        // Padding tokens (id 4 after sequence 1, never a real token) reach no loss: their
        // rows of the word table get no gradient.
        let dword = m.word.grad.to_vec().unwrap();
        assert!(dword[4 * 16..5 * 16].iter().all(|&g| g == 0.0));
    }

    /// Under LoRA only the adapters train: their gradients match finite differences, the
    /// base gets none, and the adapters sit on the Hugging Face module names.
    #[test]
    fn lora_adapters_train_alone_and_match_finite_differences() {
        let mut m = randomised();
        let pool = MemoryPool::new(Device::Cpu);
        let spec = LoraSpec {
            rank: 2,
            alpha: 4.0,
            rslora: false,
            dropout: 0.0,
            targets: vec!["query".into(), "value".into(), "dense".into()],
        };
        let adapted = m.attach_lora(&pool, &spec, None, 3).unwrap();
        assert_eq!(adapted.len(), 2 * 5);
        assert!(adapted.contains(&"encoder.layer.1.attention.self.value".to_string()));
        assert!(adapted.contains(&"encoder.layer.0.intermediate.dense".to_string()));
        assert!(!adapted.iter().any(|a| a.ends_with("self.key")));
        // Non-zero B, so A's gradient is not zero by construction.
        let mut rng = Rng::new(4, stream::INIT);
        for p in m.trainable_params_mut() {
            if p.name.ends_with(".B") {
                let v: Vec<f32> = (0..p.value.len()).map(|_| rng.next_f32() - 0.5).collect();
                p.value.copy_from_host(&v).unwrap();
            }
        }
        let b = batch();
        let w = loss_weights(&b, 16);
        let (_, acts) = m.forward_train(&b).unwrap();
        m.backward(&w, &acts).unwrap();
        let n = m.trainable_params_mut().len();
        assert_eq!(n, 2 * 5 * 2);
        for i in (0..n).step_by(3) {
            let (name, value, grad) = {
                let p = &m.trainable_params_mut()[i];
                (
                    p.name.clone(),
                    p.value.try_clone().unwrap(),
                    p.grad.to_vec().unwrap(),
                )
            };
            assert!(grad.iter().any(|&g| g != 0.0), "{name} got no gradient");
            crate::nn::gradcheck::check(&name, &value, &grad, 16, |t| {
                m.trainable_params_mut()[i]
                    .value
                    .copy_from_host(t.host())
                    .unwrap();
                loss(&m, &b, &w)
            });
            m.trainable_params_mut()[i]
                .value
                .copy_from_host(value.host())
                .unwrap();
        }
        assert!(
            m.params()
                .iter()
                .filter(|p| p.frozen)
                .all(|p| p.grad.is_empty())
        );
    }
}

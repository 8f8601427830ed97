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
//! The encoder runs forward only: kiln uses it frozen, as a feature extractor (`kiln embed`,
//! `kiln classify`), so it keeps no activations and has no backward. Weights use kiln's names
//! (`layers.N.attn.qkv.weight` with the query, key and value projections fused);
//! `models::import::bert` maps Hugging Face checkpoints onto them.

use crate::engine::cpu::attention::AttnShape;
use crate::engine::rng::{Rng, stream};
use crate::engine::{EngineError, MemoryPool, Result, Tensor, ops};
use crate::nn::layernorm::LayerNorm;
use crate::nn::linear::Linear;
use crate::nn::{Cost, Init, Param};
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

pub struct Bert {
    pub cfg: BertConfig,
    pub word: Param,
    pub position: Param,
    pub token_type: Param,
    pub ln_embed: LayerNorm,
    pub layers: Vec<BertLayer>,
}

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
        cfg.check()
            .map_err(|detail| EngineError::Shape { op: "bert", detail })?;
        let mut rng = Rng::new(seed, stream::INIT);
        let (c, f) = (cfg.d_model, cfg.ffn_hidden);
        let table = |name: &str, rows: usize, rng: &mut Rng| {
            Param::new(
                pool,
                format!("embeddings.{name}.weight"),
                &[rows, c],
                Init::Normal(0.02),
                rng,
            )
        };
        let word = table("word", cfg.vocab, &mut rng)?;
        let position = table("position", cfg.max_positions, &mut rng)?;
        let token_type = table("token_type", cfg.type_vocab, &mut rng)?;
        let ln_embed = LayerNorm::new(pool, "embeddings.ln", c, &mut rng)?;
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let name = |part: &str| format!("layers.{l}.{part}");
                Ok(BertLayer {
                    qkv: Linear::new(pool, &name("attn.qkv"), c, 3 * c, true, 0.02, &mut rng)?,
                    attn_out: Linear::new(pool, &name("attn.out"), c, c, true, 0.02, &mut rng)?,
                    ln_attn: LayerNorm::new(pool, &name("ln_attn"), c, &mut rng)?,
                    fc_in: Linear::new(pool, &name("mlp.fc_in"), c, f, true, 0.02, &mut rng)?,
                    fc_out: Linear::new(pool, &name("mlp.fc_out"), f, c, true, 0.02, &mut rng)?,
                    ln_mlp: LayerNorm::new(pool, &name("ln_mlp"), c, &mut rng)?,
                })
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

    /// Every parameter in a fixed order.
    pub fn params(&self) -> Vec<&Param> {
        let mut v = vec![&self.word, &self.position, &self.token_type];
        v.extend(self.ln_embed.params());
        for l in &self.layers {
            v.extend(l.qkv.params());
            v.extend(l.attn_out.params());
            v.extend(l.ln_attn.params());
            v.extend(l.fc_in.params());
            v.extend(l.fc_out.params());
            v.extend(l.ln_mlp.params());
        }
        v
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = vec![&mut self.word, &mut self.position, &mut self.token_type];
        v.extend(self.ln_embed.params_mut());
        for l in &mut self.layers {
            v.extend(l.qkv.params_mut());
            v.extend(l.attn_out.params_mut());
            v.extend(l.ln_attn.params_mut());
            v.extend(l.fc_in.params_mut());
            v.extend(l.fc_out.params_mut());
            v.extend(l.ln_mlp.params_mut());
        }
        v
    }

    /// The last hidden states `[batch, seq, C]` of a padded batch (rows past a sequence's
    /// length are computed too, attending to its real tokens, and are for the caller to
    /// ignore).
    pub fn forward(&self, b: &EncoderBatch) -> Result<Tensor> {
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
        let eps = self.cfg.norm_eps;
        let c = self.cfg.d_model;
        let words = ops::embedding_forward(
            &b.tokens,
            b.batch,
            b.seq,
            self.word.weight(),
            self.position.weight(),
        )?;
        let types = ops::gather_rows(self.token_type.weight(), &b.type_ids, None)?;
        let (_, mut x, _) = ops::residual_layernorm_forward_eps(
            &words,
            &types,
            self.ln_embed.gamma.weight(),
            self.ln_embed.beta.weight(),
            eps,
        )?;
        drop((words, types));
        let shape = AttnShape {
            batch: b.batch,
            seq: b.seq,
            heads: self.cfg.n_heads,
            channels: c,
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Device, MemoryPool};

    fn tiny() -> Bert {
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
}

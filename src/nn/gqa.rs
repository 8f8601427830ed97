//! Causal self-attention with rotary position embeddings and grouped-query heads (Llama,
//! Qwen, Mistral): one projection to `H` query and `K` key/value heads, rotation and packing
//! into the `[q | k | v]` layout of the attention kernels, attention, an output projection.
//!
//! Packing expands each key/value head to its `H / K` query heads, so the same attention
//! kernels serve grouped and plain multi-head attention; the backward sums the expanded
//! heads' gradients back into their shared head.
//!
//! Qwen3 normalises every query and key head (RMSNorm over `head_dim`, one gain shared by the
//! query heads and one by the key heads) before the rotation: the heads are cut out of the
//! projection's columns, normalised as rows of `head_dim`, and written back, with the RMSNorm
//! kernels every Llama block already uses.
//!
//! Mistral and Qwen2 attend within a sliding window: a query sees only the `window` latest
//! positions, its own included; every attention kernel takes the window and skips the key
//! tiles wholly outside it.
//!
//! On a GPU at a head size and dtype the fused kernels lack (f32 at Phi-3-mini's 96; the
//! 16-bit kernels take it), attention runs as
//! [`crate::nn::attention`]'s unfused chain: batched products around a causal softmax whose
//! `[B, H, T, T]` probabilities are kept for the backward (and a window shorter than the
//! sequence is refused there, as that softmax has none).

use super::attention::{
    attention_backward_unfused, attention_forward_unfused, unfused_probs_bytes,
};
use super::linear::Linear;
use super::rmsnorm::RmsNorm;
use super::{ActLayout, Cost, ParamBuilder, f32_bytes, params};
use crate::engine::AttnShape;
use crate::engine::cpu::rope::RopeShape;
use crate::engine::{DType, Device, EngineError, Result, Tensor, ops};

/// Whether attention of heads of `head_dim` on `device` runs as the unfused chain: on a GPU
/// (or the planner's meta device) at a head size no fused kernel has. The one rule the layer
/// and its cost both follow.
pub fn gemm_attention(device: Device, dtype: DType, head_dim: usize) -> bool {
    device != Device::Cpu && !crate::engine::cuda::attention::has_kernel(head_dim, dtype)
}

/// The heads of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot_dim: usize,
}

/// The rotary tables `cos`, `sin` (`[positions, rot/2]`, f32) every layer shares.
pub struct Rotary {
    pub cos: Tensor,
    pub sin: Tensor,
    /// LongRoPE: the tables of passes past the trained context and of decode steps; `cos`
    /// and `sin` then serve only passes within that context.
    pub long: Option<Box<LongTables>>,
}

/// LongRoPE's tables besides the short factors' (transformers picks the factors for each
/// forward call by its largest position: the short ones up to the trained context, the long
/// ones past it).
pub struct LongTables {
    /// The trained context: a pass of more positions reads `long`.
    pub trained: usize,
    /// The long factors' tables at every position.
    pub long: Rotary,
    /// A decode step's tables: the short factors' rows below `trained`, the long factors'
    /// from it on. A step feeds each sequence one token at its own position `p`, which a
    /// forward call of that sequence alone rotates with the long factors exactly when
    /// `p + 1 > trained`; so one table gives every row of a step its own sequence's choice,
    /// whatever the other rows' lengths (a row's tokens never depend on its batch).
    pub stepwise: Rotary,
}

impl Rotary {
    /// Tables for every pass, whatever its length.
    pub fn new(cos: Tensor, sin: Tensor) -> Rotary {
        Rotary {
            cos,
            sin,
            long: None,
        }
    }

    /// The tables of a pass whose longest sequence has `positions` positions (its largest
    /// position + 1), for passes that run whole sequences (training, evaluation, a prefill
    /// of prompts that all fall on the same side of the trained context).
    pub fn for_positions(&self, positions: usize) -> &Rotary {
        match &self.long {
            Some(l) if self.takes_long(positions) => &l.long,
            _ => self,
        }
    }

    /// The tables of a decode step (one new token per sequence, each at its own position).
    pub fn for_step(&self) -> &Rotary {
        match &self.long {
            Some(l) => &l.stepwise,
            None => self,
        }
    }

    /// Whether a pass of `positions` positions reads the long tables.
    pub fn takes_long(&self, positions: usize) -> bool {
        self.long.as_ref().is_some_and(|l| positions > l.trained)
    }
}

pub struct GqaAttention {
    pub qkv: Linear,
    /// Qwen3's per-head query and key norms.
    pub qk_norm: Option<(RmsNorm, RmsNorm)>,
    pub out: Linear,
    pub heads: Heads,
    /// The sliding window in positions (0: full causal attention).
    pub window: usize,
}

/// What the backward needs: the packed, rotated `[q | k | v]`, the softmax statistics and
/// the attention output that fed the output projection.
pub struct GqaSaved {
    pub packed: Tensor,
    pub stats: Tensor,
    pub att: Tensor,
    /// The query and key heads before their norms, with the norms' `rstd` (Qwen3).
    pub qk: Option<QkSaved>,
}

/// The query heads and the key heads before their norms, each with the norm's `rstd`.
pub type QkSaved = [(Tensor, Tensor); 2];

/// Normalises `heads` heads of `d` columns starting at column `col0` of every row of `qkv`
/// in place; returns the heads as they were (`[rows x heads, d]`) and their `rstd`.
fn norm_heads(
    qkv: &mut Tensor,
    norm: &RmsNorm,
    col0: usize,
    heads: usize,
    d: usize,
) -> Result<(Tensor, Tensor)> {
    let rows = qkv.len() / qkv.shape().last().copied().unwrap_or(1);
    let x = ops::cols_scaled(qkv, col0, heads * d, 1.0)?.reshaped(&[rows * heads, d]);
    let (y, rstd) = norm.forward(&x)?;
    let x = x.reshaped(&[rows, heads * d]);
    // x - x is exactly zero, so the columns end up holding y exactly.
    ops::add_cols_scaled(qkv, &x, col0, -1.0)?;
    ops::add_cols_scaled(qkv, &y.reshaped(&[rows, heads * d]), col0, 1.0)?;
    Ok((x.reshaped(&[rows * heads, d]), rstd))
}

/// The backward of [`norm_heads`] on the gradient `dqkv` of the normalised projection: the
/// heads' gradient is replaced by the gradient of the heads before the norm.
fn norm_heads_backward(
    dqkv: &mut Tensor,
    norm: &mut RmsNorm,
    col0: usize,
    heads: usize,
    d: usize,
    saved: &(Tensor, Tensor),
) -> Result<()> {
    let rows = dqkv.len() / dqkv.shape().last().copied().unwrap_or(1);
    let dy = ops::cols_scaled(dqkv, col0, heads * d, 1.0)?.reshaped(&[rows * heads, d]);
    let mut dx = Tensor::zeros(dy.pool(), dy.shape(), dy.dtype())?;
    norm.backward(&mut dx, &dy, &saved.0, &saved.1)?;
    ops::add_cols_scaled(dqkv, &dy.reshaped(&[rows, heads * d]), col0, -1.0)?;
    ops::add_cols_scaled(dqkv, &dx.reshaped(&[rows, heads * d]), col0, 1.0)
}

params!(GqaAttention { qkv, qk_norm, out });

impl GqaAttention {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: &mut ParamBuilder,
        c: usize,
        heads: Heads,
        bias: bool,
        qk_norm_eps: Option<f32>,
        out_std: f32,
    ) -> Result<Self> {
        let (h, k, d) = (heads.heads, heads.kv_heads, heads.head_dim);
        Ok(GqaAttention {
            qkv: Linear::new(&mut b.scope("qkv"), c, (h + 2 * k) * d, bias, 0.02)?,
            qk_norm: match qk_norm_eps {
                Some(eps) => Some((
                    RmsNorm::new(&mut b.scope("q_norm"), d, eps)?,
                    RmsNorm::new(&mut b.scope("k_norm"), d, eps)?,
                )),
                None => None,
            },
            out: Linear::new(&mut b.scope("out"), h * d, c, false, out_std)?,
            heads,
            window: 0,
        })
    }

    /// The layer attending within the `window` latest positions (0: full causal attention).
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window;
        self
    }

    fn shapes(&self, batch: usize, seq: usize) -> (RopeShape, AttnShape) {
        let h = self.heads;
        let rope = RopeShape {
            rows: batch * seq,
            heads: h.heads,
            kv_heads: h.kv_heads,
            head_dim: h.head_dim,
            rot_dim: h.rot_dim,
        };
        let attn = AttnShape {
            batch,
            seq,
            heads: h.heads,
            channels: h.heads * h.head_dim,
        };
        (rope, attn)
    }

    /// The `[q | k | v]` projection of `x`, queries and keys normalised per head when the
    /// layer has Qwen3's norms (then also what their backward needs).
    pub fn project(&self, x: &Tensor) -> Result<(Tensor, Option<QkSaved>)> {
        let mut qkv = self.qkv.forward(x)?;
        let Some((qn, kn)) = &self.qk_norm else {
            return Ok((qkv, None));
        };
        let h = self.heads;
        let q = norm_heads(&mut qkv, qn, 0, h.heads, h.head_dim)?;
        let k = norm_heads(&mut qkv, kn, h.heads * h.head_dim, h.kv_heads, h.head_dim)?;
        Ok((qkv, Some([q, k])))
    }

    /// `x` is `[B, T, C]`; `pos` gives each of the `B x T` rows its position.
    pub fn forward(&self, x: &Tensor, pos: &[u32], rot: &Rotary) -> Result<(Tensor, GqaSaved)> {
        let (batch, seq) = (x.shape()[0], x.shape()[1]);
        let (rs, s) = self.shapes(batch, seq);
        let (qkv, qk) = self.project(x)?;
        let packed = ops::rope_expand_forward(&qkv, pos, &rot.cos, &rot.sin, rs)?;
        drop(qkv);
        let (att, stats) = if gemm_attention(packed.device(), packed.dtype(), self.heads.head_dim) {
            if self.window > 0 && self.window < seq {
                return Err(EngineError::Shape {
                    op: "attention",
                    detail: format!(
                        "head size {} has no fused GPU kernel for {:?} activations, and the unfused attention that runs instead has no sliding window; train on sequences of at most the window ({} positions: train.seq_len), in bf16 or fp16 where the head size has kernels, or on the CPU",
                        self.heads.head_dim,
                        packed.dtype(),
                        self.window
                    ),
                });
            }
            let mut att = Tensor::uninit(packed.pool(), &[batch, seq, s.channels], packed.dtype())?;
            let probs = attention_forward_unfused(&mut att, &packed, s)?;
            (att, probs)
        } else {
            ops::windowed_attention_forward(&packed, s, self.window)?
        };
        let out = self.out.forward(&att)?;
        Ok((
            out,
            GqaSaved {
                packed,
                stats,
                att,
                qk,
            },
        ))
    }

    pub fn backward(
        &mut self,
        dout: &Tensor,
        x: &Tensor,
        pos: &[u32],
        rot: &Rotary,
        saved: &GqaSaved,
    ) -> Result<Tensor> {
        let (batch, seq) = (x.shape()[0], x.shape()[1]);
        let (rs, s) = self.shapes(batch, seq);
        let datt = self.out.backward(dout, &saved.att)?;
        let dpacked = if gemm_attention(
            saved.packed.device(),
            saved.packed.dtype(),
            self.heads.head_dim,
        ) {
            let p = &saved.packed;
            let mut d = Tensor::uninit(p.pool(), p.shape(), p.dtype())?;
            attention_backward_unfused(&mut d, &datt, p, &saved.stats, s)?;
            d
        } else {
            ops::windowed_attention_backward(
                &datt,
                &saved.packed,
                &saved.att,
                &saved.stats,
                s,
                self.window,
            )?
        };
        drop(datt);
        let mut dqkv = ops::rope_expand_backward(&dpacked, pos, &rot.cos, &rot.sin, rs)?;
        drop(dpacked);
        if let (Some((qn, kn)), Some([q, k])) = (&mut self.qk_norm, &saved.qk) {
            let h = self.heads;
            norm_heads_backward(&mut dqkv, qn, 0, h.heads, h.head_dim, q)?;
            let col0 = h.heads * h.head_dim;
            norm_heads_backward(&mut dqkv, kn, col0, h.kv_heads, h.head_dim, k)?;
        }
        self.qkv.backward(&dqkv, x)
    }

    /// Saves the packed `[q | k | v]`, the attention output and the softmax statistics;
    /// FLOPs count the query-key pairs the causal mask (and the window, if any) lets through.
    #[allow(clippy::too_many_arguments)]
    pub fn cost_of(
        c: usize,
        h: Heads,
        bias: bool,
        batch: usize,
        seq: usize,
        window: usize,
        layout: ActLayout,
    ) -> Cost {
        let tokens = batch * seq;
        let width = h.heads * h.head_dim;
        let pairs = (batch * h.heads * attended_pairs(seq, window)) as u64;
        let stats = AttnShape {
            batch,
            seq,
            heads: h.heads,
            channels: width,
        };
        let stats_bytes = if gemm_attention(layout.device, layout.weights, h.head_dim) {
            unfused_probs_bytes(h.heads, batch, seq, layout)
        } else {
            let n: usize = ops::attention_stats_shape(layout.device, stats)
                .iter()
                .product();
            f32_bytes(n)
        };
        let core = Cost {
            params: 0,
            flops_forward: 4 * pairs * h.head_dim as u64,
            flops_backward: 8 * pairs * h.head_dim as u64,
            saved_bytes: layout.act_bytes(tokens * 4 * width) + stats_bytes,
        };
        Linear::cost_of(c, (h.heads + 2 * h.kv_heads) * h.head_dim, bias, tokens)
            + core
            + Linear::cost_of(width, c, false, tokens)
    }
}

/// Query-key pairs of a `seq`-long sequence under the causal mask and a `window` (0: none):
/// query `i` sees `min(i + 1, window)` keys.
fn attended_pairs(seq: usize, window: usize) -> usize {
    let causal = seq * (seq + 1) / 2;
    if window == 0 || window >= seq {
        return causal;
    }
    // The first `window` queries see 1..=window keys, the rest `window` each.
    window * (window + 1) / 2 + (seq - window) * window
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_only_the_pairs_it_lets_through() {
        let brute = |seq: usize, w: usize| -> usize {
            (0..seq)
                .map(|i| (0..=i).filter(|&j| w == 0 || i - j < w).count())
                .sum()
        };
        for (seq, w) in [(7, 0), (7, 1), (7, 3), (7, 7), (7, 9), (64, 16)] {
            assert_eq!(
                attended_pairs(seq, w),
                brute(seq, w),
                "seq {seq}, window {w}"
            );
        }
        assert!(attended_pairs(64, 16) < attended_pairs(64, 0));
    }

    /// On a GPU (a meta pool stands for it) f32 heads of 96, which no fused kernel takes, run
    /// the unfused chain and keep its probabilities, as the cost says; heads of 64 keep the
    /// fused kernel's row statistics; a window shorter than the sequence is refused on the
    /// unfused path, and the CPU takes every head size through its own kernel. 16-bit heads of
    /// 96 have tensor-core kernels; heads of 80 have none in any dtype.
    #[test]
    fn head_sizes_without_a_fused_kernel_attend_through_gemms_on_a_gpu() {
        use crate::engine::MemoryPool;
        let gpu = Device::Cuda(0);
        assert!(!gemm_attention(gpu, DType::BF16, 96) && !gemm_attention(gpu, DType::F16, 96));
        assert!(gemm_attention(gpu, DType::BF16, 80));
        let (batch, seq) = (2, 8);
        for (device, hd, want_probs) in [
            (Device::Cuda(0), 96, true),
            (Device::Cuda(0), 64, false),
            (Device::Cpu, 96, false),
        ] {
            let pool = if device == Device::Cpu {
                MemoryPool::new(Device::Cpu)
            } else {
                MemoryPool::meta(device)
            };
            let heads = Heads {
                heads: 2,
                kv_heads: 1,
                head_dim: hd,
                rot_dim: hd,
            };
            let mut rng = crate::engine::rng::Rng::new(3, crate::engine::rng::stream::INIT);
            let mut b = ParamBuilder::init(&pool, &mut rng);
            let attn = GqaAttention::new(&mut b, 16, heads, false, None, 0.02).unwrap();
            let x = Tensor::zeros(&pool, &[batch, seq, 16], DType::F32).unwrap();
            let rot = Rotary::new(
                Tensor::zeros(&pool, &[seq, hd / 2], DType::F32).unwrap(),
                Tensor::zeros(&pool, &[seq, hd / 2], DType::F32).unwrap(),
            );
            let pos: Vec<u32> = (0..batch * seq).map(|i| (i % seq) as u32).collect();
            let (_, saved) = attn.forward(&x, &pos, &rot).unwrap();
            // (The CPU's fused kernel keeps the probabilities too; on a GPU only the
            // unfused chain does.)
            if device != Device::Cpu {
                let probs = saved.stats.shape().iter().product::<usize>() == batch * 2 * seq * seq;
                assert_eq!(probs, want_probs, "{device:?}, head size {hd}");
            }
            assert_eq!(gemm_attention(device, DType::F32, hd), want_probs);
            let windowed = attn.with_window(4);
            let r = windowed.forward(&x, &pos, &rot);
            assert_eq!(
                r.is_err(),
                want_probs,
                "{device:?}, head size {hd}, window 4"
            );
        }
    }
}

//! Causal self-attention with rotary position embeddings and grouped-query heads (Llama,
//! Qwen, Mistral): one projection to `H` query and `K` key/value heads, rotation and packing
//! into the `[q | k | v]` layout of the attention kernels, attention, an output projection.
//!
//! Packing expands each key/value head to its `H / K` query heads, so the same attention
//! kernels serve grouped and plain multi-head attention; the backward sums the expanded
//! heads' gradients back into their shared head.

use super::linear::Linear;
use super::{ActLayout, Cost, Param, f32_bytes};
use crate::engine::cpu::attention::AttnShape;
use crate::engine::cpu::rope::RopeShape;
use crate::engine::rng::Rng;
use crate::engine::{MemoryPool, Result, Tensor, ops};
use std::sync::Arc;

/// The heads of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot_dim: usize,
}

/// The rotary tables `cos`, `sin` (`[context, rot/2]`, f32) every layer shares.
pub struct Rotary {
    pub cos: Tensor,
    pub sin: Tensor,
}

pub struct GqaAttention {
    pub qkv: Linear,
    pub out: Linear,
    pub heads: Heads,
}

/// What the backward needs: the packed, rotated `[q | k | v]`, the softmax statistics and
/// the attention output that fed the output projection.
pub struct GqaSaved {
    pub packed: Tensor,
    pub stats: Tensor,
    pub att: Tensor,
}

impl GqaAttention {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pool: &Arc<MemoryPool>,
        name: &str,
        c: usize,
        heads: Heads,
        bias: bool,
        out_std: f32,
        rng: &mut Rng,
    ) -> Result<Self> {
        let (h, k, d) = (heads.heads, heads.kv_heads, heads.head_dim);
        Ok(GqaAttention {
            qkv: Linear::new(
                pool,
                &format!("{name}.qkv"),
                c,
                (h + 2 * k) * d,
                bias,
                0.02,
                rng,
            )?,
            out: Linear::new(pool, &format!("{name}.out"), h * d, c, false, out_std, rng)?,
            heads,
        })
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

    /// `x` is `[B, T, C]`; `pos` gives each of the `B x T` rows its position.
    pub fn forward(&self, x: &Tensor, pos: &[u32], rot: &Rotary) -> Result<(Tensor, GqaSaved)> {
        let (batch, seq) = (x.shape()[0], x.shape()[1]);
        let (rs, s) = self.shapes(batch, seq);
        let qkv = self.qkv.forward(x)?;
        let packed = ops::rope_expand_forward(&qkv, pos, &rot.cos, &rot.sin, rs)?;
        drop(qkv);
        let (att, stats) = ops::attention_forward(&packed, s)?;
        let out = self.out.forward(&att)?;
        Ok((out, GqaSaved { packed, stats, att }))
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
        let dpacked = ops::attention_backward(&datt, &saved.packed, &saved.stats, s)?;
        drop(datt);
        let dqkv = ops::rope_expand_backward(&dpacked, pos, &rot.cos, &rot.sin, rs)?;
        drop(dpacked);
        self.qkv.backward(&dqkv, x)
    }

    pub fn params(&self) -> Vec<&Param> {
        [self.qkv.params(), self.out.params()].concat()
    }

    pub fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.qkv.params_mut();
        v.extend(self.out.params_mut());
        v
    }

    /// Saves the packed `[q | k | v]`, the attention output and the softmax statistics;
    /// FLOPs count the causal half of QK^T and PV.
    pub fn cost_of(
        c: usize,
        h: Heads,
        bias: bool,
        batch: usize,
        seq: usize,
        layout: ActLayout,
    ) -> Cost {
        let tokens = batch * seq;
        let width = h.heads * h.head_dim;
        let pairs = (batch * h.heads * seq * (seq + 1) / 2) as u64;
        let stats = AttnShape {
            batch,
            seq,
            heads: h.heads,
            channels: width,
        };
        let stats: usize = ops::attention_stats_shape(layout.device, stats)
            .iter()
            .product();
        let core = Cost {
            params: 0,
            flops_forward: 4 * pairs * h.head_dim as u64,
            flops_backward: 8 * pairs * h.head_dim as u64,
            saved_bytes: layout.act_bytes(tokens * 4 * width) + f32_bytes(stats),
        };
        Linear::cost_of(c, (h.heads + 2 * h.kv_heads) * h.head_dim, bias, tokens)
            + core
            + Linear::cost_of(width, c, false, tokens)
    }
}

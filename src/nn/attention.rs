//! Causal multi-head self-attention: a fused QKV projection, attention, an output projection.
//!
//! With [`Kernels::Fused`] the attention in the middle is kiln's kernel, which on a GPU never
//! stores the T x T matrix. With [`Kernels::Unfused`] it is what PyTorch eager computes without
//! SDPA: heads copied out of the packed QKV, `S = Q K^T * scale` as a batched GEMM, a causal
//! softmax into `P` (kept for the backward, `[B, H, T, T]` in the activation dtype), `O = P V`
//! as a batched GEMM, and the heads copied back into token rows.

use super::linear::Linear;
use super::{ActLayout, Cost, Kernels, ParamBuilder, f32_bytes, params};
use crate::engine::AttnShape;
use crate::engine::GemmShape;
use crate::engine::{DType, Result, Tensor, ops};

pub struct CausalSelfAttention {
    pub qkv: Linear,
    pub proj: Linear,
    pub n_heads: usize,
}

/// What the backward needs: the QKV activations, the attention output that fed the
/// projection, and the softmax statistics: with the fused kernel the probabilities on the CPU
/// and one log-sum-exp per row on the GPU, unfused the probabilities `P` on every device.
pub struct AttnSaved {
    pub qkv: Tensor,
    pub stats: Tensor,
    pub att: Tensor,
    /// Which attention made `stats`, so the backward matches it.
    pub kernels: Kernels,
}

/// Causal attention over the packed `qkv[B, T, 3C]` as separate kernels: writes every element
/// of `out[B, T, C]` (the fused forward's layout) and returns the probabilities
/// `P[B*H, T, T]` in the activation dtype, zero above the diagonal.
pub fn attention_forward_unfused(out: &mut Tensor, qkv: &Tensor, s: AttnShape) -> Result<Tensor> {
    let (c, hs, t) = (s.channels, s.head_size(), s.seq);
    let products = |trans_a, trans_b, m, n, k| GemmShape {
        trans_a,
        trans_b,
        batch: s.batch * s.heads,
        m,
        n,
        k,
    };
    let scale = 1.0 / (hs as f32).sqrt();
    let scores = {
        let q = ops::heads_from_rows(qkv, s, 0)?;
        let k = ops::heads_from_rows(qkv, s, c)?;
        ops::batched_matmul(products(false, true, t, t, hs), scale, &q, &k)?
    };
    let probs = ops::causal_softmax(&scores)?;
    drop(scores);
    let v = ops::heads_from_rows(qkv, s, 2 * c)?;
    let o = ops::batched_matmul(products(false, false, t, hs, t), 1.0, &probs, &v)?;
    ops::heads_to_rows(out, &o, s, 0)?;
    Ok(probs)
}

/// Backward of [`attention_forward_unfused`]: writes every element of `dqkv[B, T, 3C]` from
/// `dout[B, T, C]`, the forward's `qkv` and its probabilities. `dV = P^T dO`, `dP = dO V^T`,
/// the softmax backward `dS = P * (dP - rowsum(dP * P))`, `dQ = dS K * scale`,
/// `dK = dS^T Q * scale`.
pub fn attention_backward_unfused(
    dqkv: &mut Tensor,
    dout: &Tensor,
    qkv: &Tensor,
    probs: &Tensor,
    s: AttnShape,
) -> Result<()> {
    let (c, hs, t) = (s.channels, s.head_size(), s.seq);
    let products = |trans_a, trans_b, m, n, k| GemmShape {
        trans_a,
        trans_b,
        batch: s.batch * s.heads,
        m,
        n,
        k,
    };
    let scale = 1.0 / (hs as f32).sqrt();
    let dscores = {
        let dout = ops::heads_from_rows(dout, s, 0)?;
        let dv = ops::batched_matmul(products(true, false, t, hs, t), 1.0, probs, &dout)?;
        ops::heads_to_rows(dqkv, &dv, s, 2 * c)?;
        drop(dv);
        let v = ops::heads_from_rows(qkv, s, 2 * c)?;
        let dprobs = ops::batched_matmul(products(false, true, t, t, hs), 1.0, &dout, &v)?;
        ops::causal_softmax_backward(probs, &dprobs)?
    };
    let k = ops::heads_from_rows(qkv, s, c)?;
    let dq = ops::batched_matmul(products(false, false, t, hs, t), scale, &dscores, &k)?;
    drop(k);
    ops::heads_to_rows(dqkv, &dq, s, 0)?;
    drop(dq);
    let q = ops::heads_from_rows(qkv, s, 0)?;
    let dk = ops::batched_matmul(products(true, false, t, hs, t), scale, &dscores, &q)?;
    ops::heads_to_rows(dqkv, &dk, s, c)
}

params!(CausalSelfAttention { qkv, proj });

impl CausalSelfAttention {
    pub fn new(b: &mut ParamBuilder, c: usize, n_heads: usize, proj_std: f32) -> Result<Self> {
        Ok(CausalSelfAttention {
            qkv: Linear::new(&mut b.scope("qkv"), c, 3 * c, true, 0.02)?,
            proj: Linear::new(&mut b.scope("proj"), c, c, true, proj_std)?,
            n_heads,
        })
    }

    fn shape(&self, x: &Tensor) -> AttnShape {
        let s = x.shape();
        AttnShape {
            batch: s[0],
            seq: s[1],
            heads: self.n_heads,
            channels: s[2],
        }
    }

    /// `x` is `[B, T, C]`; attention runs as [`attention_path`] chooses for `kernels`.
    pub fn forward(&self, x: &Tensor, kernels: Kernels) -> Result<(Tensor, AttnSaved)> {
        let qkv = self.qkv.forward(x)?;
        let s = self.shape(x);
        let kernels = attention_path(kernels, &qkv, self.n_heads);
        let (att, stats) = match kernels {
            Kernels::Fused => ops::attention_forward(&qkv, s)?,
            Kernels::Unfused => {
                let shape = [s.batch, s.seq, s.channels];
                let mut att = Tensor::uninit(qkv.pool(), &shape, qkv.dtype())?;
                let probs = attention_forward_unfused(&mut att, &qkv, s)?;
                (att, probs)
            }
        };
        let out = self.proj.forward(&att)?;
        let saved = AttnSaved {
            qkv,
            stats,
            att,
            kernels,
        };
        Ok((out, saved))
    }

    pub fn backward(&mut self, dout: &Tensor, x: &Tensor, saved: &AttnSaved) -> Result<Tensor> {
        let datt = self.proj.backward(dout, &saved.att)?;
        let (qkv, stats, s) = (&saved.qkv, &saved.stats, self.shape(x));
        let dqkv = match saved.kernels {
            Kernels::Fused => ops::attention_backward(&datt, qkv, &saved.att, stats, s)?,
            Kernels::Unfused => {
                let mut dqkv = Tensor::uninit(qkv.pool(), qkv.shape(), qkv.dtype())?;
                attention_backward_unfused(&mut dqkv, &datt, qkv, stats, s)?;
                dqkv
            }
        };
        drop(datt);
        self.qkv.backward(&dqkv, x)
    }

    pub fn cost(&self, batch: usize, seq: usize) -> Cost {
        Self::cost_of(self.qkv.c_in, self.n_heads, batch, seq, ActLayout::CPU_F32)
    }

    /// Saves the QKV activations, the attention output and the softmax statistics (whose
    /// size depends on the device, see `ops::attention_stats_shape`; the unfused attention
    /// keeps `P` instead, see [`unfused_probs_bytes`]). FLOPs count the QK^T and PV products
    /// over the causal half (T^2/2 per head), as the fused kernels compute them.
    pub fn cost_of(c: usize, heads: usize, batch: usize, seq: usize, layout: ActLayout) -> Cost {
        let tokens = batch * seq;
        let pairs = (batch * heads * seq * (seq + 1) / 2) as u64;
        let hs = (c / heads) as u64;
        let stats = AttnShape {
            batch,
            seq,
            heads,
            channels: c,
        };
        let stats: usize = ops::attention_stats_shape(layout.device, stats)
            .iter()
            .product();
        // f32 on a GPU at head sizes without tensor-core kernels runs as GEMMs (see
        // `attention_path`), keeping P instead.
        let act = ops::activation_dtype(layout.device, layout.weights);
        let kept = if gemm_attention(layout.device, act, hs as usize) {
            unfused_probs_bytes(heads, batch, seq, layout)
        } else {
            f32_bytes(stats)
        };
        let core = Cost {
            params: 0,
            flops_forward: 4 * pairs * hs,
            flops_backward: 8 * pairs * hs,
            saved_bytes: layout.act_bytes(tokens * 3 * c + tokens * c) + kept,
        };
        Linear::cost_of(c, 3 * c, true, tokens) + core + Linear::cost_of(c, c, true, tokens)
    }
}

/// The attention that runs for `qkv` with `heads` heads when `requested` is asked for: the
/// unfused chain when asked, and on a GPU also for f32 activations (the tf32 and fp32
/// policies) at head sizes other than 64 and 128. At 64 and 128 the fused kernels run f32 on
/// the tensor cores (tf32 products, or three of them per product for fp32's accuracy); at
/// other sizes they would run on CUDA cores, while the chain's batched GEMMs run in cuBLAS:
/// 2.5x the step speed for GPT-2 small in tf32 and 1.5x in fp32 on an H100 before the f32
/// tensor-core kernels existed (docs/perf-log.md), for keeping `P` per layer
/// ([`unfused_probs_bytes`]), which the planner's meta step books like any other buffer. The
/// CPU keeps its fused reference.
pub fn attention_path(requested: Kernels, qkv: &Tensor, heads: usize) -> Kernels {
    let head_size = qkv.shape().last().map_or(0, |w| w / 3 / heads.max(1));
    if gemm_attention(qkv.device(), qkv.dtype(), head_size) {
        Kernels::Unfused
    } else {
        requested
    }
}

/// Whether attention over activations of `dtype` with `head_size` on `device` always runs as
/// GEMMs (see [`attention_path`]): the one rule the layer and its cost both follow.
fn gemm_attention(device: crate::engine::Device, dtype: DType, head_size: usize) -> bool {
    device != crate::engine::Device::Cpu && dtype == DType::F32 && !matches!(head_size, 64 | 128)
}

/// Bytes of the probabilities `P[B, H, T, T]` one unfused attention layer keeps for its
/// backward (activation dtype); its forward and backward hold up to two more such matrices
/// for a moment (`S` then `P`; `dP` then `dS`).
pub fn unfused_probs_bytes(heads: usize, batch: usize, seq: usize, layout: ActLayout) -> usize {
    layout.act_bytes(batch * heads * seq * seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::assert_close;
    use crate::nn::gradcheck::*;

    /// f32 attention on a GPU takes the GEMM chain whatever was asked at head sizes without
    /// tensor-core kernels (here 2), and the requested path at 64 and 128; 16-bit activations
    /// and the CPU keep the requested path (a meta pool stands for the GPU: no GPU needed).
    #[test]
    fn f32_attention_on_a_gpu_runs_as_gemms_without_tensor_core_kernels() {
        use crate::engine::{DType, Device, MemoryPool};
        let gpu = MemoryPool::meta(Device::Cuda(0));
        let cpu = MemoryPool::new(Device::Cpu);
        // Two heads over a width of `c`.
        let qkv = |pool, dtype, c: usize| Tensor::zeros(pool, &[1, 4, 3 * c], dtype).unwrap();
        for asked in [Kernels::Fused, Kernels::Unfused] {
            let on_gpu = attention_path(asked, &qkv(&gpu, DType::F32, 4), 2);
            assert_eq!(on_gpu, Kernels::Unfused);
            for c in [128, 256] {
                assert_eq!(attention_path(asked, &qkv(&gpu, DType::F32, c), 2), asked);
            }
            assert_eq!(attention_path(asked, &qkv(&gpu, DType::BF16, 4), 2), asked);
            assert_eq!(attention_path(asked, &qkv(&cpu, DType::F32, 4), 2), asked);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut attn = build(&p, "attn", 5, |b| CausalSelfAttention::new(b, 8, 2, 0.3));
        let x = random_tensor(&p, &[2, 5, 8], 6);
        let w = random_tensor(&p, &[2, 5, 8], 7);
        let (_, saved) = attn.forward(&x, Kernels::Fused).unwrap();
        let dx = attn.backward(&w, &x, &saved).unwrap();
        check("dx", &x, dx.host(), 80, |x| {
            weighted_sum(&attn.forward(x, Kernels::Fused).unwrap().0, &w)
        });
        let dq = attn.qkv.weight.grad.to_vec().unwrap();
        let q0 = attn.qkv.weight.value.try_clone().unwrap();
        let s = attn.shape(&x);
        check("dWqkv", &q0, &dq, 60, |wt| {
            let qkv =
                ops::linear_forward(&x, wt, Some(&attn.qkv.bias.as_ref().unwrap().value)).unwrap();
            let (att, _) = ops::attention_forward(&qkv, s).unwrap();
            weighted_sum(&attn.proj.forward(&att).unwrap(), &w)
        });
    }

    /// The unfused chain against the fused CPU kernel on fresh random inputs: shapes with
    /// sequence lengths off multiples of 32, several head counts and sizes. Both run in f32
    /// with different summation orders, so they agree to rounding: 2e-5 relative (at least
    /// 1 in the denominator) on the output and on every element of dqkv.
    #[test]
    fn unfused_matches_fused_forward_and_backward() {
        let p = pool();
        for (i, (batch, seq, heads, channels)) in
            [(2, 7, 2, 8), (1, 33, 4, 32), (3, 45, 3, 48), (2, 70, 1, 16)]
                .into_iter()
                .enumerate()
        {
            let s = AttnShape {
                batch,
                seq,
                heads,
                channels,
            };
            let seed = 100 + 3 * i as u64;
            let qkv = random_tensor(&p, &[batch, seq, 3 * channels], seed);
            let dout = random_tensor(&p, &[batch, seq, channels], seed + 1);
            let (want, want_probs) = ops::attention_forward(&qkv, s).unwrap();
            let mut got = random_tensor(&p, &[batch, seq, channels], seed + 2);
            let probs = attention_forward_unfused(&mut got, &qkv, s).unwrap();
            let what = format!("{s:?}");
            assert_close(got.host(), want.host(), 2e-5, &format!("forward {what}"));
            assert_close(
                probs.host(),
                want_probs.host(),
                2e-5,
                &format!("probabilities {what}"),
            );
            let want = ops::attention_backward(&dout, &qkv, &want, &want_probs, s).unwrap();
            let mut got = random_tensor(&p, &[batch, seq, 3 * channels], seed + 3);
            attention_backward_unfused(&mut got, &dout, &qkv, &probs, s).unwrap();
            assert_close(got.host(), want.host(), 2e-5, &format!("dqkv {what}"));
        }
    }

    #[test]
    fn unfused_layer_backward_matches_finite_differences() {
        let p = pool();
        let mut attn = build(&p, "attn", 8, |b| CausalSelfAttention::new(b, 12, 3, 0.3));
        let x = random_tensor(&p, &[2, 5, 12], 9);
        let w = random_tensor(&p, &[2, 5, 12], 10);
        let (_, saved) = attn.forward(&x, Kernels::Unfused).unwrap();
        assert_eq!(saved.stats.len(), 2 * 3 * 5 * 5, "P is kept whole");
        let dx = attn.backward(&w, &x, &saved).unwrap();
        check("dx", &x, dx.host(), 60, |x| {
            weighted_sum(&attn.forward(x, Kernels::Unfused).unwrap().0, &w)
        });
    }
}

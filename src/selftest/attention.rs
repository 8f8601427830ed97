//! Attention checks: the fused training attention (causal, grouped, windowed, masked, its
//! backward), the prefill through it, and the `unfused` group's chain.

use super::*;

/// bf16 for a chain of kernels that each round their output, as the unfused attention does
/// (S, P and O in the forward; the dO heads, dV, dP, dS, dQ and dK in the backward), against
/// an f32 reference that rounds only its inputs: each rounding adds up to 2^-9 relative, and
/// the one of P passes into O and every gradient, so the bound is a few times the single
/// rounding's 1e-2.
const BOUND_BF16_CHAIN: f64 = 5e-2;

/// A GPU prefill's attention through the training attention (`ops::cache_attention_at` on
/// rows that form runs from position 0: queries and cached keys and values packed, padded to
/// the longest run) against the CPU's cache attention, on tensors of the GPU pool: three
/// prompts of ragged lengths in scrambled slots of a cache whose other positions hold NaN, at
/// SmolLM2's, Llama-3.2-1B's, a head size 128 and Phi-3-mini's (heads of 96) shape, with and
/// without a window. Measured
/// per head vector against the head's largest output, as the training attention is.
pub(super) fn prefill_attention_rows(pool: &Arc<MemoryPool>, inp: &mut Inputs) -> Vec<Row> {
    let mut rows = Vec::new();
    let lens = [37usize, 20, 29];
    let slots = [2u32, 0, 3];
    let slot: Vec<u32> = lens
        .iter()
        .zip(slots)
        .flat_map(|(&n, s)| std::iter::repeat_n(s, n))
        .collect();
    let pos: Vec<u32> = lens.iter().flat_map(|&n| 0..n as u32).collect();
    for (heads, kv_heads, head_dim) in [(9, 3, 64), (32, 8, 64), (16, 8, 128), (32, 32, 96)] {
        for window in [0, 16] {
            let c = cpu::kv_cache::CacheShape {
                slots: 4,
                kv_heads,
                max_len: 64,
                head_dim,
            };
            for (label, dtype, bound) in [
                ("bf16", DType::BF16, BOUND_BF16),
                ("f16", DType::F16, BOUND_F16),
            ] {
                let k = kv_cache_input(inp, c, (&slot, &pos), dtype);
                let v = kv_cache_input(inp, c, (&slot, &pos), dtype);
                let q = inp.uniform(slot.len() * heads * head_dim, 3.0, dtype);
                let mut want = vec![0.0; q.len()];
                cpu::kv_cache::cache_attention(
                    &mut want, &q, &k, &v, &slot, &pos, heads, window, c,
                );
                let got = (|| {
                    let t = |data: &[f32], shape: &[usize]| {
                        Tensor::from_vec(pool, shape, dtype, data.to_vec())
                    };
                    let (q, k, v) = (
                        t(&q, &[slot.len(), heads * head_dim])?,
                        t(&k, &[c.len()])?,
                        t(&v, &[c.len()])?,
                    );
                    let at = ops::CacheRows::host(&q, &slot, &pos, head_dim)?;
                    let out = ops::cache_attention_at(&q, &k, &v, &at, heads, window, lens[0], c)?;
                    out.to_vec()
                })();
                let result = got
                    .map(|g| rel_err_per_head(&g, &want, head_dim))
                    .map_err(|e| CudaError::Driver(e.to_string()));
                rows.push(Row {
                    kernel: "prefill_attention".into(),
                    dtype: label,
                    shape: format!(
                        "runs 37,20,29 H{heads}/{kv_heads} D{head_dim}{}",
                        if window > 0 { " W16" } else { "" }
                    ),
                    result,
                    bound,
                });
            }
        }
    }
    rows
}

/// The unfused attention chain on tensors of the GPU pool: GPT-2's shape, ragged sequence
/// lengths (not multiples of 32) and head sizes 16, 32 and 64.
pub(super) fn unfused_attention_rows(pool: &Arc<MemoryPool>, inp: &mut Inputs) -> Vec<Row> {
    let mut rows = Vec::new();
    for (b, t, nh, c) in [
        (4, 1024, 12, 768),
        (3, 77, 2, 32),
        (2, 130, 4, 64),
        (2, 45, 3, 192),
    ] {
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        for (label, dtype, bound) in [
            ("f32", DType::F32, BOUND_FP32),
            ("bf16", DType::BF16, BOUND_BF16_CHAIN),
        ] {
            let (fwd, bwd) = match check_attention_unfused(pool, inp, s, dtype) {
                Ok((f, b)) => (Ok(f), Ok(b)),
                Err(e) => (Err(CudaError::Driver(e.clone())), Err(CudaError::Driver(e))),
            };
            for (kernel, result) in [
                ("attention_forward_unfused", fwd),
                ("attention_backward_unfused", bwd),
            ] {
                rows.push(Row {
                    kernel: kernel.into(),
                    dtype: label,
                    shape: format!("B{b} T{t} H{nh} C{c}"),
                    result,
                    bound,
                });
            }
        }
    }
    rows
}

/// The elements of parameter `name` (of `len` elements) that are GPT's key bias: softmax is
/// the same for every shift of a row's scores, so its true gradient is exactly zero and what
/// its gradient holds is rounding noise, of either sign. AdamW normalises each element's
/// update, so that noise becomes an update as large as any, and the last-bit difference
/// between the host's and the GPU's AdamW (which, under bf16-mixed, can flip the rounding of a
/// compute copy and so every later gradient's last bits) turns its sign: 1.27e-2 of the
/// largest update after 3 bf16-mixed steps on an H200 with them, 2.98e-4 without
/// (2026-11-27). The offload check leaves these elements out.
pub(super) fn key_bias(name: &str, len: usize) -> std::ops::Range<usize> {
    if name.ends_with("attn.qkv.bias") {
        len / 3..2 * len / 3
    } else {
        0..0
    }
}

/// Flash-style attention (log-sum-exp saved, no T x T matrix) against the CPU kernel, which
/// stores the probabilities: forward output, then the whole dqkv; within a sliding `window`
/// (0: none); `math` picks f32's products (16-bit activations ignore it).
pub(super) fn check_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let (b, t, c) = (s.batch, s.seq, s.channels);
    let qkv = inp.uniform(b * t * 3 * c, 2.0, T::DTYPE);
    let dout = inp.uniform(b * t * c, 1.0, T::DTYPE);
    compare_attention::<T>(gpu, &qkv, &dout, s, window, math)
}

/// The GPU's attention forward and backward on `qkv` and `dout` against the CPU kernel's:
/// the output's error, then dqkv's.
///
/// Under tf32 the inputs are first rounded to tf32, as the 16-bit checks draw inputs their
/// type holds: the check measures the kernels' own roundings (P, dS, the row term), not the
/// policy's rounding of every f32 operand, which the tf32 GEMMs make too. That one is large in
/// the backward: dS = P (dP - d) subtracts nearly equal terms, and dP = dO V^T carries dO's and
/// V's rounding, 1e-2 to 3e-2 of each head's largest gradient against the exact f32
/// reference (measured on an H100).
fn compare_attention<T: Elem>(
    gpu: &CudaBackend,
    qkv: &[f32],
    dout: &[f32],
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let rounded: [Vec<f32>; 2];
    let (qkv, dout) = if T::DTYPE == DType::F32 && math == GemmMath::Tf32 {
        rounded = [qkv, dout].map(|x| x.iter().map(|&v| round_tf32(v)).collect());
        (&rounded[0][..], &rounded[1][..])
    } else {
        (qkv, dout)
    };
    let (b, t, nh, c) = (s.batch, s.seq, s.heads, s.channels);
    let mut out = vec![0.0; b * t * c];
    let mut probs = vec![0.0; b * nh * t * t];
    cpu::attention::windowed_attention_forward(&mut out, &mut probs, qkv, s, window);
    let (o, g) = match gpu_attention::<T>(gpu, qkv, dout, s, window, math) {
        Ok((o, _, g)) => (o, g),
        Err(e) => return (Err(e.clone()), Err(e)),
    };
    let mut dqkv = vec![0.0; qkv.len()];
    if !gpu.attention_uses_tensor_cores(s.head_size()) {
        // The CUDA-core kernels keep P, dS and the row term d in f32: elementwise.
        cpu::attention::windowed_attention_backward(&mut dqkv, dout, qkv, &probs, s, window);
        (
            Ok(rel_err(&o, &out, ELEMENTWISE_FLOOR)),
            Ok(rel_err(&g, &dqkv, ELEMENTWISE_FLOOR)),
        )
    } else {
        // The tensor cores take d_i = dO_i . O_i from the stored output, as FlashAttention
        // does (exact math on the output as stored); the reference uses the same d, from the
        // output the GPU stored.
        let d = row_term(dout, &o, s);
        cpu::attention::attention_backward_given_row_term(
            &mut dqkv, dout, qkv, &probs, &d, s, window,
        );
        (
            Ok(rel_err_per_head(&o, &out, s.head_size())),
            Ok(rel_err_per_head(&g, &dqkv, s.head_size())),
        )
    }
}

/// The bound of f32 attention at `head_size`: three tf32 products on the tensor cores, or f32
/// arithmetic on the CUDA cores.
pub(super) fn f32_attention_bound(gpu: &CudaBackend, head_size: usize) -> f64 {
    if gpu.attention_uses_tensor_cores(head_size) {
        BOUND_3XTF32_ATTENTION
    } else {
        BOUND_FP32
    }
}

/// `x` rounded to tf32's 10 mantissa bits (to nearest, ties away from zero, as `cvt.rna`).
fn round_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

/// `d_i = dO_i . O_i` per batch, head and row (`[B, NH, T]`), summed in f64.
fn row_term(dout: &[f32], out: &[f32], s: AttnShape) -> Vec<f32> {
    let (t, c, hs) = (s.seq, s.channels, s.head_size());
    let mut d = vec![0.0f32; s.batch * s.heads * t];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let at = (b * t + i) * c + h * hs;
                let dot: f64 = dout[at..at + hs]
                    .iter()
                    .zip(&out[at..at + hs])
                    .map(|(&g, &o)| g as f64 * o as f64)
                    .sum();
                d[(b * s.heads + h) * t + i] = dot as f32;
            }
        }
    }
    d
}

/// Attention on the layout grouped-query heads reach the kernels in: `kv_heads` key/value
/// heads, each repeated over its `heads / kv_heads` query heads (as rope_expand packs them),
/// so that groups of heads share their keys and values; against the CPU kernel as in
/// [`check_attention`].
pub(super) fn check_attention_grouped<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    kv_heads: usize,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let (c, d, group) = (s.channels, s.head_size(), s.heads / kv_heads);
    let mut qkv = inp.uniform(s.batch * s.seq * 3 * c, 2.0, T::DTYPE);
    for row in qkv.chunks_mut(3 * c) {
        for head in 0..s.heads {
            // The group's first head holds its key and value.
            let first = head / group * group;
            if first != head {
                for part in [c, 2 * c] {
                    row.copy_within(part + first * d..part + (first + 1) * d, part + head * d);
                }
            }
        }
    }
    let dout = inp.uniform(s.batch * s.seq * c, 1.0, T::DTYPE);
    compare_attention::<T>(gpu, &qkv, &dout, s, window, math)
}

/// The largest score gradient `|dS_ij| = |P_ij (dP_ij - d_i)|` of causal attention, with
/// `dP_ij = dO_i . V_j` and `d_i = sum_j P_ij dP_ij`, from the CPU forward's probabilities.
fn largest_score_gradient(probs: &[f32], qkv: &[f32], dout: &[f32], s: AttnShape) -> f32 {
    let (t, c, d) = (s.seq, s.channels, s.head_size());
    let mut largest = 0.0f32;
    let mut dp = vec![0.0f32; t];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let g = &dout[(b * t + i) * c + h * d..][..d];
                let p = &probs[((b * s.heads + h) * t + i) * t..][..t];
                for (j, x) in dp.iter_mut().enumerate().take(i + 1) {
                    let v = &qkv[(b * t + j) * 3 * c + 2 * c + h * d..][..d];
                    *x = g.iter().zip(v).map(|(a, b)| a * b).sum();
                }
                let row_d: f32 = (0..=i).map(|j| p[j] * dp[j]).sum();
                for j in 0..=i {
                    largest = largest.max((p[j] * (dp[j] - row_d)).abs());
                }
            }
        }
    }
    largest
}

/// f16's largest finite value.
const F16_MAX: f32 = 65504.0;

/// The backward with score gradients past f16's range: dO scaled (as fp16-mixed's loss
/// scale scales it) so that the largest |dS| lands above f16's largest value, near 2^17,
/// while every element of dQ, dK and dV stays under 90% of it. Q and K in [-1, 1] and V in
/// [-8, 8] make dS = P (dO . V - d) large beside dQ and dK (which scale with K and Q). The
/// tensor-core kernels scale dS per row before rounding it to f16 (unscaled it would become
/// inf); the error is dqkv's against the CPU kernel, whose f32 has the range.
pub(super) fn check_attention_large_ds<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
) -> Check {
    let (b, t, nh, c) = (s.batch, s.seq, s.heads, s.channels);
    let mut qkv = inp.uniform(b * t * 3 * c, 1.0, T::DTYPE);
    for row in qkv.chunks_mut(3 * c) {
        row[2 * c..].iter_mut().for_each(|v| *v *= 8.0);
    }
    let unit_dout = inp.uniform(b * t * c, 1.0, T::DTYPE);
    let mut out = vec![0.0; b * t * c];
    let mut probs = vec![0.0; b * nh * t * t];
    cpu::attention::windowed_attention_forward(&mut out, &mut probs, &qkv, s, 0);
    let backward = |dout: &[f32]| {
        let mut dqkv = vec![0.0; qkv.len()];
        cpu::attention::windowed_attention_backward(&mut dqkv, dout, &qkv, &probs, s, 0);
        let largest = dqkv.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        (dqkv, largest)
    };
    // The backward is linear in dO: the scale that puts either limit where it should be.
    let (_, unit_grad) = backward(&unit_dout);
    let unit_ds = largest_score_gradient(&probs, &qkv, &unit_dout, s);
    let scale = (0.9 * F16_MAX / unit_grad).min((1u32 << 17) as f32 / unit_ds);
    let dout: Vec<f32> = unit_dout
        .iter()
        .map(|x| T::DTYPE.round(x * scale))
        .collect();
    let (_, largest_grad) = backward(&dout);
    let largest_ds = largest_score_gradient(&probs, &qkv, &dout, s);
    if largest_ds <= F16_MAX || largest_grad >= 0.95 * F16_MAX {
        return Err(CudaError::Shape {
            op: "attention",
            detail: format!(
                "these inputs cannot take |dS| past f16's range with dqkv inside it (largest \
                 |dS| {largest_ds:.0}, |dqkv| {largest_grad:.0})"
            ),
        });
    }
    let (o, _, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    // As in `compare_attention`: the reference takes the kernels' row term, from the output
    // the GPU stored, and each head's vector is measured against its largest element.
    let mut dqkv = vec![0.0; qkv.len()];
    let d = row_term(&dout, &o, s);
    cpu::attention::attention_backward_given_row_term(&mut dqkv, &dout, &qkv, &probs, &d, s, 0);
    Ok(rel_err_per_head(&g, &dqkv, s.head_size()))
}

/// The f16 Hopper backward's first kernel (`attention_value_bound`): each head's largest |V_j|
/// against the CPU's over the same f16 values, relative to it.
pub(super) fn check_attention_value_bound(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, DType::F16);
    let got = gpu.attention_value_bounds(&gpu.upload_as::<F16>(&qkv)?, s)?;
    Ok(rel_err(&got, &value_bounds(&qkv, s), GEMM_FLOOR))
}

/// Each head's largest L2 norm of a token's values in `qkv` ([B, T, 3C], V the last third), in
/// f64 rounded once.
fn value_bounds(qkv: &[f32], s: AttnShape) -> Vec<f32> {
    let (c, hs) = (s.channels, s.head_size());
    let mut largest = vec![0.0f64; s.batch * s.heads];
    for (i, row) in qkv.chunks_exact(3 * c).enumerate() {
        let b = i / s.seq;
        for (h, v) in row[2 * c..].chunks_exact(hs).enumerate() {
            let norm = v
                .iter()
                .map(|&x| (x as f64) * (x as f64))
                .sum::<f64>()
                .sqrt();
            largest[b * s.heads + h] = largest[b * s.heads + h].max(norm);
        }
    }
    largest.into_iter().map(|x| x as f32).collect()
}

/// The attention output, log-sum-exp and dqkv a GPU computed.
type AttentionResults = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The GPU's attention forward (output and log-sum-exp) and backward on fresh buffers.
fn gpu_attention<T: Elem>(
    gpu: &CudaBackend,
    qkv: &[f32],
    dout: &[f32],
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> std::result::Result<AttentionResults, CudaError> {
    let d_qkv = gpu.upload_as::<T>(qkv)?;
    let mut d_out = poisoned::<T>(gpu, dout.len())?;
    let mut d_lse = poisoned::<f32>(gpu, s.batch * s.heads * s.seq)?;
    gpu.windowed_attention_forward(&mut d_out, &mut d_lse, &d_qkv, s, window, math)?;
    let mut d_dqkv = poisoned::<T>(gpu, qkv.len())?;
    let d_dout = gpu.upload_as::<T>(dout)?;
    gpu.windowed_attention_backward(
        &mut d_dqkv,
        &d_dout,
        &d_qkv,
        &d_out,
        &d_lse,
        s,
        window,
        math,
    )?;
    Ok((
        gpu.download_f32(&d_out)?,
        gpu.download_f32(&d_lse)?,
        gpu.download_f32(&d_dqkv)?,
    ))
}

/// A window at least as long as the sequence against none on the GPU: the output, the
/// log-sum-exp and dqkv must agree bit for bit (the largest difference, bound 0).
pub(super) fn check_attention_full_window<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    math: GemmMath,
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, T::DTYPE);
    let (o, l, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, math)?;
    let (wo, wl, wg) = gpu_attention::<T>(gpu, &qkv, &dout, s, s.seq, math)?;
    Ok(bits_differ(&o, &wo)
        .max(bits_differ(&l, &wl))
        .max(bits_differ(&g, &wg)))
}

/// The same attention forward and backward twice: 0 when every output bit agrees.
pub(super) fn check_attention_repeatable<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, T::DTYPE);
    let (o, l, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    let (ro, rl, rg) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    Ok(bits_differ(&o, &ro)
        .max(bits_differ(&l, &rl))
        .max(bits_differ(&g, &rg)))
}

/// Bidirectional attention with a key padding mask against the CPU kernel; every row of
/// the output is compared, padded query rows included.
pub(super) fn check_masked_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let mut out = vec![0.0; s.batch * s.seq * s.channels];
    cpu::attention_masked::masked_attention_forward(&mut out, &qkv, lens, s);
    let d_lens = gpu.upload(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.masked_attention_forward(&mut d_out, &gpu.upload_as::<T>(&qkv)?, &d_lens, s)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

/// The encoder's training softmax over `[B, H, T, T]` with its key padding mask.
pub(super) fn check_padded_softmax<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let n = s.batch * s.heads * s.seq * s.seq;
    let scores = inp.uniform(n, 4.0, T::DTYPE);
    let mut probs = vec![0.0; n];
    cpu::attention_masked::padded_softmax(&mut probs, &scores, lens, s.heads, s.seq);
    let d_lens = gpu.upload(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let mut d_probs = poisoned::<T>(gpu, n)?;
    gpu.padded_softmax(&mut d_probs, &gpu.upload_as::<T>(&scores)?, &d_lens, s)?;
    Ok(rel_err(
        &gpu.download_f32(&d_probs)?,
        &probs,
        ELEMENTWISE_FLOOR,
    ))
}

/// The whole-row softmax backward, on probabilities with padded keys zeroed as the forward
/// leaves them.
pub(super) fn check_softmax_backward_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let n = s.batch * s.heads * s.seq * s.seq;
    let scores = inp.uniform(n, 4.0, T::DTYPE);
    let mut probs = vec![0.0; n];
    cpu::attention_masked::padded_softmax(&mut probs, &scores, lens, s.heads, s.seq);
    let probs: Vec<f32> = probs.iter().map(|&p| T::DTYPE.round(p)).collect();
    let dprobs = inp.uniform(n, 1.0, T::DTYPE);
    let mut dscores = vec![0.0; n];
    cpu::attention_masked::softmax_backward(&mut dscores, &probs, &dprobs, s.seq);
    let mut d_ds = poisoned::<T>(gpu, n)?;
    gpu.softmax_backward_rows(
        &mut d_ds,
        &gpu.upload_as::<T>(&probs)?,
        &gpu.upload_as::<T>(&dprobs)?,
        s.batch * s.heads * s.seq,
        s.seq,
    )?;
    Ok(rel_err(
        &gpu.download_f32(&d_ds)?,
        &dscores,
        ELEMENTWISE_FLOOR,
    ))
}

/// The unfused attention chain (`train.fused_kernels=false`) on the GPU against the same
/// chain on the CPU, on tensors: forward output and probabilities, then dqkv. The outputs the
/// caller provides start as NaN; the probabilities and intermediates come from kernels whose
/// own checks poison them.
fn check_attention_unfused(
    gpu: &Arc<MemoryPool>,
    inp: &mut Inputs,
    s: AttnShape,
    dtype: DType,
) -> std::result::Result<(f64, f64), String> {
    let run = |pool: &Arc<MemoryPool>, qkv: &[f32], dout: &[f32]| {
        let (b, t, c) = (s.batch, s.seq, s.channels);
        let qkv = Tensor::from_vec(pool, &[b, t, 3 * c], dtype, qkv.to_vec())?;
        let dout = Tensor::from_vec(pool, &[b, t, c], dtype, dout.to_vec())?;
        let mut out = Tensor::from_vec(pool, &[b, t, c], dtype, vec![f32::NAN; b * t * c])?;
        let probs = nn_attention::attention_forward_unfused(&mut out, &qkv, s)?;
        let mut dqkv = Tensor::from_vec(pool, qkv.shape(), dtype, vec![f32::NAN; qkv.len()])?;
        nn_attention::attention_backward_unfused(&mut dqkv, &dout, &qkv, &probs, s)?;
        Ok::<_, crate::engine::EngineError>((out.to_vec()?, probs.to_vec()?, dqkv.to_vec()?))
    };
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, dtype);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, dtype);
    let cpu = MemoryPool::new(Device::Cpu);
    let (out, probs, dqkv) = run(&cpu, &qkv, &dout).map_err(|e| format!("on the CPU: {e}"))?;
    let (g_out, g_probs, g_dqkv) = run(gpu, &qkv, &dout).map_err(|e| e.to_string())?;
    // The output and dqkv are GEMM outputs of a chain whose every intermediate (S, P, dP, dS)
    // is rounded to the activation type on the GPU while the CPU keeps f32: in bf16 a small
    // output element carries an absolute error of about 0.5% of the largest one (1.6% per
    // probability from rounding S near 6, summed over a row), which is 40% of a 1%-floor
    // element -- as eager PyTorch's materialised bf16 attention has. So they are measured
    // as GEMMs are, against the largest element; the probabilities elementwise.
    Ok((
        worst(&[
            rel_err(&g_out, &out, GEMM_FLOOR),
            rel_err(&g_probs, &probs, ELEMENTWISE_FLOOR),
        ]),
        rel_err(&g_dqkv, &dqkv, GEMM_FLOOR),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value bound's reference takes each head's V (the last third of a row), not Q or K,
    /// and the largest norm over every token of its batch.
    #[test]
    fn value_bounds_take_each_heads_largest_value_norm() {
        // B 2, T 2, two heads of 2: C 4, rows of 12 (Q, K, V); Q and K hold larger values.
        let s = AttnShape {
            batch: 2,
            seq: 2,
            heads: 2,
            channels: 4,
        };
        let row = |v: [f32; 4]| {
            let mut r = vec![9.0; 8];
            r.extend(v);
            r
        };
        let qkv: Vec<f32> = [
            row([3.0, 4.0, 0.0, 1.0]),
            row([1.0, 0.0, 6.0, 8.0]),
            row([0.0, 0.0, 0.0, 0.0]),
            row([-1.0, 0.0, 0.0, -2.0]),
        ]
        .concat();
        assert_eq!(value_bounds(&qkv, s), vec![5.0, 10.0, 1.0, 2.0]);
    }
}

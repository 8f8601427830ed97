//! Attention of the training step: fused (causal, windowed, masked) forward and backward,
//! and the unfused chain's softmaxes, batched products and head layouts.

use super::*;

/// Causal attention over fused `qkv[B, T, 3C]`: returns `out[B, T, C]` and what the backward
/// needs besides `qkv` and `out`: the probabilities `[B, H, T, T]` on the CPU, one
/// log-sum-exp per row `[B, H, T]` on the GPU (which never stores the T x T matrix).
pub fn attention_forward(qkv: &Tensor, s: AttnShape) -> Result<(Tensor, Tensor)> {
    profile::label("attention_forward", qkv);
    windowed_attention_forward(qkv, s, 0)
}

/// [`attention_forward`] within a sliding `window`: query `i` attends to keys `j` with
/// `i - window < j <= i`; 0 means no window.
pub fn windowed_attention_forward(
    qkv: &Tensor,
    s: AttnShape,
    window: usize,
) -> Result<(Tensor, Tensor)> {
    let _prof = profile::scope("attention_forward", qkv);
    let on = device_of("attention", &[qkv])?;
    expect_len("attention", "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
    let mut out = Tensor::uninit(qkv.pool(), &[s.batch, s.seq, s.channels], act_dtype(qkv))?;
    let stats = attention_stats_shape(qkv.device(), s);
    match on {
        On::Meta => Ok((out, Tensor::zeros(qkv.pool(), &stats, DType::F32)?)),
        On::Cpu => {
            let mut probs = Tensor::zeros(qkv.pool(), &stats, DType::F32)?;
            cpu::attention::windowed_attention_forward(
                out.host_mut(),
                probs.host_mut(),
                qkv.host(),
                s,
                window,
            );
            Ok((out, probs))
        }
        On::Gpu(g) => {
            let mut lse = Tensor::uninit(qkv.pool(), &stats, DType::F32)?;
            let math = qkv.pool().gemm_math();
            with_elem!(qkv.dtype(), T => g.windowed_attention_forward::<T>(out.cuda_mut(), lse.cuda_mut(), qkv.cuda(), s, window, math))?;
            Ok((out, lse))
        }
    }
}

/// `dqkv` from `dout`, the forward's `qkv`, its output `out` and saved statistics (the GPU's
/// tensor-core kernels take the backward's row term from `out`).
pub fn attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    saved: &Tensor,
    s: AttnShape,
) -> Result<Tensor> {
    profile::label("attention_backward", dout);
    windowed_attention_backward(dout, qkv, out, saved, s, 0)
}

/// The backward of [`windowed_attention_forward`] with the same `window`.
pub fn windowed_attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    saved: &Tensor,
    s: AttnShape,
    window: usize,
) -> Result<Tensor> {
    let _prof = profile::scope("attention_backward", qkv);
    let on = device_of("attention_backward", &[dout, qkv, out, saved])?;
    let mut dqkv = Tensor::uninit(qkv.pool(), qkv.shape(), act_dtype(qkv))?;
    match on {
        On::Meta => meta_scratch(
            qkv,
            4 * crate::engine::cuda::attention::backward_scratch_len(s),
        ),
        On::Cpu => cpu::attention::windowed_attention_backward(
            dqkv.host_mut(),
            dout.host(),
            qkv.host(),
            saved.host(),
            s,
            window,
        ),
        On::Gpu(g) => with_elem!(qkv.dtype(), T => g.windowed_attention_backward::<T>(
            dqkv.cuda_mut(),
            dout.cuda(),
            qkv.cuda(),
            out.cuda(),
            saved.cuda(),
            s,
            window,
            qkv.pool().gemm_math(),
        ))?,
    }
    Ok(dqkv)
}

/// Bidirectional attention over fused `qkv[B, T, 3C]` with a key padding mask: sequence `b`
/// has `lens[b]` real tokens (then padding), and every row attends to those keys only.
/// Returns `out[B, T, C]`; forward only (frozen encoders).
pub fn masked_attention_forward(qkv: &Tensor, lens: &[u32], s: AttnShape) -> Result<Tensor> {
    const OP: &str = "masked_attention";
    let _prof = profile::scope("masked_attention_forward", qkv);
    let on = device_of(OP, &[qkv])?;
    expect_len(OP, "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
    if lens.len() != s.batch {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("{} lengths for a batch of {}", lens.len(), s.batch),
        });
    }
    if let Some(&bad) = lens.iter().find(|&&l| l == 0 || l as usize > s.seq) {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "a sequence length of {bad} is outside 1..={}; every sequence needs a real token",
                s.seq
            ),
        });
    }
    let mut out = Tensor::uninit(qkv.pool(), &[s.batch, s.seq, s.channels], act_dtype(qkv))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_masked::masked_attention_forward(out.host_mut(), qkv.host(), lens, s)
        }
        On::Gpu(g) => {
            let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let d_lens = g.upload(&lens)?;
            with_elem!(qkv.dtype(), T => g.masked_attention_forward::<T>(
                out.cuda_mut(),
                qkv.cuda(),
                &d_lens,
                s,
            ))?
        }
    }
    Ok(out)
}

/// Checks a padding mask: one length per sequence, each in `1 ..= T`.
fn check_lens(op: &'static str, lens: &[u32], s: AttnShape) -> Result<()> {
    if lens.len() != s.batch {
        return Err(EngineError::Shape {
            op,
            detail: format!("{} lengths for a batch of {}", lens.len(), s.batch),
        });
    }
    if let Some(&bad) = lens.iter().find(|&&l| l == 0 || l as usize > s.seq) {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "a sequence length of {bad} is outside 1..={}; every sequence needs a real token",
                s.seq
            ),
        });
    }
    Ok(())
}

/// Softmax of each row of `scores[B, H, T, T]` over its sequence's real keys `0 .. lens[b]`
/// (padded keys get probability zero), into a new tensor: the unfused route an encoder
/// trains through.
pub fn padded_softmax(scores: &Tensor, lens: &[u32], s: AttnShape) -> Result<Tensor> {
    const OP: &str = "padded_softmax";
    let _prof = profile::scope(OP, scores);
    let on = device_of(OP, &[scores])?;
    expect_len(OP, "scores", scores, s.batch * s.heads * s.seq * s.seq)?;
    check_lens(OP, lens, s)?;
    let mut probs = Tensor::uninit(scores.pool(), scores.shape(), act_dtype(scores))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_masked::padded_softmax(
            probs.host_mut(),
            scores.host(),
            lens,
            s.heads,
            s.seq,
        ),
        On::Gpu(g) => {
            let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let d_lens = g.upload(&lens)?;
            with_elem!(scores.dtype(), T => g.padded_softmax::<T>(
                probs.cuda_mut(), scores.cuda(), &d_lens, s,
            ))?
        }
    }
    Ok(probs)
}

/// The backward of a softmax over whole rows (of [`padded_softmax`]: masked entries have zero
/// probability and get zero gradient), into a new tensor.
pub fn softmax_backward(probs: &Tensor, dprobs: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    let _prof = profile::scope(OP, probs);
    let on = device_of(OP, &[probs, dprobs])?;
    let (rows, seq) = rows_cols(OP, probs)?;
    expect_len(OP, "dprobs", dprobs, probs.len())?;
    let mut dscores = Tensor::uninit(probs.pool(), probs.shape(), act_dtype(probs))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_masked::softmax_backward(
            dscores.host_mut(),
            probs.host(),
            dprobs.host(),
            seq,
        ),
        On::Gpu(g) => {
            same_gpu_dtype(OP, probs, dprobs)?;
            with_elem!(probs.dtype(), T => g.softmax_backward_rows::<T>(
                dscores.cuda_mut(), probs.cuda(), dprobs.cuda(), rows, seq,
            ))?
        }
    }
    Ok(dscores)
}

fn heads_rows_check(op: &'static str, rows: &Tensor, s: AttnShape, col0: usize) -> Result<usize> {
    let (n, row) = rows_cols(op, rows)?;
    if n != s.batch * s.seq || col0 + s.channels > row {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "rows of shape {:?} do not hold {} tokens with {} channels from column {col0}",
                rows.shape(),
                s.batch * s.seq,
                s.channels
            ),
        });
    }
    Ok(row)
}

/// The heads in columns `col0 .. col0 + C` of `rows[B, T, row]` as a new `[B, H, T, hs]`
/// tensor (PyTorch's `view(B, T, H, hs).transpose(1, 2).contiguous()`).
pub fn heads_from_rows(rows: &Tensor, s: AttnShape, col0: usize) -> Result<Tensor> {
    const OP: &str = "heads_from_rows";
    let _prof = profile::scope(OP, rows);
    let on = device_of(OP, &[rows])?;
    let row = heads_rows_check(OP, rows, s, col0)?;
    let shape = [s.batch, s.heads, s.seq, s.head_size()];
    let mut heads = Tensor::uninit(rows.pool(), &shape, act_dtype(rows))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_unfused::heads_from_rows(heads.host_mut(), rows.host(), s, row, col0)
        }
        On::Gpu(g) => with_elem!(rows.dtype(), T => g.heads_from_rows::<T>(
            heads.cuda_mut(), rows.cuda(), s, row, col0,
        ))?,
    }
    Ok(heads)
}

/// Writes `heads[B, H, T, hs]` into columns `col0 .. col0 + C` of `rows[B, T, row]`.
pub fn heads_to_rows(rows: &mut Tensor, heads: &Tensor, s: AttnShape, col0: usize) -> Result<()> {
    const OP: &str = "heads_to_rows";
    let _prof = profile::scope(OP, heads);
    let on = device_of(OP, &[rows, heads])?;
    let row = heads_rows_check(OP, rows, s, col0)?;
    expect_len(OP, "heads", heads, s.batch * s.seq * s.channels)?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_unfused::heads_to_rows(rows.host_mut(), heads.host(), s, row, col0)
        }
        On::Gpu(g) => {
            same_gpu_dtype(OP, rows, heads)?;
            with_elem!(heads.dtype(), T => g.heads_to_rows::<T>(
                rows.cuda_mut(), heads.cuda(), s, row, col0,
            ))?
        }
    }
    Ok(())
}

/// Rows of `[.., T, T]` with the causal mask applied and softmax taken, into a new tensor
/// (masked entries zero).
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax";
    let _prof = profile::scope(OP, scores);
    let on = device_of(OP, &[scores])?;
    let (rows, seq) = rows_cols(OP, scores)?;
    let mut probs = Tensor::uninit(scores.pool(), scores.shape(), act_dtype(scores))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_unfused::causal_softmax(probs.host_mut(), scores.host(), seq),
        On::Gpu(g) => with_elem!(scores.dtype(), T => g.causal_softmax::<T>(
            probs.cuda_mut(), scores.cuda(), rows, seq,
        ))?,
    }
    Ok(probs)
}

/// The gradient of the scores from the probabilities and their gradient (the backward of
/// [`causal_softmax`]), into a new tensor.
pub fn causal_softmax_backward(probs: &Tensor, dprobs: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax_backward";
    let _prof = profile::scope(OP, probs);
    let on = device_of(OP, &[probs, dprobs])?;
    let (rows, seq) = rows_cols(OP, probs)?;
    expect_len(OP, "dprobs", dprobs, probs.len())?;
    let mut dscores = Tensor::uninit(probs.pool(), probs.shape(), act_dtype(probs))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_unfused::causal_softmax_backward(
            dscores.host_mut(),
            probs.host(),
            dprobs.host(),
            seq,
        ),
        On::Gpu(g) => {
            same_gpu_dtype(OP, probs, dprobs)?;
            with_elem!(probs.dtype(), T => g.causal_softmax_backward::<T>(
                dscores.cuda_mut(), probs.cuda(), dprobs.cuda(), rows, seq,
            ))?
        }
    }
    Ok(dscores)
}

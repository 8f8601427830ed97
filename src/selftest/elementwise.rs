//! Elementwise and row checks: GELU, dropout, SwiGLU, additions, cross-entropy, embeddings,
//! gathers and scatters.

use super::*;

pub(super) fn check_gelu_erf_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
) -> Check {
    let x = inp.uniform(n, 6.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::gelu_erf::gelu_erf_forward(&mut out, &x);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.gelu_erf_forward(&mut d_out, &gpu.upload_as::<T>(&x)?, n)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

pub(super) fn check_gelu_erf_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
) -> Check {
    let (x, dout) = (inp.uniform(n, 6.0, T::DTYPE), inp.uniform(n, 1.0, T::DTYPE));
    let mut dx = vec![0.0; n];
    cpu::gelu_erf::gelu_erf_backward(&mut dx, &x, &dout);
    let mut d_dx = poisoned::<T>(gpu, n)?;
    gpu.gelu_erf_backward(
        &mut d_dx,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&dout)?,
        n,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR))
}

/// Dropout: the GPU drops exactly the elements the CPU drops (a mismatched mask would leave a
/// whole value's error, far past the bound) and scales the rest alike.
pub(super) fn check_dropout<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let x = inp.uniform(n, 2.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::dropout::dropout(&mut out, &x, 0.1, 0x5EED);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.dropout(&mut d_out, &gpu.upload_as::<T>(&x)?, n, 0.1, 0x5EED)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

pub(super) fn check_gelu_forward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let x = inp.uniform(n, 6.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::gelu::gelu_forward(&mut out, &x);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.gelu_forward(&mut d_out, &gpu.upload_as::<T>(&x)?, n)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

pub(super) fn check_gelu_backward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let (x, dout) = (inp.uniform(n, 6.0, T::DTYPE), inp.uniform(n, 1.0, T::DTYPE));
    let mut dx = vec![0.0; n];
    cpu::gelu::gelu_backward(&mut dx, &x, &dout);
    let mut d_dx = poisoned::<T>(gpu, n)?;
    gpu.gelu_backward(
        &mut d_dx,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&dout)?,
        n,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR))
}

fn logits_and_targets(
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
    d: DType,
) -> (Vec<f32>, Vec<u32>) {
    let logits = inp.uniform(n * v, 4.0, d);
    // Every fifth row is not trained (a prompt token of fine-tuning data): zero loss and
    // gradient.
    let targets = (0..n)
        .map(|r| {
            let t = inp.0.below(valid as u64) as u32;
            if r % 5 == 3 {
                crate::engine::ops::IGNORE_TARGET
            } else {
                t
            }
        })
        .collect();
    (logits, targets)
}

pub(super) fn check_cross_entropy_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let mut losses = vec![0.0; n];
    cpu::cross_entropy::cross_entropy_forward(&mut losses, &logits, &targets, v, valid);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let (d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_forward(
        &mut d_losses,
        &d_logits,
        &d_targets,
        LogitRows { n, v, valid },
    )?;
    Ok(rel_err(
        &gpu.download(&d_losses)?,
        &losses,
        ELEMENTWISE_FLOOR,
    ))
}

pub(super) fn check_cross_entropy_fused<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let grad_scale = 1.0 / n as f32;
    let (mut losses, mut grad) = (vec![0.0; n], logits.clone());
    cpu::cross_entropy::cross_entropy_fused(&mut losses, &mut grad, &targets, v, valid, grad_scale);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let (mut d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_fused(
        &mut d_losses,
        &mut d_logits,
        &d_targets,
        LogitRows { n, v, valid },
        grad_scale,
    )?;
    // The gradient is checked row by row: each row's entries against that row's largest, so
    // the tiny probabilities of a 50k vocabulary are held to account.
    let got = gpu.download_f32(&d_logits)?;
    let grad_err = got
        .chunks(v)
        .zip(grad.chunks(v))
        .map(|(g, w)| rel_err(g, w, ELEMENTWISE_FLOOR))
        .collect::<Vec<_>>();
    Ok(worst(&[
        rel_err(&gpu.download(&d_losses)?, &losses, ELEMENTWISE_FLOOR),
        worst(&grad_err),
    ]))
}

/// The three unfused kernels against their CPU references: the log-probabilities (minus
/// infinity in the padding, which must match exactly), the losses, and the gradient row by row.
pub(super) fn check_cross_entropy_unfused<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    use cpu::cross_entropy as ce;
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let grad_scale = 1.0 / n as f32;
    let (mut logp, mut losses, mut grad) = (vec![0.0; n * v], vec![0.0; n], vec![0.0; n * v]);
    ce::log_softmax(&mut logp, &logits, v, valid);
    ce::nll_loss(&mut losses, &logp, &targets, v);
    ce::log_softmax_nll_backward(&mut grad, &logp, &targets, v, valid, grad_scale);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let mut d_logp = poisoned::<f32>(gpu, n * v)?;
    let mut d_grad = poisoned::<T>(gpu, n * v)?;
    let (d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_unfused(
        &mut d_losses,
        &mut d_logp,
        &mut d_grad,
        &d_logits,
        &d_targets,
        LogitRows { n, v, valid },
        grad_scale,
    )?;
    let got_logp = gpu.download(&d_logp)?;
    let got_grad = gpu.download_f32(&d_grad)?;
    let rows = |got: &[f32], want: &[f32]| {
        worst(
            &got.chunks(v)
                .zip(want.chunks(v))
                .map(|(g, w)| rel_err(g, w, ELEMENTWISE_FLOOR))
                .collect::<Vec<_>>(),
        )
    };
    Ok(worst(&[
        rel_err(&gpu.download(&d_losses)?, &losses, ELEMENTWISE_FLOOR),
        rows(&got_logp, &logp),
        rows(&got_grad, &grad),
    ]))
}

/// `add` into a poisoned buffer and `add_assign` in place, against the CPU.
pub(super) fn check_add<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let a = inp.uniform(n, 2.0, T::DTYPE);
    let b = inp.uniform(n, 3.0, T::DTYPE);
    let mut want = vec![0.0; n];
    cpu::add::add(&mut want, &a, &b);
    let (mut d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.add(&mut d_out, &d_a, &d_b, n)?;
    gpu.add_assign(&mut d_a, &d_b, n)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &want, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_a)?, &want, ELEMENTWISE_FLOOR),
    ]))
}

/// `copy_into_at` (`n` values into a buffer of `3n` at `at`) and `add_assign_from` (`n`
/// values from `at` of that buffer added to another), against the CPU.
pub(super) fn check_offsets<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    at: usize,
) -> Check {
    let big = inp.uniform(3 * n, 2.0, T::DTYPE);
    let part = inp.uniform(n, 3.0, T::DTYPE);
    let dst = inp.uniform(n, 1.0, T::DTYPE);
    let mut want_big = big.clone();
    want_big[at..at + n].copy_from_slice(&part);
    let mut want_dst = dst.clone();
    cpu::add::add_assign(&mut want_dst, &want_big[at..at + n]);
    let mut d_big = gpu.upload_as::<T>(&big)?;
    let d_part = gpu.upload_as::<T>(&part)?;
    let mut d_dst = gpu.upload_as::<T>(&dst)?;
    let mut d_copy = poisoned::<T>(gpu, n)?;
    gpu.copy_into_at(&mut d_big, at, &d_part)?;
    gpu.add_assign_from(&mut d_dst, &d_big, at, n)?;
    gpu.copy_from_at(&mut d_copy, &d_big, at)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_big)?, &want_big, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_dst)?, &want_dst, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_copy)?, &part, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_cols<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    row: usize,
    col0: usize,
    c: usize,
) -> Check {
    let dst = inp.uniform(n * row, 2.0, T::DTYPE);
    let src = inp.uniform(n * c, 3.0, T::DTYPE);
    let mut want_add = dst.clone();
    cpu::add::add_cols_scaled(&mut want_add, &src, row, col0, c, 0.75);
    let mut want_cols = vec![0.0; n * c];
    cpu::add::cols_scaled(&mut want_cols, &dst, row, col0, c, -1.5);
    let d_src = gpu.upload_as::<T>(&src)?;
    let mut d_dst = gpu.upload_as::<T>(&dst)?;
    let mut d_cols = poisoned::<T>(gpu, n * c)?;
    gpu.cols_scaled(&mut d_cols, &d_dst, n, row, col0, c, -1.5)?;
    // The first half of src's rows set into dst's last rows (set_block).
    let (m, at) = (n / 2, n - n / 2);
    let mut want_set = dst.clone();
    cpu::add::set_block(&mut want_set, &src[..m * c], row, at, col0, c);
    let mut d_set = gpu.upload_as::<T>(&dst)?;
    gpu.set_block(
        &mut d_set,
        &gpu.upload_as::<T>(&src[..m * c])?,
        m,
        row,
        at,
        col0,
        c,
    )?;
    gpu.add_cols_scaled(&mut d_dst, &d_src, n, row, col0, c, 0.75)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dst)?, &want_add, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_cols)?, &want_cols, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_set)?, &want_set, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_embedding_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    seq: usize,
    n: usize,
    c: usize,
) -> Check {
    let (wte, wpe) = (
        inp.uniform(vocab * c, 1.0, T::DTYPE),
        inp.uniform(seq * c, 1.0, T::DTYPE),
    );
    let tokens = inp.tokens(n, vocab);
    let mut out = vec![0.0; n * c];
    cpu::embedding::embedding_forward(&mut out, &tokens, &wte, &wpe, seq, c);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (d_wte, d_wpe) = (gpu.upload_as::<T>(&wte)?, gpu.upload_as::<T>(&wpe)?);
    gpu.embedding_forward(
        &mut d_out,
        &gpu.upload(&tokens)?,
        &d_wte,
        &d_wpe,
        n,
        vocab,
        seq,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

pub(super) fn check_embedding_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    seq: usize,
    n: usize,
    c: usize,
) -> Check {
    let dout = inp.uniform(n * c, 1.0, T::DTYPE);
    let tokens = inp.tokens(n, vocab);
    let (dwte0, dwpe0) = (
        inp.uniform(vocab * c, 1.0, DType::F32),
        inp.uniform(seq * c, 1.0, DType::F32),
    );
    let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
    cpu::embedding::embedding_backward(&mut dwte, &mut dwpe, &dout, &tokens, seq, c);
    let d_dout = gpu.upload_as::<T>(&dout)?;
    let (mut d_dwte, mut d_dwpe) = (gpu.upload(&dwte0)?, gpu.upload(&dwpe0)?);
    gpu.embedding_backward(&mut d_dwte, &mut d_dwpe, &d_dout, &tokens, vocab, seq, c)?;
    Ok(worst(&[
        rel_err(&gpu.download(&d_dwte)?, &dwte, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dwpe)?, &dwpe, ELEMENTWISE_FLOOR),
    ]))
}

/// Rows `[gate | up]` with the gate over silu's curved range and beyond.
fn swiglu_input(inp: &mut Inputs, n: usize, f: usize, d: DType) -> Vec<f32> {
    let (gate, up) = (inp.uniform(n * f, 6.0, d), inp.uniform(n * f, 1.0, d));
    gate.chunks(f)
        .zip(up.chunks(f))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect()
}

pub(super) fn check_swiglu_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    f: usize,
) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let mut h = vec![0.0; n * f];
    cpu::swiglu::swiglu_forward(&mut h, &gu, f);
    let mut d_h = poisoned::<T>(gpu, n * f)?;
    gpu.swiglu_forward(&mut d_h, &gpu.upload_as::<T>(&gu)?, n, f)?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &h, ELEMENTWISE_FLOOR))
}

pub(super) fn check_swiglu_forward_normed<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    f: usize,
) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let x = inp.uniform(n * NORMED_STREAM, 4.0, T::DTYPE);
    let eps = 1e-5;
    let normed = cpu::rmsnorm::normed_rows(&gu, 2 * f, &x, NORMED_STREAM, eps, None);
    let mut h = vec![0.0; n * f];
    cpu::swiglu::swiglu_forward(&mut h, &normed, f);
    let mut d_h = poisoned::<T>(gpu, n * f)?;
    gpu.swiglu_forward_normed(
        &mut d_h,
        &gpu.upload_as::<T>(&gu)?,
        &gpu.upload_as::<T>(&x)?,
        n,
        f,
        NORMED_STREAM,
        eps,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &h, ELEMENTWISE_FLOOR))
}

pub(super) fn check_swiglu_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    f: usize,
) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let dh = inp.uniform(n * f, 1.0, T::DTYPE);
    let mut dgu = vec![0.0; 2 * n * f];
    cpu::swiglu::swiglu_backward(&mut dgu, &gu, &dh, f);
    let mut d_dgu = poisoned::<T>(gpu, 2 * n * f)?;
    gpu.swiglu_backward(
        &mut d_dgu,
        &gpu.upload_as::<T>(&gu)?,
        &gpu.upload_as::<T>(&dh)?,
        n,
        f,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dgu)?, &dgu, ELEMENTWISE_FLOOR))
}

pub(super) fn check_token_embedding_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    n: usize,
    c: usize,
) -> Check {
    let dout = inp.uniform(n * c, 1.0, T::DTYPE);
    let uniform = inp.tokens(n, vocab);
    // Uniform tokens, and the same with every third position one hot token (hundreds of
    // hits in one row, many batches of loads).
    let skewed: Vec<u32> = uniform
        .iter()
        .enumerate()
        .map(|(i, &t)| if i % 3 == 1 { 7 % vocab as u32 } else { t })
        .collect();
    let dwte0 = inp.uniform(vocab * c, 1.0, DType::F32);
    let d_dout = gpu.upload_as::<T>(&dout)?;
    let mut errors = Vec::new();
    for tokens in [uniform, skewed] {
        let mut dwte = dwte0.clone();
        cpu::embedding::token_embedding_backward(&mut dwte, &dout, &tokens, c);
        let mut d_dwte = gpu.upload(&dwte0)?;
        gpu.token_embedding_backward(&mut d_dwte, &d_dout, &tokens, vocab, c)?;
        errors.push(rel_err(&gpu.download(&d_dwte)?, &dwte, ELEMENTWISE_FLOOR));
    }
    Ok(worst(&errors))
}

pub(super) fn check_gather_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    src_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    let src = inp.uniform(src_rows * c, 2.0, T::DTYPE);
    let idx = inp.row_indices(rows, src_rows);
    let scale = inp.uniform(rows, 1.0, DType::F32);
    let mut out = vec![0.0; rows * c];
    cpu::rows::gather_rows(&mut out, &src, &idx, Some(&scale), c);
    let mut d_out = poisoned::<T>(gpu, rows * c)?;
    let (d_src, d_idx, d_scale) = (
        gpu.upload_as::<T>(&src)?,
        gpu.upload(&idx)?,
        gpu.upload(&scale)?,
    );
    gpu.gather_rows(
        &mut d_out,
        &d_src,
        &d_idx,
        Some(&d_scale),
        rows,
        src_rows,
        c,
    )?;
    let scaled = rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR);
    // Without a scale the rows are copied.
    cpu::rows::gather_rows(&mut out, &src, &idx, None, c);
    let mut d_out = poisoned::<T>(gpu, rows * c)?;
    gpu.gather_rows(&mut d_out, &d_src, &d_idx, None, rows, src_rows, c)?;
    Ok(worst(&[
        scaled,
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_scatter_add_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    dst_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    // The destination accumulates: it starts from random values, not zeros.
    let dst0 = inp.uniform(dst_rows * c, 1.0, T::DTYPE);
    let src = inp.uniform(rows * c, 2.0, T::DTYPE);
    let idx = inp.distinct_row_indices(rows, dst_rows);
    let scale = inp.uniform(rows, 1.0, DType::F32);
    let mut dst = dst0.clone();
    cpu::rows::scatter_add_rows(&mut dst, &src, &idx, Some(&scale), c);
    let mut d_dst = gpu.upload_as::<T>(&dst0)?;
    let (d_src, d_idx, d_scale) = (
        gpu.upload_as::<T>(&src)?,
        gpu.upload(&idx)?,
        gpu.upload(&scale)?,
    );
    gpu.scatter_add_rows(
        &mut d_dst,
        &d_src,
        &d_idx,
        Some(&d_scale),
        rows,
        dst_rows,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dst)?, &dst, ELEMENTWISE_FLOOR))
}

pub(super) fn check_gathered_row_dot<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    a_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    let a = inp.uniform(a_rows * c, 1.0, T::DTYPE);
    let b = inp.uniform(rows * c, 1.0, T::DTYPE);
    let idx = inp.row_indices(rows, a_rows);
    let mut out = vec![0.0; rows];
    cpu::rows::gathered_row_dot(&mut out, &a, &idx, &b, c);
    let mut d_out = poisoned::<f32>(gpu, rows)?;
    let (d_a, d_b, d_idx) = (
        gpu.upload_as::<T>(&a)?,
        gpu.upload_as::<T>(&b)?,
        gpu.upload(&idx)?,
    );
    gpu.gathered_row_dot(&mut d_out, &d_a, &d_idx, &d_b, rows, a_rows, c)?;
    // A dot product of random signs: measured against the largest, as a GEMM's output is.
    Ok(rel_err(&gpu.download(&d_out)?, &out, GEMM_FLOOR))
}

//! Row operations: embeddings, gathers and scatters of rows, and dot products of gathered rows.

use super::*;

/// `wte[tokens] + wpe[position]` -> `[B, T, C]`.
pub fn embedding_forward(
    tokens: &[u32],
    batch: usize,
    seq: usize,
    wte: &Tensor,
    wpe: &Tensor,
) -> Result<Tensor> {
    let _prof = profile::scope("embedding_forward", wte);
    let on = device_of("embedding", &[wte, wpe])?;
    let (vocab, c) = rows_cols("embedding", wte)?;
    if tokens.len() != batch * seq || wpe.len() < seq * c {
        return Err(EngineError::Shape {
            op: "embedding",
            detail: format!(
                "{} tokens for batch {batch} x seq {seq} (positions available: {})",
                tokens.len(),
                wpe.len() / c
            ),
        });
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Shape {
            op: "embedding",
            detail: format!("token id {t} outside the vocabulary of {vocab}"),
        });
    }
    let mut out = Tensor::uninit(wte.pool(), &[batch, seq, c], act_dtype(wte))?;
    match on {
        On::Meta => meta_scratch(wte, 4 * tokens.len()),
        On::Cpu => cpu::embedding::embedding_forward(
            out.host_mut(),
            tokens,
            wte.host(),
            wpe.host(),
            seq,
            c,
        ),
        On::Gpu(g) => {
            let toks = g.upload(tokens)?;
            with_elem!(wte.dtype(), T => g.embedding_forward::<T>(
                out.cuda_mut(),
                &toks,
                wte.cuda(),
                wpe.cuda(),
                tokens.len(),
                vocab,
                seq,
                c,
            ))?
        }
    }
    Ok(out)
}

pub fn embedding_backward(
    dwte: &mut Tensor,
    dwpe: &mut Tensor,
    dout: &Tensor,
    tokens: &[u32],
    seq: usize,
) -> Result<()> {
    let _prof = profile::scope("embedding_backward", dout);
    let (vocab, c) = rows_cols("embedding_backward", dwte)?;
    if dout.is_meta() {
        meta_scratch(dout, crate::engine::cuda::embedding::row_plan_bytes(tokens));
        return Ok(());
    }
    match dout.device() {
        Device::Cpu => cpu::embedding::embedding_backward(
            dwte.host_mut(),
            dwpe.host_mut(),
            dout.host(),
            tokens,
            seq,
            c,
        ),
        Device::Cuda(_) => {
            let g = dout.pool().cuda()?.clone();
            with_elem!(dout.dtype(), T => g.embedding_backward::<T>(
                dwte.cuda_mut(),
                dwpe.cuda_mut(),
                dout.cuda(),
                tokens,
                vocab,
                seq,
                c,
            ))?
        }
    }
    Ok(())
}

/// Checks row indices against a tensor of `rows` rows (and, for a scatter, that no row is
/// named twice: each destination row must have one writer) and the scale's length.
fn check_row_indices(
    op: &'static str,
    idx: &[u32],
    rows: usize,
    scale: Option<&[f32]>,
    distinct: bool,
) -> Result<()> {
    let shape_err = |detail: String| Err(EngineError::Shape { op, detail });
    if let Some(&i) = idx.iter().find(|&&i| i as usize >= rows) {
        return shape_err(format!("row index {i} outside a tensor of {rows} rows"));
    }
    if let Some(s) = scale.filter(|s| s.len() != idx.len()) {
        return shape_err(format!("{} scales for {} rows", s.len(), idx.len()));
    }
    if distinct {
        let mut seen = vec![false; rows];
        for &i in idx {
            if std::mem::replace(&mut seen[i as usize], true) {
                return shape_err(format!(
                    "row {i} named twice; a scatter needs distinct rows"
                ));
            }
        }
    }
    Ok(())
}

/// `out[s, :] = scale[s] * src[idx[s], :]` -> `[idx.len(), c]` (scale 1 where `None`).
pub fn gather_rows(src: &Tensor, idx: &[u32], scale: Option<&[f32]>) -> Result<Tensor> {
    profile::label("gather_rows", src);
    let (rows, _) = rows_cols("gather_rows", src)?;
    check_row_indices("gather_rows", idx, rows, scale, false)?;
    gather_rows_at(src, Ids::Host(idx), scale)
}

/// [`gather_rows`] with the indices where the kernel reads them; device indices are bounded
/// by the kernel (a row of NaN for one outside `src`).
pub fn gather_rows_at(src: &Tensor, idx: Ids, scale: Option<&[f32]>) -> Result<Tensor> {
    let _prof = profile::scope("gather_rows", src);
    let on = device_of("gather_rows", &[src])?;
    let (rows, c) = rows_cols("gather_rows", src)?;
    if let Some(s) = scale.filter(|s| s.len() != idx.len()) {
        return Err(EngineError::Shape {
            op: "gather_rows",
            detail: format!("{} scales for {} rows", s.len(), idx.len()),
        });
    }
    let mut out = Tensor::uninit(src.pool(), &[idx.len(), c], act_dtype(src))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            let idx = cpu_ids("gather_rows", idx)?;
            check_row_indices("gather_rows", idx, rows, scale, false)?;
            cpu::rows::gather_rows(out.host_mut(), src.host(), idx, scale, c)
        }
        On::Gpu(g) => {
            let d_idx = gpu_ids(&g, idx)?;
            let d_scale = scale.map(|s| g.upload(s)).transpose()?;
            with_elem!(src.dtype(), T => g.gather_rows::<T>(
                out.cuda_mut(),
                src.cuda(),
                d_idx.get(),
                d_scale.as_ref(),
                idx.len(),
                rows,
                c,
            ))?
        }
    }
    Ok(out)
}

/// `dst[idx[s], :] += scale[s] * src[s, :]` (scale 1 where `None`); `idx` must be distinct.
pub fn scatter_add_rows(
    dst: &mut Tensor,
    src: &Tensor,
    idx: &[u32],
    scale: Option<&[f32]>,
) -> Result<()> {
    let _prof = profile::scope("scatter_add_rows", src);
    let on = device_of("scatter_add_rows", &[dst, src])?;
    let (rows, c) = rows_cols("scatter_add_rows", dst)?;
    expect_len("scatter_add_rows", "src", src, idx.len() * c)?;
    check_row_indices("scatter_add_rows", idx, rows, scale, true)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::rows::scatter_add_rows(dst.host_mut(), src.host(), idx, scale, c),
        On::Gpu(_) if idx.is_empty() => {}
        On::Gpu(g) => {
            same_gpu_dtype("scatter_add_rows", dst, src)?;
            let d_idx = g.upload(idx)?;
            let d_scale = scale.map(|s| g.upload(s)).transpose()?;
            with_elem!(src.dtype(), T => g.scatter_add_rows::<T>(
                dst.cuda_mut(),
                src.cuda(),
                &d_idx,
                d_scale.as_ref(),
                idx.len(),
                rows,
                c,
            ))?
        }
    }
    Ok(())
}

/// `out[s] = sum_j a[idx[s], j] * b[s, j]`, read back to the host (one value per row).
pub fn gathered_row_dot(a: &Tensor, idx: &[u32], b: &Tensor) -> Result<Vec<f32>> {
    let _prof = profile::scope("gathered_row_dot", a);
    let on = device_of("gathered_row_dot", &[a, b])?;
    let (rows, c) = rows_cols("gathered_row_dot", a)?;
    expect_len("gathered_row_dot", "b", b, idx.len() * c)?;
    check_row_indices("gathered_row_dot", idx, rows, None, false)?;
    let mut out = vec![0.0; idx.len()];
    match on {
        On::Meta => {}
        On::Cpu => cpu::rows::gathered_row_dot(&mut out, a.host(), idx, b.host(), c),
        On::Gpu(_) if idx.is_empty() => {}
        On::Gpu(g) => {
            same_gpu_dtype("gathered_row_dot", a, b)?;
            let d_idx = g.upload(idx)?;
            let mut d_out = g.alloc::<f32>(idx.len())?;
            with_elem!(a.dtype(), T => g.gathered_row_dot::<T>(
                &mut d_out,
                a.cuda(),
                &d_idx,
                b.cuda(),
                idx.len(),
                rows,
                c,
            ))?;
            out = g.download(&d_out)?;
        }
    }
    Ok(out)
}

/// `wte[tokens]` -> `[batch, seq, C]` (positions come from rotary embeddings instead).
pub fn token_embedding_forward(
    tokens: &[u32],
    batch: usize,
    seq: usize,
    wte: &Tensor,
) -> Result<Tensor> {
    profile::label("token_embedding_forward", wte);
    token_embedding_at(Ids::Host(tokens), batch, seq, wte)
}

/// [`token_embedding_forward`] with the tokens where the kernel reads them; a device token
/// outside the vocabulary gives a row of NaN.
pub fn token_embedding_at(tokens: Ids, batch: usize, seq: usize, wte: &Tensor) -> Result<Tensor> {
    profile::label("token_embedding_at", wte);
    let (vocab, c) = rows_cols("token_embedding", wte)?;
    if tokens.len() != batch * seq {
        return Err(EngineError::Shape {
            op: "token_embedding",
            detail: format!("{} tokens for batch {batch} x seq {seq}", tokens.len()),
        });
    }
    if let Some(&t) = tokens
        .host()
        .and_then(|t| t.iter().find(|&&t| t as usize >= vocab))
    {
        return Err(EngineError::Shape {
            op: "token_embedding",
            detail: format!("token id {t} outside the vocabulary of {vocab}"),
        });
    }
    let rows = gather_rows_at(wte, tokens, None)?;
    Ok(rows.reshaped(&[batch, seq, c]))
}

/// `dwte[tokens[i]] += dout[i]`, repeated tokens included.
pub fn token_embedding_backward(dwte: &mut Tensor, dout: &Tensor, tokens: &[u32]) -> Result<()> {
    let _prof = profile::scope("token_embedding_backward", dout);
    let on = device_of("token_embedding_backward", &[dwte, dout])?;
    let (vocab, c) = rows_cols("token_embedding_backward", dwte)?;
    expect_len("token_embedding_backward", "dout", dout, tokens.len() * c)?;
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::Shape {
            op: "token_embedding_backward",
            detail: format!("token id {t} outside the vocabulary of {vocab}"),
        });
    }
    match on {
        On::Meta => meta_scratch(dout, crate::engine::cuda::embedding::row_plan_bytes(tokens)),
        On::Cpu => {
            cpu::embedding::token_embedding_backward(dwte.host_mut(), dout.host(), tokens, c)
        }
        On::Gpu(g) => with_elem!(dout.dtype(), T => g.token_embedding_backward::<T>(
            dwte.cuda_mut(),
            dout.cuda(),
            tokens,
            vocab,
            c,
        ))?,
    }
    Ok(())
}

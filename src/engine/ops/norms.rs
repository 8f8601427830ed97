//! LayerNorm and RMSNorm, forward (alone or after a residual add) and backward.

use super::*;

/// What a layernorm forward saves for its backward.
pub struct NormStats {
    pub mean: Tensor,
    pub rstd: Tensor,
}

fn norm_stats(x: &Tensor, n: usize) -> Result<NormStats> {
    Ok(NormStats {
        mean: Tensor::uninit(x.pool(), &[n], DType::F32)?,
        rstd: Tensor::uninit(x.pool(), &[n], DType::F32)?,
    })
}

pub fn layernorm_forward(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<(Tensor, NormStats)> {
    profile::label("layernorm_forward", x);
    layernorm_forward_eps(x, gamma, beta, cpu::layernorm::EPS)
}

/// [`layernorm_forward`] with `eps` added to the variance (BERT-family encoders use 1e-12).
pub fn layernorm_forward_eps(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, NormStats)> {
    let _prof = profile::scope("layernorm_forward", x);
    let on = device_of("layernorm", &[x, gamma, beta])?;
    let (n, c) = rows_cols("layernorm", x)?;
    expect_len("layernorm", "gamma", gamma, c)?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut st = norm_stats(x, n)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::layernorm::layernorm_forward_eps(
            out.host_mut(),
            st.mean.host_mut(),
            st.rstd.host_mut(),
            x.host(),
            gamma.host(),
            beta.host(),
            c,
            eps,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.layernorm_forward_eps::<T>(
            out.cuda_mut(),
            st.mean.cuda_mut(),
            st.rstd.cuda_mut(),
            x.cuda(),
            gamma.cuda(),
            beta.cuda(),
            n,
            c,
            eps,
        ))?,
    }
    Ok((out, st))
}

/// `sum = x + delta`, `out = layernorm(sum)`: returns `(sum, out, stats)`.
pub fn residual_layernorm_forward(
    x: &Tensor,
    delta: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
) -> Result<(Tensor, Tensor, NormStats)> {
    profile::label("residual_layernorm_forward", x);
    residual_layernorm_forward_eps(x, delta, gamma, beta, cpu::layernorm::EPS)
}

/// [`residual_layernorm_forward`] with `eps` added to the variance.
pub fn residual_layernorm_forward_eps(
    x: &Tensor,
    delta: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor, NormStats)> {
    let _prof = profile::scope("residual_layernorm_forward", x);
    let on = device_of("residual_layernorm", &[x, delta, gamma, beta])?;
    let (n, c) = rows_cols("residual_layernorm", x)?;
    expect_len("residual_layernorm", "delta", delta, n * c)?;
    let mut sum = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut st = norm_stats(x, n)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::layernorm::residual_layernorm_forward_eps(
            sum.host_mut(),
            out.host_mut(),
            st.mean.host_mut(),
            st.rstd.host_mut(),
            x.host(),
            delta.host(),
            gamma.host(),
            beta.host(),
            c,
            eps,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.residual_layernorm_forward_eps::<T>(
            sum.cuda_mut(),
            out.cuda_mut(),
            st.mean.cuda_mut(),
            st.rstd.cuda_mut(),
            x.cuda(),
            delta.cuda(),
            gamma.cuda(),
            beta.cuda(),
            n,
            c,
            eps,
        ))?,
    }
    Ok((sum, out, st))
}

/// Accumulates the input gradient into `dx` (the residual stream's gradient) and the
/// parameter gradients into `dgamma`, `dbeta`.
pub fn layernorm_backward(
    dx: &mut Tensor,
    dgamma: &mut Tensor,
    dbeta: &mut Tensor,
    dout: &Tensor,
    x: &Tensor,
    gamma: &Tensor,
    st: &NormStats,
) -> Result<()> {
    let _prof = profile::scope("layernorm_backward", x);
    let on = device_of("layernorm_backward", &[dx, dgamma, dbeta, dout, x, gamma])?;
    let (n, c) = rows_cols("layernorm_backward", x)?;
    expect_len("layernorm_backward", "dout", dout, x.len())?;
    match on {
        On::Meta => meta_scratch(x, crate::engine::cuda::reduce::norm_partials_bytes(n, c, 2)),
        On::Cpu => cpu::layernorm::layernorm_backward(
            dx.host_mut(),
            dgamma.host_mut(),
            dbeta.host_mut(),
            dout.host(),
            x.host(),
            gamma.host(),
            st.mean.host(),
            st.rstd.host(),
            c,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.layernorm_backward::<T>(
            dx.cuda_mut(),
            dgamma.cuda_mut(),
            dbeta.cuda_mut(),
            dout.cuda(),
            x.cuda(),
            gamma.cuda(),
            st.mean.cuda(),
            st.rstd.cuda(),
            n,
            c,
        ))?,
    }
    Ok(())
}

// ---- RMSNorm (the Llama family's norm) ----

/// `out = rmsnorm(x) * gamma` per row; returns `(out, rstd[rows])`.
pub fn rmsnorm_forward(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    rmsnorm_forward_padded(x, gamma, eps, 0)
}

/// The shape of a norm's output rows widened by `pad` columns.
fn padded_shape(x: &Tensor, pad: usize) -> Vec<usize> {
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last += pad;
    }
    shape
}

/// [`rmsnorm_forward`] into rows `pad` columns wider than `x`'s, the extra columns zero (for
/// a layer whose adapters are folded into its product: `nn::lora`).
pub fn rmsnorm_forward_padded(
    x: &Tensor,
    gamma: &Tensor,
    eps: f32,
    pad: usize,
) -> Result<(Tensor, Tensor)> {
    let _prof = profile::scope("rmsnorm_forward", x);
    let on = device_of("rmsnorm", &[x, gamma])?;
    let (n, c) = rows_cols("rmsnorm", x)?;
    expect_len("rmsnorm", "gamma", gamma, c)?;
    let mut out = Tensor::uninit(x.pool(), &padded_shape(x, pad), act_dtype(x))?;
    let mut rstd = Tensor::uninit(x.pool(), &[n], DType::F32)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::rmsnorm::rmsnorm_forward(
            out.host_mut(),
            rstd.host_mut(),
            x.host(),
            gamma.host(),
            c,
            c + pad,
            eps,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.rmsnorm_forward::<T>(
            out.cuda_mut(),
            rstd.cuda_mut(),
            x.cuda(),
            gamma.cuda(),
            n,
            c,
            c + pad,
            eps,
        ))?,
    }
    Ok((out, rstd))
}

/// `sum = x + delta`, `out = rmsnorm(sum) * gamma`: returns `(sum, out, rstd)`.
pub fn residual_rmsnorm_forward(
    x: &Tensor,
    delta: &Tensor,
    gamma: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    residual_rmsnorm_forward_padded(x, delta, gamma, eps, 0)
}

/// [`residual_rmsnorm_forward`] with `out`'s rows `pad` columns wider than `x`'s (see
/// [`rmsnorm_forward_padded`]).
pub fn residual_rmsnorm_forward_padded(
    x: &Tensor,
    delta: &Tensor,
    gamma: &Tensor,
    eps: f32,
    pad: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let _prof = profile::scope("residual_rmsnorm_forward", x);
    let on = device_of("residual_rmsnorm", &[x, delta, gamma])?;
    let (n, c) = rows_cols("residual_rmsnorm", x)?;
    expect_len("residual_rmsnorm", "delta", delta, n * c)?;
    expect_len("residual_rmsnorm", "gamma", gamma, c)?;
    let mut sum = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut out = Tensor::uninit(x.pool(), &padded_shape(x, pad), act_dtype(x))?;
    let mut rstd = Tensor::uninit(x.pool(), &[n], DType::F32)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::rmsnorm::residual_rmsnorm_forward(
            sum.host_mut(),
            out.host_mut(),
            rstd.host_mut(),
            x.host(),
            delta.host(),
            gamma.host(),
            c,
            c + pad,
            eps,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.residual_rmsnorm_forward::<T>(
            sum.cuda_mut(),
            out.cuda_mut(),
            rstd.cuda_mut(),
            x.cuda(),
            delta.cuda(),
            gamma.cuda(),
            n,
            c,
            c + pad,
            eps,
        ))?,
    }
    Ok((sum, out, rstd))
}

/// Accumulates the input gradient into `dx` (the residual stream's gradient) and the gain
/// gradient into `dgamma` (f32). `dout`'s rows may be wider than `x`'s (the input gradient
/// of a layer whose adapters are folded into its product): their first columns are read.
pub fn rmsnorm_backward(
    dx: &mut Tensor,
    dgamma: Option<&mut Tensor>,
    dout: &Tensor,
    x: &Tensor,
    gamma: &Tensor,
    rstd: &Tensor,
) -> Result<()> {
    let _prof = profile::scope("rmsnorm_backward", x);
    let on = device_of("rmsnorm_backward", &[dx, dout, x, gamma, rstd])?;
    if let Some(dg) = &dgamma {
        device_of("rmsnorm_backward", &[*dg])?;
    }
    let (n, c) = rows_cols("rmsnorm_backward", x)?;
    let (dout_rows, ldd) = rows_cols("rmsnorm_backward", dout)?;
    if dout_rows != n || ldd < c {
        return Err(EngineError::Shape {
            op: "rmsnorm_backward",
            detail: format!("dout is {dout_rows} rows of {ldd}, needs {n} rows of at least {c}"),
        });
    }
    expect_len("rmsnorm_backward", "dx", dx, x.len())?;
    if let Some(dg) = &dgamma {
        expect_len("rmsnorm_backward", "dgamma", dg, c)?;
    }
    expect_len("rmsnorm_backward", "rstd", rstd, n)?;
    let mut frozen_gain;
    match on {
        On::Meta => {
            if dgamma.is_some() {
                meta_scratch(x, crate::engine::cuda::reduce::norm_partials_bytes(n, c, 1));
            }
        }
        On::Cpu => cpu::rmsnorm::rmsnorm_backward(
            dx.host_mut(),
            match dgamma {
                Some(dg) => dg.host_mut(),
                // A frozen gain: its gradient is formed and dropped (the CPU's kernel keeps
                // one path).
                None => {
                    frozen_gain = vec![0.0; c];
                    &mut frozen_gain
                }
            },
            dout.host(),
            x.host(),
            gamma.host(),
            rstd.host(),
            c,
            ldd,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.rmsnorm_backward::<T>(
            dx.cuda_mut(),
            dgamma.map(|d| d.cuda_mut()),
            dout.cuda(),
            x.cuda(),
            gamma.cuda(),
            rstd.cuda(),
            n,
            c,
            ldd,
        ))?,
    }
    Ok(())
}

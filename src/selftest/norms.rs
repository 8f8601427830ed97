//! LayerNorm, RMSNorm and rotary embedding checks.

use super::*;

/// Layernorm and residual layernorm with `eps`, on rows whose spread (1e-3) makes the
/// epsilon matter.
pub(super) fn check_layernorm_eps<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 1e-3, d), inp.uniform(n * c, 1e-3, d));
    let (g, b) = (inp.uniform(c, 1.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward_eps(&mut out, &mut mean, &mut rstd, &x, &g, &b, c, eps);
    // As in check_residual_layernorm: in bf16 and f16 the GPU normalises the stored sum.
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
    let (mut r_out, mut r_mean, mut r_rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward_eps(
        &mut r_out,
        &mut r_mean,
        &mut r_rstd,
        &sum,
        &g,
        &b,
        c,
        eps,
    );
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let (d_g, d_b) = (gpu.upload_as::<T>(&g)?, gpu.upload_as::<T>(&b)?);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    gpu.layernorm_forward_eps(
        &mut d_out,
        &mut d_mean,
        &mut d_rstd,
        &d_x,
        &d_g,
        &d_b,
        n,
        c,
        eps,
    )?;
    let (mut d_sum, mut d_rout) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let (mut d_rmean, mut d_rrstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    gpu.residual_layernorm_forward_eps(
        &mut d_sum,
        &mut d_rout,
        &mut d_rmean,
        &mut d_rrstd,
        &d_x,
        &d_delta,
        &d_g,
        &d_b,
        n,
        c,
        eps,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_rout)?, &r_out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rrstd)?, &r_rstd, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_layernorm_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g, b) = (
        inp.uniform(n * c, 2.0, d),
        inp.uniform(c, 1.0, d),
        inp.uniform(c, 1.0, d),
    );
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &g, &b, c);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    let (d_x, d_g, d_b) = (
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
        gpu.upload_as::<T>(&b)?,
    );
    gpu.layernorm_forward(&mut d_out, &mut d_mean, &mut d_rstd, &d_x, &d_g, &d_b, n, c)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_mean)?, &mean, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_residual_layernorm<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 2.0, d), inp.uniform(n * c, 2.0, d));
    let (g, b) = (inp.uniform(c, 1.0, d), inp.uniform(c, 1.0, d));
    // The reference: the fused CPU kernel in f32; in bf16 the GPU stores the sum rounded and
    // normalises the stored value, so the reference does the same.
    let (mut sum, mut out) = (vec![0.0; n * c], vec![0.0; n * c]);
    let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
    if d == DType::F32 {
        cpu::layernorm::residual_layernorm_forward(
            &mut sum, &mut out, &mut mean, &mut rstd, &x, &delta, &g, &b, c,
        );
    } else {
        sum = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
        cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &sum, &g, &b, c);
    }
    let (mut d_sum, mut d_out) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let (d_g, d_b) = (gpu.upload_as::<T>(&g)?, gpu.upload_as::<T>(&b)?);
    gpu.residual_layernorm_forward(
        &mut d_sum,
        &mut d_out,
        &mut d_mean,
        &mut d_rstd,
        &d_x,
        &d_delta,
        &d_g,
        &d_b,
        n,
        c,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_mean)?, &mean, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

pub(super) fn check_layernorm_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g, b) = (
        inp.uniform(n * c, 2.0, d),
        inp.uniform(c, 1.0, d),
        inp.uniform(c, 1.0, d),
    );
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &g, &b, c);
    let dout = inp.uniform(n * c, 1.0, d);
    // All three gradients accumulate: start them from random values, not zeros.
    let (dinp0, dg0, db0) = (
        inp.uniform(n * c, 1.0, d),
        inp.uniform(c, 1.0, DType::F32),
        inp.uniform(c, 1.0, DType::F32),
    );
    let (mut dinp, mut dg, mut db) = (dinp0.clone(), dg0.clone(), db0.clone());
    cpu::layernorm::layernorm_backward(&mut dinp, &mut dg, &mut db, &dout, &x, &g, &mean, &rstd, c);
    let mut d_dinp = gpu.upload_as::<T>(&dinp0)?;
    let (mut d_dg, mut d_db) = (gpu.upload(&dg0)?, gpu.upload(&db0)?);
    let (d_dout, d_x, d_g) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
    );
    let (d_mean, d_rstd) = (gpu.upload(&mean)?, gpu.upload(&rstd)?);
    gpu.layernorm_backward(
        &mut d_dinp,
        &mut d_dg,
        &mut d_db,
        &d_dout,
        &d_x,
        &d_g,
        &d_mean,
        &d_rstd,
        n,
        c,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dinp)?, &dinp, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dg)?, &dg, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_db)?, &db, ELEMENTWISE_FLOOR),
    ]))
}

/// Rows of the rotary tables in the selftest; positions are drawn below it.
pub(super) const ROPE_POSITIONS: usize = 4096;

/// Extra columns of the strided rows the RMSNorm checks also write and read.
const NORM_PAD: usize = 16;

/// Rows of `c` values widened by NORM_PAD columns of `fill`.
fn widened(rows: &[f32], c: usize, fill: f32) -> Vec<f32> {
    rows.chunks(c)
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat_n(fill, NORM_PAD)))
        .collect()
}

pub(super) fn check_rmsnorm_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, g) = (inp.uniform(n * c, 2.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &g, c, c, eps);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let mut d_rstd = poisoned::<f32>(gpu, n)?;
    let (d_x, d_g) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&g)?);
    gpu.rmsnorm_forward(&mut d_out, &mut d_rstd, &d_x, &d_g, n, c, c, eps)?;
    // Rows written NORM_PAD columns apart, zeros in the extra ones (a folded adapter layer's
    // input).
    let mut d_wide = poisoned::<T>(gpu, n * (c + NORM_PAD))?;
    gpu.rmsnorm_forward(
        &mut d_wide,
        &mut d_rstd,
        &d_x,
        &d_g,
        n,
        c,
        c + NORM_PAD,
        eps,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
        rel_err(
            &gpu.download_f32(&d_wide)?,
            &widened(&out, c, 0.0),
            ELEMENTWISE_FLOOR,
        ),
    ]))
}

pub(super) fn check_residual_rmsnorm<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 2.0, d), inp.uniform(n * c, 2.0, d));
    let g = inp.uniform(c, 1.0, d);
    // In bf16 and f16 the GPU stores the sum rounded and normalises the stored value, so the
    // reference does the same.
    let (mut sum, mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n]);
    if d == DType::F32 {
        cpu::rmsnorm::residual_rmsnorm_forward(
            &mut sum, &mut out, &mut rstd, &x, &delta, &g, c, c, eps,
        );
    } else {
        sum = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
        cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &sum, &g, c, c, eps);
    }
    let (mut d_sum, mut d_out) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let mut d_rstd = poisoned::<f32>(gpu, n)?;
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let d_g = gpu.upload_as::<T>(&g)?;
    gpu.residual_rmsnorm_forward(
        &mut d_sum,
        &mut d_out,
        &mut d_rstd,
        &d_x,
        &d_delta,
        &d_g,
        n,
        c,
        c,
        eps,
    )?;
    let mut d_wide = poisoned::<T>(gpu, n * (c + NORM_PAD))?;
    let mut d_sum2 = poisoned::<T>(gpu, n * c)?;
    gpu.residual_rmsnorm_forward(
        &mut d_sum2,
        &mut d_wide,
        &mut d_rstd,
        &d_x,
        &d_delta,
        &d_g,
        n,
        c,
        c + NORM_PAD,
        eps,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
        rel_err(
            &gpu.download_f32(&d_wide)?,
            &widened(&out, c, 0.0),
            ELEMENTWISE_FLOOR,
        ),
    ]))
}

pub(super) fn check_rmsnorm_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g) = (inp.uniform(n * c, 2.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &g, c, c, 1e-5);
    let dout = inp.uniform(n * c, 1.0, d);
    // Both gradients accumulate: start them from random values, not zeros.
    let (dx0, dg0) = (inp.uniform(n * c, 1.0, d), inp.uniform(c, 1.0, DType::F32));
    let (mut dx, mut dg) = (dx0.clone(), dg0.clone());
    cpu::rmsnorm::rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &g, &rstd, c, c);
    let (mut d_dx, mut d_dg) = (gpu.upload_as::<T>(&dx0)?, gpu.upload(&dg0)?);
    let (d_dout, d_x, d_g) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
    );
    let d_rstd = gpu.upload(&rstd)?;
    gpu.rmsnorm_backward(
        &mut d_dx,
        Some(&mut d_dg),
        &d_dout,
        &d_x,
        &d_g,
        &d_rstd,
        n,
        c,
        c,
    )?;
    // A frozen gain: the same input gradient, no gain gradient formed.
    let mut d_dx_frozen = gpu.upload_as::<T>(&dx0)?;
    gpu.rmsnorm_backward(
        &mut d_dx_frozen,
        None,
        &d_dout,
        &d_x,
        &d_g,
        &d_rstd,
        n,
        c,
        c,
    )?;
    // dout in rows NORM_PAD columns wider, the extra columns NaN (never read), with and
    // without the gain's gradient.
    let dout_wide = widened(&dout, c, f32::NAN);
    let d_dout_wide = gpu.upload_as::<T>(&dout_wide)?;
    let (mut d_dx_wide, mut d_dg_wide) = (gpu.upload_as::<T>(&dx0)?, gpu.upload(&dg0)?);
    let mut d_dx_wide_frozen = gpu.upload_as::<T>(&dx0)?;
    for (dx, dg) in [
        (&mut d_dx_wide, Some(&mut d_dg_wide)),
        (&mut d_dx_wide_frozen, None),
    ] {
        let ld = c + NORM_PAD;
        gpu.rmsnorm_backward(dx, dg, &d_dout_wide, &d_x, &d_g, &d_rstd, n, c, ld)?;
    }
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dg)?, &dg, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_dx_frozen)?, &dx, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_dx_wide)?, &dx, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dg_wide)?, &dg, ELEMENTWISE_FLOOR),
        rel_err(
            &gpu.download_f32(&d_dx_wide_frozen)?,
            &dx,
            ELEMENTWISE_FLOOR,
        ),
    ]))
}

pub(super) fn check_rope_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    (cos, sin): (&[f32], &[f32]),
) -> Check {
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, T::DTYPE);
    let pos = inp.positions(s.rows, ROPE_POSITIONS);
    let mut out = vec![0.0; s.rows * s.packed_width()];
    cpu::rope::rope_expand_forward(&mut out, &qkv, &pos, cos, sin, s);
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.rope_expand_forward(
        &mut d_out,
        &gpu.upload_as::<T>(&qkv)?,
        &gpu.upload(&pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

pub(super) fn check_rope_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    (cos, sin): (&[f32], &[f32]),
) -> Check {
    let dpacked = inp.uniform(s.rows * s.packed_width(), 1.0, T::DTYPE);
    let pos = inp.positions(s.rows, ROPE_POSITIONS);
    let mut dqkv = vec![0.0; s.rows * s.qkv_width()];
    cpu::rope::rope_expand_backward(&mut dqkv, &dpacked, &pos, cos, sin, s);
    let mut d_dqkv = poisoned::<T>(gpu, dqkv.len())?;
    gpu.rope_expand_backward(
        &mut d_dqkv,
        &gpu.upload_as::<T>(&dpacked)?,
        &gpu.upload(&pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
    )?;
    Ok(rel_err(
        &gpu.download_f32(&d_dqkv)?,
        &dqkv,
        ELEMENTWISE_FLOOR,
    ))
}

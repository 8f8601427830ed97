//! Products: linear layers forward and backward (with their GELU epilogues) and batched and
//! strided matrix products.

use super::*;

pub(super) fn check_linear_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c_in: usize,
    c_out: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w, b) = (
        inp.uniform(n * c_in, 1.0, d),
        inp.uniform(c_out * c_in, 1.0, d),
        inp.uniform(c_out, 1.0, d),
    );
    let mut out = vec![0.0; n * c_out];
    cpu::gemm::linear_forward(&mut out, &x, &w, Some(&b), n, c_in, c_out);
    let mut d_out = poisoned::<T>(gpu, n * c_out)?;
    let (d_x, d_w, d_b) = (
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&w)?,
        gpu.upload_as::<T>(&b)?,
    );
    gpu.linear_forward(&mut d_out, &d_x, &d_w, Some(&d_b), n, c_in, c_out, math)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, GEMM_FLOOR))
}

pub(super) fn check_linear_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c_in: usize,
    c_out: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w, dout) = (
        inp.uniform(n * c_in, 1.0, d),
        inp.uniform(c_out * c_in, 1.0, d),
        inp.uniform(n * c_out, 1.0, d),
    );
    let (dw0, db0) = (
        inp.uniform(c_out * c_in, 1.0, DType::F32),
        inp.uniform(c_out, 1.0, DType::F32),
    );
    let (mut dinp, mut dw, mut db) = (vec![0.0; n * c_in], dw0.clone(), db0.clone());
    cpu::gemm::linear_backward(
        &mut dinp,
        &mut dw,
        Some(&mut db),
        &dout,
        &x,
        &w,
        n,
        c_in,
        c_out,
    );
    let mut d_dinp = poisoned::<T>(gpu, n * c_in)?;
    let (mut d_dw, mut d_db) = (gpu.upload(&dw0)?, gpu.upload(&db0)?);
    let (d_dout, d_x, d_w) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&w)?,
    );
    gpu.linear_backward(
        &mut d_dinp,
        &mut d_dw,
        false,
        Some(&mut d_db),
        &d_dout,
        &d_x,
        &d_w,
        n,
        c_in,
        c_out,
        math,
    )?;
    // A gradient whose clear was deferred to its first writer: the product overwrites it and
    // must not read the old contents (NaN here).
    let mut dw_whole = vec![0.0; c_out * c_in];
    cpu::gemm::linear_backward(
        &mut dinp,
        &mut dw_whole,
        None,
        &dout,
        &x,
        &w,
        n,
        c_in,
        c_out,
    );
    let mut d_dw_whole = poisoned::<f32>(gpu, c_out * c_in)?;
    let mut d_dinp2 = poisoned::<T>(gpu, n * c_in)?;
    gpu.linear_backward(
        &mut d_dinp2,
        &mut d_dw_whole,
        true,
        None,
        &d_dout,
        &d_x,
        &d_w,
        n,
        c_in,
        c_out,
        math,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dinp)?, &dinp, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_dw)?, &dw0, &dw, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_db)?, &db0, &db, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dw_whole)?, &dw_whole, GEMM_FLOOR),
    ]))
}

/// The error of a gradient accumulated into a buffer that started at `start` (random values,
/// which would dominate its scale): what the GPU added (`got - start`) against what the CPU
/// added (`want - start`), so that the check stays sharp.
fn accumulated_err(got: &[f32], start: &[f32], want: &[f32], floor: f64) -> f64 {
    let added = |v: &[f32]| -> Vec<f32> { v.iter().zip(start).map(|(a, s)| a - s).collect() };
    rel_err(&added(got), &added(want), floor)
}

/// The fused GELU products of an MLP against the CPU's separate kernels: `fc` with the GELU
/// in its epilogue (`pre` and `act`), then `proj`'s backward carried through the GELU (`dpre`,
/// and the accumulated `dweight` and `dbias`), `c -> hidden -> c` over `n` rows.
pub(super) fn check_linear_gelu<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    hidden: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w_fc, b_fc) = (
        inp.uniform(n * c, 1.0, d),
        inp.uniform(hidden * c, 1.0, d),
        inp.uniform(hidden, 1.0, d),
    );
    let mut pre = vec![0.0; n * hidden];
    cpu::gemm::linear_forward(&mut pre, &x, &w_fc, Some(&b_fc), n, c, hidden);
    let mut act = vec![0.0; n * hidden];
    cpu::gelu::gelu_forward(&mut act, &pre);
    let (mut d_pre, mut d_act) = (
        poisoned::<T>(gpu, n * hidden)?,
        poisoned::<T>(gpu, n * hidden)?,
    );
    gpu.linear_gelu_forward(
        &mut d_pre,
        &mut d_act,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&w_fc)?,
        Some(&gpu.upload_as::<T>(&b_fc)?),
        n,
        c,
        hidden,
        math,
    )?;
    let forward = worst(&[
        rel_err(&gpu.download_f32(&d_pre)?, &pre, GEMM_FLOOR),
        rel_err(&gpu.download_f32(&d_act)?, &act, GEMM_FLOOR),
    ]);
    // The backward takes the pre-activation and the GELU output as stored in the dtype.
    let (pre, act) = (
        inp.uniform(n * hidden, 3.0, d),
        inp.uniform(n * hidden, 1.0, d),
    );
    let (w, dout) = (inp.uniform(c * hidden, 1.0, d), inp.uniform(n * c, 1.0, d));
    let (dw0, db0) = (
        inp.uniform(c * hidden, 1.0, DType::F32),
        inp.uniform(c, 1.0, DType::F32),
    );
    let (mut dpre, mut dw, mut db) = (vec![0.0; n * hidden], dw0.clone(), db0.clone());
    cpu::gemm::linear_backward(
        &mut dpre,
        &mut dw,
        Some(&mut db),
        &dout,
        &act,
        &w,
        n,
        hidden,
        c,
    );
    cpu::gelu::gelu_backward_in_place(&mut dpre, &pre);
    let mut d_dpre = poisoned::<T>(gpu, n * hidden)?;
    let (mut d_dw, mut d_db) = (gpu.upload(&dw0)?, gpu.upload(&db0)?);
    gpu.linear_gelu_backward(
        &mut d_dpre,
        Some(&mut d_dw),
        false,
        Some(&mut d_db),
        &gpu.upload_as::<T>(&dout)?,
        &gpu.upload_as::<T>(&act)?,
        &gpu.upload_as::<T>(&pre)?,
        &gpu.upload_as::<T>(&w)?,
        n,
        hidden,
        c,
        math,
    )?;
    Ok(worst(&[
        forward,
        rel_err(&gpu.download_f32(&d_dpre)?, &dpre, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_dw)?, &dw0, &dw, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_db)?, &db0, &db, ELEMENTWISE_FLOOR),
    ]))
}

/// A strided-batched product (beta 0, output poisoned) against the CPU's loop of products,
/// error relative to the largest output of the whole batch.
pub(super) fn check_matmul_batched<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    g: GemmShape,
) -> Check {
    let a = inp.uniform(g.batch * g.m * g.k, 1.0, T::DTYPE);
    let b = inp.uniform(g.batch * g.k * g.n, 1.0, T::DTYPE);
    let mut c = vec![0.0; g.batch * g.m * g.n];
    cpu::gemm::sgemm_batched(g, 0.5, &a, &b, 0.0, &mut c);
    let mut d_c = poisoned::<T>(gpu, c.len())?;
    let (d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    gpu.matmul_batched::<T, T>(g, 0.5, &d_a, &d_b, 0.0, &mut d_c, GemmMath::Fp32)?;
    Ok(rel_err(&gpu.download_f32(&d_c)?, &c, GEMM_FLOOR))
}

/// A product whose A (when not transposed, else B) and C are column blocks starting at
/// column `off` of matrices `off + width + 5` wide, C added into (beta 1) and its other
/// columns left as they were.
pub(super) fn check_matmul_view<T: Elem, TC: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    g: GemmShape,
    off: usize,
) -> Check {
    let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    let view = |cols: usize| MatrixView {
        ld: off + cols + 5,
        offset: off,
    };
    let (va, vb, vc) = (view(ac), MatrixView::packed(bc), view(g.n));
    let a = inp.uniform(ar * va.ld, 1.0, T::DTYPE);
    let b = inp.uniform(br * vb.ld, 1.0, T::DTYPE);
    let c0 = inp.uniform(g.m * vc.ld, 1.0, TC::DTYPE);
    let mut c = c0.clone();
    cpu::gemm::sgemm_strided(g, [va, vb, vc], 0.5, &a, &b, 1.0, &mut c);
    let mut d_c = gpu.upload_as::<TC>(&c0)?;
    let (d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    gpu.matmul_view::<T, TC>(
        g,
        [va, vb, vc],
        0.5,
        &d_a,
        &d_b,
        1.0,
        &mut d_c,
        GemmMath::Fp32,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_c)?, &c, GEMM_FLOOR))
}

/// The one transpose combination the linear layer does not use, through `matmul` directly.
pub(super) fn check_matmul_tt(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    m: usize,
    k: usize,
    n: usize,
) -> Check {
    let (a, b) = (
        inp.uniform(k * m, 1.0, DType::F32),
        inp.uniform(n * k, 1.0, DType::F32),
    );
    let c0 = inp.uniform(m * n, 1.0, DType::F32);
    let mut c = c0.clone();
    cpu::gemm::sgemm(true, true, m, n, k, 0.5, &a, &b, 2.0, &mut c);
    let mut d_c = gpu.upload(&c0)?;
    let (d_a, d_b) = (gpu.upload(&a)?, gpu.upload(&b)?);
    gpu.matmul::<f32, f32>(
        true,
        true,
        m,
        n,
        k,
        0.5,
        &d_a,
        &d_b,
        2.0,
        &mut d_c,
        None,
        GemmMath::Fp32,
    )?;
    Ok(rel_err(&gpu.download(&d_c)?, &c, GEMM_FLOOR))
}

//! The ResNet-BK core's kernel and its NaN flag.

use super::*;

/// BK-Core runs its recurrences in f32 against an f64 reference; each G_ii carries the
/// rounding of O(1) contracting steps, and the gradient sums of z and the off-diagonals add
/// up to B x N terms, so the bound sits above the elementwise fp32 one.
pub(super) const BOUND_BK: f64 = 1e-3;

/// BK-Core forward and backward (with learned z, and learned off-diagonals when `with_off`;
/// ones otherwise) against the f64 CPU reference on the same f32 inputs: v uniform within
/// `v_scale`, Im z between `z_im_min` and twice that.
pub(super) fn check_bk_core(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: BkShape,
    with_off: bool,
    v_scale: f32,
    z_im_min: f32,
) -> (Check, Check) {
    use cpu::bk_core::{BkCoeffs, Cx};
    let BkShape { batch, n, .. } = s;
    let has_off = with_off && n > 1;
    let elems = batch * n;
    let v = inp.uniform(elems, v_scale, DType::F32);
    // At n = 1 there are no off-diagonals; one unused value keeps the buffers non-empty.
    let m = (n - 1).max(1);
    let b: Vec<f32> = inp.positive(m, 1.0).iter().map(|x| x + 0.5).collect();
    let c: Vec<f32> = inp.positive(m, 1.0).iter().map(|x| x + 0.5).collect();
    let z = [
        inp.uniform(1, 0.5, DType::F32)[0],
        z_im_min * (1.0 + inp.positive(1, 1.0)[0]),
    ];
    let d_out = inp.uniform(2 * elems, 1.0, DType::F32);
    let (dz0, db0, dc0) = (
        inp.uniform(2, 1.0, DType::F32),
        inp.uniform(m, 1.0, DType::F32),
        inp.uniform(m, 1.0, DType::F32),
    );
    let wide = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
    let (v64, b64, c64) = (wide(&v), wide(&b), wide(&c));
    let offdiag = has_off.then_some((&b64[..n - 1], &c64[..n - 1]));
    let k = BkCoeffs {
        z: Cx::new(z[0] as f64, z[1] as f64),
        offdiag,
    };
    let mut out = vec![0.0f64; 2 * elems];
    cpu::bk_core::forward(&mut out, &v64, k, s);
    let mut dv = vec![0.0f64; elems];
    let g = cpu::bk_core::backward(&mut dv, &wide(&d_out), &v64, k, s);
    let narrow = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<f32>>();
    let fwd = || -> Check {
        let (d_v, d_z) = (gpu.upload(&v)?, gpu.upload(&z)?);
        let (d_b, d_c) = (gpu.upload(&b)?, gpu.upload(&c)?);
        let off = has_off.then_some((&d_b, &d_c));
        let mut d_out = poisoned::<f32>(gpu, 2 * elems)?;
        if !gpu.bk_core_forward(&mut d_out, &d_v, &d_z, off, s)? {
            return Ok(f64::INFINITY);
        }
        Ok(rel_err(
            &gpu.download(&d_out)?,
            &narrow(&out),
            ELEMENTWISE_FLOOR,
        ))
    };
    let bwd = || -> Check {
        let (d_v, d_z, d_g) = (gpu.upload(&v)?, gpu.upload(&z)?, gpu.upload(&d_out)?);
        let (d_b, d_c) = (gpu.upload(&b)?, gpu.upload(&c)?);
        let mut d_dv = poisoned::<f32>(gpu, elems)?;
        let mut d_dz = gpu.upload(&dz0)?;
        let (mut d_db, mut d_dc) = (gpu.upload(&db0)?, gpu.upload(&dc0)?);
        let (off, doff) = if has_off {
            (Some((&d_b, &d_c)), Some((&mut d_db, &mut d_dc)))
        } else {
            (None, None)
        };
        gpu.bk_core_backward(&mut d_dv, &d_g, &d_v, &d_z, off, s, Some(&mut d_dz), doff)?;
        let plus = |start: &[f32], add: Vec<f64>| -> Vec<f32> {
            start
                .iter()
                .zip(add)
                .map(|(&a, b)| (a as f64 + b) as f32)
                .collect()
        };
        let want_dz = plus(&dz0, vec![g.dz.0, g.dz.1]);
        // Untouched at n = 1 (g.dp is empty) or without off-diagonals (none are passed), so
        // the starting values come back.
        let dp = |i: usize, other: &[f64]| match g.dp.get(i) {
            Some(d) if has_off => d * other[i],
            _ => 0.0,
        };
        let want_db = plus(&db0, (0..m).map(|i| dp(i, &c64)).collect());
        let want_dc = plus(&dc0, (0..m).map(|i| dp(i, &b64)).collect());
        Ok(worst(&[
            rel_err(&gpu.download(&d_dv)?, &narrow(&dv), ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_dz)?, &want_dz, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_db)?, &want_db, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_dc)?, &want_dc, ELEMENTWISE_FLOOR),
        ]))
    };
    (fwd(), bwd())
}

/// A NaN in the potential must raise the forward's non-finite flag (0 = raised).
pub(super) fn check_bk_core_flags_nan(gpu: &CudaBackend, inp: &mut Inputs) -> Check {
    let s = BkShape {
        batch: 2,
        n: 300,
        causal: false,
    };
    let mut v = inp.uniform(600, 1.0, DType::F32);
    v[417] = f32::NAN;
    let mut out = poisoned::<f32>(gpu, 1200)?;
    let finite = gpu.bk_core_forward(
        &mut out,
        &gpu.upload(&v)?,
        &gpu.upload(&[0.0f32, 1.0])?,
        None,
        s,
    )?;
    Ok(if finite { f64::INFINITY } else { 0.0 })
}

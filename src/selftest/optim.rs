//! The optimizer's kernels: AdamW (one tensor and many) and the sums of squares of the
//! gradient norm.

use super::*;

/// `with_compute`: also write the compute copy in `C` (else `C` is unused). The fused kernel
/// and the unfused passes (`kernels`) are both held to the fused CPU reference, which the
/// unfused CPU passes equal bit for bit.
pub(super) fn check_adamw<C: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    with_compute: bool,
    kernels: Kernels,
) -> Check {
    let param0 = inp.uniform(n, 1.0, DType::F32);
    let grad = inp.uniform(n, 2.0, DType::F32);
    let m0 = inp.uniform(n, 0.1, DType::F32);
    let v0 = inp.positive(n, 0.01);
    let h = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 7,
        grad_scale: 0.25,
    };
    let (mut param, mut m, mut v) = (param0.clone(), m0.clone(), v0.clone());
    let mut compute = vec![0.0; n];
    let cpu_compute = with_compute.then_some((compute.as_mut_slice(), C::DTYPE));
    cpu::adamw::adamw_update(&mut param, &grad, &mut m, &mut v, cpu_compute, h);
    let (mut d_param, d_grad) = (gpu.upload(&param0)?, gpu.upload(&grad)?);
    let (mut d_m, mut d_v) = (gpu.upload(&m0)?, gpu.upload(&v0)?);
    let mut d_compute = poisoned::<C>(gpu, n)?;
    let compute_arg = with_compute.then_some(&mut d_compute);
    match kernels {
        Kernels::Fused => {
            gpu.adamw_update(&mut d_param, &d_grad, &mut d_m, &mut d_v, compute_arg, n, h)?
        }
        Kernels::Unfused => {
            let mut scratch = poisoned::<f32>(gpu, n)?;
            gpu.adamw_update_unfused(
                &mut d_param,
                &d_grad,
                &mut d_m,
                &mut d_v,
                &mut scratch,
                compute_arg,
                n,
                h,
            )?
        }
    }
    let mut errs = vec![
        rel_err(&gpu.download(&d_param)?, &param, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_m)?, &m, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_v)?, &v, ELEMENTWISE_FLOOR),
    ];
    if with_compute {
        errs.push(rel_err(
            &gpu.download_f32(&d_compute)?,
            &compute,
            ELEMENTWISE_FLOOR,
        ));
    }
    Ok(worst(&errs))
}

/// Tensors of `sizes` through one launch of the fused update, alternating weight decays,
/// each against the CPU reference run on it alone.
pub(super) fn check_adamw_many<C: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    sizes: &[usize],
    with_compute: bool,
) -> Check {
    use crate::engine::cuda::AdamWSlices;
    let h = |i: usize| AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: if i.is_multiple_of(2) { 0.1 } else { 0.0 },
        t: 3,
        grad_scale: 0.5,
    };
    let mut want = Vec::new();
    let mut dev = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p0 = inp.uniform(n, 1.0, DType::F32);
        let g = inp.uniform(n, 2.0, DType::F32);
        let m0 = inp.uniform(n, 0.1, DType::F32);
        let v0 = inp.positive(n, 0.01);
        let (mut p, mut m, mut v, mut c) = (p0.clone(), m0.clone(), v0.clone(), vec![0.0; n]);
        let cpu_c = with_compute.then_some((c.as_mut_slice(), C::DTYPE));
        cpu::adamw::adamw_update(&mut p, &g, &mut m, &mut v, cpu_c, h(i));
        want.push((p, m, v, c));
        let up = gpu.upload(&p0)?;
        dev.push((
            up,
            gpu.upload(&g)?,
            gpu.upload(&m0)?,
            gpu.upload(&v0)?,
            poisoned::<C>(gpu, n)?,
        ));
    }
    let mut slices: Vec<_> = dev
        .iter_mut()
        .zip(sizes)
        .enumerate()
        .map(|(i, ((p, g, m, v, c), &n))| AdamWSlices {
            param: p,
            grad: &*g,
            m,
            v,
            compute: with_compute.then_some(c),
            n,
            weight_decay: h(i).weight_decay,
        })
        .collect();
    gpu.adamw_update_many(&mut slices, h(0))?;
    drop(slices);
    let mut errs = Vec::new();
    for ((p, _, m, v, c), (wp, wm, wv, wc)) in dev.iter().zip(&want) {
        errs.push(rel_err(&gpu.download(p)?, wp, ELEMENTWISE_FLOOR));
        errs.push(rel_err(&gpu.download(m)?, wm, ELEMENTWISE_FLOOR));
        errs.push(rel_err(&gpu.download(v)?, wv, ELEMENTWISE_FLOOR));
        if with_compute {
            errs.push(rel_err(&gpu.download_f32(c)?, wc, ELEMENTWISE_FLOOR));
        }
    }
    Ok(worst(&errs))
}

/// With `bad`, one element is replaced by it and the check is that the flag goes up (error 0
/// if it does, infinite if not); otherwise the sum is compared and the flag must stay down.
/// Several tensors (one empty) through one partial buffer, against the f64 sum on the host.
pub(super) fn check_sum_squares_many(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    sizes: &[usize],
) -> Check {
    let xs: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| inp.uniform(n, 3.0, DType::F32))
        .collect();
    let want: f64 = xs.iter().flatten().map(|&v| v as f64 * v as f64).sum();
    let acc0 = inp.0.next_f64();
    let (mut d_acc, mut d_flag) = (gpu.upload(&[acc0])?, gpu.upload(&[0u32])?);
    let d_xs = xs
        .iter()
        .map(|x| gpu.upload(if x.is_empty() { &[0.0f32][..] } else { x }))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let pairs: Vec<_> = d_xs.iter().zip(sizes).map(|(d, &n)| (d, n)).collect();
    gpu.sum_squares_many(&mut d_acc, &mut d_flag, &pairs)?;
    if gpu.download(&d_flag)?[0] != 0 {
        return Ok(f64::INFINITY);
    }
    let got = gpu.download(&d_acc)?[0] - acc0;
    Ok(((got - want) / want).abs())
}

pub(super) fn check_sum_squares(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    bad: Option<f32>,
) -> Check {
    let mut x = inp.uniform(n, 3.0, DType::F32);
    if let Some(bad) = bad {
        let at = inp.0.below(n as u64) as usize;
        x[at] = bad;
    }
    let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let acc0 = inp.0.next_f64();
    let (mut d_acc, mut d_flag) = (gpu.upload(&[acc0])?, gpu.upload(&[0u32])?);
    gpu.sum_squares_accumulate(&mut d_acc, &mut d_flag, &gpu.upload(&x)?, n)?;
    let flag = gpu.download(&d_flag)?[0];
    let got = gpu.download(&d_acc)?[0] - acc0;
    Ok(match bad {
        Some(_) => {
            if flag == 1 {
                0.0
            } else {
                f64::INFINITY
            }
        }
        None if flag != 0 => f64::INFINITY,
        None => ((got - want) / want).abs(),
    })
}

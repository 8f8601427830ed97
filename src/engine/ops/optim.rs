//! The optimizer's operations: AdamW (one tensor, many at once, unfused) and sums of squares.

use super::*;

/// Sum of squares over all of `ts` in f64 (the global gradient norm, and its inf/NaN check:
/// a non-finite element makes the result NaN). The GPU accumulates every tensor on the device
/// and reads the total back once.
pub fn sum_squares(ts: &[&Tensor]) -> Result<f64> {
    let Some(first) = ts.first() else {
        return Ok(0.0);
    };
    let _prof = profile::scope("sum_squares", first);
    match device_of("sum_squares", ts)? {
        On::Meta => {
            let lens: Vec<usize> = ts.iter().map(|t| t.len()).collect();
            meta_scratch(
                first,
                crate::engine::cuda::reduce::sum_squares_scratch_bytes(&lens),
            );
            Ok(0.0)
        }
        // Per tensor, then over tensors: the order the CPU reference has always used.
        On::Cpu => Ok(ts
            .iter()
            .map(|t| t.host().iter().map(|&x| x as f64 * x as f64).sum::<f64>())
            .sum()),
        On::Gpu(g) => {
            let mut acc = g.upload(&[0.0f64])?;
            let mut flag = g.upload(&[0u32])?;
            let xs: Vec<_> = ts.iter().map(|t| (t.cuda::<f32>(), t.len())).collect();
            g.sum_squares_many(&mut acc, &mut flag, &xs)?;
            if g.download(&flag)?[0] != 0 {
                return Ok(f64::NAN);
            }
            Ok(g.download(&acc)?[0])
        }
    }
}

/// One fused AdamW step over a parameter; see [`cpu::adamw`].
pub fn adamw_update(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    compute: Option<&mut Tensor>,
    h: AdamWStep,
) -> Result<()> {
    adamw_step(param, grad, m, v, compute, h, false)
}

/// One parameter of [`adamw_update_many`]: its fp32 master, gradient and moments, its compute
/// copy if it has one, and the step's settings for it.
pub struct AdamWParam<'a> {
    pub param: &'a mut Tensor,
    pub grad: &'a Tensor,
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
    pub compute: Option<&'a mut Tensor>,
    pub h: AdamWStep,
}

/// [`adamw_update`] over many parameters. On the GPU the parameters that share a kind of
/// compute copy and every setting but the weight decay go in one launch (a model's step is
/// then one or two launches instead of one per tensor, most too small to fill the GPU); on
/// the CPU each runs alone. Every parameter gets the bits [`adamw_update`] gives it.
pub fn adamw_update_many(params: Vec<AdamWParam<'_>>) -> Result<()> {
    let Some(first) = params.first() else {
        return Ok(());
    };
    let on = device_of(
        "adamw",
        &params.iter().map(|p| &*p.param).collect::<Vec<_>>(),
    )?;
    let g = match on {
        On::Gpu(g) => g,
        On::Meta => {
            let table = params.len() * crate::engine::cuda::ADAMW_TABLE_BYTES_PER_TENSOR;
            meta_scratch(first.param, table);
            return Ok(());
        }
        On::Cpu => {
            for p in params {
                adamw_update(p.param, p.grad, p.m, p.v, p.compute, p.h)?;
            }
            return Ok(());
        }
    };
    let _prof = profile::scope("adamw_update", first.param);
    for p in &params {
        let n = p.param.len();
        for (what, t) in [("grad", p.grad), ("m", &*p.m), ("v", &*p.v)] {
            expect_len("adamw", what, t, n)?;
        }
        if let Some(c) = &p.compute {
            expect_len("adamw", "compute", c, n)?;
        }
    }
    // Launches by (compute dtype, settings but the weight decay), in first-seen order.
    type Key = (Option<DType>, [u32; 5], u64);
    let key = |p: &AdamWParam| -> Key {
        let h = &p.h;
        let bits = [h.lr, h.beta1, h.beta2, h.eps, h.grad_scale].map(f32::to_bits);
        (p.compute.as_ref().map(|c| c.dtype()), bits, h.t)
    };
    let mut groups: Vec<(Key, Vec<AdamWParam>)> = Vec::new();
    for p in params {
        let k = key(&p);
        match groups.iter_mut().find(|(gk, _)| *gk == k) {
            Some((_, members)) => members.push(p),
            None => groups.push((k, vec![p])),
        }
    }
    for ((dtype, _, _), members) in groups {
        match dtype {
            None => adamw_launch::<f32>(&g, members)?,
            Some(d) => with_elem!(d, T => adamw_launch::<T>(&g, members))?,
        }
    }
    Ok(())
}

/// One launch of the fused AdamW over `members`, which share their settings (but the weight
/// decay) and their kind of compute copy, `C` (unused without one).
fn adamw_launch<C: DeviceElem>(g: &CudaBackend, members: Vec<AdamWParam<'_>>) -> Result<()> {
    let h = members[0].h;
    let mut slices: Vec<_> = members
        .into_iter()
        .map(|p| AdamWSlices {
            n: p.param.len(),
            param: p.param.cuda_mut::<f32>(),
            grad: p.grad.cuda::<f32>(),
            m: p.m.cuda_mut::<f32>(),
            v: p.v.cuda_mut::<f32>(),
            compute: p.compute.map(|c| c.cuda_mut::<C>()),
            weight_decay: p.h.weight_decay,
        })
        .collect();
    g.adamw_update_many(&mut slices, h)?;
    Ok(())
}

/// [`adamw_update`] as the five whole-tensor passes of a non-fused AdamW (scale the gradient
/// into scratch taken from the pool, update `m`, `v`, the master, round the compute copy);
/// see [`cpu::adamw::adamw_update_unfused`].
pub fn adamw_update_unfused(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    compute: Option<&mut Tensor>,
    h: AdamWStep,
) -> Result<()> {
    adamw_step(param, grad, m, v, compute, h, true)
}

/// The two AdamW forms: the same checks and dispatch, the unfused one with its scratch.
fn adamw_step(
    param: &mut Tensor,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    compute: Option<&mut Tensor>,
    h: AdamWStep,
    unfused: bool,
) -> Result<()> {
    let (op, scope) = if unfused {
        ("adamw_unfused", "adamw_update_unfused")
    } else {
        ("adamw", "adamw_update")
    };
    let _prof = profile::scope(scope, param);
    let n = param.len();
    for (what, t) in [("grad", grad), ("m", &*m), ("v", &*v)] {
        expect_len(op, what, t, n)?;
    }
    let mut scaled = match unfused {
        true => Some(Tensor::uninit(param.pool(), param.shape(), DType::F32)?),
        false => None,
    };
    if param.is_meta() {
        return Ok(());
    }
    match param.device() {
        Device::Cpu => {
            let compute = compute.map(|c| {
                let dtype = c.dtype();
                (c.host_mut(), dtype)
            });
            let (p, g, m, v) = (param.host_mut(), grad.host(), m.host_mut(), v.host_mut());
            match &mut scaled {
                None => cpu::adamw::adamw_update(p, g, m, v, compute, h),
                Some(s) => cpu::adamw::adamw_update_unfused(p, g, m, v, s.host_mut(), compute, h),
            }
        }
        Device::Cuda(_) => {
            let gpu = param.pool().cuda()?.clone();
            let (p, g) = (param.cuda_mut::<f32>(), grad.cuda::<f32>());
            let (m, v) = (m.cuda_mut::<f32>(), v.cuda_mut::<f32>());
            let scaled = scaled.as_mut().map(|s| s.cuda_mut::<f32>());
            match compute {
                None => match scaled {
                    None => gpu.adamw_update::<f32>(p, g, m, v, None, n, h)?,
                    Some(s) => gpu.adamw_update_unfused::<f32>(p, g, m, v, s, None, n, h)?,
                },
                Some(c) => with_elem!(c.dtype(), T => match scaled {
                    None => gpu.adamw_update::<T>(p, g, m, v, Some(c.cuda_mut()), n, h),
                    Some(s) => gpu.adamw_update_unfused::<T>(p, g, m, v, s, Some(c.cuda_mut()), n, h),
                })?,
            }
        }
    }
    Ok(())
}

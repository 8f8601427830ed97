//! Cross-entropy over the vocabulary: plain, fused with the logits' gradient, and unfused.

use super::*;

fn check_targets(
    op: &'static str,
    logits: &Tensor,
    targets: &[u32],
    valid: usize,
) -> Result<(usize, usize)> {
    let (n, v) = rows_cols(op, logits)?;
    if valid > v {
        return Err(EngineError::Shape {
            op,
            detail: format!("a vocabulary of {valid} does not fit rows of {v} logits"),
        });
    }
    if targets.len() != n {
        return Err(EngineError::Shape {
            op,
            detail: format!("{} targets for {n} rows", targets.len()),
        });
    }
    if let Some(&t) = targets
        .iter()
        .find(|&&t| t as usize >= valid && t != IGNORE_TARGET)
    {
        return Err(EngineError::Shape {
            op,
            detail: format!("target id {t} outside the vocabulary of {valid}"),
        });
    }
    Ok((n, v))
}

/// Per-row cross-entropy losses of `logits[N, V]` over its first `valid` columns (the rest
/// pad the vocabulary and are masked out).
pub fn cross_entropy(logits: &Tensor, targets: &[u32], valid: usize) -> Result<Vec<f32>> {
    let _prof = profile::scope("cross_entropy", logits);
    let on = device_of("cross_entropy", &[logits])?;
    let (n, v) = check_targets("cross_entropy", logits, targets, valid)?;
    let mut losses = vec![0.0; n];
    match on {
        On::Meta => meta_scratch(logits, 8 * n),
        On::Cpu => {
            cpu::cross_entropy::cross_entropy_forward(&mut losses, logits.host(), targets, v, valid)
        }
        On::Gpu(g) => {
            let mut d_losses = g.alloc::<f32>(n)?;
            let targets = g.upload(targets)?;
            with_elem!(logits.dtype(), T => g.cross_entropy_forward::<T>(&mut d_losses, logits.cuda(), &targets, LogitRows { n, v, valid }))?;
            losses = g.download(&d_losses)?;
        }
    }
    Ok(losses)
}

/// Per-row losses over the first `valid` columns; `logits` becomes the gradient of
/// `grad_scale * sum(losses)` (zero in the padding columns).
pub fn cross_entropy_fused(
    logits: &mut Tensor,
    targets: &[u32],
    valid: usize,
    grad_scale: f32,
) -> Result<Vec<f32>> {
    let _prof = profile::scope("cross_entropy_fused", logits);
    let (n, v) = check_targets("cross_entropy_fused", logits, targets, valid)?;
    let mut losses = vec![0.0; n];
    if logits.is_meta() {
        // The losses and the uploaded targets.
        meta_scratch(logits, 8 * n);
        return Ok(losses);
    }
    match logits.device() {
        Device::Cpu => cpu::cross_entropy::cross_entropy_fused(
            &mut losses,
            logits.host_mut(),
            targets,
            v,
            valid,
            grad_scale,
        ),
        Device::Cuda(_) => {
            let g = logits.pool().cuda()?.clone();
            let mut d_losses = g.alloc::<f32>(n)?;
            let targets = g.upload(targets)?;
            with_elem!(logits.dtype(), T => g.cross_entropy_fused::<T>(
                &mut d_losses,
                logits.cuda_mut(),
                &targets,
                LogitRows { n, v, valid },
                grad_scale,
            ))?;
            losses = g.download(&d_losses)?;
        }
    }
    Ok(losses)
}

/// [`cross_entropy_fused`] as the three kernels a framework without a fused loss launches:
/// the log-probabilities into a new f32 `[N, V]` buffer, the losses gathered from it, and the
/// gradient of `grad_scale * sum(losses)` written into a new buffer, which is returned with
/// the losses (`logits` is left as it was).
pub fn cross_entropy_unfused(
    logits: &Tensor,
    targets: &[u32],
    valid: usize,
    grad_scale: f32,
) -> Result<(Vec<f32>, Tensor)> {
    let _prof = profile::scope("cross_entropy_unfused", logits);
    let on = device_of("cross_entropy_unfused", &[logits])?;
    let (n, v) = check_targets("cross_entropy_unfused", logits, targets, valid)?;
    let mut losses = vec![0.0; n];
    let mut logp = Tensor::uninit(logits.pool(), logits.shape(), DType::F32)?;
    let mut dlogits = Tensor::uninit(logits.pool(), logits.shape(), act_dtype(logits))?;
    match on {
        On::Meta => meta_scratch(logits, 8 * n),
        On::Cpu => {
            use cpu::cross_entropy as ce;
            ce::log_softmax(logp.host_mut(), logits.host(), v, valid);
            ce::nll_loss(&mut losses, logp.host(), targets, v);
            ce::log_softmax_nll_backward(
                dlogits.host_mut(),
                logp.host(),
                targets,
                v,
                valid,
                grad_scale,
            );
        }
        On::Gpu(g) => {
            let mut d_losses = g.alloc::<f32>(n)?;
            let targets = g.upload(targets)?;
            with_elem!(logits.dtype(), T => g.cross_entropy_unfused::<T>(
                &mut d_losses,
                logp.cuda_mut(),
                dlogits.cuda_mut(),
                logits.cuda(),
                &targets,
                LogitRows { n, v, valid },
                grad_scale,
            ))?;
            losses = g.download(&d_losses)?;
        }
    }
    Ok((losses, dlogits))
}

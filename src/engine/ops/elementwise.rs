//! Elementwise operations: dropout, GELU (tanh and erf), SwiGLU, column scaling, additions
//! and copies, rounding.

use super::*;

/// Inverted dropout of `x` (a new tensor): each element kept with probability `1 - p` and
/// scaled by `1 / (1 - p)`, the mask a pure function of `seed` and the element's index (the
/// same on every device), so applying it to a gradient with the same seed is its backward.
pub fn dropout(x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
    const OP: &str = "dropout";
    let _prof = profile::scope(OP, x);
    let on = device_of(OP, &[x])?;
    if !(0.0..1.0).contains(&p) {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("drop probability {p} outside [0, 1)"),
        });
    }
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::dropout::dropout(out.host_mut(), x.host(), p, seed),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.dropout::<T>(
            out.cuda_mut(), x.cuda(), x.len(), p, seed,
        ))?,
    }
    Ok(out)
}

/// `dst[r, col0 .. col0 + c] += alpha * src[r, ..]` for every row `r` of `dst[N, row]` and
/// `src[N, c]`: a low-rank adapter's output added into its columns of a fused projection.
pub fn add_cols_scaled(dst: &mut Tensor, src: &Tensor, col0: usize, alpha: f32) -> Result<()> {
    const OP: &str = "add_cols_scaled";
    let _prof = profile::scope(OP, src);
    let on = device_of(OP, &[dst, src])?;
    let (n, row) = rows_cols(OP, dst)?;
    let (_, c) = rows_cols(OP, src)?;
    check_cols(OP, n, row, src, col0, c)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::add_cols_scaled(dst.host_mut(), src.host(), row, col0, c, alpha),
        On::Gpu(g) => {
            same_gpu_dtype(OP, dst, src)?;
            with_elem!(src.dtype(), T => g.add_cols_scaled::<T>(
                dst.cuda_mut(), src.cuda(), n, row, col0, c, alpha,
            ))?
        }
    }
    Ok(())
}

/// `dst[row0 + r, col0 + j] = src[r, j]` for every row `r` of `src[n, c]`, into `dst[N, row]`:
/// a low-rank adapter's `B` into its block of the widened frozen weight (`nn::lora`).
pub fn set_block(dst: &mut Tensor, src: &Tensor, row0: usize, col0: usize) -> Result<()> {
    const OP: &str = "set_block";
    let _prof = profile::scope(OP, src);
    let on = device_of(OP, &[dst, src])?;
    let (rows, row) = rows_cols(OP, dst)?;
    let (n, c) = rows_cols(OP, src)?;
    if row0 + n > rows || col0 + c > row {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "rows {row0}..{} and columns {col0}..{} of a [{rows}, {row}] tensor",
                row0 + n,
                col0 + c
            ),
        });
    }
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::set_block(dst.host_mut(), src.host(), row, row0, col0, c),
        On::Gpu(g) => {
            same_gpu_dtype(OP, dst, src)?;
            with_elem!(src.dtype(), T => g.set_block::<T>(
                dst.cuda_mut(), src.cuda(), n, row, row0, col0, c,
            ))?
        }
    }
    Ok(())
}

/// `alpha * src[.., col0 .. col0 + c]` as a new `[N, c]` tensor: the gradient that reaches a
/// low-rank adapter from its columns of a fused projection.
pub fn cols_scaled(src: &Tensor, col0: usize, c: usize, alpha: f32) -> Result<Tensor> {
    const OP: &str = "cols_scaled";
    let _prof = profile::scope(OP, src);
    let on = device_of(OP, &[src])?;
    let (n, row) = rows_cols(OP, src)?;
    if c == 0 || col0 + c > row {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("columns {col0}..{} of rows of {row}", col0 + c),
        });
    }
    let mut shape = src.shape().to_vec();
    *shape.last_mut().expect("rows_cols checked rank") = c;
    let mut out = Tensor::uninit(src.pool(), &shape, act_dtype(src))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::cols_scaled(out.host_mut(), src.host(), row, col0, c, alpha),
        On::Gpu(g) => with_elem!(src.dtype(), T => g.cols_scaled::<T>(
            out.cuda_mut(), src.cuda(), n, row, col0, c, alpha,
        ))?,
    }
    Ok(out)
}

fn check_cols(
    op: &'static str,
    n: usize,
    row: usize,
    src: &Tensor,
    col0: usize,
    c: usize,
) -> Result<()> {
    if src.len() != n * c || col0 + c > row {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "a source of shape {:?} does not fill columns {col0}..{} of {n} rows of {row}",
                src.shape(),
                col0 + c
            ),
        });
    }
    Ok(())
}

pub fn gelu_forward(x: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("gelu_forward", x);
    let on = device_of("gelu", &[x])?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gelu::gelu_forward(out.host_mut(), x.host()),
        On::Gpu(g) => {
            with_elem!(x.dtype(), T => g.gelu_forward::<T>(out.cuda_mut(), x.cuda(), x.len()))?
        }
    }
    Ok(out)
}

pub fn gelu_backward(x: &Tensor, dout: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("gelu_backward", x);
    let on = device_of("gelu_backward", &[x, dout])?;
    expect_len("gelu_backward", "dout", dout, x.len())?;
    let mut dx = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gelu::gelu_backward(dx.host_mut(), x.host(), dout.host()),
        On::Gpu(g) => {
            with_elem!(x.dtype(), T => g.gelu_backward::<T>(dx.cuda_mut(), x.cuda(), dout.cuda(), x.len()))?
        }
    }
    Ok(dx)
}

/// GELU in its exact form `x * Phi(x)` (BERT's `hidden_act = "gelu"`).
pub fn gelu_erf_forward(x: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("gelu_erf_forward", x);
    let on = device_of("gelu_erf", &[x])?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gelu_erf::gelu_erf_forward(out.host_mut(), x.host()),
        On::Gpu(g) => {
            with_elem!(x.dtype(), T => g.gelu_erf_forward::<T>(out.cuda_mut(), x.cuda(), x.len()))?
        }
    }
    Ok(out)
}

/// `dout * gelu_erf'(x)`.
pub fn gelu_erf_backward(x: &Tensor, dout: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("gelu_erf_backward", x);
    let on = device_of("gelu_erf_backward", &[x, dout])?;
    expect_len("gelu_erf_backward", "dout", dout, x.len())?;
    let mut dx = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gelu_erf::gelu_erf_backward(dx.host_mut(), x.host(), dout.host()),
        On::Gpu(g) => {
            with_elem!(x.dtype(), T => g.gelu_erf_backward::<T>(dx.cuda_mut(), x.cuda(), dout.cuda(), x.len()))?
        }
    }
    Ok(dx)
}

/// `a + b` into a new tensor, elementwise (the residual add of the unfused path).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("add", a);
    let on = device_of("add", &[a, b])?;
    expect_len("add", "b", b, a.len())?;
    let mut out = Tensor::uninit(a.pool(), a.shape(), act_dtype(a))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::add(out.host_mut(), a.host(), b.host()),
        On::Gpu(g) => {
            same_gpu_dtype("add", a, b)?;
            with_elem!(a.dtype(), T => g.add::<T>(out.cuda_mut(), a.cuda(), b.cuda(), a.len()))?
        }
    }
    Ok(out)
}

/// `dst`'s elements from `offset` on become `src`'s (same dtype): stacking matrices along
/// their rows, as a layer's low-rank adapters stack their `A`s.
pub fn copy_into_at(dst: &mut Tensor, offset: usize, src: &Tensor) -> Result<()> {
    const OP: &str = "copy_into_at";
    let on = device_of(OP, &[dst, src])?;
    if offset + src.len() > dst.len() || dst.dtype() != src.dtype() {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "{} {:?} values at {offset} do not fit {} {:?} values",
                src.len(),
                src.dtype(),
                dst.len(),
                dst.dtype()
            ),
        });
    }
    match on {
        On::Meta => {}
        On::Cpu => dst.host_mut()[offset..offset + src.len()].copy_from_slice(src.host()),
        On::Gpu(g) => {
            with_elem!(src.dtype(), T => g.copy_into_at::<T>(dst.cuda_mut(), offset, src.cuda()))?
        }
    }
    Ok(())
}

/// `dst = src[offset .. offset + dst.len()]` (same dtype): one adapter's rows of a gradient
/// computed for a layer's stacked adapters, written where [`add_from_at`] would add them.
pub fn copy_from_at(dst: &mut Tensor, src: &Tensor, offset: usize) -> Result<()> {
    const OP: &str = "copy_from_at";
    let _prof = profile::scope(OP, src);
    let on = device_of(OP, &[dst, src])?;
    let n = dst.len();
    if offset + n > src.len() || dst.dtype() != src.dtype() {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "{n} {:?} values from {offset} of a source of {} {:?}",
                dst.dtype(),
                src.len(),
                src.dtype()
            ),
        });
    }
    match on {
        On::Meta => {}
        On::Cpu => dst
            .host_mut()
            .copy_from_slice(&src.host()[offset..offset + n]),
        On::Gpu(g) => {
            with_elem!(src.dtype(), T => g.copy_from_at::<T>(dst.cuda_mut(), src.cuda(), offset))?
        }
    }
    Ok(())
}

/// `dst += src`, elementwise (two gradients of one tensor meeting).
pub fn add_in_place(dst: &mut Tensor, src: &Tensor) -> Result<()> {
    let _prof = profile::scope("add_in_place", src);
    let on = device_of("add_in_place", &[dst, src])?;
    expect_len("add_in_place", "src", src, dst.len())?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::add_assign(dst.host_mut(), src.host()),
        On::Gpu(g) => {
            same_gpu_dtype("add_in_place", dst, src)?;
            let n = dst.len();
            with_elem!(src.dtype(), T => g.add_assign::<T>(dst.cuda_mut(), src.cuda(), n))?
        }
    }
    Ok(())
}

/// `dst += src[offset .. offset + dst.len()]`, elementwise: one adapter's rows of a
/// gradient computed for a layer's stacked adapters.
pub fn add_from_at(dst: &mut Tensor, src: &Tensor, offset: usize) -> Result<()> {
    const OP: &str = "add_from_at";
    let _prof = profile::scope(OP, src);
    let on = device_of(OP, &[dst, src])?;
    let n = dst.len();
    if offset + n > src.len() {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("{n} values from {offset} of a source of {}", src.len()),
        });
    }
    match on {
        On::Meta => {}
        On::Cpu => cpu::add::add_assign(dst.host_mut(), &src.host()[offset..offset + n]),
        On::Gpu(g) => {
            same_gpu_dtype(OP, dst, src)?;
            with_elem!(src.dtype(), T => g.add_assign_from::<T>(dst.cuda_mut(), src.cuda(), offset, n))?
        }
    }
    Ok(())
}

/// Rounds every element to `dtype` in place (emulating a narrower gradient on the CPU).
pub fn round_in_place(t: &mut Tensor, dtype: DType) -> Result<()> {
    if t.is_meta() {
        return Ok(());
    }
    match t.device() {
        Device::Cpu => dtype.round_slice(t.host_mut()),
        // A GPU tensor is stored in its own dtype: it is rounded already.
        Device::Cuda(_) if dtype == DType::F32 || dtype == t.dtype() => {}
        Device::Cuda(_) => {
            return Err(EngineError::Unavailable(
                t.device().to_string(),
                format!(
                    "{:?} values cannot be rounded to {dtype:?} on the GPU",
                    t.dtype()
                ),
            ));
        }
    }
    Ok(())
}

/// `h = silu(gate) * up` from rows `[gate: F | up: F]` -> `[.., F]`.
pub fn swiglu_forward(gate_up: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("swiglu_forward", gate_up);
    let on = device_of("swiglu", &[gate_up])?;
    let (rows, two_f) = rows_cols("swiglu", gate_up)?;
    if !two_f.is_multiple_of(2) {
        return Err(EngineError::Shape {
            op: "swiglu",
            detail: format!("rows of {two_f} cannot split into gate and up halves"),
        });
    }
    let mut shape = gate_up.shape().to_vec();
    *shape.last_mut().expect("rows_cols checked rank") = two_f / 2;
    let mut h = Tensor::uninit(gate_up.pool(), &shape, act_dtype(gate_up))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::swiglu::swiglu_forward(h.host_mut(), gate_up.host(), two_f / 2),
        On::Gpu(g) => with_elem!(gate_up.dtype(), T => g.swiglu_forward::<T>(
            h.cuda_mut(),
            gate_up.cuda(),
            rows,
            two_f / 2,
        ))?,
    }
    Ok(h)
}

/// [`swiglu_forward`] of `gate_up`, the projection of an unnormalised stream `x` (`[rows, C]`)
/// through a weight with its RMSNorm gain folded in: both halves of each row are first scaled
/// by `1 / sqrt(mean(x_row^2) + eps)` (see [`kv_append_normed_at`]).
pub fn swiglu_forward_normed(gate_up: &Tensor, x: &Tensor, eps: f32) -> Result<Tensor> {
    let mut shape = gate_up.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last /= 2;
    }
    let mut h = Tensor::uninit(gate_up.pool(), &shape, act_dtype(gate_up))?;
    swiglu_forward_normed_into(&mut h, gate_up, x, eps)?;
    Ok(h)
}

/// [`swiglu_forward_normed`] into `h` (`[rows, f]` in the activation dtype of `gate_up`).
pub fn swiglu_forward_normed_into(
    h: &mut Tensor,
    gate_up: &Tensor,
    x: &Tensor,
    eps: f32,
) -> Result<()> {
    const OP: &str = "swiglu_forward_normed";
    let _prof = profile::scope(OP, gate_up);
    let on = device_of(OP, &[gate_up, x, h])?;
    let (rows, two_f) = rows_cols(OP, gate_up)?;
    let f = gate_up_halves(OP, two_f, || format!("rows of {two_f}"))?;
    let c = norm_width(OP, Some((x, eps)), rows)?;
    expect_len(OP, "output", h, rows * f)?;
    expect_act_output(OP, h, gate_up)?;
    match on {
        On::Meta => {}
        On::Cpu => {
            let scaled = cpu::rmsnorm::normed_rows(gate_up.host(), two_f, x.host(), c, eps, None);
            cpu::swiglu::swiglu_forward(h.host_mut(), &scaled, f)
        }
        On::Gpu(g) => {
            same_dtype(OP, &[gate_up, x])?;
            with_elem!(gate_up.dtype(), T => g.swiglu_forward_normed::<T>(
                h.cuda_mut(),
                gate_up.cuda(),
                x.cuda(),
                rows,
                f,
                c,
                eps,
            ))?
        }
    }
    Ok(())
}

/// The gradient of both halves of `gate_up` from `dh`.
pub fn swiglu_backward(gate_up: &Tensor, dh: &Tensor) -> Result<Tensor> {
    let _prof = profile::scope("swiglu_backward", dh);
    let on = device_of("swiglu_backward", &[gate_up, dh])?;
    let (rows, two_f) = rows_cols("swiglu_backward", gate_up)?;
    expect_len("swiglu_backward", "dh", dh, gate_up.len() / 2)?;
    let mut d = Tensor::uninit(gate_up.pool(), gate_up.shape(), act_dtype(gate_up))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::swiglu::swiglu_backward(d.host_mut(), gate_up.host(), dh.host(), two_f / 2),
        On::Gpu(g) => with_elem!(gate_up.dtype(), T => g.swiglu_backward::<T>(
            d.cuda_mut(),
            gate_up.cuda(),
            dh.cuda(),
            rows,
            two_f / 2,
        ))?,
    }
    Ok(d)
}

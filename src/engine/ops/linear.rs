//! Products: linear layers forward and backward (the few-row kernels of a decode step, the
//! fused gate/up, GELU epilogues), strided and batched matrix products, and the expansion of a
//! 4-bit weight for its product.

use super::*;

/// `x[.., c_in] @ w[c_out, c_in]^T + b` -> `[.., c_out]`.
pub fn linear_forward(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    profile::label("linear_forward", x);
    let mut out = Tensor::uninit(x.pool(), &linear_out_shape("linear", x, w)?, act_dtype(x))?;
    linear_forward_into(&mut out, x, w, b)?;
    Ok(out)
}

/// The shape of `x[.., c_in] @ w[c_out, c_in]^T`: `x`'s with the last dimension `c_out`.
fn linear_out_shape(op: &'static str, x: &Tensor, w: &Tensor) -> Result<Vec<usize>> {
    let mut shape = x.shape().to_vec();
    match shape.last_mut() {
        Some(last) => *last = w.shape()[0],
        None => {
            return Err(EngineError::Shape {
                op,
                detail: "a scalar input has no features".into(),
            });
        }
    }
    Ok(shape)
}

/// [`linear_forward`] into `out` (`[.., c_out]` elements, the activation dtype of `x`): a
/// caller that keeps its output buffer, such as a decode step replayed from a CUDA graph.
pub fn linear_forward_into(
    out: &mut Tensor,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<()> {
    let _prof = profile::scope("linear_forward", x);
    let on = device_of("linear", &[x, w, out])?;
    let (n, c_in) = rows_cols("linear", x)?;
    let c_out = w.shape()[0];
    expect_len("linear", "weight", w, c_out * c_in)?;
    expect_len("linear", "output", out, n * c_out)?;
    if let Some(b) = b {
        expect_len("linear", "bias", b, c_out)?;
    }
    expect_act_output("linear", out, x)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gemm::linear_forward(
            out.host_mut(),
            x.host(),
            w.host(),
            b.map(|b| b.host()),
            n,
            c_in,
            c_out,
        ),
        On::Gpu(g) => {
            // A decode step's few rows: the tensor-core kernel that reads the weight once.
            if b.is_none()
                && few_rows_chosen(n, c_out, c_in, w)
                && with_elem!(x.dtype(), T => g.few_rows_product::<T>(
                    out.cuda_mut(), x.cuda(), w.cuda(), n, c_out, c_in, false,
                ))?
            {
                return Ok(());
            }
            with_elem!(x.dtype(), T => g.linear_forward::<T>(
                out.cuda_mut(),
                x.cuda(),
                w.cuda(),
                b.map(|b| b.cuda()),
                n,
                c_in,
                c_out,
                x.pool().gemm_math(),
            ))?
        }
    }
    Ok(())
}

/// Whether a product of `rows` rows of `k` into `features` outputs by the weight `w` should
/// take the few-row kernels (whose launchers still decline what they cannot run): where they
/// beat cuBLAS ([`crate::engine::cuda::few_rows_pay`]), and for weights of up to 16384 rows,
/// the largest projection of the decoders kiln runs. Wider ones (a vocabulary's logits) stay
/// with cuBLAS, whose tiles reuse each row across many features where the few-row kernels read
/// the rows again for every 16.
fn few_rows_chosen(rows: usize, features: usize, k: usize, w: &Tensor) -> bool {
    let weight_bytes = w.len() * w.dtype().size_bytes();
    w.shape()[0] <= 16_384 && crate::engine::cuda::few_rows_pay(rows, features, k, weight_bytes)
}

/// `y += x @ w^T` in place (`x[.., c_in]`, `w[c_out, c_in]`, `y[.., c_out]` in the activation
/// dtype): a residual add without a kernel of its own, the product taking `y` as its
/// accumulate input (cuBLAS's `beta = 1`, or the few-row kernels' epilogue for a decode
/// step's rows).
pub fn linear_forward_add(x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<()> {
    const OP: &str = "linear_forward_add";
    let _prof = profile::scope(OP, x);
    let on = device_of(OP, &[x, w, y])?;
    let (rows, c_in) = rows_cols(OP, x)?;
    let c_out = w.shape()[0];
    expect_len(OP, "weight", w, c_out * c_in)?;
    expect_len(OP, "output", y, rows * c_out)?;
    if let On::Gpu(g) = on
        && y.dtype() == x.dtype()
        && w.dtype() == x.dtype()
        && few_rows_chosen(rows, c_out, c_in, w)
        && with_elem!(x.dtype(), T => g.few_rows_product::<T>(
            y.cuda_mut(), x.cuda(), w.cuda(), rows, c_out, c_in, true,
        ))?
    {
        return Ok(());
    }
    matmul_view(
        GemmShape::single(false, true, rows, c_out, c_in),
        [
            MatrixView::packed(c_in),
            MatrixView::packed(c_in),
            MatrixView::packed(c_out),
        ],
        1.0,
        x,
        w,
        1.0,
        y,
    )
}

/// The width of each half of `two_f` gate/up values; an error naming them as `what` says
/// (`a weight of N rows`, `rows of N`) when they do not split.
pub(super) fn gate_up_halves(
    op: &'static str,
    two_f: usize,
    what: impl FnOnce() -> String,
) -> Result<usize> {
    if two_f.is_multiple_of(2) {
        return Ok(two_f / 2);
    }
    Err(EngineError::Shape {
        op,
        detail: format!("{} cannot split into gate and up halves", what()),
    })
}

/// `silu(r gate) * (r up)` with `[gate | up] = x @ w^T` (`w[2f, c]`) and `r` each row's
/// RMSNorm factor `1 / sqrt(mean(x_row^2) + eps)`: the decode step's gate/up projection of the
/// unnormalised stream `x` (the norm's gain folded into `w`), its norm and SwiGLU. A decode
/// step's few rows on the GPU take one kernel; otherwise [`linear_forward`] and
/// [`swiglu_forward_normed`], which are also its reference.
pub fn linear_swiglu_normed(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = w.shape()[0] / 2;
    }
    let mut h = Tensor::uninit(x.pool(), &shape, act_dtype(x))?;
    linear_swiglu_normed_into(&mut h, x, w, eps)?;
    Ok(h)
}

/// [`linear_swiglu_normed`] into `h` (`[.., f]` in the activation dtype of `x`): a decode
/// step that keeps its buffers, so that its kernels follow each other with no allocation
/// between them.
pub fn linear_swiglu_normed_into(h: &mut Tensor, x: &Tensor, w: &Tensor, eps: f32) -> Result<()> {
    const OP: &str = "linear_swiglu_normed";
    let _prof = profile::scope(OP, x);
    let on = device_of(OP, &[x, w, h])?;
    let (rows, c) = rows_cols(OP, x)?;
    let two_f = w.shape()[0];
    let f = gate_up_halves(OP, two_f, || format!("a weight of {two_f} rows"))?;
    expect_len(OP, "weight", w, two_f * c)?;
    expect_len(OP, "output", h, rows * f)?;
    expect_act_output(OP, h, x)?;
    let few_rows = matches!(x.device(), Device::Cuda(_))
        && x.dtype() != DType::F32
        && w.dtype() == x.dtype()
        && few_rows_chosen(rows, f, c, w);
    if few_rows {
        match on {
            // A meta pass standing for a GPU books what the kernel allocates: nothing past `h`,
            // no gate/up rows (a GPU older than sm_80, or unaligned buffers, decline below, and
            // then the call's peak is the gate/up rows more than planned).
            On::Meta => return Ok(()),
            On::Gpu(g) => {
                if with_elem!(x.dtype(), T => g.few_rows_swiglu::<T>(
                    h.cuda_mut(), x.cuda(), w.cuda(), rows, f, c, eps,
                ))? {
                    return Ok(());
                }
            }
            On::Cpu => {}
        }
    }
    let gate_up = linear_forward(x, w, None)?;
    swiglu_forward_normed_into(h, &gate_up, x, eps)
}

/// A weight gradient for a product's backward to write: added to, or, when `overwrite`, written
/// whole without reading the buffer (a gradient cleared by its first writer, see
/// [`crate::nn::Param::defer_grad_clear`]).
pub struct WeightGrad<'a> {
    pub grad: &'a mut Tensor,
    pub overwrite: bool,
}

impl<'a> WeightGrad<'a> {
    /// The `beta` of a product writing this gradient whole: 0 to overwrite, 1 to add.
    pub fn beta(&self) -> f32 {
        if self.overwrite { 0.0 } else { 1.0 }
    }

    /// The buffer, checked to be on `on`'s device, and whether the product overwrites it. The
    /// CPU's products only add, so there an overwrite becomes a clear first (the same bits).
    fn prepare(self, op: &'static str, on: &On) -> Result<(&'a mut Tensor, bool)> {
        device_of(op, &[self.grad])?;
        if self.overwrite && !matches!(on, On::Gpu(_)) {
            self.grad.fill_zero()?;
            return Ok((self.grad, false));
        }
        Ok((self.grad, self.overwrite))
    }
}

/// Returns `dx`; accumulates into (or overwrites, see [`WeightGrad`]) `dw`, and accumulates into
/// `db`. A frozen weight passes no `dw` (and then no `db`): only the input gradient is
/// computed, with no weight-gradient GEMM.
pub fn linear_backward(
    dout: &Tensor,
    x: &Tensor,
    w: &Tensor,
    dw: Option<WeightGrad<'_>>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    let _prof = profile::scope("linear_backward", x);
    let on = device_of("linear_backward", &[dout, x, w])?;
    let (n, c_in) = rows_cols("linear_backward", x)?;
    let c_out = w.shape()[0];
    expect_len("linear_backward", "dout", dout, n * c_out)?;
    let mut dx = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let Some(dw) = dw else {
        match on {
            On::Meta => {}
            On::Cpu => cpu::gemm::linear_backward_input(
                dx.host_mut(),
                dout.host(),
                w.host(),
                n,
                c_in,
                c_out,
            ),
            On::Gpu(g) => with_elem!(x.dtype(), T => g.linear_backward_input::<T>(
                dx.cuda_mut(),
                dout.cuda(),
                w.cuda(),
                n,
                c_in,
                c_out,
                x.pool().gemm_math(),
            ))?,
        }
        return Ok(dx);
    };
    let (dw, overwrite) = dw.prepare("linear_backward", &on)?;
    match on {
        On::Meta => {
            if db.is_some() {
                meta_scratch(
                    x,
                    crate::engine::cuda::reduce::column_partials_bytes(n, c_out),
                );
            }
        }
        On::Cpu => cpu::gemm::linear_backward(
            dx.host_mut(),
            dw.host_mut(),
            db.map(|b| b.host_mut()),
            dout.host(),
            x.host(),
            w.host(),
            n,
            c_in,
            c_out,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.linear_backward::<T>(
            dx.cuda_mut(),
            dw.cuda_mut(),
            overwrite,
            db.map(|b| b.cuda_mut()),
            dout.cuda(),
            x.cuda(),
            w.cuda(),
            n,
            c_in,
            c_out,
            x.pool().gemm_math(),
        ))?,
    }
    Ok(dx)
}

/// `gelu(x @ w^T + b)` (GELU's tanh form) and the GELU's argument: returns `(pre, act)`, the
/// tensors [`linear_forward`] then [`gelu_forward`] return. On the GPU one product whose
/// epilogue applies the GELU and stores its argument (see
/// [`CudaBackend::linear_gelu_forward`]), which saves the GELU kernel's read of `pre` and
/// write of `act`; on the CPU the two kernels.
pub fn linear_gelu_forward(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let _prof = profile::scope("linear_gelu_forward", x);
    let on = device_of("linear_gelu", &[x, w])?;
    if !matches!(on, On::Gpu(_)) {
        let pre = linear_forward(x, w, b)?;
        let act = gelu_forward(&pre)?;
        return Ok((pre, act));
    }
    let (n, c_in) = rows_cols("linear_gelu", x)?;
    let c_out = w.shape()[0];
    expect_len("linear_gelu", "weight", w, c_out * c_in)?;
    if let Some(b) = b {
        expect_len("linear_gelu", "bias", b, c_out)?;
    }
    let shape = linear_out_shape("linear_gelu", x, w)?;
    let mut pre = Tensor::uninit(x.pool(), &shape, act_dtype(x))?;
    let mut act = Tensor::uninit(x.pool(), &shape, act_dtype(x))?;
    if let On::Gpu(g) = on {
        with_elem!(x.dtype(), T => g.linear_gelu_forward::<T>(
            pre.cuda_mut(),
            act.cuda_mut(),
            x.cuda(),
            w.cuda(),
            b.map(|b| b.cuda()),
            n,
            c_in,
            c_out,
            x.pool().gemm_math(),
        ))?;
    }
    Ok((pre, act))
}

/// The backward of `linear_forward(act, w, b)` where `act = gelu(pre)`, carried through the
/// GELU: returns `dpre`, what [`linear_backward`] then [`gelu_backward`] return, and
/// accumulates into `dw` and `db` as [`linear_backward`] does (a frozen weight passes neither).
/// On the GPU the input gradient is one product whose epilogue applies the GELU's derivative
/// (see [`CudaBackend::linear_gelu_backward`]); on the CPU the same arithmetic as the two
/// kernels, in place in `dpre`.
pub fn linear_gelu_backward(
    dout: &Tensor,
    act: &Tensor,
    pre: &Tensor,
    w: &Tensor,
    dw: Option<WeightGrad<'_>>,
    db: Option<&mut Tensor>,
) -> Result<Tensor> {
    let _prof = profile::scope("linear_gelu_backward", act);
    let on = device_of("linear_gelu_backward", &[dout, act, pre, w])?;
    let (n, c_in) = rows_cols("linear_gelu_backward", act)?;
    let c_out = w.shape()[0];
    expect_len("linear_gelu_backward", "dout", dout, n * c_out)?;
    expect_len("linear_gelu_backward", "pre", pre, n * c_in)?;
    let mut dpre = Tensor::uninit(act.pool(), act.shape(), act_dtype(act))?;
    let (dw, overwrite) = match dw {
        Some(d) => {
            let (dw, overwrite) = d.prepare("linear_gelu_backward", &on)?;
            (Some(dw), overwrite)
        }
        None => (None, false),
    };
    match on {
        On::Meta => {
            let elem = act_dtype(act).size_bytes();
            if !crate::engine::cuda::gelu_epilogue_fits(c_in) {
                meta_scratch(act, n * c_in * elem);
            }
            if dw.is_some() && db.is_some() {
                meta_scratch(
                    act,
                    crate::engine::cuda::reduce::column_partials_bytes(n, c_out),
                );
            }
        }
        On::Cpu => {
            let dx = dpre.host_mut();
            match dw {
                Some(dw) => cpu::gemm::linear_backward(
                    dx,
                    dw.host_mut(),
                    db.map(|b| b.host_mut()),
                    dout.host(),
                    act.host(),
                    w.host(),
                    n,
                    c_in,
                    c_out,
                ),
                None => cpu::gemm::linear_backward_input(dx, dout.host(), w.host(), n, c_in, c_out),
            }
            cpu::gelu::gelu_backward_in_place(dx, pre.host());
        }
        On::Gpu(g) => with_elem!(act.dtype(), T => g.linear_gelu_backward::<T>(
            dpre.cuda_mut(),
            dw.map(|t| t.cuda_mut()),
            overwrite,
            db.map(|t| t.cuda_mut()),
            dout.cuda(),
            act.cuda(),
            pre.cuda(),
            w.cuda(),
            n,
            c_in,
            c_out,
            act.pool().gemm_math(),
        ))?,
    }
    Ok(dpre)
}

/// `C = alpha * op(A) @ op(B) + beta * C` on matrices inside larger tensors (see
/// [`MatrixView`]); `shape.batch` is 1. `A` and `B` share a dtype; `C` has theirs (the
/// activation dtype) or is f32 (a gradient). A low-rank adapter uses it to read its columns
/// of a projection's output gradient and to add into its columns of the output and into the
/// input gradient in place, with no copy of either.
#[allow(clippy::too_many_arguments)]
pub fn matmul_view(
    shape: GemmShape,
    views: [MatrixView; 3],
    alpha: f32,
    a: &Tensor,
    b: &Tensor,
    beta: f32,
    c: &mut Tensor,
) -> Result<()> {
    const OP: &str = "matmul_view";
    let _prof = profile::scope(OP, a);
    let on = device_of(OP, &[a, b, c])?;
    if shape.batch != 1 {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("{} products: views take one", shape.batch),
        });
    }
    // Checked here for every device (the CPU kernel only asserts).
    shape
        .check_views(views, [a.len(), b.len(), c.len()])
        .map_err(|detail| EngineError::Shape { op: OP, detail })?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::gemm::sgemm_strided(shape, views, alpha, a.host(), b.host(), beta, c.host_mut())
        }
        On::Gpu(g) => {
            if a.dtype() != b.dtype() || (c.dtype() != a.dtype() && c.dtype() != DType::F32) {
                return Err(EngineError::Shape {
                    op: OP,
                    detail: format!(
                        "operands of {:?} and {:?} into {:?}",
                        a.dtype(),
                        b.dtype(),
                        c.dtype()
                    ),
                });
            }
            let math = a.pool().gemm_math();
            match c.dtype() {
                DType::F32 => with_elem!(a.dtype(), T => g.matmul_view::<T, f32>(
                    shape, views, alpha, a.cuda(), b.cuda(), beta, c.cuda_mut(), math,
                ))?,
                _ => with_elem!(a.dtype(), T => g.matmul_view::<T, T>(
                    shape, views, alpha, a.cuda(), b.cuda(), beta, c.cuda_mut(), math,
                ))?,
            }
        }
    }
    Ok(())
}

/// [`matmul_view`] into a new packed `[m, n]` tensor in the activation dtype of `a`
/// (`views[2]` is ignored: the output is packed).
pub fn matmul_view_new(
    shape: GemmShape,
    views: [MatrixView; 3],
    alpha: f32,
    a: &Tensor,
    b: &Tensor,
) -> Result<Tensor> {
    let mut out = Tensor::uninit(a.pool(), &[shape.m, shape.n], act_dtype(a))?;
    let [va, vb, _] = views;
    matmul_view(
        shape,
        [va, vb, MatrixView::packed(shape.n)],
        alpha,
        a,
        b,
        0.0,
        &mut out,
    )?;
    Ok(out)
}

/// `batch` products `op(A_i) @ op(B_i) * alpha` into a new `[batch, m, n]` tensor; `a` and `b`
/// hold their `batch` matrices back to back (see [`GemmShape`]).
pub fn batched_matmul(shape: GemmShape, alpha: f32, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "batched_matmul";
    let _prof = profile::scope(OP, a);
    let on = device_of(OP, &[a, b])?;
    let GemmShape { batch, m, n, k, .. } = shape;
    expect_len(OP, "A", a, batch * m * k)?;
    expect_len(OP, "B", b, batch * k * n)?;
    let mut c = Tensor::uninit(a.pool(), &[batch, m, n], act_dtype(a))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::gemm::sgemm_batched(shape, alpha, a.host(), b.host(), 0.0, c.host_mut()),
        On::Gpu(g) => {
            same_gpu_dtype(OP, a, b)?;
            let math = a.pool().gemm_math();
            with_elem!(a.dtype(), T => g.matmul_batched::<T, T>(
                shape, alpha, a.cuda(), b.cuda(), 0.0, c.cuda_mut(), math,
            ))?
        }
    }
    Ok(c)
}

/// Expands an NF4 weight into `out` (`rows * cols` elements of `out`'s dtype, on the weight's
/// device), overwriting all of it: the workspace a GEMM reads in place of the weight.
pub fn nf4_dequantize_into(w: &Nf4Weight, out: &mut Tensor) -> Result<()> {
    let _prof = profile::scope("nf4_dequantize", out);
    if w.device() != out.device() {
        return Err(EngineError::DeviceMismatch {
            op: "nf4_dequantize",
            a: w.device(),
            b: out.device(),
        });
    }
    if out.len() != w.len() {
        return Err(EngineError::Shape {
            op: "nf4_dequantize",
            detail: format!(
                "{} is [{}, {}] ({} values) but the output has shape {:?}",
                w.name(),
                w.rows(),
                w.cols(),
                w.len(),
                out.shape()
            ),
        });
    }
    let (n, dtype) = (w.len(), out.dtype());
    if out.is_meta() {
        return Ok(());
    }
    match w.device() {
        Device::Cpu => cpu::nf4::dequantize(w.host_view(), out.host_mut(), dtype),
        Device::Cuda(_) => {
            let g = out.pool().cuda()?.clone();
            let parts = w.cuda_parts()?;
            with_elem!(dtype, T => g.nf4_dequantize::<T>(out.cuda_mut(), &parts, n))?
        }
    }
    Ok(())
}

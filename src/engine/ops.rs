//! Device dispatch: the one place that decides which kernel runs for which device.
//!
//! Every function checks that its tensors share a device, allocates its outputs from that
//! device's pool (so out-of-memory surfaces here as a typed error) and calls the CPU kernel or
//! the CUDA kernel with the same semantics. Layers call these and stay device-agnostic.

use super::AttnShape;
use super::GemmShape;
use super::MatrixView;
use super::cpu;
use super::cpu::adamw::AdamWStep;
pub use super::cpu::cross_entropy::IGNORE_TARGET;
pub use super::cpu::diversity::SetShape;
use super::cpu::kv_cache::CacheShape;
use super::cpu::rope::RopeShape;
use super::cpu::sampling::{HostSlots, SampleParams};
use super::cuda::sampling::DeviceSlots;
use super::cuda::{AdamWSlices, Bf16, CudaBackend, F16, LogitRows};
use super::pool::MemoryPool;
use super::profile;
use super::quant::Nf4Weight;
use super::tensor::DeviceElem;
use super::{DType, Device, EngineError, Result, Tensor};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// Runs `$body` with `$T` the GPU element type of `$dtype` (f32, bf16 or f16).
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = Bf16;
                $body
            }
            DType::F16 => {
                type $T = F16;
                $body
            }
        }
    };
}

/// The dtype of an activation computed on `device` from inputs of `dtype`: the CPU computes
/// and stores f32 whatever the policy (its narrow types are emulated by rounding weights); a
/// GPU keeps the type. Public so the memory planner books activations as the kernels do.
pub fn activation_dtype(device: Device, dtype: DType) -> DType {
    match device {
        Device::Cpu => DType::F32,
        Device::Cuda(_) => dtype,
    }
}

fn act_dtype(t: &Tensor) -> DType {
    activation_dtype(t.device(), t.dtype())
}

/// An error unless `out` holds the activation dtype that `input` computes in: the check of an
/// op writing into a caller's buffer.
fn expect_act_output(op: &'static str, out: &Tensor, input: &Tensor) -> Result<()> {
    if out.dtype() == act_dtype(input) {
        return Ok(());
    }
    Err(EngineError::Shape {
        op,
        detail: format!(
            "an output of {:?} for an input computing in {:?}",
            out.dtype(),
            act_dtype(input)
        ),
    })
}

/// Shape of the f32 softmax statistics attention keeps for its backward on `device`: the
/// probabilities `[B, H, T, T]` on the CPU, one log-sum-exp per row `[B, H, T]` on a GPU.
pub fn attention_stats_shape(device: Device, s: AttnShape) -> Vec<usize> {
    match device {
        Device::Cpu => vec![s.batch, s.heads, s.seq, s.seq],
        Device::Cuda(_) => vec![s.batch, s.heads, s.seq],
    }
}

/// Where an op runs: the CPU, a GPU with its backend, or nowhere: tensors of a meta pool,
/// whose outputs are booked (by the same allocations as on the device the pool stands for)
/// and never computed.
enum On {
    Cpu,
    Gpu(Arc<CudaBackend>),
    Meta,
}

/// The common device of `ts`, or an error naming the op.
fn device_of(op: &'static str, ts: &[&Tensor]) -> Result<On> {
    let d = ts[0].device();
    if ts[0].is_meta() {
        return Ok(On::Meta);
    }
    for t in &ts[1..] {
        if t.device() != d {
            return Err(EngineError::DeviceMismatch {
                op,
                a: d,
                b: t.device(),
            });
        }
    }
    match d {
        Device::Cpu => Ok(On::Cpu),
        Device::Cuda(_) => Ok(On::Gpu(ts[0].pool().cuda()?.clone())),
    }
}

/// On a meta pool standing in for a GPU, books `bytes` the GPU kernel of an op would take
/// from the driver outside the pool while it runs (uploaded ids, partial sums).
fn meta_scratch(t: &Tensor, bytes: usize) {
    if matches!(t.device(), Device::Cuda(_)) {
        t.pool().book_outside(bytes);
    }
}

fn expect_len(op: &'static str, what: &str, t: &Tensor, len: usize) -> Result<()> {
    if t.len() == len {
        Ok(())
    } else {
        Err(EngineError::Shape {
            op,
            detail: format!("{what} has shape {:?}, expected {len} elements", t.shape()),
        })
    }
}

/// A tensor as `[rows, width]` (its last dimension the width), or a shape error naming `op`.
pub fn rows_cols(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.shape() {
        [.., c] if *c > 0 => Ok((t.len() / c, *c)),
        s => Err(EngineError::Shape {
            op,
            detail: format!("expected a non-empty last dimension, got {s:?}"),
        }),
    }
}

/// u32 indices a kernel reads (token ids, cache slots, positions).
#[derive(Clone, Copy)]
pub enum Ids<'a> {
    /// On the host: checked here, and uploaded for a GPU kernel.
    Host(&'a [u32]),
    /// Already in a GPU buffer, which a decode step replayed from a CUDA graph reads afresh
    /// at every replay. The host cannot see the values, so only their count is checked here;
    /// the kernels bound every index themselves (an index out of range gives a row of NaN,
    /// never an access outside a buffer).
    Device(&'a CudaSlice<u32>),
}

impl Ids<'_> {
    pub fn len(&self) -> usize {
        match self {
            Ids::Host(v) => v.len(),
            Ids::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn host(&self) -> Option<&[u32]> {
        match self {
            Ids::Host(v) => Some(v),
            Ids::Device(_) => None,
        }
    }
}

/// Indices where a GPU kernel reads them: borrowed, or uploaded from the host.
enum GpuIds<'a> {
    Borrowed(&'a CudaSlice<u32>),
    Uploaded(CudaSlice<u32>),
}

impl GpuIds<'_> {
    fn get(&self) -> &CudaSlice<u32> {
        match self {
            GpuIds::Borrowed(d) => d,
            GpuIds::Uploaded(d) => d,
        }
    }
}

/// The rows of one call into a layer's key/value cache (a prefill, or a decode step), as every
/// layer's cache ops read them: their slots and positions, copied to the GPU once for all the
/// layers when they come from the host, and a GPU prefill's runs ([`PrefillRuns`]), found and
/// copied once. Host ids stay at hand for the ops' checks and for the CPU.
pub struct CacheRows<'a> {
    slot: Ids<'a>,
    pos: Ids<'a>,
    /// Device copies of host `slot` and `pos` (on a GPU).
    device: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
    prefill: Option<PrefillRuns>,
}

impl<'a> CacheRows<'a> {
    /// The rows `slot`, `pos` of a call whose tensors live where `like` does, into a cache of
    /// heads of `head_dim`.
    pub fn new(like: &Tensor, slot: Ids<'a>, pos: Ids<'a>, head_dim: usize) -> Result<Self> {
        let mut prefill = PrefillRuns::of(like, slot, pos, head_dim);
        let mut device = None;
        if let On::Gpu(g) = device_of("cache_rows", &[like])? {
            if let (Some(s), Some(p)) = (slot.host(), pos.host()) {
                device = Some((g.upload(s)?, g.upload(p)?));
            }
            if let Some(runs) = &mut prefill {
                runs.device = Some((g.upload(&runs.runs)?, g.upload(&runs.padded_row)?));
            }
        }
        Ok(CacheRows {
            slot,
            pos,
            device,
            prefill,
        })
    }

    /// Rows with slots and positions on the host, where `like` lives.
    pub fn host(like: &Tensor, slot: &'a [u32], pos: &'a [u32], head_dim: usize) -> Result<Self> {
        CacheRows::new(like, Ids::Host(slot), Ids::Host(pos), head_dim)
    }

    /// Slots and positions where a GPU kernel reads them, uploaded only if no copy was made.
    fn gpu(&self, g: &CudaBackend) -> Result<(GpuIds<'_>, GpuIds<'_>)> {
        Ok(match &self.device {
            Some((s, p)) => (GpuIds::Borrowed(s), GpuIds::Borrowed(p)),
            None => (gpu_ids(g, self.slot)?, gpu_ids(g, self.pos)?),
        })
    }
}

fn gpu_ids<'a>(g: &CudaBackend, ids: Ids<'a>) -> Result<GpuIds<'a>> {
    Ok(match ids {
        Ids::Host(v) => GpuIds::Uploaded(g.upload(v)?),
        Ids::Device(d) => GpuIds::Borrowed(d),
    })
}

/// The host values of indices for a CPU kernel; device indices cannot serve one.
fn cpu_ids<'a>(op: &'static str, ids: Ids<'a>) -> Result<&'a [u32]> {
    match ids {
        Ids::Host(v) => Ok(v),
        Ids::Device(_) => Err(EngineError::Shape {
            op,
            detail: "indices on a GPU for tensors on the CPU".into(),
        }),
    }
}

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
fn gate_up_halves(op: &'static str, two_f: usize, what: impl FnOnce() -> String) -> Result<usize> {
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
                meta_scratch(x, super::cuda::reduce::column_partials_bytes(n, c_out));
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
            if !super::cuda::gelu_epilogue_fits(c_in) {
                meta_scratch(act, n * c_in * elem);
            }
            if dw.is_some() && db.is_some() {
                meta_scratch(act, super::cuda::reduce::column_partials_bytes(n, c_out));
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
        On::Meta => meta_scratch(x, super::cuda::reduce::norm_partials_bytes(n, c, 2)),
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

/// Causal attention over fused `qkv[B, T, 3C]`: returns `out[B, T, C]` and what the backward
/// needs besides `qkv` and `out`: the probabilities `[B, H, T, T]` on the CPU, one
/// log-sum-exp per row `[B, H, T]` on the GPU (which never stores the T x T matrix).
pub fn attention_forward(qkv: &Tensor, s: AttnShape) -> Result<(Tensor, Tensor)> {
    profile::label("attention_forward", qkv);
    windowed_attention_forward(qkv, s, 0)
}

/// [`attention_forward`] within a sliding `window`: query `i` attends to keys `j` with
/// `i - window < j <= i`; 0 means no window.
pub fn windowed_attention_forward(
    qkv: &Tensor,
    s: AttnShape,
    window: usize,
) -> Result<(Tensor, Tensor)> {
    let _prof = profile::scope("attention_forward", qkv);
    let on = device_of("attention", &[qkv])?;
    expect_len("attention", "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
    let mut out = Tensor::uninit(qkv.pool(), &[s.batch, s.seq, s.channels], act_dtype(qkv))?;
    let stats = attention_stats_shape(qkv.device(), s);
    match on {
        On::Meta => Ok((out, Tensor::zeros(qkv.pool(), &stats, DType::F32)?)),
        On::Cpu => {
            let mut probs = Tensor::zeros(qkv.pool(), &stats, DType::F32)?;
            cpu::attention::windowed_attention_forward(
                out.host_mut(),
                probs.host_mut(),
                qkv.host(),
                s,
                window,
            );
            Ok((out, probs))
        }
        On::Gpu(g) => {
            let mut lse = Tensor::uninit(qkv.pool(), &stats, DType::F32)?;
            let math = qkv.pool().gemm_math();
            with_elem!(qkv.dtype(), T => g.windowed_attention_forward::<T>(out.cuda_mut(), lse.cuda_mut(), qkv.cuda(), s, window, math))?;
            Ok((out, lse))
        }
    }
}

/// `dqkv` from `dout`, the forward's `qkv`, its output `out` and saved statistics (the GPU's
/// tensor-core kernels take the backward's row term from `out`).
pub fn attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    saved: &Tensor,
    s: AttnShape,
) -> Result<Tensor> {
    profile::label("attention_backward", dout);
    windowed_attention_backward(dout, qkv, out, saved, s, 0)
}

/// The backward of [`windowed_attention_forward`] with the same `window`.
pub fn windowed_attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    saved: &Tensor,
    s: AttnShape,
    window: usize,
) -> Result<Tensor> {
    let _prof = profile::scope("attention_backward", qkv);
    let on = device_of("attention_backward", &[dout, qkv, out, saved])?;
    let mut dqkv = Tensor::uninit(qkv.pool(), qkv.shape(), act_dtype(qkv))?;
    match on {
        On::Meta => meta_scratch(qkv, 4 * super::cuda::attention::backward_scratch_len(s)),
        On::Cpu => cpu::attention::windowed_attention_backward(
            dqkv.host_mut(),
            dout.host(),
            qkv.host(),
            saved.host(),
            s,
            window,
        ),
        On::Gpu(g) => with_elem!(qkv.dtype(), T => g.windowed_attention_backward::<T>(
            dqkv.cuda_mut(),
            dout.cuda(),
            qkv.cuda(),
            out.cuda(),
            saved.cuda(),
            s,
            window,
            qkv.pool().gemm_math(),
        ))?,
    }
    Ok(dqkv)
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

/// Bidirectional attention over fused `qkv[B, T, 3C]` with a key padding mask: sequence `b`
/// has `lens[b]` real tokens (then padding), and every row attends to those keys only.
/// Returns `out[B, T, C]`; forward only (frozen encoders).
pub fn masked_attention_forward(qkv: &Tensor, lens: &[u32], s: AttnShape) -> Result<Tensor> {
    const OP: &str = "masked_attention";
    let _prof = profile::scope("masked_attention_forward", qkv);
    let on = device_of(OP, &[qkv])?;
    expect_len(OP, "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
    if lens.len() != s.batch {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("{} lengths for a batch of {}", lens.len(), s.batch),
        });
    }
    if let Some(&bad) = lens.iter().find(|&&l| l == 0 || l as usize > s.seq) {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "a sequence length of {bad} is outside 1..={}; every sequence needs a real token",
                s.seq
            ),
        });
    }
    let mut out = Tensor::uninit(qkv.pool(), &[s.batch, s.seq, s.channels], act_dtype(qkv))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_masked::masked_attention_forward(out.host_mut(), qkv.host(), lens, s)
        }
        On::Gpu(g) => {
            let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let d_lens = g.upload(&lens)?;
            with_elem!(qkv.dtype(), T => g.masked_attention_forward::<T>(
                out.cuda_mut(),
                qkv.cuda(),
                &d_lens,
                s,
            ))?
        }
    }
    Ok(out)
}

/// Checks a padding mask: one length per sequence, each in `1 ..= T`.
fn check_lens(op: &'static str, lens: &[u32], s: AttnShape) -> Result<()> {
    if lens.len() != s.batch {
        return Err(EngineError::Shape {
            op,
            detail: format!("{} lengths for a batch of {}", lens.len(), s.batch),
        });
    }
    if let Some(&bad) = lens.iter().find(|&&l| l == 0 || l as usize > s.seq) {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "a sequence length of {bad} is outside 1..={}; every sequence needs a real token",
                s.seq
            ),
        });
    }
    Ok(())
}

/// Softmax of each row of `scores[B, H, T, T]` over its sequence's real keys `0 .. lens[b]`
/// (padded keys get probability zero), into a new tensor: the unfused route an encoder
/// trains through.
pub fn padded_softmax(scores: &Tensor, lens: &[u32], s: AttnShape) -> Result<Tensor> {
    const OP: &str = "padded_softmax";
    let _prof = profile::scope(OP, scores);
    let on = device_of(OP, &[scores])?;
    expect_len(OP, "scores", scores, s.batch * s.heads * s.seq * s.seq)?;
    check_lens(OP, lens, s)?;
    let mut probs = Tensor::uninit(scores.pool(), scores.shape(), act_dtype(scores))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_masked::padded_softmax(
            probs.host_mut(),
            scores.host(),
            lens,
            s.heads,
            s.seq,
        ),
        On::Gpu(g) => {
            let lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let d_lens = g.upload(&lens)?;
            with_elem!(scores.dtype(), T => g.padded_softmax::<T>(
                probs.cuda_mut(), scores.cuda(), &d_lens, s,
            ))?
        }
    }
    Ok(probs)
}

/// The backward of a softmax over whole rows (of [`padded_softmax`]: masked entries have zero
/// probability and get zero gradient), into a new tensor.
pub fn softmax_backward(probs: &Tensor, dprobs: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    let _prof = profile::scope(OP, probs);
    let on = device_of(OP, &[probs, dprobs])?;
    let (rows, seq) = rows_cols(OP, probs)?;
    expect_len(OP, "dprobs", dprobs, probs.len())?;
    let mut dscores = Tensor::uninit(probs.pool(), probs.shape(), act_dtype(probs))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_masked::softmax_backward(
            dscores.host_mut(),
            probs.host(),
            dprobs.host(),
            seq,
        ),
        On::Gpu(g) => {
            same_gpu_dtype(OP, probs, dprobs)?;
            with_elem!(probs.dtype(), T => g.softmax_backward_rows::<T>(
                dscores.cuda_mut(), probs.cuda(), dprobs.cuda(), rows, seq,
            ))?
        }
    }
    Ok(dscores)
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

fn heads_rows_check(op: &'static str, rows: &Tensor, s: AttnShape, col0: usize) -> Result<usize> {
    let (n, row) = rows_cols(op, rows)?;
    if n != s.batch * s.seq || col0 + s.channels > row {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "rows of shape {:?} do not hold {} tokens with {} channels from column {col0}",
                rows.shape(),
                s.batch * s.seq,
                s.channels
            ),
        });
    }
    Ok(row)
}

/// The heads in columns `col0 .. col0 + C` of `rows[B, T, row]` as a new `[B, H, T, hs]`
/// tensor (PyTorch's `view(B, T, H, hs).transpose(1, 2).contiguous()`).
pub fn heads_from_rows(rows: &Tensor, s: AttnShape, col0: usize) -> Result<Tensor> {
    const OP: &str = "heads_from_rows";
    let _prof = profile::scope(OP, rows);
    let on = device_of(OP, &[rows])?;
    let row = heads_rows_check(OP, rows, s, col0)?;
    let shape = [s.batch, s.heads, s.seq, s.head_size()];
    let mut heads = Tensor::uninit(rows.pool(), &shape, act_dtype(rows))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_unfused::heads_from_rows(heads.host_mut(), rows.host(), s, row, col0)
        }
        On::Gpu(g) => with_elem!(rows.dtype(), T => g.heads_from_rows::<T>(
            heads.cuda_mut(), rows.cuda(), s, row, col0,
        ))?,
    }
    Ok(heads)
}

/// Writes `heads[B, H, T, hs]` into columns `col0 .. col0 + C` of `rows[B, T, row]`.
pub fn heads_to_rows(rows: &mut Tensor, heads: &Tensor, s: AttnShape, col0: usize) -> Result<()> {
    const OP: &str = "heads_to_rows";
    let _prof = profile::scope(OP, heads);
    let on = device_of(OP, &[rows, heads])?;
    let row = heads_rows_check(OP, rows, s, col0)?;
    expect_len(OP, "heads", heads, s.batch * s.seq * s.channels)?;
    match on {
        On::Meta => {}
        On::Cpu => {
            cpu::attention_unfused::heads_to_rows(rows.host_mut(), heads.host(), s, row, col0)
        }
        On::Gpu(g) => {
            same_gpu_dtype(OP, rows, heads)?;
            with_elem!(heads.dtype(), T => g.heads_to_rows::<T>(
                rows.cuda_mut(), heads.cuda(), s, row, col0,
            ))?
        }
    }
    Ok(())
}

/// Rows of `[.., T, T]` with the causal mask applied and softmax taken, into a new tensor
/// (masked entries zero).
pub fn causal_softmax(scores: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax";
    let _prof = profile::scope(OP, scores);
    let on = device_of(OP, &[scores])?;
    let (rows, seq) = rows_cols(OP, scores)?;
    let mut probs = Tensor::uninit(scores.pool(), scores.shape(), act_dtype(scores))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_unfused::causal_softmax(probs.host_mut(), scores.host(), seq),
        On::Gpu(g) => with_elem!(scores.dtype(), T => g.causal_softmax::<T>(
            probs.cuda_mut(), scores.cuda(), rows, seq,
        ))?,
    }
    Ok(probs)
}

/// The gradient of the scores from the probabilities and their gradient (the backward of
/// [`causal_softmax`]), into a new tensor.
pub fn causal_softmax_backward(probs: &Tensor, dprobs: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_softmax_backward";
    let _prof = profile::scope(OP, probs);
    let on = device_of(OP, &[probs, dprobs])?;
    let (rows, seq) = rows_cols(OP, probs)?;
    expect_len(OP, "dprobs", dprobs, probs.len())?;
    let mut dscores = Tensor::uninit(probs.pool(), probs.shape(), act_dtype(probs))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::attention_unfused::causal_softmax_backward(
            dscores.host_mut(),
            probs.host(),
            dprobs.host(),
            seq,
        ),
        On::Gpu(g) => {
            same_gpu_dtype(OP, probs, dprobs)?;
            with_elem!(probs.dtype(), T => g.causal_softmax_backward::<T>(
                dscores.cuda_mut(), probs.cuda(), dprobs.cuda(), rows, seq,
            ))?
        }
    }
    Ok(dscores)
}

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
        meta_scratch(dout, super::cuda::embedding::row_plan_bytes(tokens));
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

/// On the GPU both tensors must be stored in one type (the CPU stores f32 whatever the tag).
fn same_gpu_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(EngineError::Shape {
            op,
            detail: format!(
                "{:?} and {:?} tensors; both must be one type",
                a.dtype(),
                b.dtype()
            ),
        })
    }
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
            meta_scratch(first, super::cuda::reduce::sum_squares_scratch_bytes(&lens));
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
            let table = params.len() * super::cuda::ADAMW_TABLE_BYTES_PER_TENSOR;
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

/// What defines `H - zI` for the BK-Core besides the potential: `z` as `[Re, Im]` and the
/// optional super- and sub-diagonals (at least `n - 1` values each; ones when absent), all
/// f32 on the potential's device. `z` stays on the device so no forward waits on a copy.
pub struct BkCoeffs<'a> {
    pub z: &'a Tensor,
    pub offdiag: Option<(&'a Tensor, &'a Tensor)>,
}

/// Where the BK-Core backward adds the gradients of learned coefficients (`None`: not learned).
#[derive(Default)]
pub struct BkCoeffGrads<'a> {
    pub dz: Option<&'a mut Tensor>,
    pub doffdiag: Option<(&'a mut Tensor, &'a mut Tensor)>,
}

fn check_bk(op: &'static str, v: &Tensor, k: &BkCoeffs, s: cpu::bk_core::BkShape) -> Result<()> {
    let bad = |detail: String| Err(EngineError::Shape { op, detail });
    if s.n == 0 || s.batch == 0 {
        return bad(format!(
            "batch {} x n {}: both must be at least 1",
            s.batch, s.n
        ));
    }
    expect_len(op, "potential v", v, s.batch * s.n)?;
    expect_len(op, "z", k.z, 2)?;
    let mut ts = vec![v, k.z];
    if let Some((b, c)) = k.offdiag {
        for (what, t) in [("super-diagonal", b), ("sub-diagonal", c)] {
            if t.len() + 1 < s.n {
                return bad(format!(
                    "{what} has {} values, n = {} needs {}",
                    t.len(),
                    s.n,
                    s.n - 1
                ));
            }
        }
        ts.extend([b, c]);
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != DType::F32) {
        return bad(format!(
            "expects f32 tensors (the recurrences run in f32 or wider), got {:?}",
            t.dtype()
        ));
    }
    Ok(())
}

/// Super- and sub-diagonal as f64 host values.
type HostOffdiag = Option<(Vec<f64>, Vec<f64>)>;

/// The coefficients as f64 host values for the CPU kernel.
fn bk_host_coeffs(k: &BkCoeffs) -> (cpu::bk_core::Cx<f64>, HostOffdiag) {
    let z = k.z.host();
    let wide = |t: &Tensor| t.host().iter().map(|&x| x as f64).collect::<Vec<f64>>();
    (
        cpu::bk_core::Cx::new(z[0] as f64, z[1] as f64),
        k.offdiag.map(|(b, c)| (wide(b), wide(c))),
    )
}

/// BK-Core forward: `[batch * n, 2]` holding `(Re, Im) G_ii` per position, and whether every
/// value is finite (a NaN/inf potential or a singular `H - zI` makes some not; the caller
/// reports it). The CPU computes in f64, the GPU in f32.
pub fn bk_core_forward(
    v: &Tensor,
    k: &BkCoeffs,
    s: cpu::bk_core::BkShape,
) -> Result<(Tensor, bool)> {
    let _prof = profile::scope("bk_core_forward", v);
    let mut ts = vec![v, k.z];
    if let Some((b, c)) = k.offdiag {
        ts.extend([b, c]);
    }
    let on = device_of("bk_core", &ts)?;
    check_bk("bk_core", v, k, s)?;
    let mut out = Tensor::uninit(v.pool(), &[s.batch * s.n, 2], DType::F32)?;
    let finite = match on {
        On::Meta => true,
        On::Cpu => {
            let (z, off) = bk_host_coeffs(k);
            let v64: Vec<f64> = v.host().iter().map(|&x| x as f64).collect();
            let mut out64 = vec![0.0f64; 2 * v64.len()];
            let coeffs = cpu::bk_core::BkCoeffs {
                z,
                offdiag: off.as_ref().map(|(b, c)| (&b[..], &c[..])),
            };
            cpu::bk_core::forward(&mut out64, &v64, coeffs, s);
            for (o, &x) in out.host_mut().iter_mut().zip(&out64) {
                *o = x as f32;
            }
            out.host().iter().all(|x| x.is_finite())
        }
        On::Gpu(g) => g.bk_core_forward(
            out.cuda_mut(),
            v.cuda(),
            k.z.cuda(),
            k.offdiag.map(|(b, c)| (b.cuda(), c.cuda())),
            s,
        )?,
    };
    Ok((out, finite))
}

/// BK-Core backward: returns `dv` (layout of `v`) for the output gradient `d_out`
/// (`[batch * n, 2]`) and adds the gradients of `z` and of the off-diagonals into `grads`.
pub fn bk_core_backward(
    d_out: &Tensor,
    v: &Tensor,
    k: &BkCoeffs,
    s: cpu::bk_core::BkShape,
    grads: BkCoeffGrads,
) -> Result<Tensor> {
    let _prof = profile::scope("bk_core_backward", v);
    let mut ts = vec![d_out, v, k.z];
    if let Some((b, c)) = k.offdiag {
        ts.extend([b, c]);
    }
    let on = device_of("bk_core_backward", &ts)?;
    check_bk("bk_core_backward", v, k, s)?;
    expect_len("bk_core_backward", "d_out", d_out, 2 * s.batch * s.n)?;
    if let Some(dz) = &grads.dz {
        expect_len("bk_core_backward", "dz", dz, 2)?;
    }
    if let Some((db, dc)) = &grads.doffdiag {
        let Some((b, c)) = k.offdiag else {
            return Err(EngineError::Shape {
                op: "bk_core_backward",
                detail: "off-diagonal gradients asked for without off-diagonals".into(),
            });
        };
        expect_len("bk_core_backward", "db", db, b.len())?;
        expect_len("bk_core_backward", "dc", dc, c.len())?;
    }
    let mut dv = Tensor::uninit(v.pool(), v.shape(), DType::F32)?;
    match on {
        On::Meta => {}
        On::Cpu => {
            let (z, off) = bk_host_coeffs(k);
            let v64: Vec<f64> = v.host().iter().map(|&x| x as f64).collect();
            let d64: Vec<f64> = d_out.host().iter().map(|&x| x as f64).collect();
            let mut dv64 = vec![0.0f64; v64.len()];
            let coeffs = cpu::bk_core::BkCoeffs {
                z,
                offdiag: off.as_ref().map(|(b, c)| (&b[..], &c[..])),
            };
            let g = cpu::bk_core::backward(&mut dv64, &d64, &v64, coeffs, s);
            for (o, &x) in dv.host_mut().iter_mut().zip(&dv64) {
                *o = x as f32;
            }
            if let Some(dz) = grads.dz {
                let dz = dz.host_mut();
                dz[0] += g.dz.0 as f32;
                dz[1] += g.dz.1 as f32;
            }
            if let (Some((db, dc)), Some((b, c))) = (grads.doffdiag, off) {
                for i in 0..s.n - 1 {
                    db.host_mut()[i] += (g.dp[i] * c[i]) as f32;
                    dc.host_mut()[i] += (g.dp[i] * b[i]) as f32;
                }
            }
        }
        On::Gpu(g) => g.bk_core_backward(
            dv.cuda_mut(),
            d_out.cuda(),
            v.cuda(),
            k.z.cuda(),
            k.offdiag.map(|(b, c)| (b.cuda(), c.cuda())),
            s,
            grads.dz.map(|t| t.cuda_mut()),
            grads.doffdiag.map(|(b, c)| (b.cuda_mut(), c.cuda_mut())),
        )?,
    }
    Ok(dv)
}

// ---- Llama-family operations: RMSNorm, rotary embeddings with grouped-query heads, SwiGLU,
// token-only embeddings. ----

/// `out = rmsnorm(x) * gamma` per row; returns `(out, rstd[rows])`.
pub fn rmsnorm_forward(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let _prof = profile::scope("rmsnorm_forward", x);
    let on = device_of("rmsnorm", &[x, gamma])?;
    let (n, c) = rows_cols("rmsnorm", x)?;
    expect_len("rmsnorm", "gamma", gamma, c)?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut rstd = Tensor::uninit(x.pool(), &[n], DType::F32)?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::rmsnorm::rmsnorm_forward(
            out.host_mut(),
            rstd.host_mut(),
            x.host(),
            gamma.host(),
            c,
            eps,
        ),
        On::Gpu(g) => with_elem!(x.dtype(), T => g.rmsnorm_forward::<T>(
            out.cuda_mut(),
            rstd.cuda_mut(),
            x.cuda(),
            gamma.cuda(),
            n,
            c,
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
    let _prof = profile::scope("residual_rmsnorm_forward", x);
    let on = device_of("residual_rmsnorm", &[x, delta, gamma])?;
    let (n, c) = rows_cols("residual_rmsnorm", x)?;
    expect_len("residual_rmsnorm", "delta", delta, n * c)?;
    expect_len("residual_rmsnorm", "gamma", gamma, c)?;
    let mut sum = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
    let mut out = Tensor::uninit(x.pool(), x.shape(), act_dtype(x))?;
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
            eps,
        ))?,
    }
    Ok((sum, out, rstd))
}

/// Accumulates the input gradient into `dx` (the residual stream's gradient) and the gain
/// gradient into `dgamma` (f32).
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
    expect_len("rmsnorm_backward", "dout", dout, x.len())?;
    expect_len("rmsnorm_backward", "dx", dx, x.len())?;
    if let Some(dg) = &dgamma {
        expect_len("rmsnorm_backward", "dgamma", dg, c)?;
    }
    expect_len("rmsnorm_backward", "rstd", rstd, n)?;
    let mut frozen_gain;
    match on {
        On::Meta => {
            if dgamma.is_some() {
                meta_scratch(x, super::cuda::reduce::norm_partials_bytes(n, c, 1));
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
        ))?,
    }
    Ok(())
}

fn check_rope(
    op: &'static str,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<()> {
    let half = s.rot_dim / 2;
    let bad = |detail: String| Err(EngineError::Shape { op, detail });
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return bad(format!(
            "{} query heads cannot share {} key/value heads evenly",
            s.heads, s.kv_heads
        ));
    }
    if !s.rot_dim.is_multiple_of(2) || s.rot_dim > s.head_dim {
        return bad(format!(
            "rotary dimensions {} must be even and at most the head size {}",
            s.rot_dim, s.head_dim
        ));
    }
    if pos.len() != s.rows {
        return bad(format!("{} positions for {} rows", pos.len(), s.rows));
    }
    let table_rows = cos.len().checked_div(half).unwrap_or(usize::MAX);
    if cos.len() != sin.len() || cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
        return bad("the cos and sin tables must be f32 of one shape".into());
    }
    if let Some(&p) = pos.iter().find(|&&p| p as usize >= table_rows) {
        return bad(format!(
            "position {p} is past the rotary table of {table_rows} positions (the model's context)"
        ));
    }
    Ok(())
}

/// Rotates the queries and keys of a grouped-query projection `qkv[rows, (H+2K) D]` by
/// each row's position and packs `[q | k | v]` with one key/value head per query head:
/// `[rows, 3 H D]`, the layout the attention kernels read. See [`cpu::rope`].
pub fn rope_expand_forward(
    qkv: &Tensor,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<Tensor> {
    let _prof = profile::scope("rope_expand_forward", qkv);
    let on = device_of("rope_expand", &[qkv, cos, sin])?;
    check_rope("rope_expand", pos, cos, sin, s)?;
    expect_len("rope_expand", "qkv", qkv, s.rows * s.qkv_width())?;
    let mut shape = qkv.shape().to_vec();
    *shape
        .last_mut()
        .expect("expect_len checked a non-empty tensor") = s.packed_width();
    let mut out = Tensor::uninit(qkv.pool(), &shape, act_dtype(qkv))?;
    match on {
        On::Meta => meta_scratch(qkv, 4 * pos.len()),
        On::Cpu => cpu::rope::rope_expand_forward(
            out.host_mut(),
            qkv.host(),
            pos,
            cos.host(),
            sin.host(),
            s,
        ),
        On::Gpu(g) => {
            let d_pos = g.upload(pos)?;
            with_elem!(qkv.dtype(), T => g.rope_expand_forward::<T>(
                out.cuda_mut(),
                qkv.cuda(),
                &d_pos,
                cos.cuda(),
                sin.cuda(),
                s,
            ))?
        }
    }
    Ok(out)
}

/// The backward of [`rope_expand_forward`]: `dqkv[rows, (H+2K) D]` from `dpacked`.
pub fn rope_expand_backward(
    dpacked: &Tensor,
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
) -> Result<Tensor> {
    let _prof = profile::scope("rope_expand_backward", dpacked);
    let on = device_of("rope_expand_backward", &[dpacked, cos, sin])?;
    check_rope("rope_expand_backward", pos, cos, sin, s)?;
    expect_len(
        "rope_expand_backward",
        "dpacked",
        dpacked,
        s.rows * s.packed_width(),
    )?;
    let mut shape = dpacked.shape().to_vec();
    *shape
        .last_mut()
        .expect("expect_len checked a non-empty tensor") = s.qkv_width();
    let mut out = Tensor::uninit(dpacked.pool(), &shape, act_dtype(dpacked))?;
    match on {
        On::Meta => meta_scratch(dpacked, 4 * pos.len()),
        On::Cpu => cpu::rope::rope_expand_backward(
            out.host_mut(),
            dpacked.host(),
            pos,
            cos.host(),
            sin.host(),
            s,
        ),
        On::Gpu(g) => {
            let d_pos = g.upload(pos)?;
            with_elem!(dpacked.dtype(), T => g.rope_expand_backward::<T>(
                out.cuda_mut(),
                dpacked.cuda(),
                &d_pos,
                cos.cuda(),
                sin.cuda(),
                s,
            ))?
        }
    }
    Ok(out)
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
        On::Meta => meta_scratch(dout, super::cuda::embedding::row_plan_bytes(tokens)),
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

/// The GPU kernels read and write every tensor of a call in one element type.
fn same_dtype(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().find(|t| t.dtype() != ts[0].dtype()) {
        Some(t) => Err(EngineError::Shape {
            op,
            detail: format!(
                "expects tensors of one dtype, got {:?} and {:?}",
                ts[0].dtype(),
                t.dtype()
            ),
        }),
        None => Ok(()),
    }
}

/// Rotates the queries and keys of `qkv[rows, (H+2K) D]` by each row's position, stores keys
/// and values into the cache at `(slot, pos)` and returns the rotated queries `[rows, H D]`.
/// See [`cpu::kv_cache`].
#[allow(clippy::too_many_arguments)]
pub fn kv_append(
    qkv: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    slot: &[u32],
    pos: &[u32],
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    profile::label("kv_append", qkv);
    let rows = CacheRows::host(qkv, slot, pos, c.head_dim)?;
    kv_append_at(qkv, k_cache, v_cache, &rows, cos, sin, s, c)
}

/// [`kv_append`] with slots and positions where the kernel reads them; device rows outside
/// the cache write nothing there and give NaN queries.
#[allow(clippy::too_many_arguments)]
pub fn kv_append_at(
    qkv: &Tensor,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    append(qkv, None, None, k_cache, v_cache, rows, cos, sin, s, c)
}

/// [`kv_append_at`] of `qkv`, the projection of an unnormalised stream `x` (`[rows, C]`)
/// through a weight with its RMSNorm gain folded in: each row of `qkv` is first scaled by
/// `1 / sqrt(mean(x_row^2) + eps)`, which makes it the projection of `rmsnorm(x) * gain`, and
/// then given the projection's `bias` (`[qkv width]`), which the product therefore leaves out.
/// One kernel where a norm and an append were two (the decode step's, see
/// `models::llama`).
#[allow(clippy::too_many_arguments)]
pub fn kv_append_normed_at(
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    append(
        qkv,
        Some((x, eps)),
        bias,
        k_cache,
        v_cache,
        rows,
        cos,
        sin,
        s,
        c,
    )
}

/// Checks `norm`'s stream against `rows` and returns its width.
fn norm_width(op: &'static str, norm: Option<(&Tensor, f32)>, rows: usize) -> Result<usize> {
    let Some((x, _)) = norm else { return Ok(0) };
    let (xr, c) = rows_cols(op, x)?;
    if xr != rows || c == 0 {
        return Err(EngineError::Shape {
            op,
            detail: format!("a stream of {xr} rows of {c} for {rows} projected rows"),
        });
    }
    Ok(c)
}

#[allow(clippy::too_many_arguments)]
fn append(
    qkv: &Tensor,
    norm: Option<(&Tensor, f32)>,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<Tensor> {
    let (slot, pos) = (rows.slot, rows.pos);
    let op = if norm.is_some() {
        "kv_append_normed"
    } else {
        "kv_append"
    };
    let _prof = profile::scope(op, qkv);
    let on = {
        let mut all = vec![qkv, &*k_cache, &*v_cache, cos, sin];
        all.extend(norm.map(|(x, _)| x));
        all.extend(bias);
        device_of(op, &all)?
    };
    let width = check_append(
        op, qkv, norm, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
    )?;
    let mut q = Tensor::uninit(qkv.pool(), &[s.rows, s.heads * s.head_dim], act_dtype(qkv))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu_append(
            op,
            q.host_mut(),
            qkv,
            norm.map(|(x, eps)| (x, eps, width)),
            bias,
            k_cache,
            v_cache,
            slot,
            pos,
            cos,
            sin,
            s,
            c,
        )?,
        On::Gpu(g) => {
            same_dtype(op, &[qkv, &*k_cache, &*v_cache])?;
            let (d_slot, d_pos) = rows.gpu(&g)?;
            match norm {
                None => with_elem!(qkv.dtype(), T => g.kv_append::<T>(
                    q.cuda_mut(),
                    k_cache.cuda_mut(),
                    v_cache.cuda_mut(),
                    qkv.cuda(),
                    d_slot.get(),
                    d_pos.get(),
                    cos.cuda(),
                    sin.cuda(),
                    s,
                    c,
                ))?,
                Some((x, eps)) => {
                    same_dtype(op, &[qkv, x])?;
                    if let Some(b) = bias {
                        same_dtype(op, &[qkv, b])?;
                    }
                    with_elem!(qkv.dtype(), T => g.kv_append_normed::<T>(
                        q.cuda_mut(),
                        k_cache.cuda_mut(),
                        v_cache.cuda_mut(),
                        qkv.cuda(),
                        x.cuda(),
                        width,
                        eps,
                        bias.map(|b| b.cuda()),
                        d_slot.get(),
                        d_pos.get(),
                        cos.cuda(),
                        sin.cuda(),
                        s,
                        c,
                    ))?
                }
            }
        }
    }
    Ok(q)
}

/// Checks an append's operands against its shapes (bias, tables, cache, rows, the norm's
/// stream); returns the stream's width (0 without a norm).
#[allow(clippy::too_many_arguments)]
fn check_append(
    op: &'static str,
    qkv: &Tensor,
    norm: Option<(&Tensor, f32)>,
    bias: Option<&Tensor>,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot: Ids,
    pos: Ids,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<usize> {
    if let Some(b) = bias {
        expect_len(op, "bias", b, s.qkv_width())?;
    }
    if let Some(p) = pos.host() {
        check_rope(op, p, cos, sin, s)?;
    }
    check_cache(op, k_cache, v_cache, slot, pos, c)?;
    expect_len(op, "qkv", qkv, s.rows * s.qkv_width())?;
    if pos.len() != s.rows {
        return Err(EngineError::Shape {
            op,
            detail: format!("{} positions for {} rows", pos.len(), s.rows),
        });
    }
    norm_width(op, norm, s.rows)
}

/// The CPU append into `q` (host values): the projection, first scaled by each row's norm
/// factor of `norm`'s stream (of `width`) and given the bias, when there is a norm.
#[allow(clippy::too_many_arguments)]
fn cpu_append(
    op: &'static str,
    q: &mut [f32],
    qkv: &Tensor,
    norm: Option<(&Tensor, f32, usize)>,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    slot: Ids,
    pos: Ids,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    c: CacheShape,
) -> Result<()> {
    let scaled = norm.map(|(x, eps, width)| {
        let bias = bias.map(Tensor::host);
        cpu::rmsnorm::normed_rows(qkv.host(), s.qkv_width(), x.host(), width, eps, bias)
    });
    cpu::kv_cache::kv_append(
        q,
        k_cache.host_mut(),
        v_cache.host_mut(),
        scaled.as_deref().unwrap_or(qkv.host()),
        cpu_ids(op, slot)?,
        cpu_ids(op, pos)?,
        cos.host(),
        sin.host(),
        s,
        c,
    );
    Ok(())
}

fn check_cache(
    op: &'static str,
    k: &Tensor,
    v: &Tensor,
    slot: Ids,
    pos: Ids,
    c: CacheShape,
) -> Result<()> {
    expect_len(op, "k_cache", k, c.len())?;
    expect_len(op, "v_cache", v, c.len())?;
    let outside = |ids: Ids, bound: usize| {
        ids.host()
            .is_some_and(|v| v.iter().any(|&i| i as usize >= bound))
    };
    if slot.len() != pos.len() || outside(slot, c.slots) || outside(pos, c.max_len) {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "rows must name a slot below {} and a position below the cache length {}",
                c.slots, c.max_len
            ),
        });
    }
    Ok(())
}

/// Each row's rotated queries `q[rows, H D]` attend to positions `0..=pos` of its cache slot,
/// or to the `window` latest of them (0: no window): `[rows, H D]`.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slot: &[u32],
    pos: &[u32],
    heads: usize,
    window: usize,
    c: CacheShape,
) -> Result<Tensor> {
    profile::label("cache_attention", q);
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let rows = CacheRows::host(q, slot, pos, c.head_dim)?;
    cache_attention_at(q, k_cache, v_cache, &rows, heads, window, longest, c)
}

/// [`cache_attention`] with slots and positions where the kernel reads them. `longest`
/// bounds every row's position + 1 and only chooses how a GPU splits rows over blocks (the
/// arithmetic, and so the last bits of the result, follow the split): calls that must agree
/// bit for bit pass the same bound. Device rows outside the cache give NaN.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_at(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    rows: &CacheRows,
    heads: usize,
    window: usize,
    longest: usize,
    c: CacheShape,
) -> Result<Tensor> {
    let _prof = profile::scope("cache_attention", q);
    let on = device_of("cache_attention", &[q, k_cache, v_cache])?;
    let (slot, pos) = (rows.slot, rows.pos);
    check_cache("cache_attention", k_cache, v_cache, slot, pos, c)?;
    expect_len("cache_attention", "q", q, slot.len() * heads * c.head_dim)?;
    if c.kv_heads == 0 || !heads.is_multiple_of(c.kv_heads) {
        return Err(EngineError::Shape {
            op: "cache_attention",
            detail: format!("{heads} heads cannot share {} key/value heads", c.kv_heads),
        });
    }
    if let Some(p) = rows.prefill.as_ref().filter(|p| p.head_dim == c.head_dim) {
        return prefill_attention(on, q, k_cache, v_cache, p, heads, window, c);
    }
    let mut out = Tensor::uninit(q.pool(), q.shape(), act_dtype(q))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::kv_cache::cache_attention(
            out.host_mut(),
            q.host(),
            k_cache.host(),
            v_cache.host(),
            cpu_ids("cache_attention", slot)?,
            cpu_ids("cache_attention", pos)?,
            heads,
            window,
            c,
        ),
        On::Gpu(g) => {
            same_dtype("cache_attention", &[q, k_cache, v_cache])?;
            let (d_slot, d_pos) = rows.gpu(&g)?;
            with_elem!(q.dtype(), T => g.cache_attention::<T>(
                out.cuda_mut(),
                q.cuda(),
                k_cache.cuda(),
                v_cache.cuda(),
                d_slot.get(),
                d_pos.get(),
                heads,
                window,
                longest,
                c,
            ))?
        }
    }
    Ok(out)
}

/// The longest prompt of a prefill from which a GPU attends through the training attention:
/// below it the cache kernel, one block per row, has no tiles to fill.
const PREFILL_FLASH_FROM: usize = 16;

/// A GPU prefill's rows as runs, each one sequence's positions `0..len` in order, for the
/// training attention's tiles: a prompt's rows otherwise each walk their prefix of the cache
/// alone (about half the prefill's time at 64 prompts of 64 tokens).
struct PrefillRuns {
    /// (slot, first row, length) per run.
    runs: Vec<u32>,
    /// The longest run: the padded sequence length.
    tmax: usize,
    /// Each row's row in the padded `[runs x tmax]` output.
    padded_row: Vec<u32>,
    /// The head size the runs were found for (the attention's kernels must have it).
    head_dim: usize,
    /// `runs` and `padded_row` on the GPU ([`CacheRows::new`] copies them once a call).
    device: Option<(CudaSlice<u32>, CudaSlice<u32>)>,
}

impl PrefillRuns {
    /// The runs of a call whose rows (on the host) all form runs from position 0, on a GPU
    /// (or a meta pool standing in for one) whose attention takes `head_dim`, with a prompt
    /// at least [`PREFILL_FLASH_FROM`] long and at most half the padded rows padding; `None`
    /// leaves the call to the cache kernel.
    fn of(q: &Tensor, slot: Ids, pos: Ids, head_dim: usize) -> Option<PrefillRuns> {
        if !matches!(q.device(), Device::Cuda(_))
            || !super::cuda::attention::has_head_size(head_dim)
        {
            return None;
        }
        let (slot, pos) = (slot.host()?, pos.host()?);
        let mut runs = Vec::new();
        let mut first = 0;
        while first < pos.len() {
            if pos[first] != 0 {
                return None;
            }
            let mut end = first + 1;
            while end < pos.len() && slot[end] == slot[first] && pos[end] as usize == end - first {
                end += 1;
            }
            runs.push((slot[first], first, end - first));
            first = end;
        }
        let tmax = runs.iter().map(|r| r.2).max()?;
        if tmax < PREFILL_FLASH_FROM || runs.len() * tmax > 2 * pos.len() {
            return None;
        }
        let padded_row = runs
            .iter()
            .enumerate()
            .flat_map(|(r, &(_, _, len))| (0..len).map(move |t| (r * tmax + t) as u32))
            .collect();
        let runs = runs
            .iter()
            .flat_map(|&(slot, first, len)| [slot, first as u32, len as u32])
            .collect();
        Some(PrefillRuns {
            runs,
            tmax,
            padded_row,
            head_dim,
            device: None,
        })
    }

    fn count(&self) -> usize {
        self.runs.len() / 3
    }
}

/// [`cache_attention_at`] of a prefill's runs through the training attention: the queries and
/// the runs' cached keys and values packed as its fused input, padded to the longest run,
/// and the real rows gathered from its output. Each row attends to positions `0..=pos` of
/// its slot as the cache kernel's rows do (with the training attention's rounding).
#[allow(clippy::too_many_arguments)]
fn prefill_attention(
    on: On,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    p: &PrefillRuns,
    heads: usize,
    window: usize,
    c: CacheShape,
) -> Result<Tensor> {
    const OP: &str = "prefill_attention";
    let width = heads * c.head_dim;
    let (n, tmax) = (p.count(), p.tmax);
    let mut packed = Tensor::uninit(q.pool(), &[n, tmax, 3 * width], act_dtype(q))?;
    match on {
        On::Meta => {}
        On::Cpu => {
            return Err(EngineError::Shape {
                op: OP,
                detail: "the packed prefill runs on a GPU only".into(),
            });
        }
        On::Gpu(g) => {
            same_dtype(OP, &[q, k_cache, v_cache])?;
            // CacheRows::new copies a GPU call's runs to the device.
            let Some((d_runs, _)) = &p.device else {
                return Err(EngineError::Shape {
                    op: OP,
                    detail: "the prefill's runs were found for another device".into(),
                });
            };
            with_elem!(q.dtype(), T => g.prefill_pack::<T>(
                packed.cuda_mut(),
                q.cuda(),
                k_cache.cuda(),
                v_cache.cuda(),
                &p.runs,
                d_runs,
                tmax,
                heads,
                c,
            ))?
        }
    }
    let s = AttnShape {
        batch: n,
        seq: tmax,
        heads,
        channels: width,
    };
    let (out, stats) = windowed_attention_forward(&packed, s, window)?;
    drop((packed, stats));
    let out = out.reshaped(&[n * tmax, width]);
    let padded = match &p.device {
        Some((_, rows)) => Ids::Device(rows),
        None => Ids::Host(&p.padded_row),
    };
    gather_rows_at(&out, padded, None)
}

/// [`kv_append_normed_at`] followed by [`cache_attention_at`] on the queries it rotates:
/// `[rows, H D]`. Where the rows name `distinct_slots` (a decode step, one row per sequence)
/// a GPU may do both in one kernel, the queries never stored (and the CPU keeps them outside
/// the pool); otherwise (a prefill, whose rows attend to each other's appends) the two ops
/// run in turn.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_append_at(
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    window: usize,
    longest: usize,
    distinct_slots: bool,
    c: CacheShape,
) -> Result<Tensor> {
    if !distinct_slots {
        let q = kv_append_normed_at(qkv, x, eps, bias, k_cache, v_cache, rows, cos, sin, s, c)?;
        return cache_attention_at(&q, k_cache, v_cache, rows, s.heads, window, longest, c);
    }
    let shape = [s.rows, s.heads * s.head_dim];
    let mut out = Tensor::uninit(qkv.pool(), &shape, act_dtype(qkv))?;
    let cache = (k_cache, v_cache);
    cache_attention_append_into(
        &mut out, qkv, x, eps, bias, cache, rows, cos, sin, s, window, longest, c,
    )?;
    Ok(out)
}

/// [`cache_attention_append_at`] of a decode step (rows naming distinct slots) into `out`
/// (`[rows, H D]` in the activation dtype): a step that keeps its buffers, so that its kernels
/// follow each other with no allocation between them.
#[allow(clippy::too_many_arguments)]
pub fn cache_attention_append_into(
    out: &mut Tensor,
    qkv: &Tensor,
    x: &Tensor,
    eps: f32,
    bias: Option<&Tensor>,
    (k_cache, v_cache): (&mut Tensor, &mut Tensor),
    rows: &CacheRows,
    cos: &Tensor,
    sin: &Tensor,
    s: RopeShape,
    window: usize,
    longest: usize,
    c: CacheShape,
) -> Result<()> {
    const OP: &str = "cache_attention_append";
    let on = {
        let mut all = vec![qkv, x, &*k_cache, &*v_cache, cos, sin, &*out];
        all.extend(bias);
        device_of(OP, &all)?
    };
    let (slot, pos) = (rows.slot, rows.pos);
    let _prof = profile::scope(OP, qkv);
    let norm = Some((x, eps));
    let width = check_append(
        OP, qkv, norm, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
    )?;
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) || s.kv_heads != c.kv_heads {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "{} heads over {} key/value heads, a cache of {}",
                s.heads, s.kv_heads, c.kv_heads
            ),
        });
    }
    let dtype = act_dtype(qkv);
    expect_len(OP, "output", out, s.rows * s.heads * s.head_dim)?;
    expect_act_output(OP, out, qkv)?;
    // Only the output is booked, on every device: the GPU kernel never stores the queries,
    // and the CPU keeps them outside the pool, so a meta pool's plan is each device's peak.
    if matches!(on, On::Meta) {
        // A GPU call of many blocks runs the two kernels, its queries taken from the driver.
        meta_scratch(qkv, out.len() * dtype.size_bytes());
    } else if matches!(on, On::Cpu) {
        let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
        let normed = Some((x, eps, width));
        cpu_append(
            OP, &mut q, qkv, normed, bias, k_cache, v_cache, slot, pos, cos, sin, s, c,
        )?;
        cpu::kv_cache::cache_attention(
            out.host_mut(),
            &q,
            k_cache.host(),
            v_cache.host(),
            cpu_ids(OP, slot)?,
            cpu_ids(OP, pos)?,
            s.heads,
            window,
            c,
        );
    } else if let On::Gpu(g) = on {
        same_dtype(OP, &[qkv, x, &*k_cache, &*v_cache])?;
        if let Some(b) = bias {
            same_dtype(OP, &[qkv, b])?;
        }
        let (d_slot, d_pos) = rows.gpu(&g)?;
        with_elem!(qkv.dtype(), T => g.cache_attention_append::<T>(
            out.cuda_mut(),
            k_cache.cuda_mut(),
            v_cache.cuda_mut(),
            qkv.cuda(),
            x.cuda(),
            width,
            eps,
            bias.map(|b| b.cuda()),
            d_slot.get(),
            d_pos.get(),
            cos.cuda(),
            sin.cuda(),
            s,
            window,
            longest,
            c,
        ))?;
    }
    Ok(())
}

/// Copies positions `0..len` of cache slot `from` into slot `to` (samples sharing a prompt's
/// prefill).
pub fn copy_cache_slot(
    cache: &mut Tensor,
    from: usize,
    to: usize,
    len: usize,
    c: CacheShape,
) -> Result<()> {
    profile::label("copy_cache_slot", cache);
    expect_len("copy_cache_slot", "cache", cache, c.len())?;
    if from >= c.slots || to >= c.slots || len > c.max_len {
        return Err(EngineError::Shape {
            op: "copy_cache_slot",
            detail: format!(
                "slots {from} -> {to} of {}, {len} positions of {}",
                c.slots, c.max_len
            ),
        });
    }
    match device_of("copy_cache_slot", &[cache])? {
        On::Meta => {}
        On::Cpu => {
            let data = cache.host_mut();
            for h in 0..c.kv_heads {
                let (src, dst) = (c.at(from, h, 0), c.at(to, h, 0));
                data.copy_within(src..src + len * c.head_dim, dst);
            }
        }
        On::Gpu(g) => with_elem!(cache.dtype(), T => g.copy_cache_slot::<T>(
            cache.cuda_mut(),
            from,
            to,
            len,
            c,
        ))?,
    }
    Ok(())
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

/// The sampler's per-slot state (next input token, position, random stream, presence mask,
/// last log-probability) on the device of the logits it samples from, with the slots' own
/// indices `0..slots` there (a decode step over every slot names them). On a meta pool the
/// host state stands in and the bytes the GPU state and the sampler's scratch would take are
/// held outside the pool (the planner's view of a generation).
pub enum SlotState {
    Host(HostSlots, Vec<u32>),
    Gpu(Arc<CudaBackend>, Box<DeviceSlots>, CudaSlice<u32>),
    Meta(HostSlots, Vec<u32>),
}

impl SlotState {
    /// `init` placed on `pool`'s device.
    pub fn new(pool: &MemoryPool, init: HostSlots) -> Result<SlotState> {
        let identity: Vec<u32> = (0..init.slots() as u32).collect();
        if pool.is_meta() {
            let bytes = match pool.device() {
                Device::Cpu => 0,
                Device::Cuda(_) => {
                    super::cuda::sampling::device_slots_bytes(init.slots(), init.vocab)
                        + 4 * init.slots()
                }
            };
            pool.hold_outside(bytes);
            return Ok(SlotState::Meta(init, identity));
        }
        Ok(match pool.device() {
            Device::Cpu => SlotState::Host(init, identity),
            Device::Cuda(_) => {
                let g = pool.cuda()?.clone();
                let d = Box::new(g.upload_slots(&init)?);
                let ids = g.upload(&identity)?;
                SlotState::Gpu(g, d, ids)
            }
        })
    }

    /// Each slot's next input token, where the decode step reads it.
    pub fn tokens(&self) -> Ids<'_> {
        match self {
            SlotState::Host(h, _) | SlotState::Meta(h, _) => Ids::Host(&h.tokens),
            SlotState::Gpu(_, d, _) => Ids::Device(&d.tokens),
        }
    }

    /// Each slot's position for its next input token.
    pub fn pos(&self) -> Ids<'_> {
        match self {
            SlotState::Host(h, _) | SlotState::Meta(h, _) => Ids::Host(&h.pos),
            SlotState::Gpu(_, d, _) => Ids::Device(&d.pos),
        }
    }

    /// `0..slots`.
    pub fn slot_ids(&self) -> Ids<'_> {
        match self {
            SlotState::Host(_, ids) | SlotState::Meta(_, ids) => Ids::Host(ids),
            SlotState::Gpu(_, _, ids) => Ids::Device(ids),
        }
    }

    /// Starts slot `slot` afresh for a sequence whose next input sits at `pos`, drawing from
    /// `seed` from its first number on, with `history` (the prompt, when a penalty is used)
    /// in its presence mask.
    pub fn reset_slot(&mut self, slot: usize, pos: u32, seed: u64, history: &[u32]) -> Result<()> {
        let fresh = |vocab: usize, max_len: usize| {
            HostSlots::new(vec![pos], vec![seed], &[history], vocab, max_len)
        };
        match self {
            SlotState::Host(h, _) | SlotState::Meta(h, _) => {
                if slot >= h.slots() {
                    return Err(EngineError::Shape {
                        op: "reset_slot",
                        detail: format!("slot {slot} of {}", h.slots()),
                    });
                }
                let one = fresh(h.vocab, h.max_len);
                let words = cpu::sampling::mask_words(h.vocab);
                h.tokens[slot] = 0;
                h.pos[slot] = pos;
                h.logprobs[slot] = 0.0;
                h.seeds[slot] = seed;
                h.counters[slot] = 0;
                h.presence[slot * words..(slot + 1) * words].copy_from_slice(&one.presence);
            }
            SlotState::Gpu(g, d, _) => {
                let one = fresh(d.vocab, d.max_len);
                g.reset_slot(d, slot, &one)?;
            }
        }
        Ok(())
    }

    /// The tokens and log-probabilities of the last draw of every slot (waits for a GPU).
    pub fn read(&mut self) -> Result<(Vec<u32>, Vec<f32>)> {
        let r = self.start_read()?;
        self.finish_read(r)
    }

    /// Starts reading the last draw of every slot: on a GPU a copy queued behind the work so
    /// far, which [`SlotState::finish_read`] waits for, so that the host can read one decode
    /// step's draws while the next one runs (two reads may be unfinished at a time); on the
    /// host the draws as they are now.
    pub fn start_read(&mut self) -> Result<DrawnRead> {
        Ok(match self {
            SlotState::Host(h, _) | SlotState::Meta(h, _) => {
                DrawnRead::Ready(h.tokens.clone(), h.logprobs.clone())
            }
            SlotState::Gpu(g, d, _) => DrawnRead::Queued(g.queue_drawn(d)?),
        })
    }

    /// The tokens and log-probabilities of the draw `read` was started after.
    pub fn finish_read(&mut self, read: DrawnRead) -> Result<(Vec<u32>, Vec<f32>)> {
        Ok(match (self, read) {
            (_, DrawnRead::Ready(tokens, logprobs)) => (tokens, logprobs),
            (SlotState::Gpu(g, d, _), DrawnRead::Queued(t)) => g.read_drawn(d, t)?,
            (_, DrawnRead::Queued(_)) => {
                return Err(EngineError::Shape {
                    op: "finish_read",
                    detail: "a GPU read of another slot state".into(),
                });
            }
        })
    }
}

/// A read of every slot's last draw ([`SlotState::start_read`]).
#[derive(Debug)]
pub enum DrawnRead {
    Ready(Vec<u32>, Vec<f32>),
    Queued(super::cuda::sampling::DrawnTicket),
}

/// The rows of a decode step over some of the slots: row `i` runs slot `slots[i]`, feeding
/// `tokens[i]` at `pos[i]`, which [`gather_step_rows`] copies from the slot state before each
/// step (on a GPU inside the step, so a replayed step reads the latest draw). Rows past the
/// live slots name no slot (`u32::MAX`): the step's kernels skip them, so a step captured for
/// a bucketed row count serves any live count up to it.
pub enum StepRows {
    Host {
        slots: Vec<u32>,
        tokens: Vec<u32>,
        pos: Vec<u32>,
    },
    Gpu {
        slots: CudaSlice<u32>,
        tokens: CudaSlice<u32>,
        pos: CudaSlice<u32>,
    },
}

impl StepRows {
    /// `rows` rows (at least `live.len()`) for the slots `live` of `st`, the rest padding.
    /// On the host (and a meta pool) padding is refused: only a GPU step needs it.
    pub fn new(st: &SlotState, live: &[u32], rows: usize) -> Result<StepRows> {
        let bad = |detail: String| EngineError::Shape {
            op: "step_rows",
            detail,
        };
        if rows < live.len() {
            return Err(bad(format!("{rows} rows for {} live slots", live.len())));
        }
        let mut slots = live.to_vec();
        slots.resize(rows, u32::MAX);
        Ok(match st {
            SlotState::Host(..) | SlotState::Meta(..) => {
                if rows != live.len() {
                    return Err(bad(format!(
                        "{} padding rows for a step on the host",
                        rows - live.len()
                    )));
                }
                StepRows::Host {
                    slots,
                    tokens: vec![0; rows],
                    pos: vec![0; rows],
                }
            }
            SlotState::Gpu(g, _, _) => StepRows::Gpu {
                slots: g.upload(&slots)?,
                tokens: g.alloc(rows)?,
                pos: g.alloc(rows)?,
            },
        })
    }

    /// Points the same rows at other live slots (as many as fit, the rest padding), keeping
    /// the GPU buffers in place so a captured step still reads them.
    pub fn refill(&mut self, live: &[u32]) -> Result<()> {
        let rows = self.len();
        if live.len() > rows {
            return Err(EngineError::Shape {
                op: "step_rows",
                detail: format!("{} live slots for {rows} rows", live.len()),
            });
        }
        let mut ids = live.to_vec();
        ids.resize(rows, u32::MAX);
        match self {
            StepRows::Host { slots, .. } => {
                if live.len() != rows {
                    return Err(EngineError::Shape {
                        op: "step_rows",
                        detail: format!(
                            "{} padding rows for a step on the host",
                            rows - live.len()
                        ),
                    });
                }
                *slots = ids;
            }
            StepRows::Gpu { slots, .. } => {
                let stream = slots.stream().clone();
                stream
                    .memcpy_htod(&ids, slots)
                    .map_err(|e| EngineError::Cuda(e.into()))?;
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        match self {
            StepRows::Host { slots, .. } => slots.len(),
            StepRows::Gpu { slots, .. } => slots.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn slots(&self) -> Ids<'_> {
        match self {
            StepRows::Host { slots, .. } => Ids::Host(slots),
            StepRows::Gpu { slots, .. } => Ids::Device(slots),
        }
    }

    pub fn tokens(&self) -> Ids<'_> {
        match self {
            StepRows::Host { tokens, .. } => Ids::Host(tokens),
            StepRows::Gpu { tokens, .. } => Ids::Device(tokens),
        }
    }

    pub fn pos(&self) -> Ids<'_> {
        match self {
            StepRows::Host { pos, .. } => Ids::Host(pos),
            StepRows::Gpu { pos, .. } => Ids::Device(pos),
        }
    }
}

/// Copies each row's slot's next token and position into `rows` (see [`StepRows`]).
pub fn gather_step_rows(st: &SlotState, rows: &mut StepRows) -> Result<()> {
    match (st, rows) {
        (SlotState::Host(h, _) | SlotState::Meta(h, _), StepRows::Host { slots, tokens, pos }) => {
            cpu::sampling::gather_slot_rows(h, slots, tokens, pos);
        }
        (SlotState::Gpu(g, d, _), StepRows::Gpu { slots, tokens, pos }) => {
            g.gather_slot_rows(d, slots, tokens, pos)?
        }
        _ => {
            return Err(EngineError::Shape {
                op: "gather_slot_rows",
                detail: "step rows and slot state on different devices".into(),
            });
        }
    }
    Ok(())
}

/// Draws one token for each of `rows` rows of `logits` (`[logit rows, stride]`, the first
/// `vocab` columns of the slots' vocabulary used): row `i` reads logits row `src_row[i]` (or
/// `i`) and updates slot `slot[i]` (or `i`) of `st`. See [`cpu::sampling`] for the rules.
pub fn sample_rows(
    logits: &Tensor,
    src_row: Option<Ids>,
    slot: Option<Ids>,
    rows: usize,
    st: &mut SlotState,
    p: &SampleParams,
) -> Result<()> {
    let _prof = profile::scope("sample_rows", logits);
    let (logit_rows, stride) = rows_cols("sample_rows", logits)?;
    let bad = |detail: String| {
        Err(EngineError::Shape {
            op: "sample_rows",
            detail,
        })
    };
    for ids in [src_row, slot].into_iter().flatten() {
        if ids.len() != rows {
            return bad(format!("{} indices for {rows} rows", ids.len()));
        }
    }
    match st {
        SlotState::Meta(..) => {}
        SlotState::Host(h, _) => {
            if logits.device() != Device::Cpu {
                return bad("GPU logits for a sampler on the host".into());
            }
            let src = src_row.map(|i| cpu_ids("sample_rows", i)).transpose()?;
            let slot = slot.map(|i| cpu_ids("sample_rows", i)).transpose()?;
            let (slots, vocab) = (h.slots(), h.vocab);
            let outside = |ids: Option<&[u32]>, bound: usize, implicit: usize| match ids {
                Some(v) => v.iter().any(|&i| i as usize >= bound),
                None => implicit > bound,
            };
            if stride < vocab || outside(src, logit_rows, rows) || outside(slot, slots, rows) {
                return bad(format!(
                    "rows must name a logits row below {logit_rows} and a slot below {slots}, with rows of at least {vocab} logits (got {stride})"
                ));
            }
            cpu::sampling::sample_rows(logits.host(), stride, src, slot, h, p, rows);
        }
        SlotState::Gpu(g, d, _) => {
            if logits.device() == Device::Cpu {
                return bad("CPU logits for a sampler on a GPU".into());
            }
            let src = src_row.map(|i| gpu_ids(g, i)).transpose()?;
            let slot = slot.map(|i| gpu_ids(g, i)).transpose()?;
            with_elem!(logits.dtype(), T => g.sample_rows::<T>(
                logits.cuda(),
                stride,
                rows,
                src.as_ref().map(GpuIds::get),
                slot.as_ref().map(GpuIds::get),
                d,
                p,
            ))?
        }
    }
    Ok(())
}

// ---- Diversity of sampled replies: the mean pairwise cosine distance of their embeddings. ----

/// What [`pairwise_diversity_backward`] needs from the forward: per set, the sum of the
/// normalised rows `[sets, d]`, and each row's reciprocal norm `[sets * n]` (both f32).
pub struct DiversitySaved {
    pub shape: SetShape,
    pub s: Tensor,
    pub rnorm: Tensor,
}

fn diversity_shape(op: &'static str, e: &Tensor, n: usize) -> Result<SetShape> {
    let (rows, d) = rows_cols(op, e)?;
    let shape = SetShape {
        sets: rows.checked_div(n).unwrap_or(0),
        n,
        d,
    };
    shape
        .check()
        .map_err(|detail| EngineError::Shape { op, detail })?;
    if rows != shape.rows() {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "{rows} embeddings do not split into sets of {n}; give the same number of replies for every prompt"
            ),
        });
    }
    Ok(shape)
}

/// D (mean over pairs of `1 - cos`) of each set of `n` consecutive rows of `e` `[sets * n,
/// d]`, read back to the host, and what the backward needs. `n < 2` is an error.
pub fn pairwise_diversity(e: &Tensor, n: usize) -> Result<(Vec<f32>, DiversitySaved)> {
    const OP: &str = "pairwise_diversity";
    let _prof = profile::scope(OP, e);
    let on = device_of(OP, &[e])?;
    let shape = diversity_shape(OP, e, n)?;
    let mut s = Tensor::uninit(e.pool(), &[shape.sets, shape.d], DType::F32)?;
    let mut rnorm = Tensor::uninit(e.pool(), &[shape.rows()], DType::F32)?;
    let value = match on {
        On::Meta => vec![0.0; shape.sets],
        On::Cpu => {
            let mut value = vec![0.0; shape.sets];
            cpu::diversity::diversity_forward(
                &mut value,
                s.host_mut(),
                rnorm.host_mut(),
                e.host(),
                shape,
            )
            .map_err(|detail| EngineError::Shape { op: OP, detail })?;
            value
        }
        On::Gpu(g) => {
            let mut value = g.alloc::<f32>(shape.sets)?;
            with_elem!(e.dtype(), T => g.diversity_forward::<T>(
                &mut value,
                s.cuda_mut(),
                rnorm.cuda_mut(),
                e.cuda(),
                shape,
            ))?;
            g.download(&value)?
        }
    };
    Ok((value, DiversitySaved { shape, s, rnorm }))
}

/// `dd[set] * dD/de` for every row of `e` (a new tensor shaped like `e`): the gradient of a
/// loss that depends on D with `dd = dLoss/dD` per set.
pub fn pairwise_diversity_backward(
    e: &Tensor,
    saved: &DiversitySaved,
    dd: &[f32],
) -> Result<Tensor> {
    const OP: &str = "pairwise_diversity_backward";
    let _prof = profile::scope(OP, e);
    let on = device_of(OP, &[e, &saved.s, &saved.rnorm])?;
    let shape = diversity_shape(OP, e, saved.shape.n)?;
    if shape != saved.shape || dd.len() != shape.sets {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "embeddings {shape:?} and {} upstream gradients do not match the forward's {:?}",
                dd.len(),
                saved.shape
            ),
        });
    }
    let mut de = Tensor::uninit(e.pool(), e.shape(), act_dtype(e))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::diversity::diversity_backward(
            de.host_mut(),
            dd,
            e.host(),
            saved.s.host(),
            saved.rnorm.host(),
            shape,
        )
        .map_err(|detail| EngineError::Shape { op: OP, detail })?,
        On::Gpu(g) => {
            let d_dd = g.upload(dd)?;
            with_elem!(e.dtype(), T => g.diversity_backward::<T>(
                de.cuda_mut(),
                &d_dd,
                e.cuda(),
                saved.s.cuda(),
                saved.rnorm.cuda(),
                shape,
            ))?
        }
    }
    Ok(de)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `_into` forms of the decode step write what the allocating ones return, and refuse
    /// an output buffer of another dtype than the activations'.
    #[test]
    fn into_forms_match_the_allocating_ones_and_check_their_output() {
        let cpu = MemoryPool::new(Device::Cpu);
        let (rows, c, f) = (3, 8, 6);
        let values = |n: usize, k: usize| (0..n).map(move |i| ((i * k % 17) as f32 - 8.0) / 9.0);
        let x = Tensor::from_vec(&cpu, &[rows, c], DType::F32, values(rows * c, 5).collect());
        let w = Tensor::from_vec(
            &cpu,
            &[2 * f, c],
            DType::F32,
            values(2 * f * c, 7).collect(),
        );
        let (x, w) = (x.unwrap(), w.unwrap());
        let want = linear_swiglu_normed(&x, &w, 1e-5)
            .unwrap()
            .to_vec()
            .unwrap();
        let mut h = Tensor::uninit(&cpu, &[rows, f], DType::F32).unwrap();
        linear_swiglu_normed_into(&mut h, &x, &w, 1e-5).unwrap();
        assert_eq!(h.to_vec().unwrap(), want);
        let mut wrong = Tensor::uninit(&cpu, &[rows, f], DType::BF16).unwrap();
        let err = linear_swiglu_normed_into(&mut wrong, &x, &w, 1e-5).unwrap_err();
        assert!(err.to_string().contains("an output of BF16"), "{err}");
        let mut short = Tensor::uninit(&cpu, &[rows, f - 1], DType::F32).unwrap();
        assert!(linear_swiglu_normed_into(&mut short, &x, &w, 1e-5).is_err());
    }

    fn q_on(pool: &Arc<MemoryPool>, rows: usize) -> Tensor {
        Tensor::uninit(pool, &[rows, 8], DType::BF16).unwrap()
    }

    #[test]
    fn prefill_runs_take_prompts_from_position_zero_on_a_gpu_only() {
        let gpu = MemoryPool::meta(Device::Cuda(0));
        let lens = [37u32, 20, 29];
        let slot: Vec<u32> = lens
            .iter()
            .zip([2u32, 0, 3])
            .flat_map(|(&n, s)| std::iter::repeat_n(s, n as usize))
            .collect();
        let pos: Vec<u32> = lens.iter().flat_map(|&n| 0..n).collect();
        let q = q_on(&gpu, slot.len());
        let p = PrefillRuns::of(&q, Ids::Host(&slot), Ids::Host(&pos), 64).unwrap();
        assert_eq!(p.runs, [2, 0, 37, 0, 37, 20, 3, 57, 29]);
        assert_eq!(p.tmax, 37);
        assert_eq!(&p.padded_row[35..39], [35, 36, 37, 38]);
        assert_eq!(p.padded_row[57], 74);
        // The CPU keeps its cache attention.
        let cpu = MemoryPool::new(Device::Cpu);
        let q_cpu = q_on(&cpu, slot.len());
        assert!(PrefillRuns::of(&q_cpu, Ids::Host(&slot), Ids::Host(&pos), 64).is_none());
        // A head size the fused attention has no kernel for keeps the cache kernel.
        assert!(PrefillRuns::of(&q, Ids::Host(&slot), Ids::Host(&pos), 96).is_none());
        // A decode step's rows, a prompt continuing a cache, short prompts, and runs mostly
        // padding keep the cache kernel.
        let none = |slot: &[u32], pos: &[u32]| {
            PrefillRuns::of(&q_on(&gpu, slot.len()), Ids::Host(slot), Ids::Host(pos), 64).is_none()
        };
        assert!(none(&[0, 1, 2], &[40, 41, 42]));
        assert!(none(&[1; 20], &(5..25).collect::<Vec<_>>()));
        assert!(none(&[1; 15], &(0..15).collect::<Vec<_>>()));
        let mut slot = vec![0u32; 40];
        let mut pos: Vec<u32> = (0..40).collect();
        for s in 1..=30 {
            slot.push(s);
            pos.push(0);
        }
        assert!(none(&slot, &pos));
    }

    #[test]
    fn a_meta_prefill_standing_for_a_gpu_books_the_packed_runs() {
        let c = CacheShape {
            slots: 2,
            kv_heads: 2,
            max_len: 64,
            head_dim: 16,
        };
        let booked = |device: Device, slot: &[u32], pos: &[u32]| {
            let pool = MemoryPool::meta(device);
            let k = Tensor::uninit(&pool, &[c.len()], DType::BF16).unwrap();
            let v = Tensor::uninit(&pool, &[c.len()], DType::BF16).unwrap();
            let q = Tensor::uninit(&pool, &[slot.len(), 64], DType::BF16).unwrap();
            pool.reset_peak();
            let before = pool.stats().current;
            let rows = CacheRows::host(&q, slot, pos, c.head_dim).unwrap();
            let out = cache_attention_at(&q, &k, &v, &rows, 4, 0, 64, c).unwrap();
            assert_eq!(out.shape(), [slot.len(), 64]);
            pool.stats().peak - before
        };
        let (slot, pos) = (vec![1u32; 40], (0..40).collect::<Vec<u32>>());
        // The output alone on the CPU; on a GPU the packed [1, 40, 192] input besides.
        let (cpu, gpu) = (
            booked(Device::Cpu, &slot, &pos),
            booked(Device::Cuda(0), &slot, &pos),
        );
        assert!(
            cpu < 40 * 192 * 2 && gpu >= (40 * 192 + 40 * 64) * 2,
            "{cpu} {gpu}"
        );
    }

    /// The decode step's gate/up, norm and SwiGLU on a GPU's few rows is one kernel with no
    /// gate/up rows in memory; a meta pass standing for a GPU books the same, and one standing
    /// for the CPU (or for a GPU's f32, or too many rows) books the gate/up rows too.
    #[test]
    fn a_meta_pass_books_the_fused_gate_up_of_a_gpus_few_rows() {
        let (c, f) = (64, 96);
        let booked = |device: Device, rows: usize, dtype: DType| {
            let pool = MemoryPool::meta(device);
            let x = Tensor::uninit(&pool, &[rows, c], dtype).unwrap();
            let w = Tensor::uninit(&pool, &[2 * f, c], dtype).unwrap();
            pool.reset_peak();
            let before = pool.stats().current;
            let h = linear_swiglu_normed(&x, &w, 1e-5).unwrap();
            assert_eq!(h.shape(), [rows, f]);
            pool.stats().peak - before
        };
        let h_bytes = |rows: usize, size: usize| rows * f * size;
        assert_eq!(booked(Device::Cuda(0), 8, DType::BF16), h_bytes(8, 2));
        assert!(booked(Device::Cpu, 8, DType::BF16) >= h_bytes(8, 2) * 3);
        assert!(booked(Device::Cuda(0), 8, DType::F32) >= h_bytes(8, 4) * 3);
        assert!(booked(Device::Cuda(0), 65, DType::BF16) >= h_bytes(65, 2) * 3);
    }
}

//! Softmax cross-entropy on the GPU, backward fused in place; reference:
//! [`crate::engine::cpu::cross_entropy`]. One block per row, so a 50k-wide vocabulary row is
//! reduced by 1024 threads and never copied in device memory. Where the row fits in the
//! block's shared memory the fused kernel keeps it there between its read and its write
//! (two passes over the logits instead of three). On Hopper each row is split over a cluster of
//! blocks instead (see cross_entropy.cu's cross_entropy_cluster), which stages rows of any
//! width and keeps more, smaller blocks on each SM.
//!
//! [`CudaBackend::cross_entropy_unfused`] runs the same mathematics as three kernels with the
//! log-probabilities in a buffer of their own: the baseline `train.fused_kernels=false`.

use super::{
    CudaBackend, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32, check_len,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg, sys::CUfunction_attribute};

pub(super) const PROGRAM: Program = Program {
    name: "cross_entropy",
    source: include_str!("cross_entropy.cu"),
    kernels: &[Kernel::NllLoss],
    elem_kernels: &[
        ElemKernel::CrossEntropyForward,
        ElemKernel::CrossEntropyFused,
        ElemKernel::CrossEntropyFusedStaged,
        ElemKernel::CrossEntropyFusedC2,
        ElemKernel::CrossEntropyFusedC4,
        ElemKernel::CrossEntropyFusedC8,
        ElemKernel::LogSoftmax,
        ElemKernel::LogSoftmaxNllBackward,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 1024;

fn rows(n: usize, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes,
    }
}

/// Static shared memory of the kernels besides the row cache (the reduction scratch), with
/// room to spare.
const STATIC_SHARED_BYTES: usize = 1024;

/// Threads of each block of the clustered kernel (cross_entropy_cluster).
const CLUSTER_BLOCK: u32 = 512;

/// The most shared memory a block of the clustered kernel stages (its share of a row): small
/// enough for three or four blocks an SM.
const CLUSTER_SEGMENT_BYTES: usize = 64 << 10;

/// The kernel that splits each row of `v` elements of `elem_bytes` over a cluster of blocks,
/// and its shared memory a block: on Hopper, for rows of whole 16-byte pieces, the smallest
/// cluster (2, 4 or 8 blocks) whose share of a row fits [`CLUSTER_SEGMENT_BYTES`].
fn cluster_plan(cc_major: u32, v: usize, elem_bytes: usize) -> Option<(ElemKernel, usize, usize)> {
    let per_piece = 16 / elem_bytes;
    if cc_major < 9 || v == 0 || !v.is_multiple_of(per_piece) {
        return None;
    }
    let pieces = v / per_piece;
    [
        (ElemKernel::CrossEntropyFusedC2, 2),
        (ElemKernel::CrossEntropyFusedC4, 4),
        (ElemKernel::CrossEntropyFusedC8, 8),
    ]
    .into_iter()
    .map(|(k, cs)| (k, cs, pieces.div_ceil(cs) * 16))
    .find(|&(_, _, bytes)| bytes <= CLUSTER_SEGMENT_BYTES)
}

/// `n` rows of `v` logits, of which the first `valid` columns are the vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct LogitRows {
    pub n: usize,
    pub v: usize,
    pub valid: usize,
}

impl CudaBackend {
    /// Per-row loss `-log softmax(logits)[target]` for `n` rows of width `v`, of which the
    /// first `valid` columns are the vocabulary. A target outside it gives a NaN loss.
    pub fn cross_entropy_forward<T: Elem>(
        &self,
        losses: &mut CudaSlice<f32>,
        logits: &CudaSlice<T>,
        targets: &CudaSlice<u32>,
        LogitRows { n, v, valid }: LogitRows,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward";
        let v32 = as_i32(OP, "row width", v)?;
        let valid32 = as_i32(OP, "vocabulary", valid.min(v))?;
        as_i32(OP, "rows", n)?;
        check_len(OP, "losses", losses, n)?;
        check_len(OP, "logits", logits, n * v)?;
        check_len(OP, "targets", targets, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::CrossEntropyForward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(losses)
            .arg(logits)
            .arg(targets)
            .arg(&v32)
            .arg(&valid32);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(rows(n, 0)) }?;
        Ok(())
    }

    /// Per-row losses, and `logits` overwritten with `d loss / d logits`, each row's loss
    /// weighted by `grad_scale`; the padding columns past `valid` get a zero gradient.
    pub fn cross_entropy_fused<T: Elem>(
        &self,
        losses: &mut CudaSlice<f32>,
        logits: &mut CudaSlice<T>,
        targets: &CudaSlice<u32>,
        LogitRows { n, v, valid }: LogitRows,
        grad_scale: f32,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_fused";
        let v32 = as_i32(OP, "row width", v)?;
        let valid32 = as_i32(OP, "vocabulary", valid.min(v))?;
        as_i32(OP, "rows", n)?;
        check_len(OP, "losses", losses, n)?;
        check_len(OP, "logits", logits, n * v)?;
        check_len(OP, "targets", targets, n)?;
        if n == 0 {
            return Ok(());
        }
        let row_bytes = v * std::mem::size_of::<T>();
        let aligned = super::raw_ptr(logits, &self.stream).is_multiple_of(16);
        let plan = cluster_plan(self.info.compute_capability.0, v, std::mem::size_of::<T>());
        let staged = row_bytes + STATIC_SHARED_BYTES <= self.info.shared_memory_per_block_optin;
        // The kernel, the shared memory a block stages its part of a row in (opted into above
        // 48 KiB), and the launch.
        let (kernel, shared, cfg) = match plan.filter(|_| aligned) {
            Some((kernel, cs, bytes)) => {
                let grid = u32::try_from(n * cs).map_err(|_| super::CudaError::Shape {
                    op: OP,
                    detail: format!("{n} rows exceed the grid"),
                })?;
                let cfg = LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (CLUSTER_BLOCK, 1, 1),
                    shared_mem_bytes: bytes as u32,
                };
                (kernel, bytes, cfg)
            }
            None if staged => (
                ElemKernel::CrossEntropyFusedStaged,
                row_bytes,
                rows(n, row_bytes as u32),
            ),
            None => (ElemKernel::CrossEntropyFused, 0, rows(n, 0)),
        };
        let f = self.elem_function::<T>(kernel)?;
        if shared > 0 {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )?;
        }
        let mut b = self.stream.launch_builder(f);
        b.arg(losses)
            .arg(logits)
            .arg(targets)
            .arg(&v32)
            .arg(&valid32)
            .arg(&grad_scale);
        // SAFETY: lengths checked above. One block per row, the staged kernel with the
        // `v * size_of::<T>()` bytes it caches the row in; or `cs` blocks a row (the clustered
        // kernel's compile-time cluster), each with the shared memory its share needs, rows
        // being whole 16-byte pieces (cluster_plan) on a 16-byte boundary (checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The unfused cross-entropy: `logp` (f32, `n x v`) gets the log-probabilities (minus
    /// infinity in the padding), `losses` the per-row `-logp[target]`, and `dlogits` the
    /// gradient `(exp(logp) - onehot) * grad_scale` (zero in the padding), one kernel each.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_unfused<T: Elem>(
        &self,
        losses: &mut CudaSlice<f32>,
        logp: &mut CudaSlice<f32>,
        dlogits: &mut CudaSlice<T>,
        logits: &CudaSlice<T>,
        targets: &CudaSlice<u32>,
        LogitRows { n, v, valid }: LogitRows,
        grad_scale: f32,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_unfused";
        let v32 = as_i32(OP, "row width", v)?;
        let valid32 = as_i32(OP, "vocabulary", valid.min(v))?;
        let n32 = as_i32(OP, "rows", n)?;
        check_len(OP, "losses", losses, n)?;
        check_len(OP, "logp", logp, n * v)?;
        check_len(OP, "dlogits", dlogits, n * v)?;
        check_len(OP, "logits", logits, n * v)?;
        check_len(OP, "targets", targets, n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::LogSoftmax)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *logp).arg(logits).arg(&v32).arg(&valid32);
        // SAFETY: lengths checked above; one block per row.
        unsafe { b.launch(rows(n, 0)) }?;

        const NLL_BLOCK: u32 = 256;
        let f = self.function(Kernel::NllLoss)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(losses)
            .arg(&*logp)
            .arg(targets)
            .arg(&n32)
            .arg(&v32)
            .arg(&valid32);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(NLL_BLOCK), 1, 1),
            block_dim: (NLL_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; one thread per row, the kernel stops at `n`.
        unsafe { b.launch(cfg) }?;

        let col_blocks = u32::try_from(v.div_ceil(NLL_BLOCK as usize))
            .ok()
            .filter(|&c| c <= 65_535)
            .ok_or_else(|| super::CudaError::Shape {
                op: OP,
                detail: format!("a row of {v} logits exceeds the grid's 65535 column blocks"),
            })?;
        let f = self.elem_function::<T>(ElemKernel::LogSoftmaxNllBackward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(dlogits)
            .arg(&*logp)
            .arg(targets)
            .arg(&v32)
            .arg(&valid32)
            .arg(&grad_scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, col_blocks, 1),
            block_dim: (NLL_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; grid x is the row (n fits i32, checked), grid y
        // covers the row's columns in blocks of NLL_BLOCK, the kernel stops at `v`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

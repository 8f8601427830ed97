//! Causal attention on the GPU without the T x T matrix; reference:
//! [`crate::engine::cpu::attention`] (same `qkv[B, T, 3C]` layout and results).
//!
//! The forward saves one log-sum-exp per row instead of the probabilities; the backward
//! recomputes them. Two kinds of kernel, both deterministic (no atomics):
//! - bf16 with head size 64 on sm_80 and newer (GPT-2's shape): tensor cores (`mma.sync`),
//!   a warp per 16 rows, 64-row tiles double-buffered in shared memory;
//! - everything else (f32, head sizes 16 and 32, older GPUs): one query (or key) row per
//!   thread on CUDA cores, f32 arithmetic.
//!
//! Both take a sliding window (`window`, 0 for none) and skip the key tiles it leaves out.

use super::{CudaBackend, CudaError, Elem, Program, Result, as_i32, check_len, raw_ptr};
use crate::engine::AttnShape;
use crate::engine::DType;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// The CUDA-core kernels for f32 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_F32: Program = Program {
    name: "attention_f32",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, float, f32)\nATTENTION_ENTRY_POINTS(32, float, f32)\nATTENTION_ENTRY_POINTS(64, float, f32)\n"
    ),
    kernels: &[
        "attention_forward_f32_hs16",
        "attention_forward_f32_hs32",
        "attention_forward_f32_hs64",
        "attention_backward_dq_f32_hs16",
        "attention_backward_dq_f32_hs32",
        "attention_backward_dq_f32_hs64",
        "attention_backward_dkv_f32_hs16",
        "attention_backward_dkv_f32_hs32",
        "attention_backward_dkv_f32_hs64",
    ],
};

/// The CUDA-core kernels for bf16 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_BF16: Program = Program {
    name: "attention_bf16",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, bf16, bf16)\nATTENTION_ENTRY_POINTS(32, bf16, bf16)\nATTENTION_ENTRY_POINTS(64, bf16, bf16)\n"
    ),
    kernels: &[
        "attention_forward_bf16_hs16",
        "attention_forward_bf16_hs32",
        "attention_forward_bf16_hs64",
        "attention_backward_dq_bf16_hs16",
        "attention_backward_dq_bf16_hs32",
        "attention_backward_dq_bf16_hs64",
        "attention_backward_dkv_bf16_hs16",
        "attention_backward_dkv_bf16_hs32",
        "attention_backward_dkv_bf16_hs64",
    ],
};

/// The CUDA-core kernels for f16 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_F16: Program = Program {
    name: "attention_f16",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, f16, f16)\nATTENTION_ENTRY_POINTS(32, f16, f16)\nATTENTION_ENTRY_POINTS(64, f16, f16)\n"
    ),
    kernels: &[
        "attention_forward_f16_hs16",
        "attention_forward_f16_hs32",
        "attention_forward_f16_hs64",
        "attention_backward_dq_f16_hs16",
        "attention_backward_dq_f16_hs32",
        "attention_backward_dq_f16_hs64",
        "attention_backward_dkv_f16_hs16",
        "attention_backward_dkv_f16_hs32",
        "attention_backward_dkv_f16_hs64",
    ],
};

/// The tensor-core kernels (bf16, head size 64).
pub(super) const PROGRAM_TC: Program = Program {
    name: "attention_tc",
    source: include_str!("attention_tc.cu"),
    kernels: &[
        "attention_forward_bf16_hs64_tc",
        "attention_backward_dq_bf16_hs64_tc",
        "attention_backward_dkv_bf16_hs64_tc",
    ],
};

/// Query rows per block (forward, dQ) and key rows per block (dK/dV), as in attention.cu.
const BR: u32 = 64;
const KR: u32 = 32;
/// Rows per block of the tensor-core kernels (TC_ROWS), and their threads: 4 warps of 16 rows.
const TC_ROWS: u32 = 64;
const TC_THREADS: u32 = 128;

/// Checks the shape and returns `(T, C, NH, HS)` as the kernels' ints.
fn dims(s: AttnShape) -> Result<(i32, i32, i32, usize)> {
    const OP: &str = "attention";
    let hs = s.channels / s.heads.max(1);
    if ![16, 32, 64].contains(&hs) || hs * s.heads != s.channels {
        return Err(CudaError::Shape {
            op: OP,
            detail: format!(
                "head size {} (d_model {} / {} heads) has no GPU kernel; use 16, 32 or 64",
                s.channels as f64 / s.heads.max(1) as f64,
                s.channels,
                s.heads
            ),
        });
    }
    Ok((
        as_i32(OP, "seq", s.seq)?,
        as_i32(OP, "channels", s.channels)?,
        as_i32(OP, "heads", s.heads)?,
        hs,
    ))
}

/// The window as the kernels' `int W`.
fn window_arg(window: usize) -> Result<i32> {
    as_i32("attention", "window", window)
}

/// One block per `per_block` rows of each (batch, head), `threads` threads each.
fn rows_grid(rows: usize, per_block: u32, threads: u32, s: AttnShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            rows.div_ceil(per_block as usize) as u32,
            (s.batch * s.heads) as u32,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel names and launch shapes of one attention call: the tensor-core kernels where they
/// apply, else the row-per-thread ones.
struct Plan {
    suffix: String,
    forward_dq: (u32, u32),
    dkv: (u32, u32),
}

impl CudaBackend {
    /// The tensor-core kernels take bf16, head size 64, sm_80+ (bf16 `mma.sync`), and buffers
    /// on 16-byte boundaries (their tiles move 16 bytes per access; rows stay aligned because
    /// C is a multiple of 64).
    fn attention_plan<T: Elem>(&self, hs: usize, ptrs: &[u64]) -> Plan {
        let tensor_cores = T::DTYPE == DType::BF16
            && hs == 64
            && self.info.arch() >= 80
            && ptrs.iter().all(|p| p % 16 == 0);
        if tensor_cores {
            Plan {
                suffix: format!("{}_hs{hs}_tc", T::SUFFIX),
                forward_dq: (TC_ROWS, TC_THREADS),
                dkv: (TC_ROWS, TC_THREADS),
            }
        } else {
            Plan {
                suffix: format!("{}_hs{hs}", T::SUFFIX),
                forward_dq: (BR, BR),
                dkv: (KR, KR),
            }
        }
    }

    /// Writes `out[B, T, C]` and `lse[B, NH, T]` from `qkv[B, T, 3C]`.
    pub fn attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
        qkv: &CudaSlice<T>,
        s: AttnShape,
    ) -> Result<()> {
        self.windowed_attention_forward(out, lse, qkv, s, 0)
    }

    /// [`Self::attention_forward`] within a sliding `window` (0: none).
    pub fn windowed_attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
        qkv: &CudaSlice<T>,
        s: AttnShape,
        window: usize,
    ) -> Result<()> {
        let (t, c, nh, hs) = dims(s)?;
        let w = window_arg(window)?;
        check_len(
            "attention_forward",
            "qkv",
            qkv,
            s.batch * s.seq * 3 * s.channels,
        )?;
        check_len(
            "attention_forward",
            "out",
            out,
            s.batch * s.seq * s.channels,
        )?;
        check_len("attention_forward", "lse", lse, s.batch * s.heads * s.seq)?;
        let plan = self.attention_plan::<T>(
            hs,
            &[raw_ptr(qkv, &self.stream), raw_ptr(out, &self.stream)],
        );
        let f = self.function(&format!("attention_forward_{}", plan.suffix))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv)
            .arg(out)
            .arg(lse)
            .arg(&t)
            .arg(&c)
            .arg(&nh)
            .arg(&w);
        let (rows, threads) = plan.forward_dq;
        // SAFETY: buffer sizes checked above; the grid covers B*NH x ceil(T/rows) row tiles.
        unsafe { b.launch(rows_grid(s.seq, rows, threads, s)) }?;
        Ok(())
    }

    /// Overwrites `dqkv[B, T, 3C]` from `dout` and the forward's `qkv` and `lse`.
    pub fn attention_backward<T: Elem>(
        &self,
        dqkv: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        s: AttnShape,
    ) -> Result<()> {
        self.windowed_attention_backward(dqkv, dout, qkv, lse, s, 0)
    }

    /// [`Self::attention_backward`] of [`Self::windowed_attention_forward`] with the same
    /// `window`.
    pub fn windowed_attention_backward<T: Elem>(
        &self,
        dqkv: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        s: AttnShape,
        window: usize,
    ) -> Result<()> {
        let (t, c, nh, hs) = dims(s)?;
        let w = window_arg(window)?;
        let rows = s.batch * s.heads * s.seq;
        check_len(
            "attention_backward",
            "dqkv",
            dqkv,
            s.batch * s.seq * 3 * s.channels,
        )?;
        check_len(
            "attention_backward",
            "dout",
            dout,
            s.batch * s.seq * s.channels,
        )?;
        check_len("attention_backward", "lse", lse, rows)?;
        let plan = self.attention_plan::<T>(
            hs,
            &[
                raw_ptr(dqkv, &self.stream),
                raw_ptr(dout, &self.stream),
                raw_ptr(qkv, &self.stream),
            ],
        );
        // Written by the dQ kernel, read by the dK/dV kernel (same stream, so in order).
        let mut d = self.alloc::<f32>(rows)?;
        {
            let f = self.function(&format!("attention_backward_dq_{}", plan.suffix))?;
            let mut b = self.stream.launch_builder(f);
            b.arg(qkv)
                .arg(dout)
                .arg(lse)
                .arg(&mut d)
                .arg(&mut *dqkv)
                .arg(&t)
                .arg(&c)
                .arg(&nh)
                .arg(&w);
            let (rows, threads) = plan.forward_dq;
            // SAFETY: as above; this kernel writes the Q third of each dqkv row and `d`.
            unsafe { b.launch(rows_grid(s.seq, rows, threads, s)) }?;
        }
        let f = self.function(&format!("attention_backward_dkv_{}", plan.suffix))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv)
            .arg(dout)
            .arg(lse)
            .arg(&d)
            .arg(dqkv)
            .arg(&t)
            .arg(&c)
            .arg(&nh)
            .arg(&w);
        let (rows, threads) = plan.dkv;
        // SAFETY: as above; this kernel writes only the K and V thirds of each dqkv row.
        unsafe { b.launch(rows_grid(s.seq, rows, threads, s)) }?;
        Ok(())
    }
}

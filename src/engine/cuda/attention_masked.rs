//! Bidirectional attention with a key padding mask on the GPU, forward only; reference:
//! [`crate::engine::cpu::attention_masked`] (same `qkv[B, T, 3C]` layout and results).
//! CUDA cores, one query row per thread, f32 arithmetic, head sizes 16, 32 and 64.

use super::{CudaBackend, CudaError, Elem, Program, Result, as_i32, check_len};
use crate::engine::cpu::attention::AttnShape;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "attention_masked",
    source: include_str!("attention_masked.cu"),
    kernels: &[
        "masked_attention_forward_f32_hs16",
        "masked_attention_forward_f32_hs32",
        "masked_attention_forward_f32_hs64",
        "masked_attention_forward_bf16_hs16",
        "masked_attention_forward_bf16_hs32",
        "masked_attention_forward_bf16_hs64",
        "masked_attention_forward_f16_hs16",
        "masked_attention_forward_f16_hs32",
        "masked_attention_forward_f16_hs64",
    ],
};

/// Query rows per block (MBR in the kernel), one thread each.
const ROWS: u32 = 64;

impl CudaBackend {
    /// Writes `out[B, T, C]` from `qkv[B, T, 3C]`, each sequence `b` attending to its first
    /// `lens[b]` keys (`lens` holds `B` values in `1 ..= T`).
    pub fn masked_attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        lens: &CudaSlice<i32>,
        s: AttnShape,
    ) -> Result<()> {
        const OP: &str = "masked_attention_forward";
        let hs = s.channels / s.heads.max(1);
        if ![16, 32, 64].contains(&hs) || hs * s.heads != s.channels {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!(
                    "head size {} (width {} / {} heads) has no GPU kernel; use 16, 32 or 64",
                    s.channels as f64 / s.heads.max(1) as f64,
                    s.channels,
                    s.heads
                ),
            });
        }
        check_len(OP, "qkv", qkv, s.batch * s.seq * 3 * s.channels)?;
        check_len(OP, "out", out, s.batch * s.seq * s.channels)?;
        check_len(OP, "lens", lens, s.batch)?;
        if s.batch == 0 || s.seq == 0 {
            return Ok(());
        }
        let (t, c, nh) = (
            as_i32(OP, "seq", s.seq)?,
            as_i32(OP, "channels", s.channels)?,
            as_i32(OP, "heads", s.heads)?,
        );
        let f = self.function(&format!("masked_attention_forward_{}_hs{hs}", T::SUFFIX))?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv).arg(lens).arg(out).arg(&t).arg(&c).arg(&nh);
        let cfg = LaunchConfig {
            grid_dim: (
                s.seq.div_ceil(ROWS as usize) as u32,
                (s.batch * s.heads) as u32,
                1,
            ),
            block_dim: (ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: buffer sizes checked above; the grid covers B*NH x ceil(T/64) row tiles and
        // the kernel reads keys only below lens[b] <= T.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

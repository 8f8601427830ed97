//! Drawing one token per row of logits on the GPU; reference:
//! [`crate::engine::cpu::sampling`]. The logits stay on the device: only the drawn tokens and
//! their log-probabilities (a few bytes per sequence) come back to the host.
//!
//! [`DeviceSlots`] is the per-slot state of [`cpu::sampling::HostSlots`] on the device. Each
//! draw writes the slot's next input token and advances its position there, so the next
//! decode step reads both from the device and a decode step replayed from a CUDA graph needs
//! nothing from the host.

use super::{CudaBackend, CudaError, Elem, Program, Result, as_i32, check_len, raw_ptr};
use crate::engine::cpu::sampling::{self as cpu, HostSlots, SampleParams};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "sampling",
    source: include_str!("sampling.cu"),
    kernels: &["sample_rows_f32", "sample_rows_bf16", "sample_rows_f16"],
};

/// Threads of a block (`SAMPLE_THREADS` in the kernel); one block per row.
const THREADS: u32 = 1024;

// SAFETY: four f32 and a u32, `repr(C)`, the layout of the kernel's `SampleParams`.
unsafe impl DeviceRepr for SampleParams {}

/// The kernel's `SampleDims`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SampleDims {
    stride: i64,
    vocab: i32,
    words: i32,
    max_len: u32,
    logit_rows: u32,
    slots: u32,
}

// SAFETY: an i64 then five 32-bit fields, `repr(C)`, the layout of the CUDA struct.
unsafe impl DeviceRepr for SampleDims {}

/// [`HostSlots`] on the device.
pub struct DeviceSlots {
    pub tokens: CudaSlice<u32>,
    pub pos: CudaSlice<u32>,
    pub logprobs: CudaSlice<f32>,
    pub seeds: CudaSlice<u64>,
    pub counters: CudaSlice<u64>,
    pub presence: CudaSlice<u32>,
    pub vocab: usize,
    pub max_len: usize,
}

impl DeviceSlots {
    pub fn slots(&self) -> usize {
        self.pos.len()
    }
}

impl CudaBackend {
    /// Copies the sampler's per-slot state to the device.
    pub fn upload_slots(&self, h: &HostSlots) -> Result<DeviceSlots> {
        Ok(DeviceSlots {
            tokens: self.upload(&h.tokens)?,
            pos: self.upload(&h.pos)?,
            logprobs: self.upload(&h.logprobs)?,
            seeds: self.upload(&h.seeds)?,
            counters: self.upload(&h.counters)?,
            presence: self.upload(&h.presence)?,
            vocab: h.vocab,
            max_len: h.max_len,
        })
    }

    /// Draws a token for each of `rows` rows: row `i` reads logits row `src_row[i]` (or `i`)
    /// of `logits` (`[logit_rows, stride]`, the first `vocab` columns used) and the state of
    /// slot `slot[i]` (or `i`). Rows must name distinct slots.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows<T: Elem>(
        &self,
        logits: &CudaSlice<T>,
        stride: usize,
        rows: usize,
        src_row: Option<&CudaSlice<u32>>,
        slot: Option<&CudaSlice<u32>>,
        st: &mut DeviceSlots,
        p: &SampleParams,
    ) -> Result<()> {
        const OP: &str = "sample_rows";
        let slots = st.slots();
        let words = cpu::mask_words(st.vocab);
        if st.vocab == 0 || stride < st.vocab {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!("rows of {stride} logits for a vocabulary of {}", st.vocab),
            });
        }
        if src_row.is_none() {
            check_len(OP, "logits", logits, rows * stride)?;
        }
        if slot.is_none() && rows > slots {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!("{rows} rows for {slots} slots"),
            });
        }
        for (what, ids) in [("src_row", src_row), ("slot", slot)] {
            if let Some(ids) = ids {
                check_len(OP, what, ids, rows)?;
            }
        }
        check_len(OP, "presence", &st.presence, slots * words)?;
        for (what, n) in [("tokens", st.tokens.len()), ("logprobs", st.logprobs.len())] {
            if n < slots {
                return Err(CudaError::Shape {
                    op: OP,
                    detail: format!("{what} has {n} entries for {slots} slots"),
                });
            }
        }
        check_len(OP, "seeds", &st.seeds, slots)?;
        check_len(OP, "counters", &st.counters, slots)?;
        let dims = SampleDims {
            stride: stride as i64,
            vocab: as_i32(OP, "vocab", st.vocab)?,
            words: as_i32(OP, "mask words", words)?,
            max_len: as_i32(OP, "max_len", st.max_len)? as u32,
            logit_rows: as_i32(OP, "logit rows", logits.len() / stride)? as u32,
            slots: as_i32(OP, "slots", slots)? as u32,
        };
        if rows == 0 {
            return Ok(());
        }
        let grid = as_i32(OP, "rows", rows)? as u32;
        let f = self.function(&format!("sample_rows_{}", T::SUFFIX))?;
        let src_ptr = src_row.map_or(0u64, |s| raw_ptr(s, &self.stream));
        let slot_ptr = slot.map_or(0u64, |s| raw_ptr(s, &self.stream));
        let mut b = self.stream.launch_builder(f);
        b.arg(logits)
            .arg(&src_ptr)
            .arg(&slot_ptr)
            .arg(&mut st.tokens)
            .arg(&mut st.pos)
            .arg(&mut st.logprobs)
            .arg(&st.seeds)
            .arg(&mut st.counters)
            .arg(&mut st.presence)
            .arg(&dims)
            .arg(p);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; the kernel skips rows whose logits row or slot lies
        // outside `dims.logit_rows` / `dims.slots`, and the index arrays hold `rows` entries
        // (or are null, meaning the row's own index).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

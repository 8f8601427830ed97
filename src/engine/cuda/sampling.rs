//! Drawing one token per row of logits on the GPU; reference:
//! [`crate::engine::cpu::sampling`]. The logits stay on the device: only the drawn tokens and
//! their log-probabilities (a few bytes per sequence) come back to the host.
//!
//! [`DeviceSlots`] is the per-slot state of [`cpu::sampling::HostSlots`] on the device, with
//! the scratch the sampler's stages pass between them (allocated once with the slots, so a
//! decode step captured into a CUDA graph allocates nothing). Each draw writes the slot's next
//! input token and advances its position there, so the next decode step reads both from the
//! device and a decode step replayed from a CUDA graph needs nothing from the host.
//! `sampling.cu` explains how a row is split over many blocks.

use super::pinned::PinnedBuffer;
use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32,
    check_len, raw_ptr,
};
use crate::engine::cpu::sampling::{self as cpu, HostSlots, SampleParams};
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg, result};

pub(super) const PROGRAM: Program = Program {
    name: "sampling",
    source: include_str!("sampling.cu"),
    kernels: &[Kernel::GatherSlotRows],
    elem_kernels: &[
        ElemKernel::SampleMax,
        ElemKernel::SampleHistogram,
        ElemKernel::SampleSelect,
        ElemKernel::SampleDraw,
    ],
    dtypes: ELEM_DTYPES,
};

/// Threads of a block (`SAMPLE_THREADS` in the kernel).
const THREADS: u32 = 512;
/// Value bins of the threshold histograms (`SAMPLE_VALUE_BINS`).
const BINS: usize = 256 - 32 + 256;
/// u64 words of the kernel's `RowState`.
const ROW_WORDS: usize = 9;
/// Blocks a row at most for which the select stage draws the token itself
/// (`SAMPLE_MERGE_CHUNKS`): a candidate's chunk fits a byte.
const MERGE_CHUNKS: usize = 255;
/// Rows a call at least for which the select stage draws the token itself. Its last block a
/// row then walks the row's candidates alone, where the draw stage spread that pass over the
/// row's blocks: with many rows a call the rows' last blocks run side by side and the saved
/// launch pays (H200, SmolLM2-135M and Llama-3.2-1B: +0.4-0.8% decode at batches 32 and 64),
/// with few they are the call's tail (-0.3% to -1.7% at batches 1 and 8).
const MERGE_MIN_ROWS: usize = 32;
/// The fewest ids a block reads: below this a row's blocks spend more on combining their
/// partials than on reading.
const MIN_CHUNK: usize = 2048;
/// Blocks a call aims for per SM (four blocks of 512 threads fill one).
const BLOCKS_PER_SM: usize = 4;

/// Blocks per row of vocabulary `vocab` at most.
fn max_chunks(vocab: usize) -> usize {
    vocab.div_ceil(MIN_CHUNK).max(1)
}

/// Blocks per row for a call of `rows` rows on `sms` SMs: enough blocks over all rows to fill
/// the GPU a few times, each reading at least [`MIN_CHUNK`] ids. Any count draws the same
/// token (every sum is of integers); this only sets the speed.
pub fn chunks_per_row(rows: usize, vocab: usize, sms: usize) -> usize {
    (BLOCKS_PER_SM * sms.max(1))
        .div_ceil(rows.max(1))
        .clamp(1, max_chunks(vocab))
}

/// Ids a block of a row split into `chunks` reads: a multiple of 8, so that every run of 8
/// ids a thread reads starts 16-byte aligned (`load_batch` in `sampling.cu`). `chunks` blocks
/// still cover the vocabulary, and none is empty: chunks_per_row keeps chunks at least
/// MIN_CHUNK long.
fn chunk_len(vocab: usize, chunks: usize) -> usize {
    vocab.div_ceil(chunks.max(1)).next_multiple_of(8)
}

/// Bytes of the sampler's scratch for `slots` slots over `vocab` tokens: per slot its stage
/// state, a partial result per block, the two histograms and room for every token as a
/// candidate of the threshold bins (its key, and its chunk).
pub fn scratch_bytes(slots: usize, vocab: usize) -> usize {
    slots * (8 * (ROW_WORDS + 2 * max_chunks(vocab) + 2 * BINS) + 5 * vocab)
}

/// Bytes [`CudaBackend::upload_slots`] allocates for `slots` slots over `vocab` tokens: the
/// per-slot state (tokens, positions, log-probabilities, seeds, counters, presence masks)
/// and the scratch.
pub fn device_slots_bytes(slots: usize, vocab: usize) -> usize {
    slots * (4 + 4 + 4 + 8 + 8 + 4 * cpu::mask_words(vocab)) + scratch_bytes(slots, vocab)
}

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
    chunks: i32,
    chunk_len: i32,
    max_chunks: i32,
    select_draws: i32,
}

// SAFETY: an i64 then nine 32-bit fields, `repr(C)`, the layout of the CUDA struct.
unsafe impl DeviceRepr for SampleDims {}

/// The kernel's `SampleScratch`: device addresses of the scratch buffers.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ScratchPtrs {
    rows: u64,
    part: u64,
    hist: u64,
    cand: u64,
    cand_chunk: u64,
}

// SAFETY: five device pointers, `repr(C)`, the layout of the CUDA struct.
unsafe impl DeviceRepr for ScratchPtrs {}

/// What the sampler's stages pass between them, for up to `slots` rows a call.
struct Scratch {
    /// `[slots, ROW_WORDS]`, zeroed: the arrival counters start at zero.
    rows: CudaSlice<u64>,
    /// `[slots, max_chunks, 2]`.
    part: CudaSlice<u64>,
    /// `[slots, 2, BINS]`.
    hist: CudaSlice<u64>,
    /// `[slots, vocab]`.
    cand: CudaSlice<u32>,
    /// `[slots, vocab]`: each candidate's chunk.
    cand_chunk: CudaSlice<u8>,
}

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
    scratch: Scratch,
    drawn: DrawnCopies,
}

impl DeviceSlots {
    pub fn slots(&self) -> usize {
        self.pos.len()
    }
}

/// Page-locked copies of every slot's last draw (its tokens, then its log-probabilities as
/// bits), two of them: the host reads one decode step's draws while the next step runs.
struct DrawnCopies {
    bufs: [PinnedBuffer; 2],
    copied: [CudaEvent; 2],
    /// Which copies are queued and not yet read.
    queued: [bool; 2],
    next: usize,
}

impl Drop for DrawnCopies {
    fn drop(&mut self) {
        // The driver may still be writing into a queued copy's buffer: wait before freeing it.
        for (e, q) in self.copied.iter().zip(self.queued) {
            if q {
                let _ = e.synchronize();
            }
        }
    }
}

/// A queued copy of every slot's last draw ([`CudaBackend::queue_drawn`]).
#[derive(Debug)]
#[must_use = "a queued copy holds its buffer until it is read"]
pub struct DrawnTicket(usize);

impl CudaBackend {
    /// Copies the sampler's per-slot state to the device and allocates its scratch.
    pub fn upload_slots(&self, h: &HostSlots) -> Result<DeviceSlots> {
        let slots = h.slots();
        let chunks = max_chunks(h.vocab);
        Ok(DeviceSlots {
            tokens: self.upload(&h.tokens)?,
            pos: self.upload(&h.pos)?,
            logprobs: self.upload(&h.logprobs)?,
            seeds: self.upload(&h.seeds)?,
            counters: self.upload(&h.counters)?,
            presence: self.upload(&h.presence)?,
            vocab: h.vocab,
            max_len: h.max_len,
            scratch: Scratch {
                rows: self.upload(&vec![0u64; slots * ROW_WORDS])?,
                part: self.alloc(slots * chunks * 2)?,
                hist: self.alloc(slots * 2 * BINS)?,
                cand: self.alloc(slots * h.vocab)?,
                cand_chunk: self.alloc(slots * h.vocab)?,
            },
            drawn: DrawnCopies {
                bufs: [
                    PinnedBuffer::zeroed(&self.ctx, 8 * slots)?,
                    PinnedBuffer::zeroed(&self.ctx, 8 * slots)?,
                ],
                copied: [self.ctx.new_event(None)?, self.ctx.new_event(None)?],
                queued: [false; 2],
                next: 0,
            },
        })
    }

    /// Queues a copy of every slot's last token and log-probability into page-locked memory,
    /// after the work queued so far, and returns at once; [`CudaBackend::read_drawn`] waits
    /// for it. So the host can read one decode step's draws while the next step runs. Two
    /// copies may be unread at a time: a third is refused.
    pub fn queue_drawn(&self, st: &mut DeviceSlots) -> Result<DrawnTicket> {
        let n = st.slots();
        let i = st.drawn.next;
        if st.drawn.queued[i] {
            return Err(CudaError::Shape {
                op: "queue_drawn",
                detail: "two copies of the draws are unread already; read one first".into(),
            });
        }
        self.ctx.bind_to_thread()?;
        let (tokens, logprobs) = st.drawn.bufs[i].words_mut().split_at_mut(n);
        let stream = self.stream.cu_stream();
        // SAFETY: each destination holds exactly its source's `n` 32-bit elements (f32 bits
        // land in `u32` words unchanged). The buffer is neither read nor freed before the
        // event recorded after both copies has completed (`read_drawn`, and `DrawnCopies`'
        // drop); the stream orders the copies after the kernels that write the sources.
        unsafe {
            result::memcpy_dtoh_async(tokens, raw_ptr(&st.tokens, &self.stream), stream)?;
            result::memcpy_dtoh_async(
                &mut logprobs[..n],
                raw_ptr(&st.logprobs, &self.stream),
                stream,
            )?;
        }
        st.drawn.copied[i].record(&self.stream)?;
        st.drawn.queued[i] = true;
        st.drawn.next = 1 - i;
        Ok(DrawnTicket(i))
    }

    /// Waits for a queued copy of the draws and returns every slot's token and
    /// log-probability.
    pub fn read_drawn(
        &self,
        st: &mut DeviceSlots,
        ticket: DrawnTicket,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let (n, i) = (st.slots(), ticket.0);
        st.drawn.copied[i].synchronize()?;
        st.drawn.queued[i] = false;
        let words = st.drawn.bufs[i].words();
        let logprobs = words[n..2 * n].iter().map(|&w| f32::from_bits(w)).collect();
        Ok((words[..n].to_vec(), logprobs))
    }

    /// Overwrites slot `slot` of `st` with the one slot of `one` (a sequence entering a freed
    /// slot).
    pub fn reset_slot(&self, st: &mut DeviceSlots, slot: usize, one: &HostSlots) -> Result<()> {
        let words = cpu::mask_words(st.vocab);
        if slot >= st.slots() || one.slots() != 1 || one.presence.len() != words {
            return Err(CudaError::Shape {
                op: "reset_slot",
                detail: format!("slot {slot} of {} from {} slots", st.slots(), one.slots()),
            });
        }
        let s = &self.stream;
        s.memcpy_htod(&one.tokens, &mut st.tokens.slice_mut(slot..slot + 1))?;
        s.memcpy_htod(&one.pos, &mut st.pos.slice_mut(slot..slot + 1))?;
        s.memcpy_htod(&one.logprobs, &mut st.logprobs.slice_mut(slot..slot + 1))?;
        s.memcpy_htod(&one.seeds, &mut st.seeds.slice_mut(slot..slot + 1))?;
        s.memcpy_htod(&one.counters, &mut st.counters.slice_mut(slot..slot + 1))?;
        let mask = slot * words..(slot + 1) * words;
        s.memcpy_htod(&one.presence, &mut st.presence.slice_mut(mask))?;
        Ok(())
    }

    /// Draws a token for each of `rows` rows: row `i` reads logits row `src_row[i]` (or `i`)
    /// of `logits` (`[logit_rows, stride]`, the first `vocab` columns used) and the state of
    /// slot `slot[i]` (or `i`). Rows must name distinct slots. Greedy settings take one
    /// launch, sampling two, and top-k or top-p three (four for rows of more than 255 blocks;
    /// see `sampling.cu`).
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
        // The scratch holds one row per slot, and rows name distinct slots.
        if rows > slots {
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
        let max_chunks = max_chunks(st.vocab);
        check_len(OP, "row scratch", &st.scratch.rows, slots * ROW_WORDS)?;
        check_len(OP, "partials", &st.scratch.part, slots * max_chunks * 2)?;
        check_len(OP, "histograms", &st.scratch.hist, slots * 2 * BINS)?;
        check_len(OP, "candidates", &st.scratch.cand, slots * st.vocab)?;
        check_len(
            OP,
            "candidate chunks",
            &st.scratch.cand_chunk,
            slots * st.vocab,
        )?;
        let chunks = chunks_per_row(rows, st.vocab, self.info().sm_count as usize);
        // The select stage draws the token itself for calls of MERGE_MIN_ROWS rows or more,
        // each of up to MERGE_CHUNKS blocks.
        let merged = chunks <= MERGE_CHUNKS && rows >= MERGE_MIN_ROWS;
        let dims = SampleDims {
            stride: stride as i64,
            vocab: as_i32(OP, "vocab", st.vocab)?,
            words: as_i32(OP, "mask words", words)?,
            max_len: as_i32(OP, "max_len", st.max_len)? as u32,
            logit_rows: as_i32(OP, "logit rows", logits.len() / stride)? as u32,
            slots: as_i32(OP, "slots", slots)? as u32,
            chunks: chunks as i32,
            chunk_len: as_i32(OP, "chunk", chunk_len(st.vocab, chunks))?,
            max_chunks: max_chunks as i32,
            select_draws: merged as i32,
        };
        if rows == 0 {
            return Ok(());
        }
        if rows > 65_535 {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!("{rows} rows in one call; the grid holds at most 65535"),
            });
        }
        let ptrs = ScratchPtrs {
            rows: raw_ptr(&st.scratch.rows, &self.stream),
            part: raw_ptr(&st.scratch.part, &self.stream),
            hist: raw_ptr(&st.scratch.hist, &self.stream),
            cand: raw_ptr(&st.scratch.cand, &self.stream),
            cand_chunk: raw_ptr(&st.scratch.cand_chunk, &self.stream),
        };
        let src_ptr = src_row.map_or(0u64, |s| raw_ptr(s, &self.stream));
        let slot_ptr = slot.map_or(0u64, |s| raw_ptr(s, &self.stream));
        let thresholds = p.top_p < 1.0 || (p.top_k > 0 && (p.top_k as usize) < st.vocab);
        use ElemKernel::{SampleDraw, SampleHistogram, SampleMax, SampleSelect};
        let stages: &[ElemKernel] = match (p.temperature == 0.0, thresholds) {
            (true, _) => &[SampleMax],
            (false, false) => &[SampleMax, SampleDraw],
            (false, true) if merged => &[SampleMax, SampleHistogram, SampleSelect],
            (false, true) => &[SampleMax, SampleHistogram, SampleSelect, SampleDraw],
        };
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        for &stage in stages {
            let f = self.elem_function::<T>(stage)?;
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
                .arg(p)
                .arg(&ptrs);
            // SAFETY: lengths checked above (the scratch holds `slots` >= `rows` rows of
            // `max_chunks` partials, histograms and `vocab` candidates); the kernels skip
            // rows whose logits row or slot lies outside `dims.logit_rows` / `dims.slots`,
            // and the index arrays hold `rows` entries (or are null, meaning the row's own
            // index).
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }

    /// `row_tokens[i] = tokens[slot[i]]`, `row_pos[i] = pos[slot[i]]` for each row of a
    /// decode step over some of the slots (`u32::MAX` for a slot outside `st`, which every
    /// kernel of the step then skips); reference: [`cpu::gather_slot_rows`].
    pub fn gather_slot_rows(
        &self,
        st: &DeviceSlots,
        slot: &CudaSlice<u32>,
        row_tokens: &mut CudaSlice<u32>,
        row_pos: &mut CudaSlice<u32>,
    ) -> Result<()> {
        const OP: &str = "gather_slot_rows";
        let rows = slot.len();
        check_len(OP, "row tokens", row_tokens, rows)?;
        check_len(OP, "row positions", row_pos, rows)?;
        if rows == 0 {
            return Ok(());
        }
        let n = as_i32(OP, "rows", rows)? as u32;
        let slots = as_i32(OP, "slots", st.slots().min(st.tokens.len()))? as u32;
        let f = self.function(Kernel::GatherSlotRows)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(slot)
            .arg(&st.tokens)
            .arg(&st.pos)
            .arg(row_tokens)
            .arg(row_pos)
            .arg(&n)
            .arg(&slots);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `slot`, `row_tokens` and `row_pos` hold at least `n` entries; the kernel
        // reads `tokens` and `pos` only below `slots`, which both hold.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_fill_the_gpu_and_cover_the_vocabulary() {
        // One row of Llama 3's vocabulary spreads over 63 blocks of about 2k ids.
        assert_eq!(chunks_per_row(1, 128_256, 132), 63);
        // 64 rows of SmolLM2's: 9 blocks each, 576 in all.
        assert_eq!(chunks_per_row(64, 49_152, 132), 9);
        // A small vocabulary is one block; many rows never drop below one.
        assert_eq!(chunks_per_row(1, 1001, 132), 1);
        assert_eq!(chunks_per_row(4096, 49_152, 132), 1);
        for (rows, vocab) in [(1, 128_256), (3, 5000), (64, 49_152), (256, 1001)] {
            let c = chunks_per_row(rows, vocab, 132);
            let len = chunk_len(vocab, c);
            assert!(c <= max_chunks(vocab) && len * c >= vocab);
            // Runs of 8 ids start aligned, and the last block has ids to read.
            assert_eq!(len % 8, 0);
            assert!(
                (c - 1) * len < vocab,
                "{rows} x {vocab}: {c} chunks of {len}"
            );
        }
        // 64 slots of Llama 3: the candidates dominate (a key and a chunk byte a token), a
        // quarter more than the rows' f32 logits.
        let bytes = scratch_bytes(64, 128_256);
        assert!(
            bytes > 64 * 128_256 * 5 && bytes < 64 * 128_256 * 6,
            "{bytes}"
        );
    }
}

//! Sampling a decode step's tokens: the per-slot state on either device, the step's rows, and
//! one token drawn per row.

use super::*;

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
                    crate::engine::cuda::sampling::device_slots_bytes(init.slots(), init.vocab)
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
    Queued(crate::engine::cuda::sampling::DrawnTicket),
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

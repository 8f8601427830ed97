//! Per-operation timing, two ways:
//!
//! - `KILN_PROFILE=1`: each op in `ops` opens a scope; closing it waits for the device and
//!   adds the wall time to a table keyed by op name. Waiting serialises the host with the GPU,
//!   so a profiled step is slower than a real one: the table says where time goes, not how
//!   fast a step is.
//! - Span recording ([`start_recording`] .. [`finish_recording`], used by `kiln train --trace`):
//!   each op's span is taken with two device events on a GPU, so the GPU's own timeline is
//!   measured without waiting, or with the host clock on the CPU, where the op runs on the
//!   calling thread. Spans come back placed on the host clock for the trace.

use super::Tensor;
use super::cuda::{CudaBackend, CudaEvent};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_PROFILE").is_ok_and(|v| v != "0"))
}

/// Names the operation about to book tensors in `t`'s pool, for a meta pool's ledger (which
/// charges bookings to the operation making them); nothing on a real pool. Operations that
/// allocate their output before the function that opens their [`scope`] call it first.
pub fn label(name: &'static str, t: &Tensor) {
    if t.is_meta() {
        t.pool().set_op(name);
    }
}

/// Calls and seconds per op name.
static TABLE: Mutex<BTreeMap<&'static str, (u64, f64)>> = Mutex::new(BTreeMap::new());

/// Where a recorded span begins or ends.
enum Mark {
    Host(Instant),
    Device(CudaEvent),
}

struct Pending {
    name: &'static str,
    /// When the host began the op (its launches follow).
    launched: Instant,
    start: Mark,
    end: Option<Mark>,
}

/// The spans being recorded on this thread (the one that runs the step) and the anchor that
/// places device events on the host clock.
struct Recording {
    anchor_host: Instant,
    anchor_event: Option<CudaEvent>,
    spans: Vec<Pending>,
}

thread_local! {
    static RECORDING: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

/// One op's span on the host clock.
#[derive(Debug, Clone)]
pub struct OpSpan {
    pub name: &'static str,
    /// When the host began the op. On a GPU, `start` minus this is how long its kernels
    /// waited in the queue: near zero where the GPU had run out of work and waited for the
    /// host's launches.
    pub launched: Instant,
    pub start: Instant,
    pub duration: Duration,
}

/// Starts recording op spans. With a GPU the stream must be idle (the caller synchronised):
/// the anchor event then completes at the host instant taken beside it, which is how device
/// times are placed on the host clock (to within the few microseconds an event takes).
pub fn start_recording(gpu: Option<&CudaBackend>) -> super::cuda::Result<()> {
    let anchor_event = gpu.map(|g| g.timing_event()).transpose()?;
    let anchor_host = Instant::now();
    RECORDING.with(|r| {
        *r.borrow_mut() = Some(Recording {
            anchor_host,
            anchor_event,
            spans: Vec::new(),
        })
    });
    Ok(())
}

/// Stops recording and returns the spans in the order the ops began. With a GPU the caller
/// synchronises first, so every event has completed.
pub fn finish_recording() -> super::cuda::Result<Vec<OpSpan>> {
    let Some(rec) = RECORDING.with(|r| r.borrow_mut().take()) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(rec.spans.len());
    for p in rec.spans {
        let Some(end) = p.end else { continue };
        let (start, duration) = match (&p.start, &end, &rec.anchor_event) {
            (Mark::Host(a), Mark::Host(b), _) => (*a, b.saturating_duration_since(*a)),
            (Mark::Device(a), Mark::Device(b), Some(anchor)) => {
                // An event that never completed (its op failed, or it was taken while the
                // stream captured a graph) cannot be timed; its span is dropped, since a trace
                // never fails the run it watches.
                let (Ok(from_anchor), Ok(dur)) = (anchor.elapsed_ms(a), a.elapsed_ms(b)) else {
                    continue;
                };
                let (from_anchor, dur) = (from_anchor.max(0.0) as f64, dur.max(0.0) as f64);
                (
                    rec.anchor_host + Duration::from_secs_f64(from_anchor * 1e-3),
                    Duration::from_secs_f64(dur * 1e-3),
                )
            }
            _ => continue,
        };
        out.push(OpSpan {
            name: p.name,
            launched: p.launched,
            start,
            duration,
        });
    }
    Ok(out)
}

/// Span recording on this thread, held aside until the guard drops.
pub struct PausedRecording(Option<Recording>);

/// Pauses span recording on this thread while the guard lives. A stream that captures a
/// graph runs nothing, so events recorded into it would time nothing and become part of the
/// graph; the decode step's capture pauses recording, and its replays are timed as one span by
/// the caller.
pub fn pause_recording() -> PausedRecording {
    PausedRecording(RECORDING.with(|r| r.borrow_mut().take()))
}

impl Drop for PausedRecording {
    fn drop(&mut self) {
        if let Some(rec) = self.0.take() {
            RECORDING.with(|r| *r.borrow_mut() = Some(rec));
        }
    }
}

/// Whether spans are being recorded on this thread.
pub fn recording() -> bool {
    RECORDING.with(|r| r.borrow().is_some())
}

/// Records a span between two timed events of another stream of the same GPU (the NCCL
/// stream of data parallelism), when a recording is on.
pub fn record_stream_span(name: &'static str, start: CudaEvent, end: CudaEvent) {
    RECORDING.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            rec.spans.push(Pending {
                name,
                launched: Instant::now(),
                start: Mark::Device(start),
                end: Some(Mark::Device(end)),
            });
        }
    });
}

/// A mark now: a device event on `gpu`'s stream, else the host clock. An event that cannot be
/// recorded drops the span (a trace is a diagnostic; it never fails the op it watches).
fn mark(gpu: Option<&Arc<CudaBackend>>) -> Option<Mark> {
    match gpu {
        Some(g) => g.timing_event().ok().map(Mark::Device),
        None => Some(Mark::Host(Instant::now())),
    }
}

pub struct Scope {
    name: &'static str,
    gpu: Option<Arc<CudaBackend>>,
    start: Instant,
    /// Whether the `KILN_PROFILE` table is being kept.
    table: bool,
    /// This scope's index among the recorded spans.
    span: Option<usize>,
}

/// Starts timing `name` for an op whose tensors live where `t` does (None when neither the
/// table nor a recording is on).
pub fn scope(name: &'static str, t: &Tensor) -> Option<Scope> {
    label(name, t);
    let table = enabled();
    if !table && !recording() {
        return None;
    }
    let gpu = t.pool().cuda().ok().cloned();
    if table && let Some(g) = &gpu {
        let _ = g.synchronize();
    }
    let launched = Instant::now();
    let span = mark(gpu.as_ref()).and_then(|start| {
        RECORDING.with(|r| {
            r.borrow_mut().as_mut().map(|rec| {
                rec.spans.push(Pending {
                    name,
                    launched,
                    start,
                    end: None,
                });
                rec.spans.len() - 1
            })
        })
    });
    Some(Scope {
        name,
        gpu,
        start: Instant::now(),
        table,
        span,
    })
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(i) = self.span {
            let end = mark(self.gpu.as_ref());
            RECORDING.with(|r| {
                if let Some(p) = r.borrow_mut().as_mut().and_then(|rec| rec.spans.get_mut(i)) {
                    p.end = end;
                }
            });
        }
        if !self.table {
            return;
        }
        if let Some(g) = &self.gpu {
            let _ = g.synchronize();
        }
        let secs = self.start.elapsed().as_secs_f64();
        if let Ok(mut t) = TABLE.lock() {
            let e = t.entry(self.name).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += secs;
        }
    }
}

/// The table so far, slowest first, as markdown; empty when profiling is off.
pub fn report() -> String {
    let Ok(t) = TABLE.lock() else {
        return String::new();
    };
    if t.is_empty() {
        return String::new();
    }
    let total: f64 = t.values().map(|v| v.1).sum();
    let mut rows: Vec<_> = t.iter().collect();
    rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
    let mut s = String::from("| op | calls | total ms | share |\n|---|---|---|---|\n");
    for (name, (calls, secs)) in rows {
        s += &format!(
            "| {name} | {calls} | {:.1} | {:.1}% |\n",
            secs * 1e3,
            100.0 * secs / total
        );
    }
    s
}

pub fn reset() {
    if let Ok(mut t) = TABLE.lock() {
        t.clear();
    }
}

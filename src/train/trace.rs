//! A Chrome trace (the JSON that Perfetto and chrome://tracing open) of chosen training steps:
//! on one track the phases (data wait, forward+backward, optimizer, eval and checkpoint) on the
//! wall clock, on a second every op of the step (each kernel launch of `engine::ops`), timed
//! with device events on a GPU and placed on the same clock. Inside traced steps the device is
//! synchronised at every phase boundary, so a phase's span covers its GPU work; steps outside
//! the range run unsynchronised and unrecorded.

use crate::error::{KilnError, Result};
use serde::Serialize;
use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The trace's tracks (Chrome trace thread ids).
const PHASES: u32 = 1;
const OPS: u32 = 2;
/// Collectives on the NCCL stream of a data-parallel run, beside the compute stream's ops.
const COMM: u32 = 3;

/// Where to write the trace and which optimizer steps (1-based, end exclusive) to record.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    pub path: PathBuf,
    pub steps: Range<u64>,
}

/// Parses `A..B` (steps A to B-1) or `A..=B`.
pub fn parse_steps(s: &str) -> std::result::Result<Range<u64>, String> {
    let bad = || {
        format!("--trace-steps {s:?}: expected A..B, such as 10..20 (steps 10 to 19) or 10..=20")
    };
    let (a, b, inclusive) = match s.split_once("..=") {
        Some((a, b)) => (a, b, true),
        None => {
            let (a, b) = s.split_once("..").ok_or_else(bad)?;
            (a, b, false)
        }
    };
    let a: u64 = a.trim().parse().map_err(|_| bad())?;
    let b: u64 = b.trim().parse().map_err(|_| bad())?;
    let end = if inclusive { b + 1 } else { b };
    if a == 0 || end <= a {
        return Err(format!(
            "--trace-steps {s:?}: steps count from 1 and the range must hold at least one step"
        ));
    }
    Ok(a..end)
}

#[derive(Serialize)]
struct Event {
    name: &'static str,
    cat: &'static str,
    ph: &'static str,
    /// Microseconds since the trace began.
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: serde_json::Value,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct File<'a> {
    trace_events: Vec<&'a Event>,
    display_time_unit: &'static str,
}

/// The spans recorded so far.
pub struct Trace {
    opts: TraceOptions,
    epoch: Instant,
    events: Vec<Event>,
}

impl Trace {
    pub fn new(opts: TraceOptions) -> Trace {
        Trace {
            opts,
            epoch: Instant::now(),
            events: Vec::new(),
        }
    }

    /// Whether optimizer step `step` (1-based) is traced.
    pub fn covers(&self, step: u64) -> bool {
        self.opts.steps.contains(&step)
    }

    /// A phase of step `step` on the phase track.
    pub fn span(&mut self, name: &'static str, step: u64, start: Instant, end: Instant) {
        self.push(
            name,
            "step",
            PHASES,
            step,
            start,
            end.saturating_duration_since(start),
        );
    }

    /// An op of step `step` on the op track, begun by the host at `launched`: its args give
    /// `queued_us`, how long its work waited for the device (near zero where the GPU had
    /// drained its queue and waited for the host's launches).
    pub fn op_span(
        &mut self,
        name: &'static str,
        step: u64,
        launched: Instant,
        start: Instant,
        duration: Duration,
    ) {
        let tid = if name.starts_with("nccl") { COMM } else { OPS };
        self.push(name, "op", tid, step, start, duration);
        if let Some(e) = self.events.last_mut() {
            let queued = start.saturating_duration_since(launched).as_secs_f64() * 1e6;
            e.args["queued_us"] = serde_json::json!((queued * 1e3).round() / 1e3);
        }
    }

    fn push(
        &mut self,
        name: &'static str,
        cat: &'static str,
        tid: u32,
        step: u64,
        start: Instant,
        duration: Duration,
    ) {
        self.events.push(Event {
            name,
            cat,
            ph: "X",
            ts: start.saturating_duration_since(self.epoch).as_secs_f64() * 1e6,
            dur: duration.as_secs_f64() * 1e6,
            pid: 1,
            tid,
            args: serde_json::json!({ "step": step }),
        });
    }

    /// Writes the trace file.
    pub fn write(&self) -> Result<()> {
        let path = &self.opts.path;
        let track = |tid: u32, name: &str| Event {
            name: "thread_name",
            cat: "",
            ph: "M",
            ts: 0.0,
            dur: 0.0,
            pid: 1,
            tid,
            args: serde_json::json!({ "name": name }),
        };
        let tracks = [
            track(PHASES, "step phases (host clock)"),
            track(OPS, "ops (device events on a GPU, host clock on the CPU)"),
            track(COMM, "collectives (NCCL stream, data parallel)"),
        ];
        let json = serde_json::to_string(&File {
            trace_events: tracks.iter().chain(&self.events).collect(),
            display_time_unit: "ms",
        })
        .map_err(|e| KilnError::output(path, e))?;
        std::fs::write(path, json).map_err(|e| KilnError::output(path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_ranges_parse_and_bad_ones_say_the_form() {
        assert_eq!(parse_steps("10..20"), Ok(10..20));
        assert_eq!(parse_steps("3..=4"), Ok(3..5));
        for bad in ["10", "a..b", "5..5", "0..3"] {
            let e = parse_steps(bad).unwrap_err();
            assert!(e.contains("--trace-steps"), "{e}");
        }
    }

    #[test]
    fn spans_become_complete_events_in_microseconds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let mut t = Trace::new(TraceOptions {
            path: path.clone(),
            steps: 2..3,
        });
        assert!(t.covers(2) && !t.covers(3) && !t.covers(1));
        let start = t.epoch + std::time::Duration::from_millis(5);
        t.span(
            "optimizer",
            2,
            start,
            start + std::time::Duration::from_micros(250),
        );
        t.op_span(
            "adamw_update",
            2,
            start + std::time::Duration::from_micros(4),
            start + std::time::Duration::from_micros(10),
            std::time::Duration::from_micros(40),
        );
        t.op_span(
            "nccl all-reduce",
            2,
            start + std::time::Duration::from_micros(20),
            start + std::time::Duration::from_micros(20),
            std::time::Duration::from_micros(30),
        );
        t.write().unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        // Three track names, then the spans.
        assert_eq!(events.len(), 6);
        assert!(events[..3].iter().all(|e| e["ph"] == "M"));
        let e = &events[3];
        assert_eq!(e["ph"], "X");
        assert_eq!(e["name"], "optimizer");
        assert!((e["ts"].as_f64().unwrap() - 5000.0).abs() < 1e-6);
        assert!((e["dur"].as_f64().unwrap() - 250.0).abs() < 1e-6);
        assert_eq!(e["args"]["step"], 2);
        let op = &events[4];
        assert_eq!(
            (op["name"].as_str(), op["tid"].as_u64()),
            (Some("adamw_update"), Some(2))
        );
        assert_ne!(op["tid"], e["tid"]);
        assert!((op["ts"].as_f64().unwrap() - 5010.0).abs() < 1e-6);
        // Launched 6 us before its device span began: queued that long.
        assert!((op["args"]["queued_us"].as_f64().unwrap() - 6.0).abs() < 1e-6);
        assert_eq!(events[5]["args"]["queued_us"].as_f64(), Some(0.0));
        // Collectives have a track of their own beside the compute stream's ops.
        assert_eq!(events[5]["tid"].as_u64(), Some(3));
    }
}

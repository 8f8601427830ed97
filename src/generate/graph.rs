//! Decode steps replayed from CUDA graphs.
//!
//! A decode step launches a few hundred small kernels; issued one by one from the host, each
//! costs a few microseconds of launch time and the GPU waits between them. Once a step's
//! shapes are fixed (the live slots run as a bucketed number of rows, padded with rows that
//! name no slot; positions and tokens live in device buffers; the attention's split is chosen
//! from a bucketed length bound) the same kernels with the same arguments run every step, so
//! the step is captured once per (bound, rows) and replayed. When the row count changes the
//! step's buffers change with it, and the graphs of the old count are dropped. The first step
//! of each key runs directly: it chooses the GEMM algorithms (which times candidates,
//! something a capture cannot hold) and shows that the step works.
//! A capture that fails (a step that waits for the device, as `KILN_PROFILE=1` makes every
//! op do) leaves the stream usable; generation then goes on without graphs and says why.

use crate::engine::cuda::CudaBackend;
use crate::engine::{EngineError, Result};
use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// What a captured step is keyed by: the attention bound and the number of rows.
pub(crate) type StepKey = (usize, usize);

/// The captured steps of one generation call, by attention bound and row count.
pub(crate) struct StepGraphs {
    gpu: Arc<CudaBackend>,
    graphs: HashMap<StepKey, CudaGraph>,
    seen: HashSet<StepKey>,
    /// Why graphs were given up, once they were.
    pub failed: Option<String>,
    pub captures: usize,
    pub replays: usize,
}

impl StepGraphs {
    pub fn new(gpu: Arc<CudaBackend>) -> StepGraphs {
        StepGraphs {
            gpu,
            graphs: HashMap::new(),
            seen: HashSet::new(),
            failed: None,
            captures: 0,
            replays: 0,
        }
    }

    /// Drops every captured step (their buffers are about to be freed).
    pub fn forget(&mut self) {
        self.graphs.clear();
        self.seen.clear();
    }

    /// Runs `step` for `key`: directly the first time, then from its graph.
    pub fn run(&mut self, key: StepKey, step: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.failed.is_some() || self.seen.insert(key) {
            return step();
        }
        if !self.graphs.contains_key(&key) {
            match self.capture(step) {
                Ok(g) => {
                    self.captures += 1;
                    self.graphs.insert(key, g);
                }
                Err(why) => {
                    self.failed = Some(why);
                    return step();
                }
            }
        }
        let g = &self.graphs[&key];
        g.launch().map_err(|e| EngineError::Cuda(e.into()))?;
        self.replays += 1;
        Ok(())
    }

    /// `step` captured (not run) into a graph, or why it could not be.
    fn capture(
        &self,
        step: &mut dyn FnMut() -> Result<()>,
    ) -> std::result::Result<CudaGraph, String> {
        let stream = self.gpu.stream();
        let _paused = crate::engine::profile::pause_recording();
        let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        stream
            .begin_capture(mode)
            .map_err(|e| format!("the stream cannot capture ({e:?})"))?;
        let captured = step();
        // Always end the capture, so that a failed one leaves the stream usable.
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured.map_err(|e| format!("the decode step cannot be captured ({e})"))?;
        let graph = graph
            .map_err(|e| format!("the captured decode step cannot be instantiated ({e:?})"))?
            .ok_or_else(|| "the captured decode step launched nothing".to_string())?;
        graph
            .upload()
            .map_err(|e| format!("the decode graph cannot be uploaded ({e:?})"))?;
        Ok(graph)
    }
}

/// The rows a step with `live` live slots runs (at most `capacity`): `live` rounded up to a
/// quarter of its next power of two, so a batch that shrinks one sequence at a time captures
/// at most four graphs per halving and pads fewer rows than half its live ones.
pub fn row_bucket(live: usize, capacity: usize) -> usize {
    let step = (live.next_power_of_two() / 4).max(1);
    (live.div_ceil(step) * step).min(capacity).max(live).max(1)
}

/// The attention bound a step with sequences up to `longest` positions uses: a power of two
/// of at least 256 (rows that short are never split), at most the cache length. Steps of one
/// bound share a graph; direct and replayed steps use the same bound, so they agree bit for
/// bit.
pub fn attention_bound(longest: usize, max_len: usize) -> usize {
    longest.next_power_of_two().max(256).min(max_len.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_buckets_are_few_and_cover_every_count() {
        assert_eq!(row_bucket(1, 64), 1);
        assert_eq!(row_bucket(5, 64), 6);
        assert_eq!(row_bucket(33, 64), 48);
        assert_eq!(row_bucket(64, 64), 64);
        assert_eq!(row_bucket(60, 60), 60);
        assert_eq!(row_bucket(65, 70), 70);
        let buckets: HashSet<usize> = (1..=256).map(|n| row_bucket(n, 256)).collect();
        assert!(buckets.len() <= 4 * 8 + 4, "{}", buckets.len());
        for n in 1..=256 {
            let b = row_bucket(n, 256);
            assert!(b >= n && b <= 256 && (b - n) * 2 < n.max(2), "{n} -> {b}");
        }
    }

    #[test]
    fn bounds_are_few_and_cover_every_length() {
        assert_eq!(attention_bound(1, 2048), 256);
        assert_eq!(attention_bound(256, 2048), 256);
        assert_eq!(attention_bound(257, 2048), 512);
        assert_eq!(attention_bound(1500, 2048), 2048);
        assert_eq!(attention_bound(100, 192), 192);
        for len in 1..=2048 {
            assert!(attention_bound(len, 2048) >= len);
        }
    }
}

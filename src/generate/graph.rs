//! Decode steps replayed from CUDA graphs.
//!
//! A decode step launches a few hundred small kernels; issued one by one from the host, each
//! costs a few microseconds of launch time and the GPU waits between them. Once a step's
//! shapes are fixed (every slot decodes each step, positions and tokens live in device
//! buffers, the attention's split is chosen from a bucketed length bound) the same kernels
//! with the same arguments run every step, so the step is captured once per bound and
//! replayed. The first step of each bound runs directly: it chooses the GEMM algorithms
//! (which times candidates, something a capture cannot hold) and shows that the step works.
//! A capture that fails (a step that waits for the device, as `KILN_PROFILE=1` makes every
//! op do) leaves the stream usable; generation then goes on without graphs and says why.

use crate::engine::cuda::CudaBackend;
use crate::engine::{EngineError, Result};
use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The captured steps of one generation call, by attention bound.
pub(crate) struct StepGraphs {
    gpu: Arc<CudaBackend>,
    graphs: HashMap<usize, CudaGraph>,
    seen: HashSet<usize>,
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

    /// Runs `step` for attention bound `bound`: directly the first time, then from its graph.
    pub fn run(&mut self, bound: usize, step: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        if self.failed.is_some() || self.seen.insert(bound) {
            return step();
        }
        if !self.graphs.contains_key(&bound) {
            match self.capture(step) {
                Ok(g) => {
                    self.captures += 1;
                    self.graphs.insert(bound, g);
                }
                Err(why) => {
                    self.failed = Some(why);
                    return step();
                }
            }
        }
        let g = &self.graphs[&bound];
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

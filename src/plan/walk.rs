//! A replay of one step's allocations in the order the code makes them.
//!
//! The planner does not add up a formula: a model's step function (see `gpt.rs`) calls
//! [`Walk::alloc`] and [`Walk::free`] in the order the real forward, backward and optimizer
//! allocate and drop their tensors, and the walk keeps the same books the memory pool keeps.
//! Buffers a kernel takes from the driver outside the pool (scratch, the GEMM workspace) are
//! walked too but booked apart, so the walk yields both the pool's peak (what
//! `MemoryPool::stats().peak` measures) and the device's.

use serde::Serialize;

/// What a buffer is for, which decides its line in the breakdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// fp32 master weights.
    Master,
    /// The weight copies compute reads (bf16/f16 under mixed precision).
    Compute,
    /// fp32 gradients.
    Grad,
    /// AdamW's two fp32 moments.
    Optimizer,
    /// Activations kept from the forward for the backward.
    Saved,
    /// Tensors that live within one layer's forward or backward (logits and their gradient
    /// included).
    Transient,
    /// Device memory a kernel or library takes outside the pool.
    Outside,
}

/// One buffer of the walk.
#[derive(Debug, Clone, Serialize)]
pub struct Buffer {
    pub what: String,
    pub kind: Kind,
    pub bytes: usize,
}

/// A handle to a live buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Id(usize);

#[derive(Default)]
pub struct Walk {
    live: Vec<Option<Buffer>>,
    pool: usize,
    device: usize,
    pool_peak: usize,
    device_peak: usize,
    /// The live buffers when the device peak was reached, and the one whose allocation
    /// reached it.
    at_peak: Vec<Buffer>,
    peak_at: String,
    /// Named points of the walk with the live buffers' kinds and bytes there.
    marks: Vec<(&'static str, Vec<(Kind, usize)>)>,
}

impl Walk {
    /// A buffer from the pool (booked), live until [`Walk::free`].
    pub fn alloc(&mut self, what: impl Into<String>, kind: Kind, bytes: usize) -> Id {
        self.pool += bytes;
        self.pool_peak = self.pool_peak.max(self.pool);
        self.push(what.into(), kind, bytes)
    }

    /// A buffer outside the pool that lives until [`Walk::free`] (the GEMM workspace).
    pub fn outside(&mut self, what: impl Into<String>, bytes: usize) -> Id {
        self.push(what.into(), Kind::Outside, bytes)
    }

    /// Scratch outside the pool that lives only during one kernel call, while nothing else
    /// is allocated.
    pub fn scratch(&mut self, what: impl Into<String>, bytes: usize) {
        let id = self.outside(what, bytes);
        self.free(id);
    }

    fn push(&mut self, what: String, kind: Kind, bytes: usize) -> Id {
        self.device += bytes;
        self.live.push(Some(Buffer { what, kind, bytes }));
        if self.device > self.device_peak {
            self.device_peak = self.device;
            self.at_peak = self.live.iter().flatten().cloned().collect();
            self.peak_at = self
                .live
                .last()
                .and_then(Option::as_ref)
                .map_or_else(String::new, |b| b.what.clone());
        }
        Id(self.live.len() - 1)
    }

    /// Drops a buffer (a second free of the same handle is a bug in the step function).
    pub fn free(&mut self, id: Id) {
        let b = self.live[id.0]
            .take()
            .unwrap_or_else(|| panic!("buffer {} freed twice in the walk", id.0));
        self.device -= b.bytes;
        if b.kind != Kind::Outside {
            self.pool -= b.bytes;
        }
    }

    pub fn free_all(&mut self, ids: impl IntoIterator<Item = Id>) {
        ids.into_iter().for_each(|id| self.free(id));
    }

    /// Remembers the live bytes by kind at a named point (for tests and reports).
    pub fn mark(&mut self, label: &'static str) {
        let live = self
            .live
            .iter()
            .flatten()
            .map(|b| (b.kind, b.bytes))
            .collect();
        self.marks.push((label, live));
    }

    /// The live bytes of `kind` at the point marked `label`.
    pub fn live_at(&self, label: &str, kind: Kind) -> Option<usize> {
        let (_, live) = self.marks.iter().find(|m| m.0 == label)?;
        Some(live.iter().filter(|b| b.0 == kind).map(|b| b.1).sum())
    }

    /// Bytes in the pool now.
    pub fn pool_bytes(&self) -> usize {
        self.pool
    }

    pub fn pool_peak(&self) -> usize {
        self.pool_peak
    }

    pub fn device_peak(&self) -> usize {
        self.device_peak
    }

    /// The buffers live at the device peak.
    pub fn at_peak(&self) -> &[Buffer] {
        &self.at_peak
    }

    /// The buffer whose allocation reached the device peak.
    pub fn peak_at(&self) -> &str {
        &self.peak_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_pool_and_outside_apart_and_remembers_the_peak() {
        let mut w = Walk::default();
        let a = w.alloc("a", Kind::Saved, 100);
        let ws = w.outside("workspace", 10);
        let b = w.alloc("b", Kind::Transient, 50);
        w.free(b);
        w.scratch("tmp", 70);
        assert_eq!((w.pool_peak(), w.device_peak()), (150, 180));
        assert_eq!(w.peak_at(), "tmp");
        assert_eq!(w.at_peak().len(), 3);
        w.mark("before");
        w.free_all([a, ws]);
        assert_eq!(w.pool_bytes(), 0);
        assert_eq!(w.live_at("before", Kind::Saved), Some(100));
        assert_eq!(w.live_at("nowhere", Kind::Saved), None);
    }
}

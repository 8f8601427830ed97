//! Memory pools that keep books.
//!
//! Each device has one pool. It counts the bytes in use now, the peak since the last reset and
//! the bytes reserved from the system, and it can be given a limit. An allocation over the limit
//! is refused with [`EngineError::OutOfMemory`] before any memory is touched, which is how
//! out-of-memory handling is provoked and tested on a machine with plenty of RAM.
//!
//! The CPU pool hands out fresh vectors and returns them to the allocator on drop, so its
//! reserved bytes equal its bytes in use. A GPU pool reports the driver allocator's reserved
//! bytes (in use plus cached). A GPU pool also holds the device's [`CudaBackend`]
//! (the pool is the handle every tensor on that device shares); its buffers come from the
//! driver's stream-ordered allocator, which caches freed memory itself.
//!
//! A host pool ([`MemoryPool::host_for`]) keeps separate books for state held off a device
//! (the offloaded optimizer's masters and moments). Beside a GPU its memory is page-locked
//! through that GPU's driver, so copies to and from it run asynchronously.
//!
//! A meta pool ([`MemoryPool::meta`]) keeps the same books for a device it only stands in
//! for: its tensors have a shape, a dtype and a booking but no storage, and operations on them
//! run no kernel. It reports the device it stands for, so every layer allocates exactly what
//! it would there (activation dtypes, attention statistics), and a step run on it books the
//! real step's peak without touching memory: that is how `kiln plan` plans. Buffers a GPU
//! kernel takes from the driver outside the pool are booked apart ([`MemoryPool::book_outside`]).
//! A meta pool also keeps a ledger of what is live by purpose ([`Phase`]: built with the model,
//! or booked in the step's forward, backward or optimizer) and by the operation that booked it,
//! and copies it at the device peak ([`PeakLedger`]): the planner's breakdown of the peak.

use super::cuda::{CudaBackend, GemmMath};
use super::{Device, EngineError, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Which part of a run booked a buffer, for a meta pool's ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// Before the first step: weights, compute copies, gradients, optimizer state.
    #[default]
    Construction,
    Forward,
    Backward,
    /// The optimizer's update and anything after the last backward.
    Optimizer,
}

/// What a meta pool's buffer was booked under: the phase and the operation running then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaTag {
    pub phase: Phase,
    pub op: &'static str,
}

/// The allocator's alignment of each buffer on a GPU (the stream-ordered allocator's).
pub const GPU_BUFFER_ALIGNMENT: usize = 512;

/// A meta pool's ledger as it stood at the device peak.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeakLedger {
    /// Live pool bytes by the phase that booked them, in [`Phase`] order.
    pub by_phase: [usize; 4],
    /// Live pool bytes by the operation that booked them (largest first).
    pub by_op: Vec<(&'static str, usize)>,
    /// Bytes held or booked outside the pool.
    pub outside: usize,
    /// What aligning every live buffer (the pool's and those outside it) to
    /// [`GPU_BUFFER_ALIGNMENT`] adds.
    pub alignment: usize,
    /// The operation running at the peak.
    pub op: &'static str,
}

impl PeakLedger {
    pub fn phase(&self, p: Phase) -> usize {
        self.by_phase[p as usize]
    }
}

#[derive(Default)]
struct Ledger {
    phase: Phase,
    op: &'static str,
    by_phase: [usize; 4],
    by_op: HashMap<&'static str, usize>,
    alignment: usize,
    /// Alignment of the buffers held outside the pool.
    outside_alignment: usize,
    peak_total: usize,
    at_peak: PeakLedger,
    /// Live forward bytes when the last backward began: what the forward saved for it.
    forward_kept: usize,
}

fn alignment_of(bytes: usize) -> usize {
    bytes.next_multiple_of(GPU_BUFFER_ALIGNMENT) - bytes
}

impl Ledger {
    /// Copies the books if `total` (pool plus outside, with `extra_alignment` for a scratch
    /// buffer booked only now) is a new device peak.
    fn observe(&mut self, total: usize, outside: usize, extra_alignment: usize) {
        if total <= self.peak_total && self.peak_total > 0 {
            return;
        }
        self.peak_total = total;
        let mut by_op: Vec<_> = self
            .by_op
            .iter()
            .filter(|e| *e.1 > 0)
            .map(|(k, v)| (*k, *v))
            .collect();
        by_op.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        self.at_peak = PeakLedger {
            by_phase: self.by_phase,
            by_op,
            outside,
            alignment: self.alignment + self.outside_alignment + extra_alignment,
            op: self.op,
        };
    }
}

/// A snapshot of a pool's books.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    pub current: usize,
    pub peak: usize,
    pub reserved: usize,
    /// 0 means no limit.
    pub limit: usize,
}

pub struct MemoryPool {
    device: Device,
    current: AtomicUsize,
    peak: AtomicUsize,
    limit: AtomicUsize,
    cuda: Option<Arc<CudaBackend>>,
    /// On a host pool beside a GPU: the backend whose driver pins this pool's memory.
    pins_for: Option<Arc<CudaBackend>>,
    /// Whether f32 GEMMs may use TF32 tensor cores (the tf32 precision policy).
    tf32: AtomicBool,
    /// A meta pool: bookings without storage (see the module comment).
    meta: bool,
    /// Bytes taken outside the pool now, and the peak of pool plus outside: booked by the
    /// operations of a meta pool standing in for a GPU, for the scratch its kernels would take
    /// from the driver.
    outside: AtomicUsize,
    device_peak: AtomicUsize,
    /// A meta pool's ledger by purpose (None on real pools, which keep only totals).
    ledger: Option<Mutex<Ledger>>,
}

impl std::fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryPool({}, {:?})", self.device, self.stats())
    }
}

impl MemoryPool {
    /// A CPU pool (a GPU pool comes from [`MemoryPool::with_cuda`]).
    pub fn new(device: Device) -> Arc<Self> {
        Self::build(device, None, None)
    }

    /// A meta pool standing in for `device`: tensors are booked as there but hold no memory,
    /// and operations on them compute nothing.
    pub fn meta(device: Device) -> Arc<Self> {
        let mut pool = Self::build(device, None, None);
        let p = Arc::get_mut(&mut pool).expect("a new pool has one owner");
        p.meta = true;
        p.ledger = Some(Mutex::new(Ledger {
            op: "construction",
            ..Ledger::default()
        }));
        if matches!(device, Device::Cuda(_)) {
            // The cuBLASLt workspace a GPU backend allocates once, outside the pool.
            pool.hold_outside(super::cuda::GEMM_WORKSPACE_BYTES);
        }
        pool
    }

    /// Whether this is a meta pool.
    pub fn is_meta(&self) -> bool {
        self.meta
    }

    /// Books `bytes` a kernel takes from the driver outside the pool, for as long as it runs
    /// (a meta pool's stand-in for kernel scratch): raises the device peak, then releases.
    pub fn book_outside(&self, bytes: usize) {
        let outside = self.outside.load(Ordering::SeqCst);
        let now = self.current.load(Ordering::SeqCst) + outside + bytes;
        self.device_peak.fetch_max(now, Ordering::SeqCst);
        if let Some(l) = &self.ledger {
            l.lock()
                .unwrap()
                .observe(now, outside + bytes, alignment_of(bytes));
        }
    }

    /// Keeps `bytes` booked outside the pool from now on (a buffer the backend allocates once,
    /// such as the GEMM workspace).
    pub fn hold_outside(&self, bytes: usize) {
        let outside = self.outside.fetch_add(bytes, Ordering::SeqCst) + bytes;
        let now = self.current.load(Ordering::SeqCst) + outside;
        self.device_peak.fetch_max(now, Ordering::SeqCst);
        if let Some(l) = &self.ledger {
            let mut l = l.lock().unwrap();
            l.outside_alignment += alignment_of(bytes);
            l.observe(now, outside, 0);
        }
    }

    /// Sets the phase a meta pool's next bookings are charged to (no-op on a real pool).
    pub fn set_phase(&self, phase: Phase) {
        if let Some(l) = &self.ledger {
            let mut l = l.lock().unwrap();
            if l.phase == Phase::Forward && phase == Phase::Backward {
                l.forward_kept = l.by_phase[Phase::Forward as usize];
            }
            l.phase = phase;
        }
    }

    /// On a meta pool, the forward's live bytes when the last backward began (what it
    /// saved for the backward); 0 on a real pool.
    pub fn forward_kept(&self) -> usize {
        self.ledger
            .as_ref()
            .map_or(0, |l| l.lock().unwrap().forward_kept)
    }

    /// Names the operation a meta pool's next bookings are charged to (no-op on a real pool).
    pub fn set_op(&self, op: &'static str) {
        if let Some(l) = &self.ledger {
            l.lock().unwrap().op = op;
        }
    }

    /// Books `bytes` in a meta pool and says under what (the tag its release hands back).
    pub fn reserve_meta(&self, bytes: usize) -> Result<MetaTag> {
        self.reserve(bytes)?;
        let l = self.ledger.as_ref().map(|l| l.lock().unwrap());
        Ok(l.map_or(
            MetaTag {
                phase: Phase::Construction,
                op: "",
            },
            |l| MetaTag {
                phase: l.phase,
                op: l.op,
            },
        ))
    }

    /// Releases a meta booking made under `tag`.
    pub fn release_meta(&self, bytes: usize, tag: MetaTag) {
        if let Some(l) = &self.ledger {
            let mut l = l.lock().unwrap();
            l.by_phase[tag.phase as usize] -= bytes;
            *l.by_op.entry(tag.op).or_default() -= bytes;
            l.alignment -= alignment_of(bytes);
        }
        self.release(bytes);
    }

    /// A meta pool's ledger at its device peak (None on a real pool).
    pub fn peak_ledger(&self) -> Option<PeakLedger> {
        self.ledger
            .as_ref()
            .map(|l| l.lock().unwrap().at_peak.clone())
    }

    /// The highest pool-plus-outside bytes booked: the device's peak on a meta pool (on a
    /// real pool, the pool's peak, since nothing is booked outside).
    pub fn device_peak(&self) -> usize {
        self.device_peak
            .load(Ordering::SeqCst)
            .max(self.peak.load(Ordering::SeqCst))
    }

    /// Bytes held outside the pool (see [`MemoryPool::hold_outside`]).
    pub fn outside(&self) -> usize {
        self.outside.load(Ordering::SeqCst)
    }

    pub fn with_cuda(backend: Arc<CudaBackend>) -> Arc<Self> {
        Self::build(Device::Cuda(backend.info().ordinal), Some(backend), None)
    }

    /// A host pool with its own books for state kept off `device`'s pool: page-locked memory
    /// when `device` is a GPU, ordinary memory when it is the CPU.
    pub fn host_for(device: &MemoryPool) -> Arc<Self> {
        if device.meta {
            return Self::meta(Device::Cpu);
        }
        Self::build(Device::Cpu, None, device.cuda.clone())
    }

    fn build(
        device: Device,
        cuda: Option<Arc<CudaBackend>>,
        pins_for: Option<Arc<CudaBackend>>,
    ) -> Arc<Self> {
        Arc::new(MemoryPool {
            device,
            current: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            limit: AtomicUsize::new(0),
            cuda,
            pins_for,
            tf32: AtomicBool::new(false),
            meta: false,
            outside: AtomicUsize::new(0),
            device_peak: AtomicUsize::new(0),
            ledger: None,
        })
    }

    /// The GPU whose driver pins this host pool's memory, if it does.
    pub fn pins_for(&self) -> Option<&Arc<CudaBackend>> {
        self.pins_for.as_ref()
    }

    /// The GPU backend of a GPU pool.
    pub fn cuda(&self) -> Result<&Arc<CudaBackend>> {
        self.cuda.as_ref().ok_or_else(|| {
            EngineError::Unavailable(
                self.device.to_string(),
                "this pool has no CUDA backend".into(),
            )
        })
    }

    pub fn set_tf32(&self, on: bool) {
        self.tf32.store(on, Ordering::SeqCst);
    }

    pub fn gemm_math(&self) -> GemmMath {
        if self.tf32.load(Ordering::SeqCst) {
            GemmMath::Tf32
        } else {
            GemmMath::Fp32
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Sets the limit in bytes (0 removes it). Memory already in use is not affected.
    pub fn set_limit(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::SeqCst);
    }

    /// Books `bytes` as in use, or refuses if that would cross the limit.
    pub fn reserve(&self, bytes: usize) -> Result<()> {
        let limit = self.limit.load(Ordering::SeqCst);
        let mut cur = self.current.load(Ordering::SeqCst);
        loop {
            let next = cur.saturating_add(bytes);
            if limit != 0 && next > limit {
                return Err(EngineError::OutOfMemory {
                    device: self.device,
                    requested: bytes,
                    in_use: cur,
                    limit,
                });
            }
            match self
                .current
                .compare_exchange(cur, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::SeqCst);
                    let outside = self.outside.load(Ordering::SeqCst);
                    if outside > 0 {
                        self.device_peak.fetch_max(next + outside, Ordering::SeqCst);
                    }
                    if let Some(l) = &self.ledger {
                        let mut l = l.lock().unwrap();
                        let (phase, op) = (l.phase, l.op);
                        l.by_phase[phase as usize] += bytes;
                        *l.by_op.entry(op).or_default() += bytes;
                        l.alignment += alignment_of(bytes);
                        l.observe(next + outside, outside, 0);
                    }
                    return Ok(());
                }
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn release(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The most this pool can hold: its limit, else the GPU's total memory; `None` for an
    /// uncapped CPU pool.
    pub fn capacity(&self) -> Option<usize> {
        match self.limit.load(Ordering::SeqCst) {
            0 => self.cuda.as_ref().map(|g| g.info().total_memory),
            limit => Some(limit),
        }
    }

    /// Returns memory the device allocator caches to the device (a no-op on the CPU, whose
    /// buffers go back to the system allocator when dropped). Called after an out-of-memory
    /// error, before retrying with less.
    pub fn release_cached(&self) -> Result<()> {
        match &self.cuda {
            Some(g) => Ok(g.release_cached_memory()?),
            None => Ok(()),
        }
    }

    /// Starts a new peak measurement from the current usage.
    pub fn reset_peak(&self) {
        let current = self.current.load(Ordering::SeqCst);
        let outside = self.outside.load(Ordering::SeqCst);
        self.peak.store(current, Ordering::SeqCst);
        self.device_peak.store(current + outside, Ordering::SeqCst);
        if let Some(l) = &self.ledger {
            let mut l = l.lock().unwrap();
            l.peak_total = 0;
            l.observe(current + outside, outside, 0);
        }
    }

    pub fn stats(&self) -> MemoryStats {
        let current = self.current.load(Ordering::SeqCst);
        MemoryStats {
            current,
            peak: self.peak.load(Ordering::SeqCst),
            reserved: self
                .cuda
                .as_ref()
                .and_then(|g| g.reserved_bytes())
                .unwrap_or(current),
            limit: self.limit.load(Ordering::SeqCst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_balance_and_the_limit_refuses() {
        let pool = MemoryPool::new(Device::Cpu);
        pool.reserve(100).unwrap();
        pool.reserve(50).unwrap();
        pool.release(100);
        let s = pool.stats();
        assert_eq!((s.current, s.peak), (50, 150));
        pool.set_limit(120);
        match pool.reserve(80) {
            Err(EngineError::OutOfMemory {
                requested, in_use, ..
            }) => assert_eq!((requested, in_use), (80, 50)),
            other => panic!("expected OOM, got {other:?}"),
        }
        assert_eq!(pool.stats().current, 50, "a refused request books nothing");
        pool.reserve(70).unwrap();
        pool.reset_peak();
        assert_eq!(pool.stats().peak, 120);
    }
}

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

use super::cuda::{CudaBackend, GemmMath};
use super::{Device, EngineError, Result};
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

    pub fn with_cuda(backend: Arc<CudaBackend>) -> Arc<Self> {
        Self::build(Device::Cuda(backend.info().ordinal), Some(backend), None)
    }

    /// A host pool with its own books for state kept off `device`'s pool: page-locked memory
    /// when `device` is a GPU, ordinary memory when it is the CPU.
    pub fn host_for(device: &MemoryPool) -> Arc<Self> {
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
        self.peak
            .store(self.current.load(Ordering::SeqCst), Ordering::SeqCst);
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

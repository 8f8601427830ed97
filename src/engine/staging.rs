//! Host staging for reading many tensors back at once: the device-to-host copies of all of
//! them are queued on the compute stream into one page-locked buffer and waited for once.
//!
//! A checkpoint reads every weight and optimizer moment back. A blocking download per tensor
//! into pageable memory makes the driver bounce each one through a buffer of its own, one at
//! a time; into page-locked memory the copies run asynchronously at the bus rate, so the
//! whole state costs about its bytes over the bus bandwidth and a single synchronisation.
//! The buffer is allocated once and reused: pinning is slow, and pinned memory is memory the
//! kernel cannot page out, so a run pays for it once and holds exactly what it needs.

use super::cuda::CudaBackend;
use super::cuda::pinned::PinnedBuffer;
use super::{EngineError, MemoryPool, Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// A reusable host buffer that [`HostStaging::gather`] fills with tensors' f32 values.
pub struct HostStaging {
    buf: Buf,
}

enum Buf {
    Pinned(PinnedBuffer),
    /// Ordinary memory: the same gathering and layout without a GPU, for tests.
    #[cfg(test)]
    Pageable(Vec<f32>),
}

impl HostStaging {
    /// `bytes` of page-locked memory beside the GPU of `pool` (zeroed, so every page is
    /// touched now rather than during the first checkpoint).
    pub fn pinned(pool: &MemoryPool, bytes: usize) -> Result<HostStaging> {
        if cfg!(target_endian = "big") {
            return Err(EngineError::Unavailable(
                "host staging".into(),
                "staged bytes are written as little-endian files, and this host is big-endian"
                    .into(),
            ));
        }
        let gpu = pool.cuda()?;
        Ok(HostStaging {
            buf: Buf::Pinned(PinnedBuffer::zeroed(gpu.context(), bytes)?),
        })
    }

    #[cfg(test)]
    pub(crate) fn pageable(bytes: usize) -> HostStaging {
        HostStaging {
            buf: Buf::Pageable(vec![0.0; bytes.div_ceil(size_of::<f32>())]),
        }
    }

    /// Bytes the buffer holds.
    pub fn bytes(&self) -> usize {
        match &self.buf {
            Buf::Pinned(b) => b.bytes(),
            #[cfg(test)]
            Buf::Pageable(v) => v.len() * size_of::<f32>(),
        }
    }

    /// The buffer's bytes: f32 values in the host's byte order, which is little-endian on
    /// every machine CUDA runs on (and so the byte order safetensors files use).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.buf {
            Buf::Pinned(b) => b.as_bytes(),
            #[cfg(test)]
            Buf::Pageable(v) => {
                // SAFETY: the bytes of initialised f32 values, living as long as `self`.
                unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) }
            }
        }
    }

    fn as_f32_mut(&mut self) -> &mut [f32] {
        match &mut self.buf {
            Buf::Pinned(b) => b.as_mut_slice::<f32>(),
            #[cfg(test)]
            Buf::Pageable(v) => v,
        }
    }

    /// Copies the f32 values of `tensors`, back to back from the start of the buffer, and
    /// returns the byte range each one occupies. Every device copy is queued first and each
    /// GPU involved is synchronised once at the end, so the call costs the transfer time of
    /// the whole set, not a round trip per tensor. A set larger than the buffer is refused
    /// before anything is copied.
    pub fn gather(&mut self, tensors: &[&Tensor]) -> Result<Vec<Range<usize>>> {
        let needed: usize = tensors.iter().map(|t| t.len() * size_of::<f32>()).sum();
        if needed > self.bytes() {
            return Err(EngineError::Shape {
                op: "host staging",
                detail: format!(
                    "{needed} bytes of tensors for a staging buffer of {} bytes",
                    self.bytes()
                ),
            });
        }
        let dst = self.as_f32_mut();
        let mut queued: Vec<&Arc<CudaBackend>> = Vec::new();
        let mut ranges = Vec::with_capacity(tensors.len());
        let mut at = 0;
        let mut result = Ok(());
        for t in tensors {
            let n = t.len();
            // SAFETY: every backend a copy was queued on is synchronised below before the
            // buffer can be read, written again or freed (`&mut self` is held until then),
            // and the tensors are borrowed for the whole call.
            match unsafe { t.queue_to_host(&mut dst[at..at + n]) } {
                Ok(Some(gpu)) => {
                    if !queued.iter().any(|g| Arc::ptr_eq(g, gpu)) {
                        queued.push(gpu);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            ranges.push(at * size_of::<f32>()..(at + n) * size_of::<f32>());
            at += n;
        }
        // Waited for after a failure too: a copy in flight must not land in a buffer that is
        // reused or freed.
        for gpu in queued {
            let synced = gpu.synchronize().map_err(EngineError::from);
            result = result.and(synced);
        }
        result.map(|_| ranges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{DType, Device};

    #[test]
    fn gather_lays_tensors_back_to_back_as_little_endian_f32() {
        let pool = MemoryPool::new(Device::Cpu);
        let a = Tensor::from_vec(&pool, &[2], DType::F32, vec![1.5, -2.0]).unwrap();
        let b = Tensor::from_vec(&pool, &[1, 3], DType::F32, vec![0.25, 3e30, -0.0]).unwrap();
        // Larger than needed, with stale bytes from an earlier use that must not matter.
        let mut staging = HostStaging::pageable(64);
        staging.as_f32_mut().fill(f32::NAN);
        let ranges = staging.gather(&[&a, &b]).unwrap();
        assert_eq!(ranges, vec![0..8, 8..20]);
        let expect: Vec<u8> = [1.5f32, -2.0, 0.25, 3e30, -0.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(&staging.as_bytes()[..20], &expect[..]);
    }

    #[test]
    fn gather_refuses_more_than_the_buffer_holds() {
        let pool = MemoryPool::new(Device::Cpu);
        let a = Tensor::from_vec(&pool, &[3], DType::F32, vec![1.0, 2.0, 3.0]).unwrap();
        let mut staging = HostStaging::pageable(8);
        let err = staging.gather(&[&a]).unwrap_err().to_string();
        assert!(err.contains("12 bytes") && err.contains("8 bytes"), "{err}");
    }
}

//! Raw bytes owned by one device's pool: the storage of packed formats (4-bit codes, 8-bit
//! scale codes) that no element type of [`Tensor`](super::Tensor) describes.
//!
//! Like a tensor, a buffer books its bytes in its pool before allocating and releases them
//! when it drops, so quantised weights show in the pool's books and its limit refuses them.
//! It is written once, from the host, and read by kernels.

use super::cuda::CudaError;
use super::tensor::device_alloc_error;
use super::{Device, MemoryPool, Result};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

enum ByteStorage {
    Host(Vec<u8>),
    Cuda(CudaSlice<u8>),
    /// A meta pool's booking (nothing stored).
    Meta(super::MetaTag),
}

pub struct PooledBytes {
    storage: ByteStorage,
    pool: Arc<MemoryPool>,
    booked: usize,
}

impl PooledBytes {
    /// The bytes of `host` in `pool`'s memory (copied to the device for a GPU pool).
    pub fn from_host(pool: &Arc<MemoryPool>, host: Vec<u8>) -> Result<PooledBytes> {
        let booked = host.len();
        if pool.is_meta() {
            // A meta pool books the bytes and keeps none.
            let tag = pool.reserve_meta(booked)?;
            return Ok(PooledBytes {
                storage: ByteStorage::Meta(tag),
                pool: pool.clone(),
                booked,
            });
        }
        pool.reserve(booked)?;
        let storage = match pool.device() {
            Device::Cpu => Ok(ByteStorage::Host(host)),
            Device::Cuda(_) => pool
                .cuda()
                .and_then(|g| Ok(g.upload(&host)?))
                .map(ByteStorage::Cuda),
        };
        match storage {
            Ok(storage) => Ok(PooledBytes {
                storage,
                pool: pool.clone(),
                booked,
            }),
            Err(e) => {
                pool.release(booked);
                Err(device_alloc_error(pool, booked, e))
            }
        }
    }

    pub fn len(&self) -> usize {
        self.booked
    }

    pub fn is_empty(&self) -> bool {
        self.booked == 0
    }

    pub fn device(&self) -> Device {
        self.pool.device()
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// A copy on the host (waits for the device).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        match &self.storage {
            ByteStorage::Host(v) => Ok(v.clone()),
            ByteStorage::Meta(_) => Ok(Vec::new()),
            ByteStorage::Cuda(s) => Ok(self
                .pool
                .cuda()?
                .stream()
                .clone_dtoh(s)
                .map_err(CudaError::from)?),
        }
    }

    /// The bytes of a host buffer, for the CPU kernels.
    ///
    /// # Panics
    /// On a GPU buffer: that is a dispatch bug, not a user error.
    pub fn host(&self) -> &[u8] {
        match &self.storage {
            ByteStorage::Host(v) => v,
            ByteStorage::Meta(_) => &[],
            ByteStorage::Cuda(_) => panic!("host() called on GPU bytes; use to_vec()"),
        }
    }

    /// The device buffer of a GPU buffer, for the CUDA kernels.
    ///
    /// # Panics
    /// On a host buffer: a dispatch bug.
    pub(crate) fn cuda(&self) -> &CudaSlice<u8> {
        match &self.storage {
            ByteStorage::Cuda(s) => s,
            ByteStorage::Host(_) | ByteStorage::Meta(_) => panic!("cuda() called on host bytes"),
        }
    }
}

impl Drop for PooledBytes {
    fn drop(&mut self) {
        match self.storage {
            ByteStorage::Meta(tag) => self.pool.release_meta(self.booked, tag),
            _ => self.pool.release(self.booked),
        }
    }
}

impl std::fmt::Debug for PooledBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PooledBytes({} bytes, {})", self.booked, self.device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineError;

    #[test]
    fn bytes_book_release_and_respect_the_limit() {
        let pool = MemoryPool::new(Device::Cpu);
        let b = PooledBytes::from_host(&pool, vec![1, 2, 3]).unwrap();
        assert_eq!((pool.stats().current, b.len()), (3, 3));
        assert_eq!(b.to_vec().unwrap(), b.host());
        drop(b);
        assert_eq!(pool.stats().current, 0);
        pool.set_limit(10);
        assert!(matches!(
            PooledBytes::from_host(&pool, vec![0; 11]),
            Err(EngineError::OutOfMemory { requested: 11, .. })
        ));
        assert_eq!(pool.stats().current, 0, "a refused buffer books nothing");
    }
}

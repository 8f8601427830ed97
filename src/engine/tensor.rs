//! Tensors: a shape, a dtype and a buffer owned by a device's pool.
//!
//! A tensor's bytes are booked in its pool while it lives and released when it drops, so the
//! pool's books are always the sum of the live tensors.

use super::{DType, Device, EngineError, MemoryPool, Result};
use std::sync::Arc;

/// Storage on one device. The CPU keeps f32 values whatever the logical dtype: a bf16 tensor
/// holds f32 values already rounded to bf16 (see `dtype`), and is booked at bf16 size.
enum Storage {
    Cpu(Vec<f32>),
}

pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
    pool: Arc<MemoryPool>,
    booked: usize,
}

impl Tensor {
    /// A zero-filled tensor from `pool`.
    pub fn zeros(pool: &Arc<MemoryPool>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        Tensor::with_storage(pool, shape, dtype, || vec![0.0; len])
    }

    /// A tensor holding `data` (f32 values; rounded if `dtype` is narrower).
    pub fn from_vec(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        mut data: Vec<f32>,
    ) -> Result<Tensor> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(EngineError::Shape {
                op: "from_vec",
                detail: format!("{} values for shape {shape:?}", data.len()),
            });
        }
        dtype.round_slice(&mut data);
        Tensor::with_storage(pool, shape, dtype, || data)
    }

    /// Books the bytes first, so a refused allocation never touches memory.
    fn with_storage(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        make: impl FnOnce() -> Vec<f32>,
    ) -> Result<Tensor> {
        let booked = shape.iter().product::<usize>() * dtype.size_bytes();
        let storage = match pool.device() {
            Device::Cpu => {
                pool.reserve(booked)?;
                Storage::Cpu(make())
            }
            d @ Device::Cuda(_) => {
                return Err(EngineError::Unavailable(
                    d.to_string(),
                    "no CUDA storage in this build".into(),
                ));
            }
        };
        Ok(Tensor {
            shape: shape.to_vec(),
            dtype,
            storage,
            pool: pool.clone(),
            booked,
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> Device {
        self.pool.device()
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// The values as f32 on the host (a copy for device tensors).
    pub fn to_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::Cpu(v) => v.clone(),
        }
    }

    /// Host slice of a CPU tensor. Kernels reach storage only through `ops`, which matches on
    /// the device first; this is for the CPU kernels and for host-side bookkeeping.
    pub fn host(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(v) => v,
        }
    }

    pub fn host_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(v) => v,
        }
    }

    /// Copies values from host memory, rounding to this tensor's dtype.
    pub fn copy_from_host(&mut self, src: &[f32]) -> Result<()> {
        if src.len() != self.len() {
            return Err(EngineError::Shape {
                op: "copy_from_host",
                detail: format!("{} values into shape {:?}", src.len(), self.shape),
            });
        }
        let dtype = self.dtype;
        let dst = self.host_mut();
        dst.copy_from_slice(src);
        dtype.round_slice(dst);
        Ok(())
    }

    pub fn fill_zero(&mut self) {
        self.host_mut().iter_mut().for_each(|x| *x = 0.0);
    }

    /// Reinterprets the shape; the element count must not change.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Tensor> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(EngineError::Shape {
                op: "reshape",
                detail: format!("{:?} to {shape:?}", self.shape),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// A new tensor with the same values (in its pool).
    pub fn try_clone(&self) -> Result<Tensor> {
        Tensor::from_vec(&self.pool, &self.shape, self.dtype, self.to_vec())
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        self.pool.release(self.booked);
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({:?}, {:?}, {})",
            self.shape,
            self.dtype,
            self.device()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_book_and_release_their_bytes() {
        let pool = MemoryPool::new(Device::Cpu);
        let a = Tensor::zeros(&pool, &[4, 8], DType::F32).unwrap();
        let b = Tensor::from_vec(&pool, &[2], DType::BF16, vec![1.0, 1.001]).unwrap();
        assert_eq!(pool.stats().current, 4 * 8 * 4 + 2 * 2);
        assert_eq!(b.host(), &[1.0, 1.0]);
        drop(a);
        drop(b);
        assert_eq!(pool.stats().current, 0);
        pool.set_limit(64);
        assert!(matches!(
            Tensor::zeros(&pool, &[32], DType::F32),
            Err(EngineError::OutOfMemory { .. })
        ));
    }
}

//! Tensors: a shape, a dtype and a buffer owned by a device's pool.
//!
//! A tensor's bytes are booked in its pool while it lives and released when it drops, so the
//! pool's books are always the sum of the live tensors.

use super::cuda::pinned::PinnedBuffer;
use super::cuda::{Bf16, CudaBackend, CudaError, Elem, F16};
use super::{DType, Device, EngineError, MemoryPool, Result};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// Storage on one device. The CPU keeps f32 values whatever the logical dtype: a bf16 tensor
/// holds f32 values already rounded to bf16 (see `dtype`), and is booked at bf16 size.
/// GPU tensors store their dtype for real: f32, or bf16 or f16 for mixed precision.
/// A tensor in a host pool beside a GPU ([`MemoryPool::host_for`]) holds its f32 values in
/// page-locked memory, and is otherwise a CPU tensor.
enum Storage {
    Cpu(Vec<f32>),
    Pinned(PinnedBuffer),
    CudaF32(CudaSlice<f32>),
    CudaBf16(CudaSlice<Bf16>),
    CudaF16(CudaSlice<F16>),
    /// A tensor of a meta pool: booked, never stored (see `pool`'s module comment).
    Meta(super::MetaTag),
}

/// Element types a GPU tensor can hold, with typed access to its buffer.
pub(crate) trait DeviceElem: Elem {
    fn of(t: &Tensor) -> Option<&CudaSlice<Self>>;
    fn of_mut(t: &mut Tensor) -> Option<&mut CudaSlice<Self>>;
}

impl DeviceElem for f32 {
    fn of(t: &Tensor) -> Option<&CudaSlice<f32>> {
        match &t.storage {
            Storage::CudaF32(s) => Some(s),
            _ => None,
        }
    }
    fn of_mut(t: &mut Tensor) -> Option<&mut CudaSlice<f32>> {
        match &mut t.storage {
            Storage::CudaF32(s) => Some(s),
            _ => None,
        }
    }
}

impl DeviceElem for Bf16 {
    fn of(t: &Tensor) -> Option<&CudaSlice<Bf16>> {
        match &t.storage {
            Storage::CudaBf16(s) => Some(s),
            _ => None,
        }
    }
    fn of_mut(t: &mut Tensor) -> Option<&mut CudaSlice<Bf16>> {
        match &mut t.storage {
            Storage::CudaBf16(s) => Some(s),
            _ => None,
        }
    }
}

impl DeviceElem for F16 {
    fn of(t: &Tensor) -> Option<&CudaSlice<F16>> {
        match &t.storage {
            Storage::CudaF16(s) => Some(s),
            _ => None,
        }
    }
    fn of_mut(t: &mut Tensor) -> Option<&mut CudaSlice<F16>> {
        match &mut t.storage {
            Storage::CudaF16(s) => Some(s),
            _ => None,
        }
    }
}

pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
    pool: Arc<MemoryPool>,
    booked: usize,
}

/// A device out-of-memory becomes the same typed error as the pool's own limit, with the
/// pool's books (what kiln holds) and its cap, or the device's memory where none is set.
pub(crate) fn device_alloc_error(pool: &MemoryPool, bytes: usize, e: EngineError) -> EngineError {
    if !e.is_out_of_memory() {
        return e;
    }
    let s = pool.stats();
    EngineError::OutOfMemory {
        device: pool.device(),
        requested: bytes,
        in_use: s.current,
        limit: pool.capacity().unwrap_or(s.limit),
    }
}

/// A zeroed host buffer, or `None` when the allocator refuses: a refused host allocation is
/// an out-of-memory error like the device's, not an abort. Zeroed by the allocator (calloc),
/// so large buffers cost no memset.
fn try_zeroed(len: usize) -> Option<Vec<f32>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(len).ok()?;
    // SAFETY: `layout` has a non-zero size; a non-null result is `len` zeroed f32s (all-zero
    // bits are 0.0) allocated by the global allocator with the layout Vec uses for them.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<f32>();
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, len, len))
    }
}

impl Tensor {
    /// A zero-filled tensor from `pool`.
    pub fn zeros(pool: &Arc<MemoryPool>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        Tensor::with_storage(pool, shape, dtype, |p| {
            Ok(match (p.device(), dtype) {
                (Device::Cpu, _) => match p.pins_for() {
                    Some(g) => Storage::Pinned(PinnedBuffer::zeroed(g.context(), len * 4)?),
                    None => Storage::Cpu(try_zeroed(len).ok_or(EngineError::OutOfMemory {
                        device: Device::Cpu,
                        requested: len * 4,
                        in_use: p.stats().current,
                        limit: p.stats().limit,
                    })?),
                },
                (Device::Cuda(_), DType::BF16) => Storage::CudaBf16(
                    p.cuda()?
                        .stream()
                        .alloc_zeros::<Bf16>(len)
                        .map_err(CudaError::from)?,
                ),
                (Device::Cuda(_), DType::F16) => Storage::CudaF16(
                    p.cuda()?
                        .stream()
                        .alloc_zeros::<F16>(len)
                        .map_err(CudaError::from)?,
                ),
                (Device::Cuda(_), DType::F32) => Storage::CudaF32(
                    p.cuda()?
                        .stream()
                        .alloc_zeros::<f32>(len)
                        .map_err(CudaError::from)?,
                ),
            })
        })
    }

    /// A tensor whose contents the caller will overwrite entirely before reading (kernel
    /// outputs). On the GPU this skips the memset that `zeros` costs; on the CPU it is zeroed
    /// like any other vector.
    pub fn uninit(pool: &Arc<MemoryPool>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        if pool.device() == Device::Cpu {
            return Tensor::zeros(pool, shape, dtype);
        }
        let len: usize = shape.iter().product();
        Tensor::with_storage(pool, shape, dtype, |p| {
            Ok(match dtype {
                DType::BF16 => Storage::CudaBf16(p.cuda()?.alloc::<Bf16>(len)?),
                DType::F16 => Storage::CudaF16(p.cuda()?.alloc::<F16>(len)?),
                DType::F32 => Storage::CudaF32(p.cuda()?.alloc::<f32>(len)?),
            })
        })
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
        Tensor::with_storage(pool, shape, dtype, |p| {
            Ok(match (p.device(), dtype) {
                (Device::Cpu, _) => match p.pins_for() {
                    Some(g) => {
                        let mut buf = PinnedBuffer::zeroed(g.context(), data.len() * 4)?;
                        buf.as_mut_slice().copy_from_slice(&data);
                        Storage::Pinned(buf)
                    }
                    None => Storage::Cpu(data),
                },
                (Device::Cuda(_), DType::BF16) => {
                    Storage::CudaBf16(p.cuda()?.upload_as::<Bf16>(&data)?)
                }
                (Device::Cuda(_), DType::F16) => {
                    Storage::CudaF16(p.cuda()?.upload_as::<F16>(&data)?)
                }
                (Device::Cuda(_), DType::F32) => Storage::CudaF32(p.cuda()?.upload(&data)?),
            })
        })
    }

    /// Books the bytes first, so a refused allocation never touches memory.
    fn with_storage(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        make: impl FnOnce(&MemoryPool) -> Result<Storage>,
    ) -> Result<Tensor> {
        let booked = shape.iter().product::<usize>() * dtype.size_bytes();
        let made = if pool.is_meta() {
            Ok(Storage::Meta(pool.reserve_meta(booked)?))
        } else {
            pool.reserve(booked)?;
            make(pool)
        };
        let storage = match made {
            Ok(s) => s,
            Err(e) => {
                pool.release(booked);
                return Err(device_alloc_error(pool, booked, e));
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

    /// The values as f32 on the host (a copy; waits for the device).
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        let mut values = match &self.storage {
            Storage::Cpu(v) => v.clone(),
            Storage::Pinned(b) => b.as_slice().to_vec(),
            Storage::CudaF32(s) => self.pool.cuda()?.download(s)?,
            Storage::CudaBf16(s) => self.pool.cuda()?.download_f32(s)?,
            Storage::CudaF16(s) => self.pool.cuda()?.download_f32(s)?,
            Storage::Meta(_) => vec![0.0; self.len()],
        };
        // A GPU buffer reshaped within its allocation holds more than its shape names.
        values.truncate(self.len());
        Ok(values)
    }

    /// Takes `shape` inside the buffer this tensor was allocated with (at most as many
    /// elements), without reallocating or rebooking: a workspace reused for operands of
    /// different sizes. The contents are unspecified afterwards; the next kernel overwrites
    /// them. On a GPU the buffer keeps its length and kernels read the elements the shape
    /// names; on the CPU the vector shrinks or grows within its capacity.
    pub(crate) fn reshape_within(&mut self, shape: &[usize]) -> Result<()> {
        let len: usize = shape.iter().product();
        let capacity = self.booked / self.dtype.size_bytes();
        if len > capacity {
            return Err(EngineError::Shape {
                op: "reshape_within",
                detail: format!(
                    "shape {shape:?} needs {len} elements, the buffer holds {capacity}"
                ),
            });
        }
        match &mut self.storage {
            Storage::Cpu(v) => v.resize(len, 0.0),
            Storage::Pinned(_) => {
                return Err(EngineError::Shape {
                    op: "reshape_within",
                    detail: "a page-locked staging buffer keeps its shape".into(),
                });
            }
            Storage::CudaF32(_) | Storage::CudaBf16(_) | Storage::CudaF16(_) | Storage::Meta(_) => {
            }
        }
        self.shape = shape.to_vec();
        Ok(())
    }

    /// Starts copying this tensor's values, as f32, into `dst` (exactly its length). A GPU
    /// f32 tensor queues an asynchronous copy on its pool's compute stream and returns that
    /// backend: `dst` holds the values once it is synchronised. A host tensor is copied at
    /// once, and a 16-bit GPU tensor is downloaded and widened, which waits for its stream.
    ///
    /// # Safety
    /// When a backend is returned, `dst` must be neither read, written nor freed, and this
    /// tensor must not be dropped, until that backend has been synchronised.
    pub(crate) unsafe fn queue_to_host(
        &self,
        dst: &mut [f32],
    ) -> Result<Option<&Arc<CudaBackend>>> {
        if dst.len() != self.len() {
            return Err(EngineError::Shape {
                op: "queue_to_host",
                detail: format!("{} values from shape {:?}", dst.len(), self.shape),
            });
        }
        match &self.storage {
            Storage::Cpu(v) => dst.copy_from_slice(v),
            Storage::Pinned(b) => dst.copy_from_slice(b.as_slice()),
            Storage::CudaF32(s) => {
                let gpu = self.pool.cuda()?;
                // SAFETY: passed on to the caller (see this function's contract).
                unsafe { gpu.queue_download(s, dst) }?;
                return Ok(Some(gpu));
            }
            Storage::CudaBf16(_) | Storage::CudaF16(_) => dst.copy_from_slice(&self.to_vec()?),
            Storage::Meta(_) => dst.fill(0.0),
        }
        Ok(None)
    }

    /// The device address, element count and dtype of a GPU tensor, for libraries that take
    /// raw pointers (NCCL); `None` on the host. The address stays valid while the tensor lives.
    pub(crate) fn cuda_raw(&self) -> Option<(u64, usize, DType)> {
        use cudarc::driver::DevicePtr;
        let stream = self.pool.cuda().ok()?.stream().clone();
        let ptr = match &self.storage {
            Storage::CudaF32(s) => s.device_ptr(&stream).0,
            Storage::CudaBf16(s) => s.device_ptr(&stream).0,
            Storage::CudaF16(s) => s.device_ptr(&stream).0,
            _ => return None,
        };
        Some((ptr, self.len(), self.dtype))
    }

    /// Host slice of a CPU tensor, for the CPU kernels (reached through `ops`, which matched
    /// on the device first) and CPU-side tests.
    ///
    /// # Panics
    /// On a GPU tensor: that is a dispatch bug, not a user error.
    pub fn host(&self) -> &[f32] {
        match &self.storage {
            Storage::Cpu(v) => v,
            Storage::Pinned(b) => b.as_slice(),
            _ => panic!("host() called on a GPU tensor; use to_vec()"),
        }
    }

    /// Mutable host slice of a CPU tensor; see [`Tensor::host`].
    pub fn host_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::Cpu(v) => v,
            Storage::Pinned(b) => b.as_mut_slice(),
            _ => panic!("host_mut() called on a GPU tensor"),
        }
    }

    /// The device buffer of a GPU tensor as `T` (for the CUDA arms of `ops`).
    ///
    /// # Panics
    /// When the tensor is on the CPU or holds another type: a dispatch bug.
    pub(crate) fn cuda<T: DeviceElem>(&self) -> &CudaSlice<T> {
        match T::of(self) {
            Some(s) => s,
            None => panic!("{self:?} read as a GPU {} buffer", T::SUFFIX),
        }
    }

    pub(crate) fn cuda_mut<T: DeviceElem>(&mut self) -> &mut CudaSlice<T> {
        // Checked through a shared borrow first, so the message is formatted only on the
        // failure path (this runs for every buffer every GPU op writes).
        if T::of(self).is_none() {
            panic!("{self:?} written as a GPU {} buffer", T::SUFFIX);
        }
        T::of_mut(self).expect("the storage was checked above")
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
        let pool = self.pool.clone();
        match &mut self.storage {
            Storage::Cpu(dst) => {
                dst.copy_from_slice(src);
                dtype.round_slice(dst);
            }
            Storage::Pinned(b) => {
                let dst = b.as_mut_slice();
                dst.copy_from_slice(src);
                dtype.round_slice(dst);
            }
            Storage::CudaF32(dst) => pool
                .cuda()?
                .stream()
                .memcpy_htod(src, dst)
                .map_err(CudaError::from)?,
            Storage::CudaBf16(dst) => upload_converted(&pool, src, dst)?,
            Storage::CudaF16(dst) => upload_converted(&pool, src, dst)?,
            Storage::Meta(_) => {}
        }
        Ok(())
    }

    pub fn fill_zero(&mut self) -> Result<()> {
        let pool = self.pool.clone();
        match &mut self.storage {
            Storage::Cpu(v) => v.iter_mut().for_each(|x| *x = 0.0),
            Storage::Pinned(b) => b.as_mut_slice::<f32>().fill(0.0),
            Storage::CudaF32(s) => pool
                .cuda()?
                .stream()
                .memset_zeros(s)
                .map_err(CudaError::from)?,
            Storage::CudaBf16(s) => pool
                .cuda()?
                .stream()
                .memset_zeros(s)
                .map_err(CudaError::from)?,
            Storage::CudaF16(s) => pool
                .cuda()?
                .stream()
                .memset_zeros(s)
                .map_err(CudaError::from)?,
            Storage::Meta(_) => {}
        }
        Ok(())
    }

    /// Bytes this tensor holds in its pool.
    pub fn bytes(&self) -> usize {
        self.booked
    }

    /// The same buffer under another shape of the same number of elements (no copy).
    pub fn reshaped(mut self, shape: &[usize]) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.len(),
            "reshape from {:?} to {shape:?} changes the element count",
            self.shape
        );
        self.shape = shape.to_vec();
        self
    }

    /// A new tensor with the same values (in its pool).
    pub fn try_clone(&self) -> Result<Tensor> {
        self.converted(&self.pool, self.dtype)
    }

    /// This tensor's values as `dtype` in `pool` (a copy). A meta tensor is booked there
    /// without reading anything.
    pub fn converted(&self, pool: &Arc<MemoryPool>, dtype: DType) -> Result<Tensor> {
        if self.pool.is_meta() {
            return Tensor::zeros(pool, &self.shape, dtype);
        }
        Tensor::from_vec(pool, &self.shape, dtype, self.to_vec()?)
    }

    /// Whether this tensor is booked in a meta pool (it has no values).
    pub fn is_meta(&self) -> bool {
        self.pool.is_meta()
    }
}

/// Rounds host f32 values to a 16-bit element type and copies them into `dst`.
fn upload_converted<T: Elem>(pool: &MemoryPool, src: &[f32], dst: &mut CudaSlice<T>) -> Result<()> {
    let converted: Vec<T> = src.iter().map(|&x| T::from_f32(x)).collect();
    pool.cuda()?
        .stream()
        .memcpy_htod(&converted, dst)
        .map_err(CudaError::from)?;
    Ok(())
}

impl Drop for Tensor {
    fn drop(&mut self) {
        match self.storage {
            Storage::Meta(tag) => self.pool.release_meta(self.booked, tag),
            _ => self.pool.release(self.booked),
        }
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

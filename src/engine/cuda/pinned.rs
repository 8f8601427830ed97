//! Page-locked host memory, and the two copy streams that move optimizer traffic between it
//! and the GPU while the host computes.
//!
//! The driver can copy to and from page-locked ("pinned") memory asynchronously, at the full
//! bus rate, without bouncing through a staging buffer of its own; from ordinary pageable
//! memory the same copy is synchronous. The optimizer offload keeps its fp32 masters and
//! moments in such memory, and streams each gradient chunk down and each new compute chunk up
//! through a small ring of pinned staging slots ([`CopyPipeline`]).
//!
//! Synchronisation is explicit, with one event per slot and direction: the context runs with
//! cudarc's per-buffer event tracking switched off (see [`super::CudaBackend`]), so nothing
//! orders the copy streams against the compute stream except the joins and events here.

use super::{CudaBackend, CudaError, Elem, Result, check_len, raw_ptr};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, result};
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// A block of page-locked host memory from `cuMemHostAlloc`, zero-filled, read and written
/// as a slice of one element type at a time.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; shared access hands out `&[T]`
// and mutation needs `&mut self`, so the usual borrow rules make concurrent use sound.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `bytes` of zeroed page-locked memory. Default flags (not write-combined): the host
    /// reads these buffers as much as it writes them, and write-combined reads are slow.
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBuffer> {
        ctx.bind_to_thread()?;
        // SAFETY: allocates at least one byte (a zero-size request is refused by some
        // drivers); the pointer is checked for null below and freed exactly once in `drop`.
        let raw = unsafe { result::malloc_host(bytes.max(1), 0) }?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
            CudaError::OutOfMemory(format!("cuMemHostAlloc returned null for {bytes} bytes"))
        })?;
        // SAFETY: `ptr` points to at least `bytes` writable bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(PinnedBuffer {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The whole buffer as elements of `T` (its length is `bytes / size_of::<T>()`).
    pub fn as_slice<T: Elem>(&self) -> &[T] {
        // SAFETY: the memory is `bytes` long and lives as long as `self`; cuMemHostAlloc
        // returns page-aligned memory, more than any `Elem` needs; every bit pattern is a
        // valid f32, bf16 or f16 (the only `Elem` types), and it was zeroed at allocation.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), self.bytes / size_of::<T>())
        }
    }

    /// The whole buffer as bytes (what a file write reads).
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `bytes` initialised bytes (zeroed at allocation) that live as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    /// The whole buffer as 32-bit words (token ids; every bit pattern is a valid `u32`).
    pub fn words(&self) -> &[u32] {
        // SAFETY: as in `as_slice`; page alignment suits `u32`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u32>(), self.bytes / 4) }
    }

    pub fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `as_mut_slice`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u32>(), self.bytes / 4) }
    }

    pub fn as_mut_slice<T: Elem>(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().cast::<T>(),
                self.bytes / size_of::<T>(),
            )
        }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // A failure here cannot be reported; the memory is then leaked, never reused.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed once. Every copy that used a
        // staging buffer is waited for before its pipeline lets go of it (`CopyPipeline` drop).
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({} bytes)", self.bytes)
    }
}

impl CudaBackend {
    /// Queues a copy of `src` into `dst` (its length) on the compute stream, after everything
    /// queued there before it, and returns at once. Into page-locked memory the copy runs
    /// asynchronously at the full bus rate, so many of them cost one synchronisation.
    ///
    /// # Safety
    /// Until the compute stream has been synchronised ([`CudaBackend::synchronize`]), the
    /// host must neither read, write nor free `dst`, and `src` must stay allocated.
    pub unsafe fn queue_download(&self, src: &CudaSlice<f32>, dst: &mut [f32]) -> Result<()> {
        check_len("queued download", "source", src, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let from = raw_ptr(src, &self.stream);
        // SAFETY: `dst.len()` elements lie inside `src` (checked above); the stream orders the
        // copy after the kernels that write it. `src` stays allocated and `dst` untouched
        // until the stream is synchronised (the caller's contract).
        unsafe { result::memcpy_dtoh_async(dst, from, self.stream.cu_stream()) }?;
        Ok(())
    }
}

/// One staging slot: a gradient chunk coming down, a compute chunk going up, and the events
/// that say when each copy has finished with its buffer.
struct Slot {
    grad: PinnedBuffer,
    out: PinnedBuffer,
    downloaded: CudaEvent,
    uploaded: CudaEvent,
}

/// A ring of pinned staging slots and two copy streams (one per direction, so a download and
/// an upload run on the two copy engines at once).
///
/// Order of use in a step: [`begin`](Self::begin) once; then per chunk `download` into a
/// slot, `host_slot` (waits for that download, and for the slot's previous upload), host work
/// on the returned slices, `upload` from the slot; finally [`finish`](Self::finish).
pub struct CopyPipeline {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    down: Arc<CudaStream>,
    up: Arc<CudaStream>,
    slots: Vec<Slot>,
    /// Elements of f32 one slot holds.
    chunk: usize,
}

impl CopyPipeline {
    /// `slots` slots of `chunk` f32 elements each (the compute staging is sized for f32, the
    /// widest compute type).
    pub fn new(gpu: &CudaBackend, slots: usize, chunk: usize) -> Result<CopyPipeline> {
        let ctx = gpu.context().clone();
        let slots = (0..slots)
            .map(|_| {
                Ok(Slot {
                    grad: PinnedBuffer::zeroed(&ctx, chunk * 4)?,
                    out: PinnedBuffer::zeroed(&ctx, chunk * 4)?,
                    downloaded: ctx.new_event(None)?,
                    uploaded: ctx.new_event(None)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CopyPipeline {
            compute: gpu.stream().clone(),
            down: ctx.new_stream()?,
            up: ctx.new_stream()?,
            ctx,
            slots,
            chunk,
        })
    }

    /// Pinned bytes the staging slots hold.
    pub fn staging_bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|s| s.grad.bytes() + s.out.bytes())
            .sum()
    }

    /// Orders both copy streams after everything queued on the compute stream so far: the
    /// gradients are complete and the weights are no longer read.
    pub fn begin(&self) -> Result<()> {
        self.down.join(&self.compute)?;
        self.up.join(&self.compute)?;
        Ok(())
    }

    /// Queues the copy of `src[range]` into slot `s`'s gradient buffer.
    pub fn download(&mut self, s: usize, src: &CudaSlice<f32>, range: Range<usize>) -> Result<()> {
        self.check("download", range.len())?;
        check_len("offload download", "gradient", src, range.end)?;
        self.ctx.bind_to_thread()?;
        let slot = &mut self.slots[s];
        let dst = &mut slot.grad.as_mut_slice::<f32>()[..range.len()];
        let from = raw_ptr(src, &self.down) + (range.start * size_of::<f32>()) as u64;
        // SAFETY: `from` and `range.len()` elements lie inside `src` (checked above), which
        // the compute stream finished writing before `begin`'s join. `dst` is pinned memory
        // owned by this pipeline, which the host touches again only after `host_slot` has
        // waited on `downloaded`, recorded right after this copy.
        unsafe { result::memcpy_dtoh_async(dst, from, self.down.cu_stream()) }?;
        slot.downloaded.record(&self.down)?;
        Ok(())
    }

    /// Slot `s`'s first `len` gradient values and its compute staging as `C`, once its
    /// download has landed and its previous upload has finished reading the staging.
    pub fn host_slot<C: Elem>(&mut self, s: usize, len: usize) -> Result<(&[f32], &mut [C])> {
        self.check("host_slot", len)?;
        let slot = &mut self.slots[s];
        slot.downloaded.synchronize()?;
        slot.uploaded.synchronize()?;
        Ok((
            &slot.grad.as_slice::<f32>()[..len],
            &mut slot.out.as_mut_slice::<C>()[..len],
        ))
    }

    /// Queues the copy of slot `s`'s first `range.len()` compute values into `dst[range]`.
    pub fn upload<C: Elem>(
        &mut self,
        s: usize,
        dst: &mut CudaSlice<C>,
        range: Range<usize>,
    ) -> Result<()> {
        self.check("upload", range.len())?;
        check_len("offload upload", "compute copy", dst, range.end)?;
        self.ctx.bind_to_thread()?;
        let slot = &mut self.slots[s];
        let src = &slot.out.as_slice::<C>()[..range.len()];
        let to = raw_ptr(dst, &self.up) + (range.start * size_of::<C>()) as u64;
        // SAFETY: the destination range lies inside `dst` (checked above); the compute stream
        // stops reading it at `begin` and reads it again only after `finish` joins this
        // stream. `src` is pinned and owned by this pipeline; the host writes it again only
        // after `host_slot` has waited on `uploaded`, recorded right after this copy.
        unsafe { result::memcpy_htod_async(to, src, self.up.cu_stream()) }?;
        slot.uploaded.record(&self.up)?;
        Ok(())
    }

    /// Orders the compute stream after every queued copy, so the next forward reads the new
    /// compute copies and the next backward overwrites gradients only once they are read.
    /// The host does not wait.
    pub fn finish(&self) -> Result<()> {
        self.compute.join(&self.down)?;
        self.compute.join(&self.up)?;
        Ok(())
    }

    fn check(&self, op: &'static str, len: usize) -> Result<()> {
        if len > self.chunk {
            return Err(CudaError::Shape {
                op,
                detail: format!("{len} elements exceed the staging chunk of {}", self.chunk),
            });
        }
        Ok(())
    }
}

impl Drop for CopyPipeline {
    fn drop(&mut self) {
        // The staging buffers must outlive every copy that reads or writes them.
        let _ = self.down.synchronize();
        let _ = self.up.synchronize();
    }
}

//! NCCL on one GPU of a data-parallel job: a communicator per process, its own stream so
//! collectives run beside the compute stream (a bucket of gradients travels while backward
//! computes the layers below it), and the three collectives data parallelism needs (all-reduce,
//! reduce to an owner, broadcast from an owner) on raw tensor addresses, grouped per bucket.
//!
//! Ordering between the two streams is explicit: before a bucket is launched the NCCL stream
//! waits for everything queued on the compute stream so far (the bucket's gradients are
//! final there), and before the optimizer the compute stream waits for the NCCL stream.

use crate::engine::DType;
use crate::engine::cuda::CudaBackend;
use crate::engine::cuda::loader::{self, CudaLibrary};
use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};
use std::sync::Arc;

/// One collective on one tensor, by address.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Collective {
    AllReduceSum,
    /// Sum into `root`'s buffer only (the others' buffers are left as they were sent).
    ReduceSum {
        root: usize,
    },
    BroadcastFrom {
        root: usize,
    },
}

/// A tensor's device address, element count and dtype ([`crate::engine::Tensor::cuda_raw`]).
pub type RawTensor = (u64, usize, DType);

pub struct Nccl {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    pub rank: usize,
    pub world_size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; kiln calls it from the training thread only (the backward hook runs there too),
// and the mutex around the reducer serialises it.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

fn nccl_error(what: &str, e: result::NcclError) -> String {
    format!("NCCL {what} failed: {e:?}")
}

fn nccl_dtype(d: DType) -> Result<sys::ncclDataType_t, String> {
    Ok(match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    })
}

/// Loads libnccl, turning a missing library into a message that says what to install.
fn load() -> Result<(), String> {
    loader::ensure_loaded(CudaLibrary::Nccl).map_err(|e| e.to_string())
}

/// A new NCCL unique id (rank 0 makes it and hands it out at the rendezvous).
pub fn unique_id() -> Result<Vec<u8>, String> {
    load()?;
    let id = loader::guarded("ncclGetUniqueId", || {
        result::get_uniqueid().map_err(|e| crate::engine::cuda::CudaError::Driver(format!("{e:?}")))
    })
    .map_err(|e| format!("NCCL unique id: {e}"))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// The NCCL version as major.minor.patch.
pub fn version() -> Result<String, String> {
    load()?;
    let v = result::get_nccl_version().map_err(|e| nccl_error("version", e))?;
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

impl Nccl {
    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on `gpu`.
    pub fn new(
        gpu: &CudaBackend,
        rank: usize,
        world_size: usize,
        id: &[u8],
    ) -> Result<Nccl, String> {
        load()?;
        if id.len() != 128 {
            return Err(format!(
                "NCCL unique id of {} bytes (expected 128)",
                id.len()
            ));
        }
        let mut internal = [0 as core::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(id) {
            *d = *s as core::ffi::c_char;
        }
        let uid = sys::ncclUniqueId { internal };
        // The context must be current on this thread for NCCL to pick the device.
        gpu.context()
            .bind_to_thread()
            .map_err(|e| format!("binding the CUDA context: {e}"))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` receives the new communicator; the id came from ncclGetUniqueId.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), world_size as i32, uid, rank as i32)
                .map_err(|e| nccl_error("communicator init", e))?;
            comm.assume_init()
        };
        let stream = gpu
            .context()
            .new_stream()
            .map_err(|e| format!("creating the NCCL stream: {e}"))?;
        Ok(Nccl {
            comm,
            stream,
            compute: gpu.stream().clone(),
            rank,
            world_size,
        })
    }

    /// Queues `ops` as one NCCL group on the NCCL stream, after the compute stream's work.
    pub fn launch(&self, ops: &[(RawTensor, Collective)]) -> Result<(), String> {
        if ops.is_empty() {
            return Ok(());
        }
        self.stream
            .join(&self.compute)
            .map_err(|e| format!("ordering the NCCL stream: {e}"))?;
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        // Under `kiln train --trace` each group is a span on the collectives' own track.
        let timed = crate::engine::profile::recording();
        let event = || {
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        };
        let start = if timed { event() } else { None };
        result::group_start().map_err(|e| nccl_error("group start", e))?;
        for &((ptr, len, dtype), op) in ops {
            let dt = nccl_dtype(dtype)?;
            let p = ptr as *mut core::ffi::c_void;
            // SAFETY: `ptr` addresses `len` elements of `dtype` that stay allocated until the
            // compute stream has waited for this stream (`compute_waits`).
            unsafe {
                match op {
                    Collective::AllReduceSum => {
                        result::all_reduce(p, p, len, dt, sys::ncclRedOp_t::ncclSum, self.comm, s)
                    }
                    Collective::ReduceSum { root } => result::reduce(
                        p,
                        p,
                        len,
                        dt,
                        sys::ncclRedOp_t::ncclSum,
                        root as i32,
                        self.comm,
                        s,
                    ),
                    Collective::BroadcastFrom { root } => {
                        result::broadcast(p, p, len, dt, root as i32, self.comm, s)
                    }
                }
            }
            .map_err(|e| nccl_error("collective", e))?;
        }
        result::group_end().map_err(|e| nccl_error("group end", e))?;
        if let (Some(a), Some(b)) = (start, if timed { event() } else { None }) {
            let name = match ops[0].1 {
                Collective::AllReduceSum => "nccl all-reduce",
                Collective::ReduceSum { .. } => "nccl reduce",
                Collective::BroadcastFrom { .. } => "nccl broadcast",
            };
            crate::engine::profile::record_stream_span(name, a, b);
        }
        Ok(())
    }

    /// Makes the compute stream wait for every collective queued so far.
    pub fn compute_waits(&self) -> Result<(), String> {
        self.compute
            .join(&self.stream)
            .map_err(|e| format!("ordering the compute stream: {e}"))
    }

    /// Waits on the host for the collectives queued so far.
    pub fn synchronize(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| format!("NCCL stream: {e}"))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator is not used after this; abort also ends anything pending.
        unsafe {
            let _ = result::comm_abort(self.comm);
        }
    }
}

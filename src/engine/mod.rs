//! The engine: devices, dtypes, tensors, memory pools and the operations layers call.
//!
//! Layers never branch on the device. They call [`ops`], which looks at where the tensors live
//! and runs the matching kernel (`cpu/` today, the CUDA backend behind the same functions).
//! Every buffer comes from a [`pool::MemoryPool`] that keeps books, so out-of-memory is a typed
//! error the trainer can act on, and planned memory can be checked against measured memory.

pub mod bytes;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod offload;
pub mod ops;
pub mod pool;
pub mod profile;
pub mod quant;
pub mod rng;
pub mod shapes;
pub mod staging;
pub mod tensor;

pub use device::Device;
pub use dtype::DType;
pub use pool::{MemoryPool, MemoryStats, MetaTag, Phase};
pub use shapes::{AttnShape, GemmShape, MatrixView};
pub use tensor::Tensor;

use thiserror::Error;

/// Failures of the engine that callers are expected to handle (not bugs).
#[derive(Debug, Error)]
pub enum EngineError {
    /// `limit` is the pool's cap, or the device's total memory where no cap is set.
    #[error(
        "out of memory on {device}: asked for {requested} bytes with {in_use} in use and a limit of {limit} bytes"
    )]
    OutOfMemory {
        device: Device,
        requested: usize,
        in_use: usize,
        limit: usize,
    },
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op} needs all tensors on one device, got {a} and {b}")]
    DeviceMismatch {
        op: &'static str,
        a: Device,
        b: Device,
    },
    #[error("device '{0}' is not available: {1}")]
    Unavailable(String, String),
    /// A layer met or produced inf/NaN; `layer` names it (the trainer adds the step).
    #[error("{layer}: {detail}")]
    NonFinite { layer: String, detail: String },
    /// Weights a model is built from do not fit it; `origin` names where they came from.
    #[error("{origin}: {detail}")]
    Weights { origin: String, detail: String },
    #[error(transparent)]
    Cuda(cuda::CudaError),
}

impl From<cuda::CudaError> for EngineError {
    /// A refused device allocation becomes the same error as the pool's own limit: the
    /// trainer recovers from both alike.
    fn from(e: cuda::CudaError) -> Self {
        match e {
            cuda::CudaError::AllocFailed {
                ordinal,
                requested,
                free,
                total,
            } => EngineError::OutOfMemory {
                device: Device::Cuda(ordinal),
                requested,
                in_use: total.saturating_sub(free),
                limit: total,
            },
            other => EngineError::Cuda(other),
        }
    }
}

impl EngineError {
    /// Whether memory ran out: the pool's limit, a refused device allocation, or the driver
    /// running out inside a library. Each leaves the device usable once buffers are freed.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            EngineError::OutOfMemory { .. } | EngineError::Cuda(cuda::CudaError::OutOfMemory(_))
        )
    }
}

/// Opens the device a request names and returns its pool, with a note for the user when the
/// choice is worth telling (which GPU `auto` found, or why it fell back to the CPU).
pub fn open(
    request: device::DeviceRequest,
) -> Result<(std::sync::Arc<MemoryPool>, Option<String>)> {
    use device::DeviceRequest;
    let gpu = |ordinal: usize| {
        cuda::CudaBackend::new(ordinal).map(|b| MemoryPool::with_cuda(std::sync::Arc::new(b)))
    };
    match request {
        DeviceRequest::Exact(Device::Cpu) => Ok((MemoryPool::new(Device::Cpu), None)),
        DeviceRequest::Exact(d @ Device::Cuda(i)) => {
            let pool = gpu(i).map_err(|e| {
                EngineError::Unavailable(
                    d.to_string(),
                    format!("{e}; use train.device=cpu or auto"),
                )
            })?;
            let note = format!("using {}", pool.cuda()?.info());
            Ok((pool, Some(note)))
        }
        DeviceRequest::Auto => match gpu(0) {
            Ok(pool) => {
                let note = format!("using {}", pool.cuda()?.info());
                Ok((pool, Some(note)))
            }
            Err(e) => {
                // One line: the library search list is for `kiln selftest`, not every run.
                let why = match e {
                    cuda::CudaError::LibraryMissing { library, .. } => {
                        format!("{library} not found")
                    }
                    other => other.to_string(),
                };
                Ok((
                    MemoryPool::new(Device::Cpu),
                    Some(format!(
                        "no usable GPU ({why}); using the CPU. `kiln selftest` says more"
                    )),
                ))
            }
        },
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

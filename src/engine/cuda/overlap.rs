//! Overlapped launches (programmatic dependent launch, sm_90 and newer).
//!
//! A decode step is a chain of a few hundred small kernels, each needing the one before, and
//! on an H200 each boundary costs about as much as a small kernel's work: the next grid is
//! launched only once the previous one has finished and its writes are flushed. Launched
//! overlapped, a kernel's blocks start while the previous kernel still runs, fetch what does
//! not depend on it (a product's weight rows, into L2; the cache attention's keys and values of
//! earlier steps, into shared memory) and wait in `grid_wait_for_previous`
//! (common.cuh) until it has finished. Only kernels that call that wait before touching
//! their inputs may be launched so; they then run the same arithmetic, so results are bit
//! for bit those of plain launches.
//!
//! Overlap is switched on only around work that is known to be such a chain (a generation's
//! decode step, [`CudaBackend::overlapped`]) and can be switched off for a process with
//! `KILN_OVERLAPPED_LAUNCHES=0`; elsewhere, and on older GPUs, the same kernels launch plainly.

use super::{CudaBackend, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, LaunchConfig};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// The environment variable that, set to `0`, keeps every launch plain.
pub const OVERLAP_ENV: &str = "KILN_OVERLAPPED_LAUNCHES";

/// Whether this process allows overlapped launches (the variable unset, or anything but `0`).
pub(super) fn allowed_by_env() -> bool {
    allowed_by(std::env::var(OVERLAP_ENV).ok().as_deref())
}

/// [`allowed_by_env`] for the variable's value (`None`: unset).
fn allowed_by(value: Option<&str>) -> bool {
    value.is_none_or(|v| v.trim() != "0")
}

/// The kernel parameter list of `cuLaunchKernelEx`: a pointer to each argument, in order.
/// Every argument must outlive the launch call (locals of the caller).
macro_rules! kernel_params {
    ($($arg:expr),* $(,)?) => {
        [$((&$arg) as *const _ as *mut ::std::ffi::c_void),*]
    };
}
pub(super) use kernel_params;

/// Switches overlapped launches on while it lives, and back to what they were after.
pub struct Overlapped<'a> {
    gpu: &'a CudaBackend,
    was: bool,
}

impl Drop for Overlapped<'_> {
    fn drop(&mut self) {
        self.gpu.overlap.store(self.was, Ordering::Relaxed);
    }
}

impl CudaBackend {
    /// Overlapped launches on (where this GPU and the process allow them) until the guard
    /// drops: for work whose chained kernels read nothing before their wait that the kernel
    /// before them writes (a decode step: the products fetch weights early and the cache
    /// attention the keys and values of earlier steps, never activations).
    pub fn overlapped(&self) -> Overlapped<'_> {
        let on = self.overlap_allowed && self.info.arch() >= 90;
        let was = self.overlap.swap(on, Ordering::Relaxed);
        Overlapped { gpu: self, was }
    }

    /// Whether launches are overlapped now.
    pub fn overlapping(&self) -> bool {
        self.overlap.load(Ordering::Relaxed)
    }

    /// Launches `func` on the stream, overlapped with the previous kernel while
    /// [`Self::overlapped`] holds, plainly otherwise.
    ///
    /// # Safety
    /// As for any kernel launch: `params` point at arguments of the kernel's types, in order,
    /// and the kernel stays within its buffers. The kernel must call `grid_wait_for_previous`
    /// (common.cuh) before it reads any input or writes anything.
    pub(super) unsafe fn launch_overlapped(
        &self,
        func: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.ctx.bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: a union of plain integers; zero is a valid value of every field.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.overlapping()),
        };
        // SAFETY: the caller's contract; the config and attribute live through the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only `0` (spaces aside) turns overlap off; unset or anything else leaves it on.
    #[test]
    fn only_zero_turns_overlap_off() {
        assert!(allowed_by(None));
        assert!(allowed_by(Some("1")));
        assert!(allowed_by(Some("")));
        assert!(!allowed_by(Some("0")));
        assert!(!allowed_by(Some(" 0\n")));
    }
}

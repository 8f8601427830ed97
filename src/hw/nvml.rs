//! NVML, the NVIDIA Management Library, loaded at run time, and a background sampler of a
//! GPU's utilisation, power, clocks, temperature and memory.
//!
//! The `nvml-wrapper` crate opens `libnvidia-ml.so.1` (installed with the driver) with
//! `libloading` when [`Nvml::load`] runs and looks each function up when it is first called,
//! so kiln builds and runs with no driver, and a function an old driver lacks, or a query a
//! GPU does not support, leaves its field `None` ("unknown"), never an error for the whole
//! report. It reports everything `kiln hw` and the sampler read, so kiln keeps no bindings
//! of its own.
//!
//! NVML numbers GPUs in PCI order and sees every GPU, while CUDA renumbers them (fastest
//! first, and only those in `CUDA_VISIBLE_DEVICES`), so a CUDA ordinal is matched to its NVML
//! device through the PCI location both report.

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError as NvmlCallError;
use serde::Serialize;
use std::collections::VecDeque;
use std::ffi::OsStr;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

/// The soname the driver installs; the unversioned name exists only with development files.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// Links per GPU the API can address (18 on Hopper; older GPUs answer fewer).
const NVLINK_MAX_LINKS: u32 = 18;

#[derive(Debug, Clone, Error)]
pub enum NvmlError {
    #[error("{LIBRARY} could not be loaded ({0}); it is installed with the NVIDIA driver")]
    Missing(String),
    #[error("NVML {call} failed: {detail}")]
    Call { call: &'static str, detail: String },
    #[error("no NVML device at PCI {0}")]
    NotFound(String),
}

/// What went wrong in a call, in the words the report uses.
fn describe(e: &NvmlCallError) -> String {
    match e {
        NvmlCallError::Uninitialized => "NVML is not initialised".into(),
        NvmlCallError::InvalidArg => "invalid argument".into(),
        NvmlCallError::NotSupported => "not supported on this GPU".into(),
        NvmlCallError::NoPermission => "no permission".into(),
        NvmlCallError::NotFound => "not found".into(),
        NvmlCallError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".into(),
        NvmlCallError::FailedToLoadSymbol(_) => "this driver's NVML lacks the function".into(),
        NvmlCallError::GpuLost => "the GPU has fallen off the bus".into(),
        other => other.to_string(),
    }
}

fn failed(call: &'static str) -> impl FnOnce(NvmlCallError) -> NvmlError {
    move |e| NvmlError::Call {
        call,
        detail: describe(&e),
    }
}

/// A GPU's place on the PCI bus: (domain, bus, device).
pub type PciLocation = (u32, u32, u32);

/// An NVML device by its NVML index. Each query looks the handle up again (a table read in
/// the library), which keeps this a plain value that a sampler thread owns beside its
/// [`Nvml`], where the wrapper's handle borrows the library.
#[derive(Debug, Clone, Copy)]
pub struct Device {
    pub index: u32,
}

type Handle<'a> = nvml_wrapper::Device<'a>;

/// An initialised NVML; shut down when dropped.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
}

impl Nvml {
    /// Opens and initialises NVML, or says why it cannot.
    pub fn load() -> Result<Arc<Nvml>, NvmlError> {
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(OsStr::new(LIBRARY))
            .init()
            .map_err(|e| match e {
                NvmlCallError::LibloadingError(e) => NvmlError::Missing(e.to_string()),
                NvmlCallError::FailedToLoadSymbol(_) => {
                    NvmlError::Missing("the library has no nvmlInit_v2; it is not NVML".into())
                }
                other => failed("nvmlInit_v2")(other),
            })?;
        Ok(Arc::new(Nvml { nvml }))
    }

    /// The driver version, such as `580.95.05`.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// The CUDA driver API version the driver supports, as CUDA writes it (13000 is 13.0).
    pub fn cuda_driver_version(&self) -> Option<i32> {
        self.nvml.sys_cuda_driver_version().ok()
    }

    pub fn device_count(&self) -> Result<u32, NvmlError> {
        self.nvml
            .device_count()
            .map_err(failed("nvmlDeviceGetCount_v2"))
    }

    pub fn device(&self, index: u32) -> Result<Device, NvmlError> {
        let d = Device { index };
        self.handle(d)?;
        Ok(d)
    }

    fn handle(&self, d: Device) -> Result<Handle<'_>, NvmlError> {
        self.nvml
            .device_by_index(d.index)
            .map_err(failed("nvmlDeviceGetHandleByIndex_v2"))
    }

    /// The device at a PCI location (which a CUDA ordinal names too).
    pub fn device_at(&self, pci: PciLocation) -> Result<Device, NvmlError> {
        for index in 0..self.device_count()? {
            let d = self.device(index)?;
            let h = self.handle(d)?;
            if Self::pci(&h).is_some_and(|(loc, _)| loc == pci) {
                return Ok(d);
            }
        }
        Err(NvmlError::NotFound(format_bus_id(pci)))
    }

    /// PCI location and NVML's bus id string (`00000000:1B:00.0`).
    fn pci(h: &Handle) -> Option<(PciLocation, String)> {
        let p = h.pci_info().ok()?;
        Some(((p.domain, p.bus, p.device), p.bus_id))
    }

    /// (total, free, used) bytes. NVML's `_v2` memory query, the one the wrapper makes, counts
    /// the driver's reserved memory apart from `used`; it is added back so that `used` is what
    /// the first query reported and `total - free`, as `nvidia-smi` shows it.
    fn memory(h: &Handle) -> Option<(u64, u64, u64)> {
        let m = h.memory_info().ok()?;
        Some((m.total, m.free, m.used + m.reserved))
    }

    /// Active NVLinks and the PCI bus id at the far end of each, grouped by peer. `None` when
    /// this NVML cannot say; no links at all (a PCIe-only GPU) is `Some` with zero.
    fn nvlink(h: &Handle) -> Option<NvLink> {
        let mut out = NvLink::default();
        let mut answered = false;
        for link in 0..NVLINK_MAX_LINKS {
            let link = h.link_wrapper_for(link);
            match link.is_active() {
                Ok(active) => {
                    answered = true;
                    if !active {
                        continue;
                    }
                }
                // A GPU without NVLink, or a link number past this GPU's last.
                Err(NvmlCallError::NotSupported | NvmlCallError::InvalidArg) => {
                    answered = true;
                    continue;
                }
                Err(_) => continue,
            }
            out.active_links += 1;
            let peer = match link.remote_pci_info() {
                Ok(p) => p.bus_id,
                Err(_) => "unknown".into(),
            };
            match out.peers.iter_mut().find(|x| x.bus_id == peer) {
                Some(x) => x.links += 1,
                None => out.peers.push(NvLinkPeer {
                    bus_id: peer,
                    links: 1,
                }),
            }
        }
        answered.then_some(out)
    }

    /// Everything `kiln hw` shows about one device; each field that NVML cannot give is `None`.
    pub fn describe(&self, d: Device) -> NvmlDevice {
        let h = self.handle(d).ok();
        let h = h.as_ref();
        let memory = h.and_then(Self::memory);
        let pci = h.and_then(Self::pci);
        NvmlDevice {
            index: d.index,
            name: ask(h, |h| h.name()),
            uuid: ask(h, |h| h.uuid()),
            pci: pci.as_ref().map(|p| p.0),
            pci_bus_id: pci.map(|p| p.1),
            memory_total: memory.map(|m| m.0),
            memory_free: memory.map(|m| m.1),
            clocks: Clocks {
                sm_mhz: ask(h, |h| h.clock_info(Clock::SM)),
                sm_max_mhz: ask(h, |h| h.max_clock_info(Clock::SM)),
                memory_mhz: ask(h, |h| h.clock_info(Clock::Memory)),
                memory_max_mhz: ask(h, |h| h.max_clock_info(Clock::Memory)),
            },
            power_limit_w: ask(h, |h| h.power_management_limit()).map(milliwatts),
            power_draw_w: ask(h, |h| h.power_usage()).map(milliwatts),
            temperature_c: ask(h, |h| h.temperature(TemperatureSensor::Gpu)),
            pcie: Pcie {
                generation: ask(h, |h| h.current_pcie_link_gen()),
                width: ask(h, |h| h.current_pcie_link_width()),
                max_generation: ask(h, |h| h.max_pcie_link_gen()),
                max_width: ask(h, |h| h.max_pcie_link_width()),
            },
            nvlink: h.and_then(Self::nvlink),
        }
    }

    /// One reading of what changes while a GPU works.
    pub fn sample(&self, d: Device, gpu: usize, elapsed_s: f64) -> DeviceSample {
        let h = self.handle(d).ok();
        let h = h.as_ref();
        let util = ask(h, |h| h.utilization_rates());
        DeviceSample {
            elapsed_s,
            gpu,
            gpu_util_pct: util.as_ref().map(|u| u.gpu),
            mem_util_pct: util.as_ref().map(|u| u.memory),
            power_w: ask(h, |h| h.power_usage()).map(milliwatts),
            sm_clock_mhz: ask(h, |h| h.clock_info(Clock::SM)),
            mem_clock_mhz: ask(h, |h| h.clock_info(Clock::Memory)),
            temperature_c: ask(h, |h| h.temperature(TemperatureSensor::Gpu)),
            mem_used_bytes: h.and_then(Self::memory).map(|m| m.2),
        }
    }
}

/// The answer of query `q` on a device, if there is a device and it answers.
fn ask<'a, T>(
    h: Option<&Handle<'a>>,
    q: impl FnOnce(&Handle<'a>) -> Result<T, NvmlCallError>,
) -> Option<T> {
    h.and_then(|h| q(h).ok())
}

fn milliwatts(mw: u32) -> f64 {
    f64::from(mw) / 1000.0
}

/// NVML's bus id form of a PCI location.
pub fn format_bus_id((domain, bus, device): PciLocation) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.0")
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Clocks {
    pub sm_mhz: Option<u32>,
    pub sm_max_mhz: Option<u32>,
    pub memory_mhz: Option<u32>,
    pub memory_max_mhz: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Pcie {
    pub generation: Option<u32>,
    pub width: Option<u32>,
    pub max_generation: Option<u32>,
    pub max_width: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NvLink {
    pub active_links: u32,
    pub peers: Vec<NvLinkPeer>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NvLinkPeer {
    /// PCI bus id at the far end (another GPU, or an NVSwitch).
    pub bus_id: String,
    pub links: u32,
}

/// What NVML says about one GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct NvmlDevice {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub pci: Option<PciLocation>,
    pub pci_bus_id: Option<String>,
    pub memory_total: Option<u64>,
    pub memory_free: Option<u64>,
    pub clocks: Clocks,
    pub power_limit_w: Option<f64>,
    pub power_draw_w: Option<f64>,
    pub temperature_c: Option<u32>,
    pub pcie: Pcie,
    pub nvlink: Option<NvLink>,
}

/// One reading of a GPU, as `metrics.jsonl` stores it (under `"kind": "device"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceSample {
    /// Seconds since the sampler's epoch (the start of the run).
    pub elapsed_s: f64,
    /// CUDA ordinal of the GPU.
    pub gpu: usize,
    pub gpu_util_pct: Option<u32>,
    pub mem_util_pct: Option<u32>,
    pub power_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    pub mem_used_bytes: Option<u64>,
}

/// Samples kept when the owner does not drain: a day at one per second.
const MAX_PENDING: usize = 86_400;

/// A background thread reading one GPU every `interval`; the owner collects the readings
/// with [`Sampler::drain`]. Dropping it stops the thread.
pub struct Sampler {
    samples: Arc<Mutex<VecDeque<DeviceSample>>>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling CUDA device `ordinal`, timestamps counted from `epoch`. Fails when NVML
    /// cannot be loaded or does not know the device.
    pub fn spawn(ordinal: usize, interval: Duration, epoch: Instant) -> Result<Sampler, NvmlError> {
        let nvml = Nvml::load()?;
        let pci = crate::engine::cuda::pci_location(ordinal)
            .map_err(|e| NvmlError::NotFound(format!("cuda:{ordinal} ({e})")))?;
        let device = nvml.device_at(pci)?;
        let samples = Arc::new(Mutex::new(VecDeque::new()));
        let (stop, stopped) = mpsc::channel::<()>();
        let sink = Arc::clone(&samples);
        let thread = std::thread::Builder::new()
            .name(format!("kiln-nvml-{ordinal}"))
            .spawn(move || {
                loop {
                    let s = nvml.sample(device, ordinal, epoch.elapsed().as_secs_f64());
                    if let Ok(mut q) = sink.lock() {
                        if q.len() == MAX_PENDING {
                            q.pop_front();
                        }
                        q.push_back(s);
                    }
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                }
            })
            .map_err(|e| NvmlError::Missing(format!("cannot start the sampler thread: {e}")))?;
        Ok(Sampler {
            samples,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The readings taken since the last drain, oldest first.
    pub fn drain(&self) -> Vec<DeviceSample> {
        self.samples
            .lock()
            .map(|mut q| q.drain(..).collect())
            .unwrap_or_default()
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_read_as_nvml_writes_them() {
        assert_eq!(format_bus_id((0, 0x1b, 0)), "00000000:1B:00.0");
    }

    #[test]
    fn errors_say_what_failed() {
        let e = failed("nvmlDeviceGetPowerUsage")(NvmlCallError::NotSupported);
        assert_eq!(
            e.to_string(),
            "NVML nvmlDeviceGetPowerUsage failed: not supported on this GPU"
        );
    }

    #[test]
    fn without_a_driver_loading_fails_with_the_library_name() {
        match Nvml::load() {
            Ok(nvml) => assert!(nvml.device_count().is_ok()),
            Err(e) => assert!(e.to_string().contains(LIBRARY), "{e}"),
        }
    }
}

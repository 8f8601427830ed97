//! NVML, the NVIDIA Management Library, loaded at run time, and a background sampler of a
//! GPU's utilisation, power, clocks, temperature and memory.
//!
//! cudarc has no NVML binding, so `libnvidia-ml.so.1` (installed with the driver) is opened
//! with `libloading` and only the functions kiln reads are looked up, each one optional: a
//! function an old driver lacks, or a query a GPU does not support, leaves its field `None`
//! ("unknown"), never an error for the whole report. The declarations follow `nvml.h`.
//!
//! NVML numbers GPUs in PCI order and sees every GPU, while CUDA renumbers them (fastest
//! first, and only those in `CUDA_VISIBLE_DEVICES`), so a CUDA ordinal is matched to its NVML
//! device through the PCI location both report.

use libloading::Library;
use serde::Serialize;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

/// The soname the driver installs; the unversioned name exists only with development files.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

type Status = c_int;
type RawDevice = *mut c_void;

const SUCCESS: Status = 0;
const ERROR_NOT_SUPPORTED: Status = 3;
const ERROR_FUNCTION_NOT_FOUND: Status = 13;

// Enumerations and sizes from nvml.h.
const CLOCK_SM: c_uint = 1;
const CLOCK_MEM: c_uint = 2;
const TEMPERATURE_GPU: c_uint = 0;
const FEATURE_ENABLED: c_uint = 1;
/// Links per GPU the API can address (18 on Hopper; older GPUs answer fewer).
const NVLINK_MAX_LINKS: c_uint = 18;
const NAME_BUFFER: usize = 96;
const UUID_BUFFER: usize = 96;
const DRIVER_VERSION_BUFFER: usize = 80;

#[repr(C)]
#[derive(Default)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlPciInfo_t` as the `_v3` queries fill it.
#[repr(C)]
#[derive(Default)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// Declares the NVML functions kiln uses; each is looked up once and may be absent.
macro_rules! nvml_api {
    ($($field:ident = $symbol:literal ($($arg:ty),*);)*) => {
        struct Api {
            $($field: Option<unsafe extern "C" fn($($arg),*) -> Status>,)*
        }

        impl Api {
            fn resolve(lib: &Library) -> Api {
                Api {
                    // SAFETY: each type is the function's declaration in nvml.h.
                    $($field: unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> Status>($symbol)
                    }
                    .ok()
                    .map(|s| *s),)*
                }
            }
        }
    };
}

nvml_api! {
    init = "nvmlInit_v2"();
    shutdown = "nvmlShutdown"();
    driver_version = "nvmlSystemGetDriverVersion"(*mut c_char, c_uint);
    cuda_driver_version = "nvmlSystemGetCudaDriverVersion_v2"(*mut c_int);
    device_count = "nvmlDeviceGetCount_v2"(*mut c_uint);
    handle_by_index = "nvmlDeviceGetHandleByIndex_v2"(c_uint, *mut RawDevice);
    name = "nvmlDeviceGetName"(RawDevice, *mut c_char, c_uint);
    uuid = "nvmlDeviceGetUUID"(RawDevice, *mut c_char, c_uint);
    pci_info = "nvmlDeviceGetPciInfo_v3"(RawDevice, *mut PciInfo);
    memory_info = "nvmlDeviceGetMemoryInfo"(RawDevice, *mut Memory);
    clock = "nvmlDeviceGetClockInfo"(RawDevice, c_uint, *mut c_uint);
    max_clock = "nvmlDeviceGetMaxClockInfo"(RawDevice, c_uint, *mut c_uint);
    power_limit = "nvmlDeviceGetPowerManagementLimit"(RawDevice, *mut c_uint);
    power_usage = "nvmlDeviceGetPowerUsage"(RawDevice, *mut c_uint);
    temperature = "nvmlDeviceGetTemperature"(RawDevice, c_uint, *mut c_uint);
    utilization = "nvmlDeviceGetUtilizationRates"(RawDevice, *mut Utilization);
    pcie_gen = "nvmlDeviceGetCurrPcieLinkGeneration"(RawDevice, *mut c_uint);
    pcie_width = "nvmlDeviceGetCurrPcieLinkWidth"(RawDevice, *mut c_uint);
    pcie_max_gen = "nvmlDeviceGetMaxPcieLinkGeneration"(RawDevice, *mut c_uint);
    pcie_max_width = "nvmlDeviceGetMaxPcieLinkWidth"(RawDevice, *mut c_uint);
    nvlink_state = "nvmlDeviceGetNvLinkState"(RawDevice, c_uint, *mut c_uint);
    nvlink_remote_pci = "nvmlDeviceGetNvLinkRemotePciInfo_v2"(RawDevice, c_uint, *mut PciInfo);
}

/// Calls an optional NVML function; a missing one fails like an unsupported query.
macro_rules! call {
    ($nvml:expr, $f:ident ($($arg:expr),*)) => {
        match $nvml.api.$f {
            // SAFETY: the arguments are a live device handle from NVML and pointers to locals
            // of the types and sizes the declaration names.
            Some(f) => status(stringify!($f), unsafe { f($($arg),*) }),
            None => status(stringify!($f), ERROR_FUNCTION_NOT_FOUND),
        }
    };
}

#[derive(Debug, Clone, Error)]
pub enum NvmlError {
    #[error("{LIBRARY} could not be loaded ({0}); it is installed with the NVIDIA driver")]
    Missing(String),
    #[error("NVML {call} failed: {}", describe(*code))]
    Call { call: &'static str, code: i32 },
    #[error("no NVML device at PCI {0}")]
    NotFound(String),
}

fn describe(code: Status) -> &'static str {
    match code {
        1 => "NVML is not initialised",
        2 => "invalid argument",
        ERROR_NOT_SUPPORTED => "not supported on this GPU",
        4 => "no permission",
        6 => "not found",
        9 => "the NVIDIA kernel driver is not loaded",
        ERROR_FUNCTION_NOT_FOUND => "this driver's NVML lacks the function",
        15 => "the GPU has fallen off the bus",
        _ => "unknown error",
    }
}

fn status(call: &'static str, code: Status) -> Result<(), NvmlError> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(NvmlError::Call { call, code })
    }
}

fn text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A GPU's place on the PCI bus: (domain, bus, device).
pub type PciLocation = (u32, u32, u32);

/// An NVML device handle. NVML is thread-safe and its handles stay valid until shutdown,
/// which only [`Nvml`]'s drop performs.
#[derive(Clone, Copy)]
pub struct Device {
    raw: RawDevice,
    pub index: u32,
}

// SAFETY: see the type's comment; the pointer is an opaque token NVML hands out.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

/// An initialised NVML; shut down when dropped.
pub struct Nvml {
    api: Api,
    _lib: Library,
}

impl Nvml {
    /// Opens and initialises NVML, or says why it cannot.
    pub fn load() -> Result<Arc<Nvml>, NvmlError> {
        // SAFETY: opening the driver's NVML runs only its own initialisers.
        let lib =
            unsafe { Library::new(LIBRARY) }.map_err(|e| NvmlError::Missing(e.to_string()))?;
        let nvml = Nvml {
            api: Api::resolve(&lib),
            _lib: lib,
        };
        if nvml.api.shutdown.is_none() {
            return Err(NvmlError::Missing(
                "the library has no nvmlShutdown; it is not NVML".into(),
            ));
        }
        call!(nvml, init())?;
        Ok(Arc::new(nvml))
    }

    /// The driver version, such as `580.95.05`.
    pub fn driver_version(&self) -> Option<String> {
        let mut buf = [0 as c_char; DRIVER_VERSION_BUFFER];
        call!(self, driver_version(buf.as_mut_ptr(), buf.len() as c_uint)).ok()?;
        Some(text(&buf))
    }

    /// The CUDA driver API version the driver supports, as CUDA writes it (13000 is 13.0).
    pub fn cuda_driver_version(&self) -> Option<i32> {
        let mut v: c_int = 0;
        call!(self, cuda_driver_version(&mut v)).ok()?;
        Some(v)
    }

    pub fn device_count(&self) -> Result<u32, NvmlError> {
        let mut n: c_uint = 0;
        call!(self, device_count(&mut n))?;
        Ok(n)
    }

    pub fn device(&self, index: u32) -> Result<Device, NvmlError> {
        let mut raw: RawDevice = std::ptr::null_mut();
        call!(self, handle_by_index(index, &mut raw))?;
        Ok(Device { raw, index })
    }

    /// The device at a PCI location (which a CUDA ordinal names too).
    pub fn device_at(&self, pci: PciLocation) -> Result<Device, NvmlError> {
        for index in 0..self.device_count()? {
            let d = self.device(index)?;
            if self.pci(d).is_some_and(|(loc, _)| loc == pci) {
                return Ok(d);
            }
        }
        Err(NvmlError::NotFound(format_bus_id(pci)))
    }

    /// PCI location and NVML's bus id string (`00000000:1B:00.0`).
    fn pci(&self, d: Device) -> Option<(PciLocation, String)> {
        let mut p = PciInfo::default();
        call!(self, pci_info(d.raw, &mut p)).ok()?;
        Some(((p.domain, p.bus, p.device), text(&p.bus_id)))
    }

    fn string(
        &self,
        f: Option<unsafe extern "C" fn(RawDevice, *mut c_char, c_uint) -> Status>,
        d: Device,
        len: usize,
    ) -> Option<String> {
        let mut buf = vec![0 as c_char; len];
        let f = f?;
        // SAFETY: `buf` holds `len` bytes, the length passed.
        status("string query", unsafe {
            f(d.raw, buf.as_mut_ptr(), len as c_uint)
        })
        .ok()?;
        Some(text(&buf))
    }

    fn uint(
        &self,
        f: Option<unsafe extern "C" fn(RawDevice, *mut c_uint) -> Status>,
        d: Device,
    ) -> Option<u32> {
        let mut v: c_uint = 0;
        // SAFETY: `v` is a live c_uint the function writes.
        status("query", unsafe { f?(d.raw, &mut v) }).ok()?;
        Some(v)
    }

    fn clock(&self, max: bool, d: Device, which: c_uint) -> Option<u32> {
        let mut v: c_uint = 0;
        if max {
            call!(self, max_clock(d.raw, which, &mut v)).ok()?;
        } else {
            call!(self, clock(d.raw, which, &mut v)).ok()?;
        }
        Some(v)
    }

    fn memory(&self, d: Device) -> Option<Memory> {
        let mut m = Memory::default();
        call!(self, memory_info(d.raw, &mut m)).ok()?;
        Some(m)
    }

    /// Active NVLinks and the PCI bus id at the far end of each, grouped by peer. `None` when
    /// this NVML cannot say; no links at all (a PCIe-only GPU) is `Some` with zero.
    fn nvlink(&self, d: Device) -> Option<NvLink> {
        let mut out = NvLink::default();
        let mut answered = false;
        for link in 0..NVLINK_MAX_LINKS {
            let mut state: c_uint = 0;
            match call!(self, nvlink_state(d.raw, link, &mut state)) {
                Ok(()) => answered = true,
                // A GPU without NVLink, or a link number past this GPU's last.
                Err(NvmlError::Call {
                    code: ERROR_NOT_SUPPORTED | 2,
                    ..
                }) => {
                    answered = true;
                    continue;
                }
                Err(_) => continue,
            }
            if state != FEATURE_ENABLED {
                continue;
            }
            out.active_links += 1;
            let mut p = PciInfo::default();
            let peer = match call!(self, nvlink_remote_pci(d.raw, link, &mut p)) {
                Ok(()) => text(&p.bus_id),
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
        let memory = self.memory(d);
        let pci = self.pci(d);
        NvmlDevice {
            index: d.index,
            name: self.string(self.api.name, d, NAME_BUFFER),
            uuid: self.string(self.api.uuid, d, UUID_BUFFER),
            pci: pci.as_ref().map(|p| p.0),
            pci_bus_id: pci.map(|p| p.1),
            memory_total: memory.as_ref().map(|m| m.total),
            memory_free: memory.as_ref().map(|m| m.free),
            clocks: Clocks {
                sm_mhz: self.clock(false, d, CLOCK_SM),
                sm_max_mhz: self.clock(true, d, CLOCK_SM),
                memory_mhz: self.clock(false, d, CLOCK_MEM),
                memory_max_mhz: self.clock(true, d, CLOCK_MEM),
            },
            power_limit_w: self.uint(self.api.power_limit, d).map(milliwatts),
            power_draw_w: self.uint(self.api.power_usage, d).map(milliwatts),
            temperature_c: self.temperature(d),
            pcie: Pcie {
                generation: self.uint(self.api.pcie_gen, d),
                width: self.uint(self.api.pcie_width, d),
                max_generation: self.uint(self.api.pcie_max_gen, d),
                max_width: self.uint(self.api.pcie_max_width, d),
            },
            nvlink: self.nvlink(d),
        }
    }

    fn temperature(&self, d: Device) -> Option<u32> {
        let mut t: c_uint = 0;
        call!(self, temperature(d.raw, TEMPERATURE_GPU, &mut t)).ok()?;
        Some(t)
    }

    /// One reading of what changes while a GPU works.
    pub fn sample(&self, d: Device, gpu: usize, elapsed_s: f64) -> DeviceSample {
        let mut u = Utilization::default();
        let util = call!(self, utilization(d.raw, &mut u)).ok().map(|()| u);
        DeviceSample {
            elapsed_s,
            gpu,
            gpu_util_pct: util.as_ref().map(|u| u.gpu),
            mem_util_pct: util.as_ref().map(|u| u.memory),
            power_w: self.uint(self.api.power_usage, d).map(milliwatts),
            sm_clock_mhz: self.clock(false, d, CLOCK_SM),
            mem_clock_mhz: self.clock(false, d, CLOCK_MEM),
            temperature_c: self.temperature(d),
            mem_used_bytes: self.memory(d).map(|m| m.used),
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // NVML counts initialisations; this undoes the one `load` made.
        let _ = call!(self, shutdown());
    }
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
    fn struct_layouts_match_nvml_h() {
        assert_eq!(std::mem::size_of::<PciInfo>(), 16 + 5 * 4 + 32);
        assert_eq!(std::mem::size_of::<Memory>(), 24);
        assert_eq!(std::mem::size_of::<Utilization>(), 8);
    }

    #[test]
    fn bus_ids_read_as_nvml_writes_them() {
        assert_eq!(format_bus_id((0, 0x1b, 0)), "00000000:1B:00.0");
        let mut buf = [0 as c_char; 8];
        for (i, b) in b"GPU-ab".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(text(&buf), "GPU-ab");
    }

    #[test]
    fn errors_say_what_failed() {
        let e = status("nvmlDeviceGetPowerUsage", ERROR_NOT_SUPPORTED).unwrap_err();
        assert_eq!(
            e.to_string(),
            "NVML nvmlDeviceGetPowerUsage failed: not supported on this GPU"
        );
        assert!(status("x", SUCCESS).is_ok());
    }

    #[test]
    fn without_a_driver_loading_fails_with_the_library_name() {
        match Nvml::load() {
            Ok(nvml) => assert!(nvml.device_count().is_ok()),
            Err(e) => assert!(e.to_string().contains(LIBRARY), "{e}"),
        }
    }
}

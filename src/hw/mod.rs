//! Hardware detection: every GPU (through CUDA and NVML), the driver, the CPU and RAM, and
//! the settings kiln recommends for them.
//!
//! [`detect`] never fails: a machine without a GPU gets a report of its CPU and RAM and one
//! line saying why no GPU was found ([`NoGpu`]); a query that one GPU or driver cannot answer
//! leaves that field `None`. [`probe`] measures the GEMM and copy rates that bound training
//! speed; [`nvml::Sampler`] watches a GPU while a run trains.

pub mod cpu;
pub mod nvml;
pub mod probe;

pub use cpu::{CpuInfo, RamInfo};
pub use probe::ProbeResult;

use crate::engine::cuda::{self, CudaError};
use nvml::{Clocks, NvLink, Nvml, NvmlDevice, Pcie};
use serde::Serialize;

/// Everything `kiln hw` reports; its JSON form (`kiln hw --json`) keeps these field names.
#[derive(Debug, Clone, Serialize)]
pub struct HwReport {
    pub driver: DriverInfo,
    pub gpus: Vec<GpuReport>,
    /// Why kiln has no GPU to train on; `None` when it has one.
    pub no_gpu: Option<NoGpu>,
    pub cpu: CpuInfo,
    pub ram: RamInfo,
    pub recommendations: Vec<Recommendation>,
    /// Things worth knowing that are not an error (NVML missing, GPUs hidden from CUDA).
    pub notes: Vec<String>,
    /// Measured rates, when asked for (`kiln hw --probe`).
    pub probe: Option<ProbeResult>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DriverInfo {
    /// The NVIDIA driver version, such as `580.95.05`.
    pub version: Option<String>,
    /// The CUDA driver API version the driver supports, such as `13.0`.
    pub cuda_version: Option<String>,
}

/// What each number format's tensor cores exist for, from the compute capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    pub bf16: bool,
    pub tf32: bool,
    pub fp8: bool,
}

impl Capabilities {
    /// bf16 and TF32 arrived with Ampere (8.0), FP8 with Ada (8.9) and Hopper (9.0).
    pub fn of((major, minor): (u32, u32)) -> Capabilities {
        let ampere = major >= 8;
        Capabilities {
            bf16: ampere,
            tf32: ampere,
            fp8: (major, minor) >= (8, 9),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuReport {
    /// CUDA ordinal (`train.device=cuda:N`); `None` for a GPU CUDA cannot use.
    pub ordinal: Option<usize>,
    pub name: String,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    pub memory_total: Option<u64>,
    pub memory_free: Option<u64>,
    /// (major, minor): (9, 0) is Hopper.
    pub compute_capability: Option<(u32, u32)>,
    pub sm_count: Option<u32>,
    pub supports: Option<Capabilities>,
    pub clocks: Clocks,
    pub power_limit_w: Option<f64>,
    pub power_draw_w: Option<f64>,
    pub temperature_c: Option<u32>,
    pub pcie: Pcie,
    /// `None` when NVML cannot say; zero active links on a PCIe-only GPU.
    pub nvlink: Option<NvLink>,
}

impl GpuReport {
    fn new(cuda: Option<&cuda::GpuInfo>, nvml: Option<NvmlDevice>) -> GpuReport {
        let cc = cuda.map(|g| g.compute_capability);
        let name = cuda
            .map(|g| g.name.clone())
            .or_else(|| nvml.as_ref().and_then(|n| n.name.clone()))
            .unwrap_or_else(|| "unknown GPU".into());
        let nv = nvml.unwrap_or_else(|| NvmlDevice {
            index: 0,
            name: None,
            uuid: None,
            pci: None,
            pci_bus_id: None,
            memory_total: None,
            memory_free: None,
            clocks: Clocks::default(),
            power_limit_w: None,
            power_draw_w: None,
            temperature_c: None,
            pcie: Pcie::default(),
            nvlink: None,
        });
        GpuReport {
            ordinal: cuda.map(|g| g.ordinal),
            name,
            uuid: nv.uuid,
            pci_bus_id: nv.pci_bus_id,
            memory_total: cuda.map(|g| g.total_memory as u64).or(nv.memory_total),
            memory_free: nv.memory_free,
            compute_capability: cc,
            sm_count: cuda.map(|g| g.sm_count),
            supports: cc.map(Capabilities::of),
            clocks: nv.clocks,
            power_limit_w: nv.power_limit_w,
            power_draw_w: nv.power_draw_w,
            temperature_c: nv.temperature_c,
            pcie: nv.pcie,
            nvlink: nv.nvlink,
        }
    }
}

/// Why no GPU is usable, sorted so scripts can act on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NoGpuReason {
    /// Neither libcuda nor libnvidia-ml loads: no NVIDIA driver is installed.
    NoDriver,
    /// The driver is there and reports no GPU (or `CUDA_VISIBLE_DEVICES` hides them all).
    NoDevice,
    /// One of the driver's libraries loads and another does not.
    LibraryMissing,
    /// The driver is there and failed.
    DriverError,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NoGpu {
    pub reason: NoGpuReason,
    /// One line for the person at the terminal.
    pub detail: String,
}

/// Sorts a failed CUDA probe into a [`NoGpu`]; `nvml` says whether NVML loaded and how many
/// GPUs it sees, which tells "no driver" from "a library of the driver missing".
fn no_gpu(cuda_err: &CudaError, nvml: Result<usize, &nvml::NvmlError>) -> NoGpu {
    let hidden = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
        .unwrap_or_default();
    match (cuda_err, nvml) {
        (CudaError::LibraryMissing { library, .. }, Err(_)) => NoGpu {
            reason: NoGpuReason::NoDriver,
            detail: format!(
                "no NVIDIA driver: neither {library} nor {} could be loaded",
                nvml::LIBRARY
            ),
        },
        (CudaError::LibraryMissing { library, .. }, Ok(n)) => NoGpu {
            reason: NoGpuReason::LibraryMissing,
            detail: format!(
                "{library} could not be loaded although {} sees {n} GPU(s); reinstall the NVIDIA driver's CUDA library",
                nvml::LIBRARY
            ),
        },
        (CudaError::NoDevice(_), _) => NoGpu {
            reason: NoGpuReason::NoDevice,
            detail: format!("the NVIDIA driver is installed but reports no GPU{hidden}"),
        },
        (other, _) => NoGpu {
            reason: NoGpuReason::DriverError,
            detail: format!("the NVIDIA driver failed: {other}"),
        },
    }
}

/// The settings kiln recommends for one device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Recommendation {
    /// As `train.device` takes it: `cuda:0` or `cpu`.
    pub device: String,
    /// As `train.precision` takes it.
    pub precision: &'static str,
    /// Whether `train.precision=tf32` would use TF32 tensor cores here.
    pub tf32_available: bool,
    pub fp8_available: bool,
    /// CPU threads the kernels run on (CPU only).
    pub threads: Option<usize>,
    pub why: String,
}

/// What to train with on a GPU of compute capability `cc`.
pub fn recommend_gpu(ordinal: usize, cc: (u32, u32)) -> Recommendation {
    let caps = Capabilities::of(cc);
    let (precision, why) = if caps.bf16 {
        (
            "bf16-mixed",
            format!(
                "compute capability {}.{} has bf16 tensor cores: bf16 compute, fp32 master weights, no loss scaling",
                cc.0, cc.1
            ),
        )
    } else {
        (
            "fp16-mixed",
            format!(
                "compute capability {}.{} has no bf16: fp16 compute with dynamic loss scaling, fp32 master weights",
                cc.0, cc.1
            ),
        )
    };
    Recommendation {
        device: format!("cuda:{ordinal}"),
        precision,
        tf32_available: caps.tf32,
        fp8_available: caps.fp8,
        threads: None,
        why,
    }
}

/// What to train with when there is no GPU.
pub fn recommend_cpu(threads: usize) -> Recommendation {
    Recommendation {
        device: "cpu".into(),
        precision: "fp32",
        tf32_available: false,
        fp8_available: false,
        threads: Some(threads),
        why: format!(
            "no usable GPU: training runs on the CPU in fp32 on {threads} threads (set RAYON_NUM_THREADS to change)"
        ),
    }
}

/// Looks at the machine. Never fails; what cannot be found is `None` or explained.
pub fn detect() -> HwReport {
    let nvml = Nvml::load();
    let mut notes = Vec::new();
    let nvml_devices: Vec<NvmlDevice> = match &nvml {
        Ok(n) => (0..n.device_count().unwrap_or(0))
            .filter_map(|i| n.device(i).ok())
            .map(|d| n.describe(d))
            .collect(),
        Err(_) => Vec::new(),
    };
    let driver = DriverInfo {
        version: nvml.as_ref().ok().and_then(|n| n.driver_version()),
        cuda_version: nvml
            .as_ref()
            .ok()
            .and_then(|n| n.cuda_driver_version())
            .or_else(|| cuda::driver_api_version().ok())
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)),
    };
    let cpu = cpu::detect_cpu();
    let (gpus, no_gpu) = match cuda::probe_devices() {
        Ok(found) => {
            if let Err(e) = &nvml {
                notes.push(format!(
                    "{e}: clocks, power, PCIe, NVLink and free memory are unknown"
                ));
            } else if nvml_devices.len() > found.len() {
                notes.push(format!(
                    "NVML sees {} GPUs and CUDA {}: CUDA_VISIBLE_DEVICES hides the others",
                    nvml_devices.len(),
                    found.len()
                ));
            }
            let gpus: Vec<GpuReport> = found
                .iter()
                .map(|g| {
                    let pci = cuda::pci_location(g.ordinal).ok();
                    let nv = nvml_devices
                        .iter()
                        .find(|d| pci.is_some() && d.pci == pci)
                        .cloned();
                    GpuReport::new(Some(g), nv)
                })
                .collect();
            (gpus, None)
        }
        Err(e) => {
            let seen = nvml.as_ref().map(|_| nvml_devices.len());
            let gpus = nvml_devices
                .into_iter()
                .map(|d| GpuReport::new(None, Some(d)))
                .collect();
            (gpus, Some(no_gpu(&e, seen)))
        }
    };
    let recommendations = if no_gpu.is_some() {
        vec![recommend_cpu(cpu.compute_threads)]
    } else {
        gpus.iter()
            .filter_map(|g| Some(recommend_gpu(g.ordinal?, g.compute_capability?)))
            .collect()
    };
    HwReport {
        driver,
        gpus,
        no_gpu,
        cpu,
        ram: cpu::detect_ram(),
        recommendations,
        notes,
        probe: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turing_trains_in_fp16_mixed() {
        let r = recommend_gpu(0, (7, 5));
        assert_eq!(r.precision, "fp16-mixed");
        assert!(!r.tf32_available && !r.fp8_available);
        assert!(r.why.contains("loss scaling"), "{}", r.why);
    }

    #[test]
    fn ampere_trains_in_bf16_mixed_with_tf32_and_no_fp8() {
        let r = recommend_gpu(1, (8, 0));
        assert_eq!((r.device.as_str(), r.precision), ("cuda:1", "bf16-mixed"));
        assert!(r.tf32_available && !r.fp8_available);
    }

    #[test]
    fn fp8_from_ada_and_hopper() {
        assert!(Capabilities::of((8, 9)).fp8);
        assert!(!Capabilities::of((8, 6)).fp8);
        let r = recommend_gpu(0, (9, 0));
        assert_eq!(r.precision, "bf16-mixed");
        assert!(r.fp8_available && r.tf32_available);
    }

    #[test]
    fn cpu_recommendation_names_the_threads() {
        let r = recommend_cpu(12);
        assert_eq!((r.precision, r.threads), ("fp32", Some(12)));
        assert!(r.why.contains("12 threads"), "{}", r.why);
    }

    #[test]
    fn the_reasons_for_no_gpu_are_told_apart() {
        let missing = CudaError::LibraryMissing {
            library: "libcuda.so".into(),
            tried: String::new(),
            searched: String::new(),
            remedy: "",
        };
        let nvml_err = nvml::NvmlError::Missing("not found".into());
        let r = no_gpu(&missing, Err(&nvml_err));
        assert_eq!(r.reason, NoGpuReason::NoDriver);
        assert!(r.detail.contains("libcuda.so") && r.detail.contains(nvml::LIBRARY));
        assert_eq!(no_gpu(&missing, Ok(2)).reason, NoGpuReason::LibraryMissing);
        let none = no_gpu(&CudaError::NoDevice("0 devices".into()), Ok(0));
        assert_eq!(none.reason, NoGpuReason::NoDevice);
        let failed = no_gpu(&CudaError::Driver("CUDA_ERROR_UNKNOWN".into()), Ok(1));
        assert_eq!(failed.reason, NoGpuReason::DriverError);
        assert!(failed.detail.contains("CUDA_ERROR_UNKNOWN"));
    }

    #[test]
    fn detect_reports_this_machine() {
        let r = detect();
        assert!(r.cpu.threads >= 1);
        // Either GPUs with a recommendation each, or the reason and the CPU recommendation.
        match &r.no_gpu {
            None => assert_eq!(r.recommendations.len(), r.gpus.len()),
            Some(why) => {
                assert!(!why.detail.is_empty());
                assert_eq!(r.recommendations[0].device, "cpu");
            }
        }
    }
}

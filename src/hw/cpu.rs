//! The CPU and RAM, read from `/proc/cpuinfo`, sysfs and `/proc/meminfo`.
//!
//! The parsers take the file text, so they are tested against fixed samples; [`detect_cpu`]
//! and [`detect_ram`] read the real files and fall back field by field (an ARM `cpuinfo` has
//! no `model name` or `core id`; a container may hide sysfs), leaving `None` for what nothing
//! could tell.

use serde::Serialize;
use std::collections::BTreeSet;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CpuInfo {
    pub model: Option<String>,
    /// Distinct physical cores (a core with two hardware threads counts once).
    pub physical_cores: Option<usize>,
    /// Logical CPUs (hardware threads) the kernel lists.
    pub threads: usize,
    /// Threads kiln's CPU kernels run on (rayon's pool: the CPUs this process may use).
    pub compute_threads: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RamInfo {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
}

/// What `/proc/cpuinfo` says: the model name, the logical CPUs, and the physical cores when
/// it lists `physical id` and `core id` (x86 does, most ARM kernels do not).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuInfoText {
    pub model: Option<String>,
    pub threads: usize,
    pub physical_cores: Option<usize>,
}

pub fn parse_cpuinfo(text: &str) -> CpuInfoText {
    let mut out = CpuInfoText::default();
    let mut cores = BTreeSet::new();
    let mut every_cpu_has_core_id = true;
    // One block per logical CPU, separated by blank lines.
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let field = |key: &str| {
            block.lines().find_map(|line| {
                let (k, v) = line.split_once(':')?;
                (k.trim() == key).then(|| v.trim().to_string())
            })
        };
        if field("processor").is_none() {
            continue; // the trailing summary block some ARM kernels print
        }
        out.threads += 1;
        if out.model.is_none() {
            // x86 says `model name`; some ARM and POWER kernels `Model`, `cpu` or `Hardware`.
            out.model = ["model name", "Model", "cpu", "Hardware"]
                .into_iter()
                .find_map(|k| field(k).filter(|v| !v.is_empty()));
        }
        match (field("physical id"), field("core id")) {
            (Some(p), Some(c)) => {
                cores.insert((p, c));
            }
            _ => every_cpu_has_core_id = false,
        }
    }
    if every_cpu_has_core_id && !cores.is_empty() {
        out.physical_cores = Some(cores.len());
    }
    out
}

/// Physical cores from sysfs: the distinct (package, core) pairs over the online CPUs.
fn sysfs_physical_cores(root: &Path) -> Option<usize> {
    let mut cores = BTreeSet::new();
    for entry in std::fs::read_dir(root).ok()?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let is_cpu = name
            .strip_prefix("cpu")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !is_cpu {
            continue;
        }
        let topo = entry.path().join("topology");
        let read = |f: &str| std::fs::read_to_string(topo.join(f)).ok();
        // An offline CPU has no topology directory; it is not a core kiln can use.
        if let (Some(pkg), Some(core)) = (read("physical_package_id"), read("core_id")) {
            cores.insert((pkg.trim().to_string(), core.trim().to_string()));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

pub fn detect_cpu() -> CpuInfo {
    let parsed = std::fs::read_to_string("/proc/cpuinfo")
        .map(|t| parse_cpuinfo(&t))
        .unwrap_or_default();
    let compute_threads = rayon::current_num_threads();
    let threads = if parsed.threads > 0 {
        parsed.threads
    } else {
        std::thread::available_parallelism().map_or(compute_threads, |n| n.get())
    };
    CpuInfo {
        model: parsed.model,
        physical_cores: parsed
            .physical_cores
            .or_else(|| sysfs_physical_cores(Path::new("/sys/devices/system/cpu"))),
        threads,
        compute_threads,
    }
}

/// `MemTotal` and `MemAvailable` in bytes. Kernels before 3.14 lack `MemAvailable`; there
/// free plus page cache is the nearest estimate.
pub fn parse_meminfo(text: &str) -> RamInfo {
    let kib = |key: &str| {
        text.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            if k.trim() != key {
                return None;
            }
            let mut parts = v.split_whitespace();
            let n: u64 = parts.next()?.parse().ok()?;
            // The kernel always writes kB (KiB); anything else is not a number to trust.
            match parts.next() {
                Some("kB") => Some(n * 1024),
                None => Some(n),
                _ => None,
            }
        })
    };
    let estimate = || Some(kib("MemFree")? + kib("Buffers").unwrap_or(0) + kib("Cached")?);
    RamInfo {
        total_bytes: kib("MemTotal"),
        available_bytes: kib("MemAvailable").or_else(estimate),
    }
}

pub fn detect_ram() -> RamInfo {
    std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo(&t))
        .unwrap_or(RamInfo {
            total_bytes: None,
            available_bytes: None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two cores with two hardware threads each, as an x86 kernel lists them.
    const X86: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\ncore id\t\t: 1\n\n\
processor\t: 2\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\ncore id\t\t: 0\n\n\
processor\t: 3\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: 0\ncore id\t\t: 1\n\n";

    /// An arm64 kernel: no model name, no core ids, a trailing block without `processor`.
    const ARM: &str = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n\n\
processor\t: 1\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n\n\
Hardware\t: NVIDIA Grace\n";

    #[test]
    fn x86_cpuinfo_gives_model_threads_and_cores() {
        let c = parse_cpuinfo(X86);
        assert_eq!(c.model.as_deref(), Some("Intel(R) Xeon(R) Platinum 8480+"));
        assert_eq!(c.threads, 4);
        assert_eq!(c.physical_cores, Some(2));
    }

    #[test]
    fn two_sockets_with_the_same_core_ids_are_distinct_cores() {
        let text = "processor : 0\nphysical id : 0\ncore id : 0\n\nprocessor : 1\nphysical id : 1\ncore id : 0\n";
        assert_eq!(parse_cpuinfo(text).physical_cores, Some(2));
    }

    #[test]
    fn arm_cpuinfo_leaves_cores_to_sysfs() {
        let c = parse_cpuinfo(ARM);
        assert_eq!(c.threads, 2);
        assert_eq!(c.physical_cores, None);
        assert_eq!(c.model, None);
    }

    #[test]
    fn garbage_cpuinfo_yields_nothing_rather_than_failing() {
        assert_eq!(parse_cpuinfo("not a cpuinfo file"), CpuInfoText::default());
    }

    #[test]
    fn meminfo_in_bytes() {
        let text = "MemTotal:       24684084 kB\nMemFree:        21789488 kB\nMemAvailable:   23827156 kB\nBuffers:            4012 kB\n";
        let r = parse_meminfo(text);
        assert_eq!(r.total_bytes, Some(24_684_084 * 1024));
        assert_eq!(r.available_bytes, Some(23_827_156 * 1024));
    }

    #[test]
    fn meminfo_without_memavailable_estimates_from_free_and_cache() {
        let text = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 10 kB\nCached: 200 kB\n";
        assert_eq!(parse_meminfo(text).available_bytes, Some(310 * 1024));
        assert_eq!(parse_meminfo("").total_bytes, None);
    }

    #[test]
    fn sysfs_cores_of_a_fake_tree() {
        let dir = tempfile::tempdir().unwrap();
        for (cpu, core) in [(0, 0), (1, 1), (2, 0), (3, 1)] {
            let topo = dir.path().join(format!("cpu{cpu}/topology"));
            std::fs::create_dir_all(&topo).unwrap();
            std::fs::write(topo.join("physical_package_id"), "0\n").unwrap();
            std::fs::write(topo.join("core_id"), format!("{core}\n")).unwrap();
        }
        std::fs::create_dir_all(dir.path().join("cpufreq")).unwrap();
        assert_eq!(sysfs_physical_cores(dir.path()), Some(2));
    }

    #[test]
    fn this_machine_has_at_least_one_thread() {
        let c = detect_cpu();
        assert!(c.threads >= 1 && c.compute_threads >= 1);
        assert!(c.physical_cores.is_none_or(|p| p <= c.threads));
    }
}

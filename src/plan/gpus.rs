//! Named GPUs for `kiln plan --gpu NAME`: memory as the driver reports it, compute
//! capability, and dense tensor-core and fp32 peaks from the vendors' datasheets (no
//! sparsity; GeForce figures with fp32 accumulation). A peak left out is one not known here.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GpuSpec {
    /// The name `--gpu` takes.
    pub name: &'static str,
    /// Other names that mean the same card.
    pub aliases: &'static [&'static str],
    pub description: &'static str,
    /// Total device memory as `cudaMemGetInfo` reports it, in MiB.
    pub memory_mib: usize,
    pub compute_capability: (u32, u32),
    /// Dense 16-bit tensor-core peak (bf16 where the GPU has it, else fp16), TFLOP/s.
    pub tensor_tflops: Option<f64>,
    /// Dense fp32 (CUDA core) peak, TFLOP/s.
    pub fp32_tflops: Option<f64>,
}

impl GpuSpec {
    pub fn memory_bytes(&self) -> usize {
        self.memory_mib << 20
    }

    /// bf16 arithmetic arrived with compute capability 8.0.
    pub fn has_bf16(&self) -> bool {
        self.compute_capability.0 >= 8
    }
}

const fn gpu(
    name: &'static str,
    aliases: &'static [&'static str],
    description: &'static str,
    memory_mib: usize,
    compute_capability: (u32, u32),
    tensor_tflops: Option<f64>,
    fp32_tflops: Option<f64>,
) -> GpuSpec {
    GpuSpec {
        name,
        aliases,
        description,
        memory_mib,
        compute_capability,
        tensor_tflops,
        fp32_tflops,
    }
}

pub const CATALOGUE: &[GpuSpec] = &[
    gpu(
        "h100-80gb",
        &["h100", "h100-sxm", "h100-pcie"],
        "NVIDIA H100 80GB",
        81_559,
        (9, 0),
        Some(989.4),
        Some(66.9),
    ),
    gpu(
        "h100-94gb",
        &["h100-nvl"],
        "NVIDIA H100 NVL 94GB",
        95_830,
        (9, 0),
        Some(835.0),
        Some(60.0),
    ),
    gpu(
        "h200-141gb",
        &["h200"],
        "NVIDIA H200 141GB",
        143_771,
        (9, 0),
        Some(989.4),
        Some(66.9),
    ),
    gpu(
        "a100-40gb",
        &["a100"],
        "NVIDIA A100 40GB",
        40_960,
        (8, 0),
        Some(312.0),
        Some(19.5),
    ),
    gpu(
        "a100-80gb",
        &[],
        "NVIDIA A100 80GB",
        81_920,
        (8, 0),
        Some(312.0),
        Some(19.5),
    ),
    gpu(
        "l40s",
        &["l40s-48gb"],
        "NVIDIA L40S 48GB",
        46_068,
        (8, 9),
        Some(362.1),
        Some(91.6),
    ),
    gpu(
        "a10-24gb",
        &["a10"],
        "NVIDIA A10 24GB",
        23_028,
        (8, 6),
        Some(125.0),
        Some(31.2),
    ),
    gpu(
        "rtx4090",
        &["rtx4090-24gb"],
        "NVIDIA GeForce RTX 4090 24GB",
        24_564,
        (8, 9),
        Some(165.2),
        Some(82.6),
    ),
    gpu(
        "rtx4080",
        &["rtx4080-16gb"],
        "NVIDIA GeForce RTX 4080 16GB",
        16_376,
        (8, 9),
        Some(97.5),
        Some(48.7),
    ),
    gpu(
        "rtx3090",
        &["rtx3090-24gb"],
        "NVIDIA GeForce RTX 3090 24GB",
        24_576,
        (8, 6),
        Some(35.6),
        Some(35.6),
    ),
    gpu(
        "rtx3080-10gb",
        &["rtx3080"],
        "NVIDIA GeForce RTX 3080 10GB",
        10_240,
        (8, 6),
        Some(29.8),
        Some(29.8),
    ),
    gpu(
        "rtx3060-12gb",
        &["rtx3060"],
        "NVIDIA GeForce RTX 3060 12GB",
        12_288,
        (8, 6),
        Some(12.7),
        Some(12.7),
    ),
    gpu(
        "t4-16gb",
        &["t4"],
        "NVIDIA T4 16GB",
        15_360,
        (7, 5),
        Some(65.0),
        Some(8.1),
    ),
    gpu(
        "v100-16gb",
        &["v100"],
        "NVIDIA V100 16GB",
        16_160,
        (7, 0),
        Some(125.0),
        Some(15.7),
    ),
    gpu(
        "v100-32gb",
        &[],
        "NVIDIA V100 32GB",
        32_510,
        (7, 0),
        Some(125.0),
        Some(15.7),
    ),
];

/// The GPU `name` names (case-insensitive, by name or alias), or a message listing the
/// known names.
pub fn lookup(name: &str) -> Result<&'static GpuSpec, String> {
    let want = name.trim().to_ascii_lowercase();
    CATALOGUE
        .iter()
        .find(|g| g.name == want || g.aliases.contains(&want.as_str()))
        .ok_or_else(|| {
            let known: Vec<&str> = CATALOGUE.iter().map(|g| g.name).collect();
            format!(
                "unknown GPU '{name}' for --gpu; known GPUs: {}. Leave --gpu out to plan for the GPU in this machine",
                known.join(", ")
            )
        })
}

/// The catalogue entry a driver-reported device name matches, if any (for its peaks).
pub fn match_device_name(device: &str, memory_bytes: usize) -> Option<&'static GpuSpec> {
    let d = device.to_ascii_lowercase().replace(' ', "");
    let family = |g: &&GpuSpec| {
        let base = g.name.split('-').next().unwrap_or(g.name);
        d.contains(base)
    };
    // Within a family (A100 40GB and 80GB), the entry nearest in memory.
    CATALOGUE
        .iter()
        .filter(family)
        .min_by_key(|g| g.memory_bytes().abs_diff(memory_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_resolve_and_unknown_names_list_the_known_ones() {
        assert_eq!(lookup("H100-80GB").unwrap().compute_capability, (9, 0));
        assert_eq!(lookup("h100-nvl").unwrap().name, "h100-94gb");
        assert_eq!(lookup("rtx4090").unwrap().memory_mib, 24_564);
        assert!(!lookup("t4").unwrap().has_bf16());
        let err = lookup("gtx480").unwrap_err();
        for g in CATALOGUE {
            assert!(err.contains(g.name), "{err}");
        }
        assert!(err.contains("unknown GPU 'gtx480'"), "{err}");
        // Every name and alias is unique.
        let mut all: Vec<&str> = CATALOGUE
            .iter()
            .flat_map(|g| std::iter::once(g.name).chain(g.aliases.iter().copied()))
            .collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn driver_names_find_their_entry() {
        let a100 = match_device_name("NVIDIA A100-SXM4-80GB", 81_920 << 20).unwrap();
        assert_eq!(a100.name, "a100-80gb");
        let h200 = match_device_name("NVIDIA H200", 143_771 << 20).unwrap();
        assert_eq!(h200.name, "h200-141gb");
        assert!(match_device_name("Some Other GPU", 1 << 30).is_none());
    }
}

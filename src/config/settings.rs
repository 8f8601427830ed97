//! The settings every run-shaped command shares (`train`, `plan`, `bench train`): the
//! `--profile` choice, the `--config` file and the `KEY=VALUE` overrides, resolved into one
//! configuration the same way everywhere.

use crate::config::auto::{self, GpuView, Machine};
use crate::config::{Config, ConfigError, Profile, ResolvedConfig, profile};
use crate::engine::device::DeviceRequest;
use crate::error::{KilnError, Result};
use std::path::Path;

/// A resolved configuration and a line saying which profile made it and why.
pub struct Settings {
    pub config: ResolvedConfig,
    pub profile_note: String,
}

/// The machine a run on `device` would use: the GPU `device` names (the first GPU for
/// `auto`; none for `cpu` or when no GPU is usable) and the CPU's thread count.
pub fn machine_for(device: &str) -> Result<Machine> {
    let request: DeviceRequest = device.parse().map_err(KilnError::Setting)?;
    let cpu_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ordinal = match request {
        DeviceRequest::Exact(crate::engine::Device::Cpu) => None,
        DeviceRequest::Exact(crate::engine::Device::Cuda(i)) => Some(i),
        DeviceRequest::Auto => Some(0),
    };
    let gpu = ordinal.and_then(|i| {
        let gpus = crate::engine::cuda::probe().ok()?;
        let g = gpus.into_iter().find(|g| g.ordinal == i)?;
        Some(GpuView {
            name: g.name,
            memory_total: g.total_memory,
            compute_capability: g.compute_capability,
        })
    });
    Ok(Machine { gpu, cpu_threads })
}

/// Resolves `--profile`, `--config` and the overrides. `profile_arg` is a built-in name, a
/// `.toml` path, `auto` (pick by the detected GPU, then derive precision, micro-batch,
/// recomputation and offload from the machine) or `none` (defaults only).
pub fn resolve(profile_arg: &str, file: Option<&Path>, overrides: &[String]) -> Result<Settings> {
    // A first pass without a profile says which device the run wants, and rejects bad
    // files and overrides before any hardware is touched.
    let plain = ResolvedConfig::resolve(file, overrides)?;
    match profile_arg {
        "none" => Ok(Settings {
            config: plain,
            profile_note: "profile: none (defaults, --config and overrides only)".into(),
        }),
        "auto" => {
            let machine = machine_for(&plain.config.train.device)?;
            let gpu = machine
                .gpu
                .as_ref()
                .map(|g| (g.name.as_str(), g.memory_total));
            let name = profile::for_gpu(gpu);
            let p = Profile::load(name)?;
            let mut config = ResolvedConfig::resolve_layers(Some(&p), file, overrides)?;
            let fit = |c: &Config| -> std::result::Result<usize, ConfigError> {
                // A configuration the planner's meta step refuses keeps the micro-batch it
                // was given: the run itself then says what is wrong.
                Ok(match &machine.gpu {
                    Some(g) => largest_on_gpu(c, g).unwrap_or(c.train.micro_batch),
                    None => c.train.micro_batch,
                })
            };
            auto::apply(&mut config, &machine, &fit)?;
            let on = match &machine.gpu {
                Some(g) => format!(
                    "{} ({:.0} GiB, compute capability {}.{})",
                    g.name,
                    g.memory_total as f64 / (1u64 << 30) as f64,
                    g.compute_capability.0,
                    g.compute_capability.1
                ),
                None => format!("the CPU ({} threads)", machine.cpu_threads),
            };
            Ok(Settings {
                config,
                profile_note: format!("profile: {name} (auto, for {on})"),
            })
        }
        name => {
            let p = Profile::load(name)?;
            Ok(Settings {
                config: ResolvedConfig::resolve_layers(Some(&p), file, overrides)?,
                profile_note: format!("profile: {}", p.name),
            })
        }
    }
}

/// The planner's largest micro-batch for `c` on `gpu` (0 when one sequence does not fit),
/// with the planner's safety margin and an estimated CUDA context.
fn largest_on_gpu(c: &Config, gpu: &GpuView) -> Result<usize> {
    use crate::engine::{DType, Device};
    use crate::plan::{self, Budget, PlanRequest};
    // Both were validated with the config; a failure here can only make the plan smaller.
    let compute = crate::train::precision::Precision::parse(&c.train.precision)
        .ok()
        .and_then(|p| p.compute_dtype())
        .unwrap_or(DType::F32);
    let vocab = crate::train::model_vocab(c)?;
    let request = PlanRequest::for_config(c, vocab, compute, Device::Cuda(0));
    let mut budget = Budget::gpu(
        gpu.name.clone(),
        gpu.memory_total,
        None,
        gpu.compute_capability,
    );
    if let Ok(Some(limit)) = crate::config::parse_bytes(&c.train.memory_limit) {
        budget = budget.with_pool_limit(limit);
    }
    Ok(plan::largest_micro_batch(&request, &budget)?.unwrap_or(0))
}

//! `--profile auto`: the values that depend on the exact machine and model.
//!
//! After the layers are merged, each rule here fills a key that no file or override chose
//! (a default or a profile's value; see [`ResolvedConfig::is_open`]) and records the rule as
//! the value's origin, so `--print-config` shows why a run uses what it uses:
//! - precision from the compute capability: bf16-mixed from 8.0 (bf16 tensor cores),
//!   fp16-mixed with loss scaling below, fp32 on the CPU;
//! - the micro-batch: the largest that the memory planner says fits (with its safety margin)
//!   among the divisors of the global batch, and the accumulation that reaches the global
//!   batch;
//! - recomputation, then optimizer offload, only when the model would not fit otherwise;
//! - one tokeniser thread per CPU thread.
//!
//! The planner is passed in as a function so these rules can be tested without a GPU.

use super::{Config, ConfigError, ResolvedConfig};

/// What the rules need to know about a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuView {
    pub name: String,
    pub memory_total: usize,
    pub compute_capability: (u32, u32),
}

/// The machine the run will use: the GPU it trains on (`None` for the CPU) and the CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    pub gpu: Option<GpuView>,
    pub cpu_threads: usize,
}

/// The largest micro-batch of `config` (with its own `train.recompute` and
/// `train.offload_optimizer`) that fits the GPU, safety margin included; 0 when not even
/// one sequence fits.
pub type FitFn<'a> = &'a dyn Fn(&Config) -> Result<usize, ConfigError>;

/// Applies every rule to `r` for `machine`; `fit` is the memory planner.
pub fn apply(r: &mut ResolvedConfig, machine: &Machine, fit: FitFn) -> Result<(), ConfigError> {
    r.set_auto(
        "data.loader_threads",
        machine.cpu_threads.max(1) as i64,
        format!("{} CPU threads", machine.cpu_threads),
    )?;
    match &machine.gpu {
        None => {
            r.set_auto("train.precision", "fp32", "no GPU: fp32 on the CPU")?;
            if r.config.train.recompute == "auto" {
                r.set_derived("train.recompute", "none".into(), "no GPU".into())?;
            }
        }
        Some(gpu) => {
            let (major, minor) = gpu.compute_capability;
            let (precision, why) = if major >= 8 {
                ("bf16-mixed", "has bf16 tensor cores")
            } else {
                ("fp16-mixed", "lacks bf16; fp16 with loss scaling")
            };
            r.set_auto(
                "train.precision",
                precision,
                format!("compute capability {major}.{minor} {why}"),
            )?;
            fit_memory(r, gpu, fit)?;
        }
    }
    r.finish_auto()
}

/// Picks recomputation, offload and the micro-batch so the step fits `gpu`.
fn fit_memory(r: &mut ResolvedConfig, gpu: &GpuView, fit: FitFn) -> Result<(), ConfigError> {
    let t = &r.config.train;
    let global = if t.global_batch > 0 {
        t.global_batch
    } else {
        t.micro_batch * t.grad_accum
    };
    // With the accumulation fixed by hand and no global batch, the micro-batch is fixed too.
    let micro_open =
        r.is_open("train.micro_batch") && (t.global_batch > 0 || r.is_open("train.grad_accum"));
    let want = if micro_open { 1 } else { t.micro_batch };
    let recompute_choices: &[&str] = match t.recompute.as_str() {
        "auto" => &["none", "blocks"],
        "blocks" => &["blocks"],
        _ => &["none"],
    };
    // The unfused kernels have no offloaded optimizer to pair with.
    let offload_choices: &[bool] = if !t.fused_kernels {
        &[false]
    } else if r.is_open("train.offload_optimizer") {
        &[false, true]
    } else if t.offload_optimizer {
        &[true]
    } else {
        &[false]
    };
    // Cheapest first: recomputation costs a third more compute, offload costs PCIe traffic
    // every step, so offload is the last resort.
    let mut candidates = Vec::new();
    for &offload in offload_choices {
        for &recompute in recompute_choices {
            candidates.push((recompute, offload));
        }
    }
    let gib = |bytes: usize| bytes as f64 / (1u64 << 30) as f64;
    // What the plan had to fit: the pool cap when one is set, else the GPU.
    let room = match super::parse_bytes(&r.config.train.memory_limit) {
        Ok(Some(limit)) => format!("train.memory_limit ({:.1} GiB)", gib(limit)),
        _ => format!("{:.0} GiB", gib(gpu.memory_total)),
    };
    let mut chosen = None;
    for &(recompute, offload) in &candidates {
        let mut trial = r.config.clone();
        trial.train.recompute = recompute.into();
        trial.train.offload_optimizer = offload;
        let largest = fit(&trial)?;
        if largest >= want {
            chosen = Some((recompute, offload, largest));
            break;
        }
    }
    // Nothing fits: keep the settings; the run reports what one sequence needs when it
    // starts, and `kiln plan` says which options would help.
    let Some((recompute, offload, largest)) = chosen else {
        return Ok(());
    };
    let needed = if recompute != "none" || offload {
        "it would not fit otherwise"
    } else {
        "it fits without"
    };
    if r.config.train.recompute == "auto" {
        r.set_derived(
            "train.recompute",
            recompute.into(),
            format!("{needed} in {room}"),
        )?;
    }
    if offload {
        r.set_auto(
            "train.offload_optimizer",
            true,
            format!("the model does not fit {room} without it"),
        )?;
    }
    if micro_open {
        let micro = (1..=global.min(largest))
            .rev()
            .find(|d| global % d == 0)
            .unwrap_or(1);
        r.set_auto(
            "train.micro_batch",
            micro as i64,
            format!(
                "planner: up to {largest} fit {room}; largest divisor of global batch {global}"
            ),
        )?;
        if r.config.train.global_batch == 0 {
            r.set_auto(
                "train.global_batch",
                global as i64,
                "the configured micro_batch x grad_accum",
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Source;

    const GIB: usize = 1 << 30;

    fn gpu(cc: (u32, u32)) -> Machine {
        Machine {
            gpu: Some(GpuView {
                name: "test gpu".into(),
                memory_total: 24 * GIB,
                compute_capability: cc,
            }),
            cpu_threads: 6,
        }
    }

    fn resolved(overrides: &[&str]) -> ResolvedConfig {
        let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        ResolvedConfig::resolve(None, &o).unwrap()
    }

    #[test]
    fn precision_follows_compute_capability() {
        let fit = |_: &Config| Ok(1000);
        for (cc, want) in [
            ((9, 0), "bf16-mixed"),
            ((8, 0), "bf16-mixed"),
            ((7, 5), "fp16-mixed"),
        ] {
            let mut r = resolved(&[]);
            apply(&mut r, &gpu(cc), &fit).unwrap();
            assert_eq!(r.config.train.precision, want, "{cc:?}");
            assert!(
                matches!(&r.sources["train.precision"], Source::Auto(s) if s.contains("compute capability"))
            );
        }
        let mut r = resolved(&[]);
        apply(
            &mut r,
            &Machine {
                gpu: None,
                cpu_threads: 2,
            },
            &fit,
        )
        .unwrap();
        assert_eq!(r.config.train.precision, "fp32");
        assert_eq!(r.config.train.recompute, "none");
        assert_eq!(r.config.data.loader_threads, 2);
    }

    #[test]
    fn an_override_wins_over_every_rule() {
        let fit = |_: &Config| Ok(3);
        let mut r = resolved(&["train.precision=fp32", "train.micro_batch=16"]);
        apply(&mut r, &gpu((9, 0)), &fit).unwrap();
        assert_eq!(r.config.train.precision, "fp32");
        assert_eq!(r.config.train.micro_batch, 16);
        assert_eq!(r.sources["train.precision"], Source::Override);
    }

    /// The micro-batch is the largest divisor of the global batch that fits; the
    /// accumulation makes up the rest, so the optimisation is unchanged.
    #[test]
    fn micro_batch_is_the_largest_fitting_divisor() {
        let fit = |_: &Config| Ok(7);
        let mut r = resolved(&["train.global_batch=48"]);
        apply(&mut r, &gpu((9, 0)), &fit).unwrap();
        assert_eq!(r.config.train.micro_batch, 6);
        assert_eq!(r.config.train.grad_accum, 8);
        assert_eq!(r.config.train.recompute, "none");
        assert!(!r.config.train.offload_optimizer);
        // Without a global batch, the configured micro x accum (16 x 1) is the target.
        let mut r = resolved(&[]);
        apply(&mut r, &gpu((9, 0)), &fit).unwrap();
        assert_eq!(
            (r.config.train.micro_batch, r.config.train.grad_accum),
            (4, 4)
        );
        assert_eq!(r.config.train.global_batch, 16);
    }

    /// Recomputation comes on only when nothing fits without it, and offload only when
    /// recomputation is not enough.
    #[test]
    fn recompute_then_offload_only_when_needed() {
        let fit = |c: &Config| {
            Ok(
                match (c.train.recompute.as_str(), c.train.offload_optimizer) {
                    ("none", false) => 0,
                    ("blocks", false) => 2,
                    _ => 9,
                },
            )
        };
        let mut r = resolved(&[]);
        apply(&mut r, &gpu((9, 0)), &fit).unwrap();
        assert_eq!(r.config.train.recompute, "blocks");
        assert!(!r.config.train.offload_optimizer);
        assert_eq!(r.config.train.micro_batch, 2);
        assert_eq!(r.config.train.grad_accum, 8);

        let tight = |c: &Config| Ok(if c.train.offload_optimizer { 1 } else { 0 });
        let mut r = resolved(&[]);
        apply(&mut r, &gpu((9, 0)), &tight).unwrap();
        assert_eq!(r.config.train.recompute, "none");
        assert!(r.config.train.offload_optimizer);
        assert_eq!(r.config.train.micro_batch, 1);
        assert!(
            matches!(&r.sources["train.offload_optimizer"], Source::Auto(s) if s.contains("does not fit"))
        );
    }

    #[test]
    fn a_global_batch_the_micro_batch_cannot_reach_is_refused() {
        let err = ResolvedConfig::resolve(
            None,
            &["train.global_batch=10".into(), "train.micro_batch=4".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("train.global_batch = 10") && err.contains("1, 2, 5, 10"),
            "{err}"
        );
        let err = ResolvedConfig::resolve(
            None,
            &[
                "train.global_batch=16".into(),
                "train.micro_batch=4".into(),
                "train.grad_accum=2".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("set only one"), "{err}");
        let r = ResolvedConfig::resolve(
            None,
            &["train.global_batch=16".into(), "train.micro_batch=4".into()],
        )
        .unwrap();
        assert_eq!(r.config.train.grad_accum, 4);
    }
}

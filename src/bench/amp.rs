//! `kiln bench amp`: one model trained the same number of steps on the same batches in each
//! precision (fp32, tf32, bf16-mixed, fp16-mixed), and in bf16-mixed with kiln's fused kernels
//! switched off (`bf16-mixed-unfused`, i.e. `train.fused_kernels=false`): tokens/s, speedup
//! over fp32, peak memory, memory reduction and the loss reached, so a faster mode that learns
//! worse shows it. Read down the table: baseline, + tensor cores, + mixed precision, and
//! bf16-mixed against its unfused row is what the custom kernels add.
//!
//! Every mode starts from the same seed, so the loss curves differ only by arithmetic. On the
//! CPU the modes that exist there run (fp32 and the emulated mixed modes) and the rest are
//! listed as skipped.

use super::{TimedStep, timed_steps};
use crate::data::{self, Corpus};
use crate::engine::Device;
use crate::error::{KilnError, Result};
use crate::report::{BarChart, LinePlot, Plot, Report, Series, Table};
use crate::train::{self, Trainer};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench amp                                  GPT-2 small on a GPU, the default GPT on the CPU
  kiln bench amp --steps 100 --out bench-out/amp
  kiln bench amp --modes fp32,bf16-mixed model.n_layers=6
  kiln bench amp --modes bf16-mixed,bf16-mixed-unfused   what the fused kernels add")]
pub struct BenchAmpArgs {
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Timed optimizer steps per mode (after the warm-up steps).
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Untimed steps per mode before timing starts (their losses are still plotted).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Precisions to compare, in order; the first is the baseline of speedups and savings.
    /// A precision with `-unfused` appended runs with train.fused_kernels=false.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fp32,tf32,bf16-mixed,fp16-mixed,bf16-mixed-unfused"
    )]
    pub modes: Vec<String>,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out/amp")]
    pub out: PathBuf,
    /// Settings file, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Overrides on dotted keys, applied after the suite's model shape (so they win).
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// The GPT-2 small shape (124M parameters at the GPT-2 vocabulary), batch 8 x 1024.
const GPT2_SMALL: [&str; 7] = [
    "model.d_model=768",
    "model.n_layers=12",
    "model.n_heads=12",
    "model.context=1024",
    "train.seq_len=1024",
    "train.micro_batch=8",
    "data.tokenizer=gpt2",
];

/// The suffix of a mode that runs with kiln's fused kernels switched off.
const UNFUSED: &str = "-unfused";

/// A mode's precision and whether it runs the fused kernels.
fn parse_mode(mode: &str) -> Result<(&str, bool)> {
    let (precision, fused) = match mode.strip_suffix(UNFUSED) {
        Some(p) => (p, false),
        None => (mode, true),
    };
    train::Precision::parse(precision)?;
    Ok((precision, fused))
}

/// What runs fused in a `-unfused` mode, for the report.
const STILL_FUSED: &str = "GELU stays as in the fused modes (one kernel each way); \
     cross-entropy, AdamW, the residual add with layernorm and attention (batched GEMMs around \
     a causal softmax that keeps the T x T probabilities) run as chains of single-purpose kernels";

#[derive(Debug, Serialize)]
struct ModeResult {
    mode: String,
    /// The precision trained in (a GPU without bf16 runs fp16-mixed for bf16-mixed).
    ran_as: String,
    median_step_ms: f64,
    tokens_per_s: f64,
    speedup_vs_baseline: Option<f64>,
    peak_bytes: u64,
    memory_reduction_vs_baseline: Option<f64>,
    /// Mean loss over the last quarter of the steps (at least one).
    final_loss: f64,
    /// Loss of every step, warm-up included.
    losses: Vec<f64>,
    skipped_steps: usize,
}

pub fn run(a: BenchAmpArgs) -> Result<()> {
    if a.modes.is_empty() {
        return Err(KilnError::Setting(
            "--modes is empty; name at least one of fp32, tf32, bf16-mixed, fp16-mixed, bf16-mixed-unfused".into(),
        ));
    }
    // A misspelt mode or a zero step count is refused before anything is measured.
    for mode in &a.modes {
        parse_mode(mode)?;
    }
    if a.steps == 0 {
        return Err(KilnError::Setting(
            "--steps must be at least 1: a benchmark needs a timed step".into(),
        ));
    }
    let mut report = Report::new("amp", "Mixed precision: speed, memory and loss", &a.out)?;
    // Which device "auto" means decides the model shape; fp32 opens on every device.
    let (probe_pool, _, _) = train::open_device(&a.device, "fp32")?;
    let device = probe_pool.device();
    drop(probe_pool);
    let mut overrides: Vec<String> = Vec::new();
    if let Device::Cuda(ordinal) = device {
        overrides.extend(GPT2_SMALL.iter().map(|s| s.to_string()));
        report.watch_gpu(ordinal);
    }
    overrides.extend(a.overrides.iter().cloned());
    overrides.push(format!("train.device={device}"));
    overrides.push(format!("train.steps={}", a.warmup + a.steps));
    let cfg = crate::config::settings::resolve("none", a.config.as_deref(), &overrides)?
        .config
        .config;
    let tokenizer = data::tokenizer_by_name(&cfg.data.tokenizer)?;
    let corpus = Corpus::load(train::data_spec(&cfg).corpus.as_deref())?;
    let tokens = tokenizer.encode(&corpus.text);
    data::check_train_len(&tokens, cfg.train.seq_len)?;
    let (b, t, k) = (
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
    );
    println!(
        "kiln bench amp: d_model {}, {} layers, batch {b} x {t} x accum {k}, {} + {} steps per mode on {device}",
        cfg.model.d_model, cfg.model.n_layers, a.warmup, a.steps
    );

    let mut results: Vec<ModeResult> = Vec::new();
    for mode in &a.modes {
        let (precision_name, fused) = parse_mode(mode)?;
        let mut cfg = cfg.clone();
        if !fused {
            if cfg.train.offload_optimizer {
                report.skip(format!(
                    "{mode}: the offloaded optimizer has no unfused form; run without train.offload_optimizer=true"
                ));
                continue;
            }
            cfg.train.fused_kernels = false;
            report.note(format!("{mode}: {STILL_FUSED}"));
        }
        let (pool, precision, notes) = match train::open_device(&device.to_string(), precision_name)
        {
            Ok(opened) => opened,
            Err(KilnError::Setting(why)) => {
                report.skip(format!("{mode}: {why}"));
                continue;
            }
            Err(e) => return Err(e),
        };
        for n in notes {
            report.note(format!("{mode}: {n}"));
        }
        train::set_memory_limit(&pool, &cfg)?;
        let mut trainer = Trainer::new(&cfg, tokenizer.vocab_size(), &pool, precision)?;
        // Warm-up losses are kept for the curves; only the timed steps count for speed.
        let all = timed_steps(&mut trainer, &tokens, 0, a.warmup + a.steps, false)?;
        let peak = pool.stats().peak;
        let timed: Vec<&TimedStep> = all.iter().skip(a.warmup).collect();
        let mut secs: Vec<f64> = timed.iter().map(|s| s.seconds).collect();
        secs.sort_by(f64::total_cmp);
        let median = secs[secs.len() / 2];
        let losses: Vec<f64> = all.iter().map(|s| s.report.loss).collect();
        let tail = (losses.len() / 4).max(1);
        let final_loss = losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64;
        let r = ModeResult {
            mode: mode.clone(),
            ran_as: if fused {
                precision.to_string()
            } else {
                format!("{precision}{UNFUSED}")
            },
            median_step_ms: median * 1e3,
            tokens_per_s: (b * t * k) as f64 / median,
            speedup_vs_baseline: None,
            peak_bytes: peak as u64,
            memory_reduction_vs_baseline: None,
            final_loss,
            skipped_steps: all.iter().filter(|s| s.report.skipped).count(),
            losses,
        };
        println!(
            "{mode:<18} {:>10.1} ms/step {:>12.0} tokens/s  peak {:>8.1} MiB  loss {:.4}",
            r.median_step_ms,
            r.tokens_per_s,
            peak as f64 / (1 << 20) as f64,
            r.final_loss
        );
        results.push(r);
        // Free this mode's device memory before the next one allocates.
        drop(trainer);
    }
    if let Some((tps, peak)) = results.first().map(|r| (r.tokens_per_s, r.peak_bytes)) {
        for r in &mut results {
            r.speedup_vs_baseline = Some(r.tokens_per_s / tps);
            r.memory_reduction_vs_baseline = Some(1.0 - r.peak_bytes as f64 / peak as f64);
        }
    }
    write_report(report, &cfg, &a, results)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

fn write_report(
    mut report: Report,
    cfg: &crate::config::Config,
    a: &BenchAmpArgs,
    results: Vec<ModeResult>,
) -> Result<()> {
    let baseline = results.first().map_or("-".to_string(), |r| r.mode.clone());
    report.text(&format!(
        "GPT: d_model {}, {} layers, {} heads, tokenizer {}; batch {} x {} tokens x accum {}; \
         {} warm-up + {} timed steps per mode from the same seed on the same batches. \
         tokens/s from the median step time (device synchronised after each step); peak is \
         the memory pool's peak over the whole run of the mode; loss reached is the mean over \
         the last quarter of the steps. Speedup and memory reduction are against {baseline}.",
        cfg.model.d_model,
        cfg.model.n_layers,
        cfg.model.n_heads,
        cfg.data.tokenizer,
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
        a.warmup,
        a.steps,
    ));
    let mut t = Table::new(&[
        "mode",
        "ms/step",
        "tokens/s",
        "speedup",
        "peak MiB",
        "memory saved",
        "loss reached",
        "skipped steps",
    ]);
    for r in &results {
        t.row(vec![
            if r.ran_as == r.mode {
                r.mode.clone()
            } else {
                format!("{} (ran as {})", r.mode, r.ran_as)
            },
            format!("{:.1}", r.median_step_ms),
            format!("{:.0}", r.tokens_per_s),
            r.speedup_vs_baseline
                .map_or("-".into(), |s| format!("{s:.2}x")),
            mib(r.peak_bytes),
            r.memory_reduction_vs_baseline
                .map_or("-".into(), |m| format!("{:.0}%", 100.0 * m)),
            format!("{:.4}", r.final_loss),
            r.skipped_steps.to_string(),
        ]);
    }
    report.table(&t);
    let bars = |f: &dyn Fn(&ModeResult) -> f64| -> Vec<(String, f64)> {
        results.iter().map(|r| (r.mode.clone(), f(r))).collect()
    };
    report.plot(
        "tokens_per_s",
        &Plot::Bar(BarChart {
            title: "Training throughput by precision".into(),
            y_label: "tokens/s".into(),
            bars: bars(&|r| r.tokens_per_s),
        }),
    )?;
    report.plot(
        "peak_memory",
        &Plot::Bar(BarChart {
            title: "Peak memory by precision".into(),
            y_label: "MiB".into(),
            bars: bars(&|r| r.peak_bytes as f64 / (1 << 20) as f64),
        }),
    )?;
    report.plot(
        "loss",
        &Plot::Line(LinePlot {
            title: "Training loss by precision (same seed, same batches)".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: results
                .iter()
                .map(|r| {
                    Series::new(
                        r.mode.as_str(),
                        r.losses
                            .iter()
                            .enumerate()
                            .map(|(i, l)| (i as f64, *l))
                            .collect(),
                    )
                })
                .collect(),
            ..LinePlot::default()
        }),
    )?;
    report.result("model", &cfg.model)?;
    report.result("modes", &results)?;
    report.finish(&t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_cpu_it_runs_the_cpu_modes_and_skips_tf32() {
        if crate::engine::cuda::probe().is_ok() {
            return; // the GPU path is the `kiln bench amp` run on the GPU machine
        }
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("amp");
        run(BenchAmpArgs {
            device: "cpu".into(),
            steps: 3,
            warmup: 1,
            modes: [
                "fp32",
                "tf32",
                "bf16-mixed",
                "fp16-mixed",
                "bf16-mixed-unfused",
            ]
            .map(String::from)
            .to_vec(),
            out: out.clone(),
            config: None,
            overrides: crate::report::tiny_model_overrides(&["train.micro_batch=2"]),
        })
        .unwrap();
        let json = crate::report::read_results(&out);
        let modes = json["modes"].as_array().unwrap();
        let names: Vec<&str> = modes.iter().map(|m| m["mode"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            ["fp32", "bf16-mixed", "fp16-mixed", "bf16-mixed-unfused"]
        );
        assert_eq!(modes[3]["ran_as"].as_str(), Some("bf16-mixed-unfused"));
        assert_eq!(modes[0]["speedup_vs_baseline"].as_f64(), Some(1.0));
        for m in modes {
            assert_eq!(m["losses"].as_array().unwrap().len(), 4);
            assert!(m["final_loss"].as_f64().unwrap().is_finite());
            assert!(m["peak_bytes"].as_u64().unwrap() > 0);
        }
        // Same seed, same batches: the first loss agrees across modes to rounding.
        let first = |i: usize| modes[i]["losses"][0].as_f64().unwrap();
        assert!((first(0) - first(1)).abs() < 0.05 * first(0));
        // The unfused kernels compute what the fused ones do: the same losses to rounding.
        for (f, u) in modes[1]["losses"]
            .as_array()
            .unwrap()
            .iter()
            .zip(modes[3]["losses"].as_array().unwrap())
        {
            let (f, u) = (f.as_f64().unwrap(), u.as_f64().unwrap());
            assert!((f - u).abs() <= 1e-5 * f, "bf16-mixed {f} vs unfused {u}");
        }
        let skipped = json["skipped"].as_array().unwrap();
        assert!(
            skipped[0].as_str().unwrap().starts_with("tf32: "),
            "{skipped:?}"
        );
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("| fp32 |"), "{md}");
        assert!(md.contains("| bf16-mixed-unfused |"), "{md}");
        assert!(md.contains("GELU stays as in the fused modes"), "{md}");
        for p in ["tokens_per_s", "peak_memory", "loss"] {
            crate::report::plot::tests::assert_png(&out.join(format!("{p}.png")));
        }
    }
}

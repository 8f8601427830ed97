//! `kiln bench train`: training throughput of one model configuration, written as a report.
//!
//! kiln's median step gives tokens/s, model FLOP/s, MFU and peak memory; the timed steps are
//! also split into forward+backward and optimizer (the device synchronised at that boundary
//! inside the timed steps only). When `python3` imports torch and sees a GPU, and kiln runs
//! on one, `bench/pytorch_gpt.py` trains the same GPT shape on kiln's own batches in the same
//! command, so tokens/s, MFU, peak memory and loss curves sit side by side.

use super::{TimedStep, dense_peak_flops, find_script, timed_steps};
use crate::data::{self, Batch, Corpus};
use crate::engine::{Device, profile};
use crate::error::{KilnError, Result};
use crate::report::{BarChart, LinePlot, Plot, Report, Series, Table};
use crate::train::{self, Precision, Trainer};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench train --device cpu
  kiln bench train --steps 20 model.n_layers=6 train.micro_batch=8
  kiln bench train train.recompute=blocks        memory saved and time cost of recomputation
  kiln bench train train.memory_limit=2GiB       a cap that makes the micro-batch split
  kiln bench train --device cuda --out bench-out/train model.d_model=768 model.n_layers=12 \\
      model.n_heads=12 model.context=1024 train.seq_len=1024 train.micro_batch=8 \\
      data.tokenizer=gpt2 train.precision=bf16-mixed")]
pub struct BenchTrainArgs {
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Timed optimizer steps (after the warm-up steps).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed steps before timing starts (for PyTorch too).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out/train")]
    pub out: PathBuf,
    /// Do not run the PyTorch reference even where torch is available.
    #[arg(long)]
    pub no_python: bool,
    /// Settings file, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Hardware profile, as for `kiln train`; `none` by default so a benchmark measures
    /// exactly the settings it is given.
    #[arg(long, value_name = "NAME", default_value = "none")]
    pub profile: String,
    /// Overrides on dotted keys, as for `kiln train`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// One engine in one mode, as compared in the report.
#[derive(Debug, Serialize)]
struct EngineResult {
    engine: String,
    mode: String,
    median_step_ms: f64,
    tokens_per_s: f64,
    /// Against the GPU's dense peak for the mode, counting kiln's FLOPs per token for every
    /// engine so the figures compare like with like.
    mfu: Option<f64>,
    peak_mib: f64,
    /// Loss of each timed step.
    losses: Vec<f64>,
}

/// What `bench/pytorch_gpt.py` prints for one mode.
#[derive(Debug, Deserialize, Serialize)]
struct PyMode {
    engine: String,
    mode: String,
    device: String,
    params: u64,
    tokens_per_s: f64,
    step_ms: f64,
    /// The script's own MFU (its FLOP formula, the vocabulary it was given).
    mfu: Option<f64>,
    peak_mem_gib: f64,
    losses: Vec<f64>,
}

/// Median of the timed steps' phases, in milliseconds.
#[derive(Debug, Serialize)]
struct Phases {
    fwd_bwd_ms: f64,
    optimizer_ms: f64,
    step_ms: f64,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn phases(timed: &[TimedStep]) -> Option<Phases> {
    let split: Option<Vec<(f64, f64)>> = timed
        .iter()
        .map(|s| s.fwd_bwd_seconds.map(|f| (f, s.seconds - f)))
        .collect();
    let split = split?;
    Some(Phases {
        fwd_bwd_ms: 1e3 * median(split.iter().map(|p| p.0).collect()),
        optimizer_ms: 1e3 * median(split.iter().map(|p| p.1).collect()),
        step_ms: 1e3 * median(timed.iter().map(|s| s.seconds).collect()),
    })
}

pub fn run(a: BenchTrainArgs) -> Result<()> {
    if a.steps == 0 {
        return Err(KilnError::Setting(
            "--steps must be at least 1: a benchmark needs a timed step".into(),
        ));
    }
    let mut overrides = a.overrides.clone();
    overrides.push(format!("train.device={}", a.device));
    let cfg = crate::config::settings::resolve(&a.profile, a.config.as_deref(), &overrides)?
        .config
        .config;
    let (pool, precision, notes) = train::open_device(&cfg.train.device, &cfg.train.precision)?;
    train::set_memory_limit(&pool, &cfg)?;
    let device = pool.device();
    let mut report = Report::new("train", "Training step: throughput and phases", &a.out)?;
    if let Device::Cuda(ordinal) = device {
        report.watch_gpu(ordinal);
    }
    notes.into_iter().for_each(|n| report.note(n));
    let tokenizer = data::tokenizer_by_name(&cfg.data.tokenizer)?;
    let corpus = Corpus::load(train::data_spec(&cfg).corpus.as_deref())?;
    let tokens = tokenizer.encode(&corpus.text);
    data::check_train_len(&tokens, cfg.train.seq_len)?;
    let vocab = tokenizer.vocab_size();
    let mut trainer = Trainer::new(&cfg, vocab, &pool, precision)?;
    let (b, t, k) = (
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
    );
    let cost = trainer.model.cost(b, t);
    let timed = timed_steps(&mut trainer, &tokens, a.warmup, a.steps, true)?;
    let median_s = median(timed.iter().map(|s| s.seconds).collect());
    let tokens_per_step = (b * t * k) as f64;
    let flops_per_token = cost.flops_per_token(b * t);
    let flops_per_step = flops_per_token * tokens_per_step;
    let peak_flops = pool
        .cuda()
        .ok()
        .and_then(|g| dense_peak_flops(&g.info().name, precision));
    let shape = format!(
        "{} params, d_model {}, {} layers, {} heads, batch {b} x {t} x accum {k}, {precision}, recompute {} on {device}{}",
        cost.params,
        cfg.model.d_model,
        cfg.model.n_layers,
        cfg.model.n_heads,
        trainer.model.recompute(),
        if cfg.train.offload_optimizer {
            ", optimizer offloaded to the host"
        } else {
            ""
        }
    );
    println!("kiln bench train: {shape}");
    for split in trainer.passes.take_splits() {
        report.note(format!(
            "out of memory with {} sequences per pass in step {}; ran {} per pass from then on",
            split.from, split.step, split.to
        ));
    }
    let stats = trainer.pool.stats();
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let mut metrics = Table::new(&["metric", "value"]);
    let mut metric = |name: String, value: String| metrics.row(vec![name, value]);
    metric(
        "median step time".into(),
        format!("{:.1} ms", median_s * 1e3),
    );
    metric(
        "tokens/s".into(),
        format!("{:.0}", tokens_per_step / median_s),
    );
    metric(
        "model FLOP/s".into(),
        format!("{:.2} GFLOP/s", flops_per_step / median_s / 1e9),
    );
    metric(
        "FLOPs per token (fwd+bwd)".into(),
        format!("{:.3} M", flops_per_token / 1e6),
    );
    metric("peak memory".into(), format!("{:.1} MiB", mib(stats.peak)));
    metric(
        "memory reserved by the allocator".into(),
        format!("{:.1} MiB", mib(stats.reserved)),
    );
    if let Some(host) = trainer.opt.host_memory() {
        let locked = if pool.cuda().is_ok() {
            " (page-locked)"
        } else {
            ""
        };
        metric(
            format!("host memory of the offloaded optimizer{locked}"),
            format!("{:.1} MiB", mib(host.current)),
        );
    }
    if let Some(peak) = peak_flops {
        metric(
            format!("MFU (of {:.0} TFLOP/s dense peak)", peak / 1e12),
            format!("{:.1}%", 100.0 * flops_per_step / median_s / peak),
        );
    }
    print!("{}", metrics.markdown());
    let phase = phases(&timed);
    let mut engines = vec![EngineResult {
        engine: format!("kiln {}", env!("CARGO_PKG_VERSION")),
        mode: precision.to_string(),
        median_step_ms: median_s * 1e3,
        tokens_per_s: tokens_per_step / median_s,
        mfu: peak_flops.map(|p| flops_per_step / median_s / p),
        peak_mib: mib(stats.peak),
        losses: timed.iter().map(|s| s.report.loss).collect(),
    }];
    let profile_table = profile::report();
    if !profile_table.is_empty() {
        println!(
            "\nper-op time over the timed steps (KILN_PROFILE=1; each op synchronised):\n{profile_table}"
        );
    }
    // The GPU is PyTorch's now.
    drop(trainer);

    let mut py_modes = Vec::new();
    let py_batches: Vec<Batch> = (0..(a.warmup + a.steps) as u64)
        .map(|step| data::train_batch(&tokens, cfg.train.seed, step, 0, b, t))
        .collect();
    match pytorch_plan(&a, device, precision, k) {
        Err(why) => report.skip(format!("PyTorch reference (bench/pytorch_gpt.py): {why}")),
        Ok(plan) => {
            // PyTorch on kiln's padded vocabulary (the like-for-like comparison), then its
            // fastest mode once more on the tokenizer's own vocabulary, as an extra row.
            let padded = crate::plan::padded_vocab(vocab);
            let last = plan.modes[plan.modes.len() - 1];
            let runs = [
                (padded, plan.modes.clone(), ""),
                (vocab, vec![last], " raw-vocab"),
            ];
            for (v, modes, label) in runs {
                if label.is_empty() || v != padded {
                    let run = PyPlan {
                        script: plan.script.clone(),
                        modes,
                    };
                    match run_pytorch(&run, &a, &cfg, v, py_batches.iter().cloned()) {
                        Ok(mut m) => {
                            m.iter_mut().for_each(|m| m.mode.push_str(label));
                            py_modes.extend(m);
                        }
                        Err(why) => {
                            report.skip(format!("PyTorch reference (bench/pytorch_gpt.py): {why}"))
                        }
                    }
                }
            }
        }
    }
    for m in &py_modes {
        engines.push(EngineResult {
            engine: m.engine.clone(),
            mode: m.mode.clone(),
            median_step_ms: m.step_ms,
            tokens_per_s: m.tokens_per_s,
            mfu: peak_flops.map(|p| m.tokens_per_s * flops_per_token / p),
            peak_mib: m.peak_mem_gib * 1024.0,
            losses: m.losses.iter().skip(a.warmup).copied().collect(),
        });
    }

    report.text(&format!(
        "GPT: {shape}; tokenizer {} ({vocab} tokens, padded by kiln to {}). {} warm-up + {} \
         timed steps; tokens/s from the median step time, the device synchronised after each \
         step. Peak memory is kiln's memory pool over the timed steps and PyTorch's \
         max_memory_allocated. PyTorch trains on the same padded vocabulary; its fastest mode \
         runs once more on the tokenizer's own (`raw-vocab`). MFU counts kiln's FLOPs per token \
         ({:.3} M, padded vocabulary) for every engine against the GPU's dense peak for the \
         precision.",
        cfg.data.tokenizer,
        crate::plan::padded_vocab(vocab),
        a.warmup,
        a.steps,
        flops_per_token / 1e6,
    ));
    report.table(&metrics);
    write_phases(&mut report, phase.as_ref())?;
    let comparison = write_engines(&mut report, &engines, a.warmup)?;
    if !profile_table.is_empty() {
        report.text(&format!(
            "Per-op time over the timed steps (KILN_PROFILE=1; each op synchronised):\n\n```\n{profile_table}\n```"
        ));
    }
    report.result("model", &cfg.model)?;
    report.result("phases", &phase)?;
    report.result("engines", &engines)?;
    report.result("pytorch", &py_modes)?;
    report.finish(&comparison)
}

fn write_phases(report: &mut Report, phase: Option<&Phases>) -> Result<()> {
    let Some(p) = phase else {
        return Ok(());
    };
    report.heading("kiln's step by phase");
    report.text(
        "Median over the timed steps; the device is synchronised between the phases in these \
         steps only. Forward+backward covers every micro-batch's passes; optimizer covers the \
         gradient norm, clipping and the AdamW update.",
    );
    let mut t = Table::new(&["phase", "ms", "share of step"]);
    let rows = [
        ("forward + backward", p.fwd_bwd_ms),
        ("optimizer", p.optimizer_ms),
    ];
    for (name, ms) in rows {
        t.row(vec![
            name.into(),
            format!("{ms:.2}"),
            format!("{:.0}%", 100.0 * ms / (p.fwd_bwd_ms + p.optimizer_ms)),
        ]);
    }
    t.row(vec![
        "whole step".into(),
        format!("{:.2}", p.step_ms),
        "".into(),
    ]);
    report.table(&t);
    report.plot(
        "phases",
        &Plot::Bar(BarChart {
            title: "kiln step time by phase (median)".into(),
            y_label: "ms".into(),
            bars: rows.iter().map(|(n, ms)| (n.to_string(), *ms)).collect(),
        }),
    )
}

/// The engines side by side; returns the table (also the printed summary).
fn write_engines(report: &mut Report, engines: &[EngineResult], warmup: usize) -> Result<Table> {
    report.heading("Engines side by side");
    let mut t = Table::new(&["engine", "mode", "ms/step", "tokens/s", "MFU", "peak MiB"]);
    for e in engines {
        t.row(vec![
            e.engine.clone(),
            e.mode.clone(),
            format!("{:.1}", e.median_step_ms),
            format!("{:.0}", e.tokens_per_s),
            e.mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m)),
            format!("{:.1}", e.peak_mib),
        ]);
    }
    report.table(&t);
    let label = |e: &EngineResult| format!("{} {}", e.engine, e.mode);
    if engines.len() > 1 {
        report.plot(
            "tokens_per_s",
            &Plot::Bar(BarChart {
                title: "Training throughput by engine".into(),
                y_label: "tokens/s".into(),
                bars: engines.iter().map(|e| (label(e), e.tokens_per_s)).collect(),
            }),
        )?;
    }
    report.text(
        "Loss of each timed step. Every engine trains on the same batches (kiln's own, passed \
         to PyTorch) from its own random initialisation with its own optimizer settings: the \
         curves show the same task, not the same weights.",
    );
    report.plot(
        "loss",
        &Plot::Line(LinePlot {
            title: "Training loss per timed step".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: engines
                .iter()
                .map(|e| {
                    Series::new(
                        label(e),
                        e.losses
                            .iter()
                            .enumerate()
                            .map(|(i, l)| ((warmup + i + 1) as f64, *l))
                            .collect(),
                    )
                })
                .collect(),
            ..LinePlot::default()
        }),
    )?;
    Ok(t)
}

/// Which PyTorch modes run beside kiln's precision (eager, and compiled where it has both).
struct PyPlan {
    script: PathBuf,
    modes: Vec<&'static str>,
}

/// Decides whether the PyTorch reference can run; the error says why not.
fn pytorch_plan(
    a: &BenchTrainArgs,
    device: Device,
    precision: Precision,
    grad_accum: usize,
) -> std::result::Result<PyPlan, String> {
    if a.no_python {
        return Err("--no-python".into());
    }
    let script = find_script("pytorch_gpt.py")?;
    probe_torch()?;
    if device == Device::Cpu {
        return Err("kiln ran on the CPU; the script runs on a CUDA GPU only".into());
    }
    if grad_accum != 1 {
        return Err(format!(
            "train.grad_accum={grad_accum}; the script has no gradient accumulation (use 1)"
        ));
    }
    let modes = match precision {
        Precision::Bf16Mixed => vec!["bf16", "bf16-compile"],
        Precision::Fp32 => vec!["fp32"],
        Precision::Tf32 => vec!["tf32"],
        Precision::Fp16Mixed => vec!["fp16", "fp16-compile"],
    };
    Ok(PyPlan { script, modes })
}

/// Whether `python3` imports torch and torch sees a CUDA GPU.
pub(crate) fn probe_torch() -> std::result::Result<(), String> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import torch; print(torch.__version__, torch.cuda.is_available())",
        ])
        .output()
        .map_err(|e| format!("python3 could not start ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "torch is not importable by python3 ({})",
            err.lines().last().unwrap_or("no output")
        ));
    }
    let said = String::from_utf8_lossy(&out.stdout);
    match said.split_whitespace().collect::<Vec<_>>()[..] {
        [_, "True"] => Ok(()),
        [v, _] => Err(format!("torch {v} sees no CUDA GPU")),
        _ => Err(format!("unexpected answer from python3: {said:?}")),
    }
}

/// Writes the batches as the script's `--data` file: per step, inputs then targets, int32.
pub(crate) fn write_batches(path: &Path, batches: impl Iterator<Item = Batch>) -> Result<()> {
    let mut bytes = Vec::new();
    for batch in batches {
        for tok in batch.inputs.iter().chain(&batch.targets) {
            bytes.extend_from_slice(&(*tok as i32).to_le_bytes());
        }
    }
    std::fs::write(path, bytes).map_err(|e| KilnError::output(path, e))
}

/// Runs the script on kiln's batches; an error is a reason to list as skipped.
fn run_pytorch(
    plan: &PyPlan,
    a: &BenchTrainArgs,
    cfg: &crate::config::Config,
    vocab: usize,
    batches: impl Iterator<Item = Batch>,
) -> std::result::Result<Vec<PyMode>, String> {
    let data = a.out.join("pytorch_batches.i32");
    write_batches(&data, batches).map_err(|e| e.to_string())?;
    let m = &cfg.model;
    let arg = |x: usize| x.to_string();
    println!(
        "running {} ({})",
        plan.script.display(),
        plan.modes.join(",")
    );
    let out = std::process::Command::new("python3")
        .arg(&plan.script)
        .args(["--batch", &arg(cfg.train.micro_batch)])
        .args(["--seq", &arg(cfg.train.seq_len)])
        .args(["--vocab", &arg(vocab)])
        .args(["--d-model", &arg(m.d_model)])
        .args(["--layers", &arg(m.n_layers)])
        .args(["--heads", &arg(m.n_heads)])
        .args(["--steps", &arg(a.steps)])
        .args(["--warmup", &arg(a.warmup)])
        .args(["--modes", &plan.modes.join(",")])
        .arg("--data")
        .arg(&data)
        .output();
    // The batches are an input, not a result.
    let _ = std::fs::remove_file(&data);
    let out = out.map_err(|e| format!("python3 could not start ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "python3 {} failed: {}",
            plan.script.display(),
            err.lines().last().unwrap_or("no output")
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| format!("unreadable line from {}: {e}", plan.script.display()))
        })
        .collect()
}

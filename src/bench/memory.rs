//! `kiln bench memory`: the planner against real steps. For each micro-batch size, the pool
//! peak `kiln plan` predicts beside the one a real optimizer step books; then, under a memory
//! cap, the largest micro-batch the planner says fits against the one found by trial.
//!
//! The cap is the pool's own limit (`train.memory_limit`), which refuses an allocation before
//! touching memory on the CPU and the GPU alike, so the boundary is found safely and quickly
//! on any machine. Without `train.memory_limit` the suite picks a cap between the planned
//! peaks of two of the sizes it measures, so the boundary falls inside the plot.

use crate::engine::{Device, EngineError, MemoryPool};
use crate::error::{KilnError, Result};
use crate::plan::trial_step;
use crate::plan::{self, Budget, PlanRequest};
use crate::report::{LinePlot, Plot, Report, Series, Table};
use crate::train::{self, Precision};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench memory
  kiln bench memory --batches 1,2,4,8,16,32 train.memory_limit=200MiB
  kiln bench memory --device cuda train.precision=bf16-mixed model.n_layers=12")]
pub struct BenchMemoryArgs {
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Micro-batch sizes whose peak is planned and measured.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub batches: Vec<usize>,
    /// Directory for report.md, results.json and the plot.
    #[arg(long, default_value = "bench-out/memory")]
    pub out: PathBuf,
    /// Settings file, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Overrides on dotted keys, as for `kiln train`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

#[derive(Debug, Serialize)]
struct PeakRow {
    micro_batch: usize,
    planned_pool_peak: usize,
    /// `None` when the step did not run in one pass (the device ran out of memory).
    measured_pool_peak: Option<usize>,
    /// (measured - planned) / planned.
    error: Option<f64>,
}

/// The out-of-memory boundary under a pool cap: planned, and found by trial.
#[derive(Debug, Serialize)]
struct Boundary {
    cap_bytes: usize,
    predicted: Option<usize>,
    found: Option<usize>,
    trials: Vec<Trial>,
}

#[derive(Debug, Serialize)]
struct Trial {
    micro_batch: usize,
    fits: bool,
}

/// One optimizer step of micro-batch `b` in a pool capped at `limit` (0: no cap). Returns
/// whether it ran in one pass, and the pool's peak.
fn trial(
    cfg: &crate::config::Config,
    vocab: usize,
    precision: Precision,
    device_pool: &Arc<MemoryPool>,
    b: usize,
    limit: usize,
) -> Result<(bool, usize)> {
    // The CPU gets a fresh pool per trial; a GPU pool is one per device and is reset.
    let pool = if device_pool.device() == Device::Cpu {
        MemoryPool::new(Device::Cpu)
    } else {
        device_pool.clone()
    };
    pool.set_limit(limit);
    pool.reset_peak();
    let fits = match trial_step(cfg, vocab, precision, &pool, b) {
        Ok(one_pass) => one_pass,
        Err(KilnError::Engine(EngineError::OutOfMemory { .. })) | Err(KilnError::DoesNotFit(_)) => {
            false
        }
        Err(e) => return Err(e),
    };
    let peak = pool.stats().peak;
    pool.set_limit(0);
    Ok((fits, peak))
}

/// The largest micro-batch whose planned pool peak is within `cap`.
fn predicted_boundary(r: &PlanRequest, cap: usize) -> Result<Option<usize>> {
    let budget = Budget {
        name: "pool cap".into(),
        device: r.device,
        capacity: usize::MAX / 4,
        context: 0,
        context_measured: true,
        margin: 0,
        pool_limit: Some(cap),
        compute_capability: None,
    };
    plan::largest_micro_batch(r, &budget)
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

pub fn run(a: BenchMemoryArgs) -> Result<()> {
    let mut batches = a.batches.clone();
    batches.sort_unstable();
    batches.dedup();
    if batches.is_empty() || batches[0] == 0 {
        return Err(KilnError::Setting(
            "--batches needs micro-batch sizes of at least 1, such as --batches 1,2,4,8".into(),
        ));
    }
    let mut overrides = a.overrides.clone();
    overrides.push(format!("train.device={}", a.device));
    let cfg = crate::config::settings::resolve("none", a.config.as_deref(), &overrides)?
        .config
        .config;
    let mut report = Report::new("memory", "Planned against measured memory", &a.out)?;
    let (pool, precision, notes) = train::open_device(&cfg.train.device, &cfg.train.precision)?;
    notes.into_iter().for_each(|n| report.note(n));
    let device = pool.device();
    if let Device::Cuda(ordinal) = device {
        report.watch_gpu(ordinal);
    }
    let vocab = crate::train::model_vocab(&cfg)?;
    let r = PlanRequest::for_config(
        &cfg,
        vocab,
        precision
            .compute_dtype()
            .unwrap_or(crate::engine::DType::F32),
        device,
    );

    let mut rows = Vec::new();
    for &b in &batches {
        let planned = plan::plan(&r.with_batch(b))?.pool_peak;
        let (fits, peak) = trial(&cfg, vocab, precision, &pool, b, 0)?;
        let measured = fits.then_some(peak);
        println!(
            "micro-batch {b:>4}: planned {:>9.1} MiB, measured {}",
            mib(planned),
            measured.map_or("out of memory".into(), |m| format!("{:.1} MiB", mib(m)))
        );
        rows.push(PeakRow {
            micro_batch: b,
            planned_pool_peak: planned,
            measured_pool_peak: measured,
            error: measured.map(|m| (m as f64 - planned as f64) / planned as f64),
        });
    }

    let cap = match crate::config::parse_bytes(&cfg.train.memory_limit)
        .map_err(|rule| KilnError::Setting(format!("train.memory_limit: {rule}")))?
    {
        Some(limit) => limit,
        None => {
            // Between the planned peaks of the middle size and the next, so the boundary
            // lands inside the measured range.
            let i = (rows.len() - 1) / 2;
            let lo = rows[i].planned_pool_peak;
            let hi = rows.get(i + 1).map_or(lo + lo / 2, |x| x.planned_pool_peak);
            lo + (hi - lo) / 2
        }
    };
    let predicted = predicted_boundary(&r, cap)?;
    // Trial from the prediction outwards until the boundary is bracketed.
    let mut trials = Vec::new();
    let mut b = predicted.unwrap_or(1).max(1);
    let mut found = None;
    let limit_b = 4 * predicted.unwrap_or(1) + 8;
    loop {
        let (fits, _) = trial(&cfg, vocab, precision, &pool, b, cap)?;
        trials.push(Trial {
            micro_batch: b,
            fits,
        });
        if fits {
            found = Some(b);
            if trials.iter().any(|t| t.micro_batch == b + 1) || b >= limit_b {
                break;
            }
            b += 1;
        } else {
            if trials.iter().any(|t| t.micro_batch + 1 == b && t.fits) || b == 1 {
                break;
            }
            b -= 1;
        }
    }
    let say =
        |x: Option<usize>| x.map_or("none (one sequence does not fit)".into(), |b| b.to_string());
    println!(
        "cap {:.1} MiB: largest micro-batch planned {}, found {}",
        mib(cap),
        say(predicted),
        say(found)
    );
    let boundary = Boundary {
        cap_bytes: cap,
        predicted,
        found,
        trials,
    };
    write_report(report, &cfg, precision, device, rows, boundary)
}

fn write_report(
    mut report: Report,
    cfg: &crate::config::Config,
    precision: Precision,
    device: Device,
    rows: Vec<PeakRow>,
    boundary: Boundary,
) -> Result<()> {
    let (cap, predicted, found) = (boundary.cap_bytes, boundary.predicted, boundary.found);
    report.text(&format!(
        "GPT d_model {}, {} layers, seq {}, {precision}, recompute {}, on {device}. Planned: \
         `kiln plan`'s pool peak for one step. Measured: the memory pool's peak over one real \
         optimizer step (trainer built, forward, backward, AdamW) with no cap.",
        cfg.model.d_model, cfg.model.n_layers, cfg.train.seq_len, cfg.train.recompute
    ));
    let mut t = Table::new(&["micro-batch", "planned MiB", "measured MiB", "error"]);
    for x in &rows {
        t.row(vec![
            x.micro_batch.to_string(),
            format!("{:.2}", mib(x.planned_pool_peak)),
            x.measured_pool_peak
                .map_or("out of memory".into(), |m| format!("{:.2}", mib(m))),
            x.error
                .map_or("-".into(), |e| format!("{:+.2}%", 100.0 * e)),
        ]);
    }
    report.table(&t);
    let line = |f: &dyn Fn(&PeakRow) -> Option<usize>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|x| f(x).map(|v| (x.micro_batch as f64, mib(v))))
            .collect()
    };
    let (first, last) = (
        rows[0].micro_batch as f64,
        rows[rows.len() - 1].micro_batch as f64,
    );
    report.plot(
        "peak_by_micro_batch",
        &Plot::Line(LinePlot {
            title: format!("Pool peak against micro-batch ({device}, {precision})"),
            x_label: "micro-batch (sequences)".into(),
            y_label: "MiB".into(),
            series: vec![
                Series::new("planned", line(&|x| Some(x.planned_pool_peak))),
                Series::new("measured", line(&|x| x.measured_pool_peak)),
                Series::new(
                    "cap of the boundary search",
                    vec![(first, mib(cap)), (last, mib(cap))],
                ),
            ],
            ..LinePlot::default()
        }),
    )?;
    report.heading("Out-of-memory boundary");
    let show = |x: Option<usize>| x.map_or("none".into(), |b| b.to_string());
    report.text(&format!(
        "Pool capped at {:.2} MiB ({}). Largest micro-batch that fits: planned **{}**, found by \
         trial **{}**{}. Trials (micro-batch: fits): {}.",
        mib(cap),
        if cfg.train.memory_limit.is_empty() || cfg.train.memory_limit == "none" {
            "chosen by the suite; set train.memory_limit to choose"
        } else {
            "train.memory_limit"
        },
        show(predicted),
        show(found),
        if predicted == found {
            ": the planner is exact here"
        } else {
            ": the planner is off"
        },
        boundary
            .trials
            .iter()
            .map(|t| format!("{}: {}", t.micro_batch, if t.fits { "yes" } else { "no" }))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    report.result("rows", &rows)?;
    report.result("boundary", &boundary)?;
    let mut summary = t;
    summary.row(vec![
        format!("boundary @ {:.1} MiB", mib(cap)),
        show(predicted),
        show(found),
        "-".into(),
    ]);
    report.finish(&summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_cpu_planned_and_measured_peaks_agree_and_the_boundary_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("memory");
        run(BenchMemoryArgs {
            device: "cpu".into(),
            batches: vec![1, 2, 4, 8],
            out: out.clone(),
            config: None,
            overrides: crate::report::tiny_model_overrides(&[]),
        })
        .unwrap();
        let json = crate::report::read_results(&out);
        let rows = json["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for r in rows {
            // The planner is exact on the CPU (the pool books every tensor).
            assert_eq!(r["planned_pool_peak"], r["measured_pool_peak"], "{r}");
        }
        // The suite's cap lies halfway between the planned peaks of 2 and 4 sequences.
        let b = &json["boundary"];
        let predicted = b["predicted"].as_u64().unwrap();
        assert!((2..4).contains(&predicted), "{predicted}");
        assert_eq!(b["found"], b["predicted"]);
        let trials = b["trials"].as_array().unwrap();
        assert!(trials.iter().any(|t| t["fits"] == false), "{trials:?}");
        crate::report::plot::tests::assert_png(&out.join("peak_by_micro_batch.png"));
    }
}

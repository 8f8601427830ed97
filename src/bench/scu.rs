//! `kiln bench scu`: the SCU controller against fixed penalty strengths. Every configuration
//! (the controller, then each fixed lambda; 0 is plain LoRA with the penalty's bookkeeping)
//! fine-tunes the same base on the same data for the same steps, once per seed, as a
//! `kiln finetune` run of its own. Reported per configuration: held-out bits per token (mean
//! and spread over seeds), the final share S of penalty bits (smoothed, S_hat) against the
//! target S*, the final lambda, and plots of S_hat and lambda over the steps. The verdict says
//! which configuration reached the lowest held-out bits, including when it is not the
//! controller.

use crate::error::{KilnError, Result};
use crate::report::{LinePlot, Plot, Report, Series, Table};
use clap::Args;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench scu --init-from SmolLM2-135M-Instruct.Q4_1.gguf --data chat.jsonl
  kiln bench scu --init-from ./base --data chat.jsonl --lambdas 0,0.1,1 --seeds 1,2,3 \\
      --steps 200 scu.target=0.05 lora.rank=8

Each run is a `kiln finetune` under OUT/runs/ (its metrics, scu_history.jsonl and summary.json
stay there); KEY=VALUE overrides go to every run.")]
pub struct BenchScuArgs {
    /// The base to fine-tune: a Hugging Face directory or a GGUF file.
    #[arg(long, value_name = "PATH")]
    pub init_from: PathBuf,
    /// Fine-tuning data (JSON lines, as `kiln finetune --data` reads).
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Fixed lambdas to compare with the controller.
    #[arg(long, default_value = "0,0.01,1,10", value_delimiter = ',')]
    pub lambdas: Vec<f64>,
    /// Seeds: every configuration runs once per seed.
    #[arg(long, default_value = "1,2,3", value_delimiter = ',')]
    pub seeds: Vec<u64>,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Device: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Directory for report.md, results.json, the plots and the runs.
    #[arg(long, default_value = "bench-out/scu")]
    pub out: PathBuf,
    /// Overrides for every run, e.g. scu.target=0.05 lora.rank=8 train.seq_len=256.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// One configuration's runs.
#[derive(Debug, Clone, Serialize)]
struct ConfigResult {
    name: String,
    /// `None` for the controller.
    fixed_lambda: Option<f64>,
    seeds: Vec<SeedResult>,
    val_bits_mean: f64,
    val_bits_std: f64,
}

#[derive(Debug, Clone, Serialize)]
struct SeedResult {
    seed: u64,
    val_bits_per_token: f64,
    final_s_hat: f64,
    final_lambda: f64,
    /// `(step, S_hat, lambda)` of every controller record.
    history: Vec<(u64, f64, f64)>,
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

/// Reads a finished run: held-out bits per token and the controller's history.
fn read_run(dir: &Path, seed: u64) -> Result<SeedResult> {
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        KilnError::run_dir(dir, format!("cannot read {what}: {e}"))
    };
    let summary: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("summary.json")).map_err(|e| bad("summary.json", &e))?,
    )
    .map_err(|e| bad("summary.json", &e))?;
    let val = summary["val_bits_per_token"].as_f64().unwrap_or(f64::NAN);
    let text = std::fs::read_to_string(dir.join("scu_history.jsonl"))
        .map_err(|e| bad("scu_history.jsonl", &e))?;
    let history: Vec<(u64, f64, f64)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|r| {
            (
                r["step"].as_u64().unwrap_or(0),
                r["S_hat"].as_f64().unwrap_or(f64::NAN),
                r["lambda"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    let last = history.last().copied().unwrap_or((0, f64::NAN, f64::NAN));
    Ok(SeedResult {
        seed,
        val_bits_per_token: val,
        final_s_hat: last.1,
        final_lambda: last.2,
        history,
    })
}

pub fn run(a: BenchScuArgs) -> Result<()> {
    if a.seeds.is_empty() || a.steps == 0 {
        return Err(KilnError::Setting(
            "--seeds needs at least one seed and --steps at least 1".into(),
        ));
    }
    if let Some(l) = a.lambdas.iter().find(|l| !l.is_finite() || **l < 0.0) {
        return Err(KilnError::Setting(format!(
            "--lambdas: {l} is not a penalty strength; give numbers of 0 or more, e.g. 0,0.01,1,10"
        )));
    }
    for (flag, path) in [("--init-from", &a.init_from), ("--data", &a.data)] {
        if !path.exists() {
            return Err(KilnError::Setting(format!(
                "{flag} {}: no such file or directory",
                path.display()
            )));
        }
    }
    let mut report = Report::new(
        "scu",
        "SCU: the controller against fixed penalty strengths",
        &a.out,
    )?;
    let exe = std::env::current_exe()
        .map_err(|e| KilnError::Setting(format!("cannot find the kiln executable: {e}")))?;
    let target = a
        .overrides
        .iter()
        .rev()
        .find_map(|o| o.strip_prefix("scu.target="))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| crate::config::Config::default().scu.target);
    let mut configs: Vec<(String, Option<f64>)> = vec![("controller".into(), None)];
    configs.extend(a.lambdas.iter().map(|&l| (format!("lambda={l}"), Some(l))));
    let mut results = Vec::new();
    for (name, fixed) in &configs {
        let mut seeds = Vec::new();
        for &seed in &a.seeds {
            let dir = a.out.join("runs").join(format!("{name}-seed{seed}"));
            let _ = std::fs::remove_dir_all(&dir);
            let mut cmd = Command::new(&exe);
            cmd.arg("finetune")
                .arg("--init-from")
                .arg(&a.init_from)
                .arg("--data")
                .arg(&a.data)
                .arg("--out")
                .arg(&dir)
                .args(["--device", &a.device, "-q"])
                .arg(format!("train.seed={seed}"))
                .arg(format!("train.steps={}", a.steps))
                .arg("scu.enabled=true");
            match fixed {
                None => cmd.arg("scu.control=true"),
                Some(l) => cmd
                    .arg("scu.control=false")
                    .arg(format!("scu.lambda_init={l}"))
                    .arg(format!("scu.lambda_min={}", l.max(1e-12)))
                    .arg(format!("scu.lambda_max={}", l.max(1e-12))),
            };
            cmd.args(&a.overrides);
            eprintln!("bench scu: {name}, seed {seed}");
            let out = cmd
                .output()
                .map_err(|e| KilnError::Setting(format!("cannot run kiln finetune: {e}")))?;
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                return Err(KilnError::Setting(format!(
                    "the {name} run of seed {seed} failed (exit {:?}): {}",
                    out.status.code(),
                    err.trim()
                )));
            }
            seeds.push(read_run(&dir, seed)?);
        }
        let vals: Vec<f64> = seeds.iter().map(|s| s.val_bits_per_token).collect();
        let (m, sd) = mean_std(&vals);
        results.push(ConfigResult {
            name: name.clone(),
            fixed_lambda: *fixed,
            seeds,
            val_bits_mean: m,
            val_bits_std: sd,
        });
    }

    let mut t = Table::new(&[
        "configuration",
        "held-out bits/token",
        "final S_hat (S* = target)",
        "final lambda",
    ]);
    for r in &results {
        let (s, _) = mean_std(&r.seeds.iter().map(|s| s.final_s_hat).collect::<Vec<_>>());
        let (l, _) = mean_std(&r.seeds.iter().map(|s| s.final_lambda).collect::<Vec<_>>());
        t.row(vec![
            r.name.clone(),
            format!("{:.4} +- {:.4}", r.val_bits_mean, r.val_bits_std),
            format!("{s:.4} ({target})"),
            format!("{l:.4}"),
        ]);
    }
    report.text(&format!(
        "Base `{}`, data `{}`, {} steps per run, seeds {:?}, device {}; overrides: {}.",
        a.init_from.display(),
        a.data.display(),
        a.steps,
        a.seeds,
        a.device,
        if a.overrides.is_empty() {
            "none".to_string()
        } else {
            a.overrides.join(" ")
        }
    ));
    report.table(&t);
    report.text(&verdict(&results, target));
    let first_seed = |r: &ConfigResult, pick: fn(&(u64, f64, f64)) -> f64| {
        Series::new(
            r.name.clone(),
            r.seeds[0]
                .history
                .iter()
                .map(|h| (h.0 as f64, pick(h)))
                .collect(),
        )
    };
    report.plot(
        "s_hat",
        &Plot::Line(LinePlot {
            title: format!("S_hat over steps (seed {}; target {target})", a.seeds[0]),
            x_label: "step".into(),
            y_label: "S_hat".into(),
            series: results.iter().map(|r| first_seed(r, |h| h.1)).collect(),
            ..LinePlot::default()
        }),
    )?;
    report.plot(
        "lambda",
        &Plot::Line(LinePlot {
            title: format!("lambda over steps (seed {})", a.seeds[0]),
            x_label: "step".into(),
            y_label: "lambda".into(),
            log_y: true,
            series: results.iter().map(|r| first_seed(r, |h| h.2)).collect(),
            ..LinePlot::default()
        }),
    )?;
    report.result("target", target)?;
    report.result("steps", a.steps)?;
    report.result("configs", &results)?;
    print!("{}", t.terminal());
    println!("{}", verdict(&results, target));
    report.finish(&t)
}

/// What the runs found, said plainly.
fn verdict(results: &[ConfigResult], target: f64) -> String {
    let Some(best) = results
        .iter()
        .filter(|r| r.val_bits_mean.is_finite())
        .min_by(|a, b| a.val_bits_mean.total_cmp(&b.val_bits_mean))
    else {
        return "No run produced a held-out loss.".into();
    };
    let ctl = &results[0];
    let s: Vec<f64> = ctl.seeds.iter().map(|s| s.final_s_hat).collect();
    let (s_mean, _) = mean_std(&s);
    let tracking = format!(
        "The controller ended at S_hat {s_mean:.4} against the target {target} ({:.0}% off).",
        100.0 * (s_mean - target).abs() / target.max(1e-12)
    );
    if best.name == ctl.name {
        format!(
            "The controller reached the lowest held-out bits per token ({:.4}). {tracking}",
            best.val_bits_mean
        )
    } else {
        let within =
            (ctl.val_bits_mean - best.val_bits_mean).abs() <= ctl.val_bits_std + best.val_bits_std;
        format!(
            "The controller did not win: {} reached {:.4} held-out bits per token against the controller's {:.4}{}. {tracking}",
            best.name,
            best.val_bits_mean,
            ctl.val_bits_mean,
            if within {
                " (within the spread over seeds)"
            } else {
                ""
            }
        )
    }
}

//! `kiln bench dataloader`: how fast kiln's data path turns a corpus into training batches,
//! beside how fast a training step eats them.
//!
//! Stages, each in tokens/s: reading the corpus file, tokenising it (byte and GPT-2 tokenizers,
//! one loader thread and all of them, as `data.loader_threads` sets), cutting a global batch
//! from the token stream, and (on a GPU) copying a batch's inputs and targets to the device the
//! way the step does, synchronised. Tokenising happens once before training; batching and the
//! copy happen every step, so they are what could ever hold a step up.

use super::timed_steps;
use crate::data::{self, Corpus, encode_chunked};
use crate::engine::Device;
use crate::error::{KilnError, Result};
use crate::report::{Report, Table};
use crate::train::{self, Trainer};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench dataloader
  kiln bench dataloader --out bench-out/dataloader data.corpus=big.txt
  kiln bench dataloader --device cpu --reps 3")]
pub struct BenchDataloaderArgs {
    /// Device the copy and the training step run on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Timed repetitions of each stage (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Timed training steps of the model (after 2 warm-up steps).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Directory for report.md and results.json.
    #[arg(long, default_value = "bench-out/dataloader")]
    pub out: PathBuf,
    /// Settings file, as for `kiln train` (the corpus, model and batch shape come from it).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Overrides on dotted keys, as for `kiln train`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Stage {
    stage: String,
    /// Once before training, or every step.
    per_step: bool,
    median_s: f64,
    tokens: usize,
    tokens_per_s: f64,
}

fn median_s(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn stage(name: String, per_step: bool, secs: f64, tokens: usize) -> Stage {
    println!(
        "{name:<40} {:>14.0} tokens/s",
        tokens as f64 / secs.max(1e-12)
    );
    Stage {
        stage: name,
        per_step,
        median_s: secs,
        tokens,
        tokens_per_s: tokens as f64 / secs.max(1e-12),
    }
}

pub fn run(a: BenchDataloaderArgs) -> Result<()> {
    if a.reps == 0 || a.steps == 0 {
        return Err(KilnError::Setting(
            "--reps and --steps must be at least 1".into(),
        ));
    }
    let mut overrides = a.overrides.clone();
    overrides.push(format!("train.device={}", a.device));
    let cfg = crate::config::settings::resolve("none", a.config.as_deref(), &overrides)?
        .config
        .config;
    let mut report = Report::new("dataloader", "Data loading against training speed", &a.out)?;
    let (pool, precision, notes) = train::open_device(&cfg.train.device, &cfg.train.precision)?;
    notes.into_iter().for_each(|n| report.note(n));
    if let Device::Cuda(ordinal) = pool.device() {
        report.watch_gpu(ordinal);
    }
    let spec = train::data_spec(&cfg);
    let all_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut stages = Vec::new();

    // Reading: the file (or the bundled corpus) into a string, counted in bytes-as-tokens of
    // the byte tokenizer so every row shares one unit.
    let mut corpus = Corpus::load(spec.corpus.as_deref())?;
    let read_s = median_s(a.reps, || {
        corpus = Corpus::load(spec.corpus.as_deref())?;
        Ok(())
    })?;
    stages.push(stage(
        "read corpus (1 token = 1 byte)".into(),
        false,
        read_s,
        corpus.text.len(),
    ));

    let cancel = AtomicBool::new(false);
    let mut threads = vec![1, all_threads];
    threads.dedup();
    for name in ["byte", "gpt2"] {
        let tok = data::tokenizer_by_name(name)?;
        for &n in &threads {
            let mut count = 0;
            let secs = median_s(a.reps, || {
                count =
                    encode_chunked(tok.as_ref(), &corpus.text, &cancel, n).map_or(0, |t| t.len());
                Ok(())
            })?;
            stages.push(stage(
                format!(
                    "tokenise, {name}, {n} thread{}",
                    if n == 1 { "" } else { "s" }
                ),
                false,
                secs,
                count,
            ));
        }
    }

    let tokenizer = data::tokenizer_by_name(&cfg.data.tokenizer)?;
    let tokens = tokenizer.encode(&corpus.text);
    data::check_train_len(&tokens, cfg.train.seq_len)?;
    let (b, t, k) = (
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
    );
    let per_step_tokens = b * t * k;
    // Batching: a global batch of the run's shape, at successive steps.
    let mut step = 0u64;
    let batch_s = median_s(a.reps.max(20), || {
        for m in 0..k as u64 {
            std::hint::black_box(data::train_batch(&tokens, cfg.train.seed, step, m, b, t));
        }
        step += 1;
        Ok(())
    })?;
    stages.push(stage(
        format!("batch ({b} x {t} x accum {k})"),
        true,
        batch_s,
        per_step_tokens,
    ));
    match pool.cuda() {
        Ok(g) => {
            let batch = data::train_batch(&tokens, cfg.train.seed, 0, 0, b, t);
            let copy_s = median_s(a.reps.max(20), || {
                for _ in 0..k {
                    let inputs = g
                        .upload(&batch.inputs)
                        .map_err(crate::engine::EngineError::from)?;
                    let targets = g
                        .upload(&batch.targets)
                        .map_err(crate::engine::EngineError::from)?;
                    g.synchronize().map_err(crate::engine::EngineError::from)?;
                    drop((inputs, targets));
                }
                Ok(())
            })?;
            stages.push(stage(
                "copy inputs and targets to the GPU".into(),
                true,
                copy_s,
                per_step_tokens,
            ));
        }
        Err(_) => report.skip("copy to the device: no GPU; CPU training reads the host batch"),
    }

    let mut trainer = Trainer::new(&cfg, tokenizer.vocab_size(), &pool, precision)?;
    let timed = timed_steps(&mut trainer, &tokens, 2, a.steps, false)?;
    let mut secs: Vec<f64> = timed.iter().map(|s| s.seconds).collect();
    secs.sort_by(f64::total_cmp);
    let step_s = secs[secs.len() / 2];
    let train_rate = per_step_tokens as f64 / step_s;
    println!(
        "{:<40} {train_rate:>14.0} tokens/s",
        format!("training step ({precision}, {})", pool.device())
    );
    write_report(report, &cfg, stages, train_rate, precision, pool.device())
}

fn write_report(
    mut report: Report,
    cfg: &crate::config::Config,
    stages: Vec<Stage>,
    train_rate: f64,
    precision: train::Precision,
    device: Device,
) -> Result<()> {
    // The loader keeps up when every per-step stage outruns the step; the prefetcher runs
    // batching in the background, but a stage slower than the step would still starve it.
    let per_step_rate = stages
        .iter()
        .filter(|s| s.per_step)
        .map(|s| 1.0 / s.tokens_per_s)
        .sum::<f64>()
        .recip();
    let headroom = per_step_rate / train_rate;
    let verdict = if headroom > 1.0 {
        format!(
            "The per-step data work (batching{}) runs at {per_step_rate:.0} tokens/s, {headroom:.0}x \
             the {train_rate:.0} tokens/s a training step consumes: the loader is not the \
             bottleneck of this model on this machine.",
            if matches!(device, Device::Cuda(_)) {
                " and copying"
            } else {
                ""
            }
        )
    } else {
        format!(
            "The per-step data work runs at {per_step_rate:.0} tokens/s, slower than the \
             {train_rate:.0} tokens/s a training step consumes: the loader IS the bottleneck here."
        )
    };
    report.text(&format!(
        "Corpus `{}`; model d_model {}, {} layers, trained in {precision} on {device}. \
         Tokenising runs once before training (its time is start-up, not throughput); batching \
         and the copy run every step. Medians of repeated runs; the copy is synchronised.\n\n{verdict}",
        if cfg.data.corpus.is_empty() {
            "bundled"
        } else {
            &cfg.data.corpus
        },
        cfg.model.d_model,
        cfg.model.n_layers,
    ));
    let mut t = Table::new(&["stage", "when", "tokens/s", "x training step"]);
    for s in &stages {
        t.row(vec![
            s.stage.clone(),
            if s.per_step { "every step" } else { "once" }.into(),
            format!("{:.0}", s.tokens_per_s),
            format!("{:.1}", s.tokens_per_s / train_rate),
        ]);
    }
    t.row(vec![
        "training step".into(),
        "every step".into(),
        format!("{train_rate:.0}"),
        "1.0".into(),
    ]);
    report.table(&t);
    report.result("stages", &stages)?;
    report.result("train_tokens_per_s", train_rate)?;
    report.result("loader_headroom", headroom)?;
    report.finish(&t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_cpu_it_measures_every_stage_and_says_the_copy_was_skipped() {
        if crate::engine::cuda::probe().is_ok() {
            return; // the GPU run adds the copy; `kiln bench dataloader` there covers it
        }
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("dl");
        run(BenchDataloaderArgs {
            device: "cpu".into(),
            reps: 1,
            steps: 1,
            out: out.clone(),
            config: None,
            overrides: crate::report::tiny_model_overrides(&["train.micro_batch=2"]),
        })
        .unwrap();
        let json = crate::report::read_results(&out);
        let stages = json["stages"].as_array().unwrap();
        let names: Vec<&str> = stages
            .iter()
            .map(|s| s["stage"].as_str().unwrap())
            .collect();
        assert!(names[0].starts_with("read corpus"), "{names:?}");
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("tokenise, gpt2, 1 thread"))
        );
        assert!(
            names.last().unwrap().starts_with("batch (2 x 16"),
            "{names:?}"
        );
        // The GPT-2 tokenizer makes fewer tokens of the same text than the byte one.
        let count = |prefix: &str| {
            stages
                .iter()
                .find(|s| s["stage"].as_str().unwrap().starts_with(prefix))
                .unwrap()["tokens"]
                .as_u64()
                .unwrap()
        };
        assert!(count("tokenise, gpt2") < count("tokenise, byte"));
        assert!(
            stages
                .iter()
                .all(|s| s["tokens_per_s"].as_f64().unwrap() > 0.0)
        );
        assert!(json["train_tokens_per_s"].as_f64().unwrap() > 0.0);
        let skipped = json["skipped"].as_array().unwrap();
        assert!(
            skipped[0]
                .as_str()
                .unwrap()
                .starts_with("copy to the device")
        );
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("the loader"), "{md}");
    }
}

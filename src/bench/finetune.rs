//! `kiln bench finetune`: low-rank fine-tuning of one shape (random weights) in three engines
//! on the same batches: kiln LoRA over a bf16 base (bf16-mixed), kiln QLoRA over an NF4 base,
//! and transformers + PEFT LoRA (`bench/hf_llama_train.py --lora R`, bf16 autocast, SDPA) when
//! python3 imports torch and sees a GPU. The shapes are Llama-family (rank R adapters on
//! q/k/v/o/gate/up/down) or GPT-2 small (on every c_attn, c_proj and c_fc), alpha 2R in every
//! engine, AdamW at a constant learning rate.
//!
//! Per engine: tokens/s from the median step (device synchronised after each step), peak
//! memory (kiln: the pool's peak over the steps; transformers: torch's peak allocated), the
//! bytes the frozen base's weights hold on the device (for QLoRA the NF4 weights, beside the
//! workspace they are expanded into), and the loss of every step. The data is the bundled
//! corpus as bytes, the same windows in every engine. On the CPU the suite runs its `tiny` and
//! `gpt2-tiny` shapes (kiln's engines only), which is what the test suite covers.

use super::train::{probe_torch, write_batches};
use super::{find_script, timed_steps};
use crate::data::{self, Corpus};
use crate::engine::Device;
use crate::error::{KilnError, Result};
use crate::generate::bench::{PRESETS, preset};
use crate::models::llama::LlamaConfig;
use crate::report::{BarChart, LinePlot, Plot, Report, Series, Table};
use crate::train::{self, Trainer};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench finetune                                SmolLM2-135M's shape, batch 16 x 1024
  kiln bench finetune --shape llama-3.2-1b           Llama-3.2-1B's shape, batch 8 x 1024
  kiln bench finetune --shape gpt2-small             GPT-2 small (GPT2LMHeadModel), 16 x 1024
  kiln bench finetune --shape tiny --device cpu      a tiny shape on the CPU (kiln only)
  kiln bench finetune --no-python --steps 10 --out bench-out/ft

Targets it reports: kiln QLoRA's base weights under 1 GiB on the GPU for the Llama-3.2-1B
shape and its tokens/s at least 0.8x kiln's bf16 LoRA; kiln LoRA at least 2.5x the tokens/s
of transformers + PEFT at no more than half its peak memory.")]
pub struct BenchFinetuneArgs {
    /// A published shape with random weights (smollm2-135m, llama-3.2-1b, gpt2-small), or
    /// tiny or gpt2-tiny (the CPU's).
    #[arg(long, default_value = "smollm2-135m")]
    pub shape: String,
    /// Sequences per step (default: 8 for llama-3.2-1b, 2 for the tiny shapes, else 16).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence (default: 1024; 32 for the tiny shapes).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Rank of every adapter.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Timed steps per engine (after the warm-up steps).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps per engine before timing starts (their losses are still plotted).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Skip the transformers + PEFT run.
    #[arg(long)]
    pub no_python: bool,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out/finetune")]
    pub out: PathBuf,
}

/// A model the suite fine-tunes: a Llama-family shape or a GPT-2 one. (A Llama shape carries
/// room for per-pair rotary factors; the suite holds a few of these, so no box.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum SuiteModel {
    Llama(LlamaConfig),
    Gpt(GptShape),
}

/// A GPT-2 shape (GPT2LMHeadModel's: learned positions, biases, tied head).
#[derive(Debug, Clone, Copy, Serialize)]
struct GptShape {
    vocab: usize,
    d_model: usize,
    n_layers: usize,
    n_heads: usize,
    context: usize,
}

/// The shapes the suite knows: the generation presets, GPT-2 small, and a tiny one of each
/// family for the CPU.
fn shape(name: &str) -> Option<SuiteModel> {
    match name {
        "tiny" => Some(SuiteModel::Llama(LlamaConfig {
            vocab: 256,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            ffn_hidden: 128,
            context: 64,
            rot_dim: 16,
            ..preset("smollm2-135m")?
        })),
        "gpt2-small" => Some(SuiteModel::Gpt(GptShape {
            vocab: 50257,
            d_model: 768,
            n_layers: 12,
            n_heads: 12,
            context: 1024,
        })),
        "gpt2-tiny" => Some(SuiteModel::Gpt(GptShape {
            vocab: 256,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            context: 64,
        })),
        _ => preset(name).map(SuiteModel::Llama),
    }
}

/// Every shape name [`shape`] takes, for the error that lists them.
fn shape_names() -> String {
    let mut names: Vec<&str> = PRESETS.to_vec();
    names.extend(["gpt2-small", "tiny", "gpt2-tiny"]);
    names.join(", ")
}

/// The `model.*` settings of a shape, with a context of at least `seq`.
fn model_overrides(m: &SuiteModel, seq: usize) -> Vec<String> {
    match m {
        SuiteModel::Llama(m) => vec![
            "model.kind=llama".into(),
            format!("model.vocab={}", m.vocab),
            format!("model.d_model={}", m.d_model),
            format!("model.n_layers={}", m.n_layers),
            format!("model.n_heads={}", m.n_heads),
            format!("model.n_kv_heads={}", m.n_kv_heads),
            format!("model.head_dim={}", m.head_dim),
            format!("model.ffn_hidden={}", m.ffn_hidden),
            format!("model.context={}", m.context.max(seq)),
            format!("model.rope_theta={:?}", m.rope_theta),
            format!("model.rot_dim={}", m.rot_dim),
            format!("model.norm_eps={:?}", m.norm_eps),
            format!("model.tied_head={}", m.tied_head),
        ],
        SuiteModel::Gpt(g) => vec![
            "model.kind=gpt".into(),
            format!("model.vocab={}", g.vocab),
            format!("model.d_model={}", g.d_model),
            format!("model.n_layers={}", g.n_layers),
            format!("model.n_heads={}", g.n_heads),
            format!("model.context={}", g.context.max(seq)),
        ],
    }
}

/// What the shape's adapters cover and how the model is built, for the report.
fn describe(m: &SuiteModel) -> (String, &'static str) {
    match m {
        SuiteModel::Llama(m) => (
            format!(
                "width {}, {} layers, {} heads, {} key/value heads, feed-forward {}, vocabulary {}",
                m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab
            ),
            "q/k/v/o/gate/up/down",
        ),
        SuiteModel::Gpt(g) => (
            format!(
                "GPT-2: width {}, {} layers, {} heads, vocabulary {}",
                g.d_model, g.n_layers, g.n_heads, g.vocab
            ),
            "every c_attn, c_proj and c_fc",
        ),
    }
}

/// One engine's measurements.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineResult {
    pub engine: String,
    pub median_step_ms: f64,
    pub tokens_per_s: f64,
    pub peak_bytes: u64,
    /// Bytes the frozen base's weights hold on the device.
    pub base_weight_bytes: u64,
    /// The workspace an NF4 base is expanded into (kiln QLoRA).
    #[serde(default)]
    pub workspace_bytes: Option<u64>,
    /// Loss of every step, warm-up included.
    #[serde(default)]
    pub losses: Vec<f64>,
}

/// A target the issue sets, and whether this run met it.
#[derive(Debug, Serialize)]
struct Target {
    what: String,
    measured: String,
    met: bool,
}

pub fn run(a: BenchFinetuneArgs) -> Result<()> {
    let m = shape(&a.shape).ok_or_else(|| {
        KilnError::Setting(format!(
            "--shape {} is not a shape this suite knows; use one of {}",
            a.shape,
            shape_names()
        ))
    })?;
    if a.steps == 0 || a.rank == 0 {
        return Err(KilnError::Setting(
            "--steps and --rank must be at least 1: a benchmark needs a timed step and adapters"
                .into(),
        ));
    }
    let tiny = a.shape.ends_with("tiny");
    let batch = a.batch.unwrap_or(match a.shape.as_str() {
        _ if tiny => 2,
        "llama-3.2-1b" => 8,
        _ => 16,
    });
    let seq = a.seq.unwrap_or(if tiny { 32 } else { 1024 });
    let mut report = Report::new(
        "finetune",
        "Fine-tuning: kiln LoRA, kiln QLoRA and transformers + PEFT LoRA",
        &a.out,
    )?;
    let (probe_pool, _, _) = train::open_device(&a.device, "fp32")?;
    let device = probe_pool.device();
    drop(probe_pool);
    if let Device::Cuda(ordinal) = device {
        report.watch_gpu(ordinal);
    }
    let total = a.warmup + a.steps;
    let mut overrides = model_overrides(&m, seq);
    overrides.extend([
        "data.tokenizer=byte".to_string(),
        format!("train.device={device}"),
        "train.precision=bf16-mixed".into(),
        format!("train.seq_len={seq}"),
        format!("train.micro_batch={batch}"),
        "train.grad_accum=1".into(),
        "train.recompute=none".into(),
        format!("train.steps={total}"),
        // The reference's AdamW: constant learning rate, torch's default decay.
        "optim.lr=1e-4".into(),
        "optim.min_lr=1e-4".into(),
        "optim.warmup_steps=0".into(),
        "optim.weight_decay=0.01".into(),
        "lora.enabled=true".into(),
        format!("lora.base=random weights ({} shape)", a.shape),
        format!("lora.rank={}", a.rank),
        format!("lora.alpha={}", 2 * a.rank),
    ]);
    let cfg = crate::config::settings::resolve("none", None, &overrides)?
        .config
        .config;
    let vocab = train::model_vocab(&cfg)?;
    let corpus = Corpus::load(None)?;
    let tokens = data::tokenizer_by_name("byte")?.encode(&corpus.text);
    data::check_train_len(&tokens, seq)?;
    println!(
        "kiln bench finetune: {} shape, rank {} on {}, batch {batch} x {seq}, {} + {} steps per engine on {device}",
        a.shape,
        a.rank,
        describe(&m).1,
        a.warmup,
        a.steps
    );

    let mut results = Vec::new();
    for (engine, quantize) in [
        ("kiln LoRA (bf16 base)", "none"),
        ("kiln QLoRA (NF4 base)", "nf4"),
    ] {
        let mut cfg = cfg.clone();
        cfg.lora.quantize = quantize.into();
        let (pool, precision, notes) = train::open_device(&device.to_string(), "bf16-mixed")?;
        for n in notes {
            report.note(format!("{engine}: {n}"));
        }
        train::set_memory_limit(&pool, &cfg)?;
        let mut trainer = Trainer::over_initialised_base(&cfg, vocab, &pool, precision)?;
        let base_weight_bytes = trainer.base_weight_bytes() as u64;
        let workspace_bytes = trainer.quantized.map(|q| q.workspace_bytes as u64);
        let all = timed_steps(&mut trainer, &tokens, 0, total, false)?;
        let mut secs: Vec<f64> = all.iter().skip(a.warmup).map(|s| s.seconds).collect();
        secs.sort_by(f64::total_cmp);
        let median = secs[secs.len() / 2];
        let r = EngineResult {
            engine: engine.into(),
            median_step_ms: median * 1e3,
            tokens_per_s: (batch * seq) as f64 / median,
            peak_bytes: pool.stats().peak as u64,
            base_weight_bytes,
            workspace_bytes,
            losses: all.iter().map(|s| s.report.loss).collect(),
        };
        print_line(&r);
        results.push(r);
        // Free this engine's device memory before the next one allocates.
        drop(trainer);
    }

    let reference = if a.no_python {
        Err("--no-python".to_string())
    } else if device == Device::Cpu {
        Err("kiln ran on the CPU; the script runs on a CUDA GPU only".to_string())
    } else if tiny {
        Err(format!(
            "--shape {} has no published counterpart; the script builds published shapes",
            a.shape
        ))
    } else {
        find_script("hf_llama_train.py").and_then(|script| probe_torch().map(|()| script))
    };
    match reference.and_then(|script| {
        let batches = (0..total as u64)
            .map(|step| data::train_batch(&tokens, cfg.train.seed, step, 0, batch, seq));
        run_peft(&script, &a, batch, seq, batches)
    }) {
        Ok(r) => {
            print_line(&r);
            results.push(r);
        }
        Err(why) => report.skip(format!("transformers + PEFT LoRA: {why}")),
    }
    write_report(report, &a, &m, batch, seq, results)
}

fn print_line(r: &EngineResult) {
    println!(
        "{:<34} {:>9.1} ms/step {:>10.0} tokens/s  peak {:>9.1} MiB  base weights {:>9.1} MiB",
        r.engine,
        r.median_step_ms,
        r.tokens_per_s,
        mib(r.peak_bytes),
        mib(r.base_weight_bytes)
    );
}

/// Runs the transformers + PEFT script on the suite's batches; an error says why it did not.
fn run_peft(
    script: &std::path::Path,
    a: &BenchFinetuneArgs,
    batch: usize,
    seq: usize,
    batches: impl Iterator<Item = data::Batch>,
) -> std::result::Result<EngineResult, String> {
    let data = a.out.join("peft_batches.i32");
    write_batches(&data, batches).map_err(|e| e.to_string())?;
    println!("running {} --lora {}", script.display(), a.rank);
    let out = std::process::Command::new("python3")
        .arg(script)
        .args(["--shape", &a.shape])
        .args(["--batch", &batch.to_string()])
        .args(["--seq", &seq.to_string()])
        .args(["--steps", &a.steps.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--lora", &a.rank.to_string()])
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
            script.display(),
            err.lines().last().unwrap_or("no output")
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| format!("{} printed no JSON line", script.display()))?;
    let v: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| format!("unreadable line from {}: {e}", script.display()))?;
    let num = |k: &str| {
        v[k].as_f64()
            .ok_or_else(|| format!("{} gave no {k}: {line}", script.display()))
    };
    let tokens_per_s = num("tokens_per_s")?;
    Ok(EngineResult {
        engine: "transformers + PEFT LoRA".into(),
        median_step_ms: (batch * seq) as f64 / tokens_per_s * 1e3,
        tokens_per_s,
        peak_bytes: num("peak_bytes")? as u64,
        base_weight_bytes: num("base_weight_bytes")? as u64,
        workspace_bytes: None,
        losses: v["losses"]
            .as_array()
            .map(|l| l.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default(),
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The targets that this run's engines and shape allow checking.
fn targets(shape: &str, results: &[EngineResult]) -> Vec<Target> {
    let find = |prefix: &str| results.iter().find(|r| r.engine.starts_with(prefix));
    let mut out = Vec::new();
    let (lora, qlora) = (find("kiln LoRA"), find("kiln QLoRA"));
    if let (Some(l), Some(q)) = (lora, qlora) {
        let ratio = q.tokens_per_s / l.tokens_per_s;
        out.push(Target {
            what: "kiln QLoRA tokens/s at least 0.8x kiln's bf16 LoRA".into(),
            measured: format!("{ratio:.2}x"),
            met: ratio >= 0.8,
        });
        if shape == "llama-3.2-1b" {
            out.push(Target {
                what: "kiln QLoRA base weights under 1 GiB on the GPU".into(),
                measured: format!(
                    "{:.3} GiB",
                    q.base_weight_bytes as f64 / (1u64 << 30) as f64
                ),
                met: q.base_weight_bytes < 1 << 30,
            });
        }
    }
    if let (Some(l), Some(p)) = (lora, find("transformers")) {
        let speed = l.tokens_per_s / p.tokens_per_s;
        let memory = l.peak_bytes as f64 / p.peak_bytes as f64;
        out.push(Target {
            what: "kiln LoRA at least 2.5x the tokens/s of transformers + PEFT".into(),
            measured: format!("{speed:.2}x"),
            met: speed >= 2.5,
        });
        out.push(Target {
            what: "kiln LoRA at most half the peak memory of transformers + PEFT".into(),
            measured: format!("{memory:.2}x"),
            met: memory <= 0.5,
        });
    }
    out
}

fn write_report(
    mut report: Report,
    a: &BenchFinetuneArgs,
    m: &SuiteModel,
    batch: usize,
    seq: usize,
    results: Vec<EngineResult>,
) -> Result<()> {
    let (model, adapted) = describe(m);
    report.text(&format!(
        "{} shape ({model}), random weights; LoRA rank {} (alpha {}) on {adapted}; \
         batch {batch} x {seq}; {} warm-up + {} timed steps per engine on the same windows of \
         the bundled corpus (as bytes); AdamW at a constant 1e-4. tokens/s from the median \
         step; peak is kiln's pool peak over the steps, torch's peak allocated for \
         transformers; base weights are the bytes the frozen base holds on the device (kiln \
         QLoRA: embedding and norms in bf16, projections in NF4 with double-quantised scales; \
         its workspace is listed apart).",
        a.shape,
        a.rank,
        2 * a.rank,
        a.warmup,
        a.steps,
    ));
    let mut t = Table::new(&[
        "engine",
        "ms/step",
        "tokens/s",
        "peak MiB",
        "base weights MiB",
        "workspace MiB",
        "first loss",
        "last loss",
    ]);
    for r in &results {
        let loss = |l: Option<&f64>| l.map_or("-".into(), |v| format!("{v:.4}"));
        t.row(vec![
            r.engine.clone(),
            format!("{:.1}", r.median_step_ms),
            format!("{:.0}", r.tokens_per_s),
            format!("{:.1}", mib(r.peak_bytes)),
            format!("{:.1}", mib(r.base_weight_bytes)),
            r.workspace_bytes
                .map_or("-".into(), |w| format!("{:.1}", mib(w))),
            loss(r.losses.first()),
            loss(r.losses.last()),
        ]);
    }
    report.table(&t);
    if let (Some(l), Some(q)) = (
        results.iter().find(|r| r.engine.starts_with("kiln LoRA")),
        results.iter().find(|r| r.engine.starts_with("kiln QLoRA")),
    ) {
        report.text(&format!(
            "The NF4 base holds {:.1} MiB where the bf16 base holds {:.1} MiB ({:.0}% saved).",
            mib(q.base_weight_bytes),
            mib(l.base_weight_bytes),
            100.0 * (1.0 - q.base_weight_bytes as f64 / l.base_weight_bytes as f64)
        ));
    }
    let goals = targets(&a.shape, &results);
    if !goals.is_empty() {
        let mut g = Table::new(&["target", "measured", "met"]);
        for goal in &goals {
            g.row(vec![
                goal.what.clone(),
                goal.measured.clone(),
                if goal.met { "yes" } else { "no" }.into(),
            ]);
            println!(
                "target: {} -- {} ({})",
                goal.what,
                goal.measured,
                if goal.met { "met" } else { "NOT met" }
            );
        }
        report.table(&g);
    }
    let bars = |f: &dyn Fn(&EngineResult) -> f64| -> Vec<(String, f64)> {
        results.iter().map(|r| (r.engine.clone(), f(r))).collect()
    };
    report.plot(
        "tokens_per_s",
        &Plot::Bar(BarChart {
            title: "Fine-tuning throughput".into(),
            y_label: "tokens/s".into(),
            bars: bars(&|r| r.tokens_per_s),
        }),
    )?;
    report.plot(
        "peak_memory",
        &Plot::Bar(BarChart {
            title: "Peak memory".into(),
            y_label: "MiB".into(),
            bars: bars(&|r| mib(r.peak_bytes)),
        }),
    )?;
    report.plot(
        "base_weights",
        &Plot::Bar(BarChart {
            title: "Frozen base weights on the device".into(),
            y_label: "MiB".into(),
            bars: bars(&|r| mib(r.base_weight_bytes)),
        }),
    )?;
    report.plot(
        "loss",
        &Plot::Line(LinePlot {
            title: "Training loss (same batches)".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: results
                .iter()
                .filter(|r| !r.losses.is_empty())
                .map(|r| {
                    Series::new(
                        r.engine.as_str(),
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
    report.result("shape", a.shape.as_str())?;
    report.result("model", m)?;
    report.result("batch", batch)?;
    report.result("seq", seq)?;
    report.result("rank", a.rank)?;
    report.result("engines", &results)?;
    report.result("targets", &goals)?;
    report.finish(&t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short run of `shape` on the CPU at rank 4 into `out`.
    fn cpu_args(shape: &str, no_python: bool, out: PathBuf) -> BenchFinetuneArgs {
        BenchFinetuneArgs {
            shape: shape.into(),
            batch: None,
            seq: None,
            rank: 4,
            steps: 2,
            warmup: 1,
            device: "cpu".into(),
            no_python,
            out,
        }
    }

    #[test]
    fn on_the_cpu_the_tiny_shape_runs_both_kiln_engines() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ft");
        run(cpu_args("tiny", false, out.clone())).unwrap();
        let json = crate::report::read_results(&out);
        let engines = json["engines"].as_array().unwrap();
        let names: Vec<&str> = engines
            .iter()
            .map(|e| e["engine"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["kiln LoRA (bf16 base)", "kiln QLoRA (NF4 base)"]);
        let bytes = |i: usize, k: &str| engines[i][k].as_u64().unwrap();
        assert!(bytes(1, "base_weight_bytes") < bytes(0, "base_weight_bytes"));
        assert!(engines[0]["workspace_bytes"].is_null());
        // The largest projection (gate/up, [256, 64]) in bf16.
        assert_eq!(bytes(1, "workspace_bytes"), 256 * 64 * 2);
        for e in engines {
            assert_eq!(e["losses"].as_array().unwrap().len(), 3);
            assert!(e["tokens_per_s"].as_f64().unwrap() > 0.0);
            assert!(e["peak_bytes"].as_u64().unwrap() > 0);
        }
        // Same seed, same batches, B = 0 at the start: the first losses differ by NF4 only.
        let first = |i: usize| engines[i]["losses"][0].as_f64().unwrap();
        assert!((first(0) - first(1)).abs() < 0.02 * first(0));
        let skipped = json["skipped"].as_array().unwrap();
        assert!(
            skipped[0]
                .as_str()
                .unwrap()
                .starts_with("transformers + PEFT LoRA: kiln ran on the CPU"),
            "{skipped:?}"
        );
        let targets = json["targets"].as_array().unwrap();
        assert_eq!(targets.len(), 1, "only the speed ratio applies to tiny");
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("| kiln QLoRA (NF4 base) |"), "{md}");
        assert!(md.contains("saved"), "{md}");
        for p in ["tokens_per_s", "peak_memory", "base_weights", "loss"] {
            crate::report::plot::tests::assert_png(&out.join(format!("{p}.png")));
        }
        let e = run(cpu_args("gpt2", true, out)).unwrap_err().to_string();
        assert!(
            e.contains("smollm2-135m, llama-3.2-1b, gpt2-small, tiny, gpt2-tiny"),
            "{e}"
        );
    }

    /// A GPT-2 base: both kiln engines train adapters on its Conv1D-named projections, the
    /// NF4 base is the smaller, and the report says what was adapted.
    #[test]
    fn on_the_cpu_the_gpt2_tiny_shape_runs_both_kiln_engines() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ft");
        run(cpu_args("gpt2-tiny", true, out.clone())).unwrap();
        let json = crate::report::read_results(&out);
        assert_eq!(json["model"]["kind"], "gpt");
        let engines = json["engines"].as_array().unwrap();
        assert_eq!(engines.len(), 2);
        let bytes = |i: usize, k: &str| engines[i][k].as_u64().unwrap();
        assert!(bytes(1, "base_weight_bytes") < bytes(0, "base_weight_bytes"));
        for e in engines {
            let losses = e["losses"].as_array().unwrap();
            assert_eq!(losses.len(), 3);
            assert!(losses.iter().all(|l| l.as_f64().unwrap().is_finite()));
        }
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("on every c_attn, c_proj and c_fc"), "{md}");
        assert!(md.contains("GPT-2: width 64, 2 layers"), "{md}");
    }
}

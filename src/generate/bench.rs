//! `kiln bench generate`: prefill and decode tokens/s of the generation engine at several
//! batch sizes, against the physical floor of a decode step and beside Hugging Face
//! `generate` on the same model and GPU in the same command.
//!
//! Every batch runs `batch` prompts of `prompt_len` random token ids, one sample each,
//! `new_tokens` new tokens with no stop token, sampling with the suite's temperature and
//! top-p, after an untimed run of the same shapes (kernel choice and graph capture stay
//! out of the timing). The prefill phase runs the prompts and draws each sequence's first
//! token; the decode phase draws the rest. The floor of a decode step is the bytes it must
//! read once from memory, the weights plus the key/value cache at the average length,
//! over the measured device-to-device copy bandwidth; the report gives the fraction of that
//! floor each batch reaches. `bench/hf_generate.py` runs transformers with the same shape
//! (or the same checkpoint), prompt length, new tokens, sampling, bf16 and SDPA.

use super::{Options, Request, Sampling, generate};
use crate::data::Tokenizer;
use crate::engine::cuda::CudaBackend;
use crate::engine::rng::{Rng, stream};
use crate::error::{KilnError, Result};
use crate::models::Model;
use crate::models::llama::LlamaConfig;
use crate::report::{LinePlot, Plot, Report, Series, Table};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Published shapes the suite can build with random weights.
pub const PRESETS: &[&str] = &["smollm2-135m", "llama-3.2-1b"];

/// The Llama-family shape of a preset (random weights; long enough a context for any
/// benchmark prompt plus its new tokens).
pub fn preset(name: &str) -> Option<LlamaConfig> {
    let base = LlamaConfig {
        vocab: 49152,
        d_model: 576,
        n_layers: 30,
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        ffn_hidden: 1536,
        context: 2048,
        rope_theta: 1e5,
        rot_dim: 64,
        rope_scaling: None,
        rope_factors: None,
        rope_long_factors: None,
        rope_trained_context: 0,
        rope_attention_factor: 1.0,
        norm_eps: 1e-5,
        tied_head: true,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: 0,
        full_attention_layers: 0,
    };
    match name {
        "smollm2-135m" => Some(base),
        "llama-3.2-1b" => Some(LlamaConfig {
            vocab: 128256,
            d_model: 2048,
            n_layers: 16,
            n_heads: 32,
            n_kv_heads: 8,
            ffn_hidden: 8192,
            rope_theta: 5e5,
            ..base
        }),
        _ => None,
    }
}

/// Where the reference run gets its model: the same preset shape, or the same checkpoint.
#[derive(Debug, Clone)]
pub enum ReferenceModel {
    Preset(String),
    Dir(PathBuf),
}

/// What the suite measures.
pub struct Settings {
    /// A label for the model in the report.
    pub label: String,
    pub batches: Vec<usize>,
    pub prompt_len: usize,
    pub new_tokens: usize,
    pub sampling: Sampling,
    pub cuda_graphs: bool,
    /// Queue each decode step before reading the last one's tokens ([`Options::overlap_steps`]).
    pub overlap_steps: bool,
    pub seed: u64,
    pub out: PathBuf,
    /// The reference run: its script, model and batches; `Err` says why it does not run.
    pub reference: std::result::Result<Reference, String>,
}

/// How to run `bench/hf_generate.py`.
pub struct Reference {
    pub script: PathBuf,
    pub model: ReferenceModel,
    pub batches: Vec<usize>,
}

/// One batch size of one engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    pub engine: String,
    pub batch: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// Decode tokens/s at the floor of a step, and the fraction of it reached (kiln only).
    #[serde(default)]
    pub floor_tokens_per_s: Option<f64>,
    #[serde(default)]
    pub floor_fraction: Option<f64>,
    #[serde(default)]
    pub graph_replays: Option<usize>,
}

/// Decodes ids to nothing: the suite reads tokens, never text.
struct NoText;

impl Tokenizer for NoText {
    fn name(&self) -> &str {
        "none"
    }
    fn vocab_size(&self) -> usize {
        0
    }
    fn encode(&self, _: &str) -> Vec<u32> {
        Vec::new()
    }
    fn decode(&self, _: &[u32]) -> String {
        String::new()
    }
}

/// Bytes a decode step of `batch` sequences at `len` positions reads at the least: every
/// weight matrix once (the token table only where it is also the head) and every sequence's
/// cached keys and values.
pub fn step_floor_bytes(model: &dyn Model, batch: usize, len: usize) -> usize {
    let params = model.params();
    let untied = params.iter().any(|p| p.name == "lm_head.weight");
    let weights: usize = params
        .iter()
        .filter(|p| !(untied && p.name == "embed.weight"))
        .map(|p| p.weight().bytes())
        .sum();
    let cache = model.decoder().map_or(0, |d| d.cache_bytes(1, len));
    weights + batch * cache
}

fn options(s: &Settings, new_tokens: usize) -> Options {
    Options {
        seed: s.seed,
        cuda_graphs: s.cuda_graphs,
        overlap_steps: s.overlap_steps,
        ..Options::new(new_tokens, s.sampling)
    }
}

/// Runs the suite on `model` (on `gpu` when there is one) and writes the report.
pub fn run(model: &dyn Model, gpu: Option<&CudaBackend>, s: &Settings) -> Result<()> {
    if s.batches.is_empty() || s.batches.contains(&0) {
        return Err(KilnError::Setting(
            "--batches needs sizes of 1 or more, e.g. 1,8,64,256".into(),
        ));
    }
    if s.prompt_len == 0 || s.new_tokens < 2 {
        return Err(KilnError::Setting(
            "--prompt-len must be at least 1 and --new-tokens at least 2 (one for the prefill, the rest timed as decode)".into(),
        ));
    }
    if s.prompt_len + s.new_tokens > model.context() {
        return Err(KilnError::Setting(format!(
            "--prompt-len {} + --new-tokens {} exceed the model's context of {}",
            s.prompt_len,
            s.new_tokens,
            model.context()
        )));
    }
    let mut report = Report::new("generate", "Generation: prefill and decode speed", &s.out)?;
    if let Some(g) = gpu {
        report.watch_gpu(g.info().ordinal);
    }
    let copy_gbs = match gpu {
        Some(g) => Some(
            crate::hw::probe::gpu_copy_gbs(g, 1 << 30).map_err(crate::engine::EngineError::from)?,
        ),
        None => None,
    };
    let mut rng = Rng::new(s.seed, stream::DATA);
    let vocab = model.vocab() as u64;
    let avg_len = s.prompt_len + s.new_tokens / 2;
    let mut points = Vec::new();
    for &batch in &s.batches {
        let reqs: Vec<Request> = (0..batch)
            .map(|_| Request {
                prompt: (0..s.prompt_len).map(|_| rng.below(vocab) as u32).collect(),
                samples: 1,
            })
            .collect();
        // The same shapes untimed first: GEMM choices and graph captures happen there.
        generate(model, &NoText, &reqs, &options(s, 3), &mut |_, _, _| {})?;
        let (done, stats) = generate(
            model,
            &NoText,
            &reqs,
            &options(s, s.new_tokens),
            &mut |_, _, _| {},
        )?;
        let produced: usize = done.iter().map(|c| c.tokens.len()).sum();
        if produced != batch * s.new_tokens {
            return Err(KilnError::Setting(format!(
                "batch {batch} produced {produced} tokens instead of {}",
                batch * s.new_tokens
            )));
        }
        let floor = copy_gbs.map(|gbs| {
            let step_secs = step_floor_bytes(model, batch, avg_len) as f64 / (gbs * 1e9);
            batch as f64 / step_secs
        });
        let decode = stats.decode_rate();
        println!(
            "kiln batch {batch}: prefill {:.0} tok/s, decode {:.0} tok/s{}",
            stats.prefill_rate(),
            decode,
            floor.map_or(String::new(), |f| format!(
                " ({:.0}% of the {:.0} tok/s floor)",
                100.0 * decode / f,
                f
            ))
        );
        if let Some(why) = &stats.graphs_off {
            report.note(format!("batch {batch}: CUDA graphs off: {why}"));
        }
        points.push(Point {
            engine: "kiln".into(),
            batch,
            prefill_tokens_per_s: stats.prefill_rate(),
            decode_tokens_per_s: decode,
            floor_tokens_per_s: floor,
            floor_fraction: floor.map(|f| decode / f),
            graph_replays: Some(stats.graph_replays),
        });
    }
    match &s.reference {
        Ok(r) => match run_reference(r, s) {
            Ok(p) => points.extend(p),
            Err(why) => report.skip(format!("transformers generate: {why}")),
        },
        Err(why) => report.skip(format!("transformers generate: {why}")),
    }
    write_report(&mut report, s, &points, copy_gbs)?;
    report.result("points", &points)?;
    let mut summary = Table::new(&[
        "engine",
        "batch",
        "prefill tok/s",
        "decode tok/s",
        "of floor",
    ]);
    for p in &points {
        summary.row(vec![
            p.engine.clone(),
            p.batch.to_string(),
            format!("{:.0}", p.prefill_tokens_per_s),
            format!("{:.0}", p.decode_tokens_per_s),
            p.floor_fraction
                .map_or("-".into(), |f| format!("{:.0}%", 100.0 * f)),
        ]);
    }
    report.finish(&summary)
}

fn write_report(
    report: &mut Report,
    s: &Settings,
    points: &[Point],
    copy_gbs: Option<f64>,
) -> Result<()> {
    report.text(&format!(
        "Model: {}. `batch` prompts of {} random tokens, {} new tokens each, temperature {}, top-p {}, top-k {} (0 = off), no stop token; CUDA graphs {}; decode steps {}.\n\n\
         Prefill = the prompts' forward passes and each sequence's first token; decode = the remaining tokens. \
         The floor of a decode step is the weights plus the key/value cache at the average length read once, over the \
         measured copy bandwidth{}.\n\n",
        s.label,
        s.prompt_len,
        s.new_tokens,
        s.sampling.temperature,
        s.sampling.top_p,
        s.sampling.top_k,
        if s.cuda_graphs { "on" } else { "off" },
        if s.overlap_steps {
            "queued one ahead of the host's reading"
        } else {
            "each read before the next is queued"
        },
        copy_gbs.map_or(" (no GPU: no floor)".into(), |g| format!(" ({g:.0} GB/s)"))
    ));
    let mut t = Table::new(&[
        "engine",
        "batch",
        "prefill tok/s",
        "decode tok/s",
        "floor tok/s",
        "of floor",
        "kiln / transformers (decode)",
    ]);
    for p in points {
        let hf = points
            .iter()
            .find(|q| q.engine != "kiln" && q.batch == p.batch)
            .map(|q| q.decode_tokens_per_s);
        t.row(vec![
            p.engine.clone(),
            p.batch.to_string(),
            format!("{:.0}", p.prefill_tokens_per_s),
            format!("{:.0}", p.decode_tokens_per_s),
            p.floor_tokens_per_s
                .map_or("-".into(), |f| format!("{f:.0}")),
            p.floor_fraction
                .map_or("-".into(), |f| format!("{:.1}%", 100.0 * f)),
            match (p.engine.as_str(), hf) {
                ("kiln", Some(h)) if h > 0.0 => format!("{:.1}x", p.decode_tokens_per_s / h),
                _ => "-".into(),
            },
        ]);
    }
    report.table(&t);
    let series = |engine: &str, f: &dyn Fn(&Point) -> Option<f64>| {
        Series::new(
            engine,
            points
                .iter()
                .filter(|p| p.engine == engine)
                .filter_map(|p| f(p).map(|y| (p.batch as f64, y)))
                .collect(),
        )
    };
    let mut lines = vec![
        series("kiln", &|p| Some(p.decode_tokens_per_s)),
        series("transformers", &|p| Some(p.decode_tokens_per_s)),
    ];
    if copy_gbs.is_some() {
        let mut floor = series("kiln", &|p| p.floor_tokens_per_s);
        floor.name = "floor (weights + cache read)".into();
        lines.push(floor);
    }
    lines.retain(|l| !l.points.is_empty());
    report.plot(
        "decode_tokens_per_s",
        &Plot::Line(LinePlot {
            title: format!("Decode tokens/s, {}", s.label),
            x_label: "batch".into(),
            y_label: "new tokens/s".into(),
            log_x: true,
            log_y: true,
            series: lines,
        }),
    )
}

/// Runs `bench/hf_generate.py`; an error is a reason to list as skipped.
fn run_reference(r: &Reference, s: &Settings) -> std::result::Result<Vec<Point>, String> {
    let script = &r.script;
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(script);
    match &r.model {
        ReferenceModel::Preset(name) => cmd.args(["--shape", name]),
        ReferenceModel::Dir(dir) => cmd.arg("--model").arg(dir),
    };
    let list: Vec<String> = r.batches.iter().map(usize::to_string).collect();
    cmd.args(["--batches", &list.join(",")])
        .args(["--prompt-len", &s.prompt_len.to_string()])
        .args(["--new-tokens", &s.new_tokens.to_string()])
        .args(["--temperature", &s.sampling.temperature.to_string()])
        .args(["--top-p", &s.sampling.top_p.to_string()])
        .args(["--top-k", &s.sampling.top_k.to_string()]);
    println!("running {} (batches {})", script.display(), list.join(","));
    let out = cmd
        .output()
        .map_err(|e| format!("python3 could not start ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "python3 {} failed: {}",
            script.display(),
            err.lines().last().unwrap_or("no output")
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .map(|l| {
            serde_json::from_str::<Point>(l)
                .map_err(|e| format!("unreadable line from {}: {e}", script.display()))
        })
        .inspect(|p| {
            if let Ok(p) = p {
                println!(
                    "transformers batch {}: prefill {:.0} tok/s, decode {:.0} tok/s",
                    p.batch, p.prefill_tokens_per_s, p.decode_tokens_per_s
                );
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Device, MemoryPool};
    use crate::models::llama::Llama;
    use crate::nn::Params;

    #[test]
    fn presets_have_the_published_sizes_and_the_floor_counts_weights_and_cache() {
        let smol = preset("smollm2-135m").unwrap();
        assert_eq!((smol.d_model, smol.n_layers, smol.vocab), (576, 30, 49152));
        let big = preset("llama-3.2-1b").unwrap();
        assert_eq!(
            (big.d_model, big.n_kv_heads, big.ffn_hidden),
            (2048, 8, 8192)
        );
        assert!(preset("gpt-5").is_none());
        let cfg = LlamaConfig {
            vocab: 256,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            rot_dim: 8,
            ffn_hidden: 48,
            context: 64,
            ..smol
        };
        let model = Llama::new(&MemoryPool::new(Device::Cpu), cfg, 1).unwrap();
        let weights: usize = model.params().iter().map(|p| p.weight().bytes()).sum();
        // 2 layers x (K + V) x 2 heads x 8 dims x 4 bytes per position.
        assert_eq!(step_floor_bytes(&model, 1, 10), weights + 256 * 10);
        assert_eq!(step_floor_bytes(&model, 3, 10), weights + 3 * 256 * 10);
    }

    #[test]
    fn kiln_points_run_on_the_cpu_and_reach_a_report() {
        let cfg = LlamaConfig {
            vocab: 256,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            rot_dim: 8,
            ffn_hidden: 48,
            context: 64,
            ..preset("smollm2-135m").unwrap()
        };
        let model = Llama::new(&MemoryPool::new(Device::Cpu), cfg, 1).unwrap();
        let out = tempfile::tempdir().unwrap();
        let s = Settings {
            label: "tiny".into(),
            batches: vec![1, 3],
            prompt_len: 5,
            new_tokens: 4,
            sampling: Sampling {
                temperature: 0.9,
                top_k: 0,
                top_p: 0.9,
                ..Sampling::default()
            },
            cuda_graphs: true,
            overlap_steps: true,
            seed: 1,
            out: out.path().to_path_buf(),
            reference: Err("not asked for".into()),
        };
        run(&model, None, &s).unwrap();
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join("results.json")).unwrap(),
        )
        .unwrap();
        let points = json["points"].as_array().unwrap();
        assert_eq!(points.len(), 2);
        assert!(points[1]["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        let md = std::fs::read_to_string(out.path().join("report.md")).unwrap();
        assert!(md.contains("transformers generate: not asked for"), "{md}");
    }
}

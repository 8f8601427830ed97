//! `kiln bench generate`: the command line of [`crate::generate::bench`].

use crate::error::{KilnError, Result};
use crate::generate::Sampling;
use crate::generate::bench::{self, PRESETS, Reference, ReferenceModel, Settings};
use crate::models::Model;
use crate::models::llama::Llama;
use crate::nn::Params;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench generate                                   SmolLM2-135M's shape, random weights
  kiln bench generate --shape llama-3.2-1b --batches 1,64
  kiln bench generate --init-from DIR --out bench-out/gen-mine
  kiln bench generate --no-python --no-cuda-graphs      kiln alone, every kernel launched

Beside kiln it runs bench/hf_generate.py (transformers generate, bf16, SDPA, the same
prompts' length, new tokens and sampling) when python3 can import torch and transformers.")]
pub struct BenchGenerateArgs {
    /// A pretrained model (Hugging Face directory or GGUF file) instead of a preset shape.
    #[arg(long, value_name = "PATH", conflicts_with = "shape")]
    pub init_from: Option<PathBuf>,
    /// A published shape built with random weights: smollm2-135m or llama-3.2-1b.
    #[arg(long, default_value = "smollm2-135m")]
    pub shape: String,
    /// Batch sizes (prompts decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,256")]
    pub batches: Vec<usize>,
    /// Batch sizes transformers runs at (default: all of --batches).
    #[arg(long, value_delimiter = ',')]
    pub reference_batches: Option<Vec<usize>>,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this, in (0, 1].
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub top_p: f32,
    /// 0 = off (transformers gets the same).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Launch every decode kernel from the host instead of replaying CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Wait for each decode step's tokens before queueing the next step (by default the
    /// next step runs while the host reads them).
    #[arg(long)]
    pub no_overlap: bool,
    /// Skip the transformers run.
    #[arg(long)]
    pub no_python: bool,
    /// Where to run: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// bf16 (the default on a GPU) or fp32.
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory for report.md, results.json and the plot.
    #[arg(long, default_value = "bench-out/generate")]
    pub out: PathBuf,
}

pub fn run(a: BenchGenerateArgs) -> Result<()> {
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };
    sampling.check().map_err(KilnError::Setting)?;
    let (model, label, reference_model): (Box<dyn Model>, String, ReferenceModel) =
        match &a.init_from {
            Some(path) => {
                let (cpu, cfg, vocab) = crate::generate::load::load_pretrained_on_cpu(path)?;
                let (m, _) = crate::generate::load::to_device(
                    cpu,
                    &cfg,
                    vocab,
                    &a.device,
                    a.precision.as_deref(),
                )?;
                (
                    m,
                    path.display().to_string(),
                    ReferenceModel::Dir(path.clone()),
                )
            }
            None => {
                let cfg = bench::preset(&a.shape).ok_or_else(|| {
                    KilnError::Setting(format!(
                        "--shape {} is not a preset; use one of {}",
                        a.shape,
                        PRESETS.join(", ")
                    ))
                })?;
                let (pool, dtype, _) =
                    crate::generate::load::open_for_generation(&a.device, a.precision.as_deref())?;
                let mut m = Llama::new(&pool, cfg, a.seed)?;
                // As `kiln generate` readies a model (generate::load::ready_for_generation).
                m.fold_norm_gains()?;
                for p in m.params_mut() {
                    p.set_compute_dtype(dtype)?;
                }
                (
                    Box::new(m),
                    format!("{} shape, random weights", a.shape),
                    ReferenceModel::Preset(a.shape.clone()),
                )
            }
        };
    let pool = model.params()[0].value.pool().clone();
    let gpu = pool.cuda().ok().cloned();
    let reference = if a.no_python {
        Err("--no-python".to_string())
    } else if gpu.is_none() {
        Err("kiln ran on the CPU; the script runs on a CUDA GPU only".to_string())
    } else if a.init_from.as_ref().is_some_and(|p| !p.is_dir()) {
        Err("the script loads Hugging Face directories, not GGUF files".to_string())
    } else {
        super::find_script("hf_generate.py").map(|script| Reference {
            script,
            model: reference_model,
            batches: a.reference_batches.clone().unwrap_or(a.batches.clone()),
        })
    };
    let settings = Settings {
        label,
        batches: a.batches.clone(),
        prompt_len: a.prompt_len,
        new_tokens: a.new_tokens,
        sampling,
        cuda_graphs: !a.no_cuda_graphs,
        overlap_steps: !a.no_overlap,
        seed: a.seed,
        out: a.out.clone(),
        reference,
    };
    bench::run(model.as_ref(), gpu.as_deref(), &settings)
}

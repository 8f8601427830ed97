//! `kiln export`: write a run's model as a Hugging Face directory; `kiln merge`: the same with
//! low-rank adapters folded into their base, refusing a model that has none.

use crate::error::Result;
use crate::models::export_gguf::GgufType;
use crate::train;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln export --run runs/smol-ft --to smol-ft-hf     then in Python:
      AutoModelForCausalLM.from_pretrained(\"smol-ft-hf\")

A run that trained low-rank adapters (kiln finetune) exports with the adapters merged into
its base; --adapter-only DIR writes the adapters alone in PEFT's format.

Llama-family runs export as LlamaForCausalLM, GPT runs as GPT2LMHeadModel (f32 safetensors).
The tokenizer files come along when the run's tokenizer is a pretrained model's.

  kiln export --init-from SmolLM2-135M-Instruct.Q4_1.gguf --to smol-hf
      an imported model (a GGUF file or a Hugging Face directory, with --adapter DIR merged
      in) written back as a Hugging Face directory, dequantised to f32.

  kiln export --run runs/smol-ft --to smol-ft.gguf --outtype q8_0
      a single GGUF file for llama.cpp, Ollama or LM Studio (Llama-family models: llama, or
      qwen2/qwen3 with their biases or norms), its tokenizer and chat template in the
      metadata; matrices in f32, f16 (the default), bf16, q8_0, q4_0 or q4_k, vectors in f32.")]
pub struct ExportArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub run: Option<PathBuf>,
    /// Export an imported model instead of a run: a GGUF file or a Hugging Face directory.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["checkpoint", "adapter_only"])]
    pub init_from: Option<PathBuf>,
    /// With --init-from: a PEFT adapter directory merged into the model before export.
    #[arg(long, value_name = "DIR", requires = "init_from")]
    pub adapter: Option<PathBuf>,
    /// Export this checkpoint (step_N, N, or best: a train.keep_best run's lowest
    /// validation loss) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
    /// Directory to write (created if missing), or a FILE.gguf: a single file for llama.cpp
    /// (Llama-family models).
    #[arg(long, value_name = "DIR", required_unless_present = "adapter_only")]
    pub to: Option<PathBuf>,
    /// For a LoRA run: write only the adapters, in PEFT's format, to DIR.
    #[arg(long, value_name = "DIR")]
    pub adapter_only: Option<PathBuf>,
    /// With --to FILE.gguf: how the matrices are stored (vectors are always f32; default f16).
    #[arg(long, value_enum)]
    pub outtype: Option<GgufType>,
}

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln merge --run runs/ft --to ft-merged
      the adapters a kiln finetune run trained, folded into its base (W + scale * B A) and
      written as a Hugging Face directory that transformers loads alone
  kiln merge --init-from ./base --adapter ./peft-adapter --to merged
      a PEFT adapter directory (kiln's or PEFT's own) folded into a base from disk

What merge_and_unload() and save_pretrained() do in PEFT. A model without adapters has
nothing to merge and is refused (exit 2): kiln export writes it as it is.")]
pub struct MergeArgs {
    /// Run directory of a `kiln finetune` run with adapters (default: the most recent run).
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub run: Option<PathBuf>,
    /// Merge into an imported model instead: a GGUF file or a Hugging Face directory.
    #[arg(
        long,
        value_name = "PATH",
        requires = "adapter",
        conflicts_with = "checkpoint"
    )]
    pub init_from: Option<PathBuf>,
    /// With --init-from: the PEFT adapter directory to merge.
    #[arg(long, value_name = "DIR", requires = "init_from")]
    pub adapter: Option<PathBuf>,
    /// Merge the adapters of this checkpoint (step_N, N, or best: a train.keep_best run's
    /// lowest validation loss) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
    /// Directory to write (created if missing), or a FILE.gguf for llama.cpp.
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// With --to FILE.gguf: how the matrices are stored (vectors are always f32; default f16).
    #[arg(long, value_enum)]
    pub outtype: Option<GgufType>,
}

/// The GGUF storage type: `--outtype`, which only a `.gguf` target takes, or f16.
fn gguf_type(to: Option<&std::path::Path>, outtype: Option<GgufType>) -> Result<GgufType> {
    match (outtype, to) {
        (Some(_), Some(to)) if !is_gguf(to) => Err(crate::error::KilnError::Setting(format!(
            "--outtype sets how a GGUF file stores its matrices, and {} is a directory target (written in f32 safetensors); give --to FILE.gguf, or leave --outtype out",
            to.display()
        ))),
        (t, _) => Ok(t.unwrap_or(GgufType::F16)),
    }
}

fn is_gguf(to: &std::path::Path) -> bool {
    to.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

pub fn merge(a: MergeArgs) -> Result<()> {
    let outtype = gguf_type(Some(&a.to), a.outtype)?;
    if let Some(path) = &a.init_from {
        return export_imported(path, a.adapter.as_deref(), Some(&a.to), outtype);
    }
    export_run(
        a.run,
        a.checkpoint.as_deref(),
        Some(&a.to),
        None,
        Adapters::MustMerge,
        outtype,
    )
}

/// What a run without adapters means to the command.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Adapters {
    /// `kiln export`: merged when there are any, the model as it is otherwise.
    MergeIfAny,
    /// `kiln merge`: there must be some.
    MustMerge,
}

pub fn run(a: ExportArgs) -> Result<()> {
    let outtype = gguf_type(a.to.as_deref(), a.outtype)?;
    if let Some(path) = &a.init_from {
        return export_imported(path, a.adapter.as_deref(), a.to.as_deref(), outtype);
    }
    export_run(
        a.run,
        a.checkpoint.as_deref(),
        a.to.as_deref(),
        a.adapter_only.as_deref(),
        Adapters::MergeIfAny,
        outtype,
    )
}

fn export_run(
    run: Option<PathBuf>,
    checkpoint: Option<&str>,
    to: Option<&std::path::Path>,
    adapter_only: Option<&std::path::Path>,
    adapters: Adapters,
    outtype: GgufType,
) -> Result<()> {
    let run_dir = super::find_run(run)?;
    let mut loaded = train::load_run(&run_dir, checkpoint)?;
    if let Some(w) = &loaded.unverified {
        eprintln!("warning: {w}");
    }
    let cfg = &loaded.config;
    if !cfg.lora.enabled && adapters == Adapters::MustMerge {
        return Err(crate::error::KilnError::Setting(format!(
            "{} trained every weight, so it has no adapters to merge; kiln export --run {} --to DIR writes it as it is",
            run_dir.display(),
            run_dir.display()
        )));
    }
    if cfg.lora.enabled {
        if let Some(dir) = adapter_only {
            let n = crate::models::peft::save_adapter(
                loaded.model.as_ref(),
                &cfg.lora,
                &cfg.lora.base,
                dir,
            )?;
            println!("wrote {n} adapters in PEFT's format to {}", dir.display());
            return Ok(());
        }
        // The adapters folded into the f32 base: a plain model transformers loads alone.
        loaded.model.merge_lora()?;
        if adapters == Adapters::MergeIfAny {
            eprintln!(
                "note: the run trained low-rank adapters; they are merged into the base {} for this export (--adapter-only DIR writes them alone in PEFT's format)",
                cfg.lora.base
            );
        }
    } else if adapter_only.is_some() {
        return Err(crate::error::KilnError::Setting(format!(
            "{} trained every weight, so it has no adapters; export it without --adapter-only",
            run_dir.display()
        )));
    }
    let vocab = train::model_vocab(cfg)?;
    let to = to.ok_or_else(|| {
        crate::error::KilnError::Setting("give --to DIR, the directory to write".into())
    })?;
    let notes = write_model(
        loaded.model.as_ref(),
        &cfg.model,
        vocab,
        &cfg.data.tokenizer,
        to,
        outtype,
    )?;
    for n in notes {
        eprintln!("note: {n}");
    }
    println!(
        "exported {} (step {}) to {}",
        loaded.checkpoint.display(),
        loaded.step,
        to.display()
    );
    Ok(())
}

/// An imported model written back in Hugging Face's layout (with a PEFT adapter merged when
/// one is given): the bridge from a GGUF file to transformers.
fn export_imported(
    path: &std::path::Path,
    adapter: Option<&std::path::Path>,
    to: Option<&std::path::Path>,
    outtype: GgufType,
) -> Result<()> {
    let to = to.ok_or_else(|| {
        crate::error::KilnError::Setting("give --to DIR, the directory to write".into())
    })?;
    let p = crate::models::import::pretrained::open(path)?;
    let mut model = p.build_on_cpu()?;
    if let Some(dir) = adapter {
        crate::models::peft::apply(model.as_mut(), dir)?;
        model.merge_lora()?;
    }
    let notes = write_model(
        model.as_ref(),
        &p.model,
        p.vocab,
        &path.display().to_string(),
        to,
        outtype,
    )?;
    for n in notes {
        eprintln!("note: {n}");
    }
    println!("exported {} to {}", path.display(), to.display());
    Ok(())
}

/// Writes `model` to `to`: a GGUF file when the name ends in `.gguf`, else a Hugging Face
/// directory.
fn write_model(
    model: &dyn crate::models::Model,
    m: &crate::config::ModelConfig,
    vocab: usize,
    tokenizer: &str,
    to: &std::path::Path,
    outtype: GgufType,
) -> Result<Vec<String>> {
    if is_gguf(to) {
        crate::models::export_gguf::export_gguf(model, m, vocab, tokenizer, to, outtype)
    } else {
        crate::models::export::export_hf(model, m, vocab, tokenizer, to)
    }
}

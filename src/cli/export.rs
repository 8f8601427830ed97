//! `kiln export`: write a run's model as a Hugging Face directory.

use crate::error::Result;
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
      in) written back as a Hugging Face directory, dequantised to f32.")]
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
    /// Export this checkpoint (step_N or N) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
    /// Directory to write (created if missing).
    #[arg(long, value_name = "DIR", required_unless_present = "adapter_only")]
    pub to: Option<PathBuf>,
    /// For a LoRA run: write only the adapters, in PEFT's format, to DIR.
    #[arg(long, value_name = "DIR")]
    pub adapter_only: Option<PathBuf>,
}

pub fn run(a: ExportArgs) -> Result<()> {
    if let Some(path) = &a.init_from {
        return export_imported(path, a.adapter.as_deref(), a.to.as_deref());
    }
    let run_dir = super::find_run(a.run)?;
    let mut loaded = train::load_run(&run_dir, a.checkpoint.as_deref())?;
    if let Some(w) = &loaded.unverified {
        eprintln!("warning: {w}");
    }
    let cfg = &loaded.config;
    if cfg.lora.enabled {
        if let Some(dir) = &a.adapter_only {
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
        eprintln!(
            "note: the run trained low-rank adapters; they are merged into the base {} for this export (--adapter-only DIR writes them alone in PEFT's format)",
            cfg.lora.base
        );
    } else if a.adapter_only.is_some() {
        return Err(crate::error::KilnError::Setting(format!(
            "{} trained every weight, so it has no adapters; export it without --adapter-only",
            run_dir.display()
        )));
    }
    let vocab = train::model_vocab(cfg)?;
    let to = a.to.as_ref().ok_or_else(|| {
        crate::error::KilnError::Setting("give --to DIR, the directory to write".into())
    })?;
    let notes = crate::models::export::export_hf(
        loaded.model.as_ref(),
        &cfg.model,
        vocab,
        &cfg.data.tokenizer,
        to,
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
    let notes = crate::models::export::export_hf(
        model.as_ref(),
        &p.model,
        p.vocab,
        &path.display().to_string(),
        to,
    )?;
    for n in notes {
        eprintln!("note: {n}");
    }
    println!("exported {} to {}", path.display(), to.display());
    Ok(())
}

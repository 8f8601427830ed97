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
The tokenizer files come along when the run's tokenizer is a pretrained model's.")]
pub struct ExportArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(long, value_name = "DIR")]
    pub run: Option<PathBuf>,
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

//! `kiln export`: write a run's model as a Hugging Face directory.

use crate::error::Result;
use crate::train;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln export --run runs/smol-ft --to smol-ft-hf     then in Python:
      AutoModelForCausalLM.from_pretrained(\"smol-ft-hf\")

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
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
}

pub fn run(a: ExportArgs) -> Result<()> {
    let run_dir = super::find_run(a.run)?;
    let loaded = train::load_run(&run_dir, a.checkpoint.as_deref())?;
    if let Some(w) = &loaded.unverified {
        eprintln!("warning: {w}");
    }
    let cfg = &loaded.config;
    let vocab = train::model_vocab(cfg)?;
    let notes = crate::models::export::export_hf(
        loaded.model.as_ref(),
        &cfg.model,
        vocab,
        &cfg.data.tokenizer,
        &a.to,
    )?;
    for n in notes {
        eprintln!("note: {n}");
    }
    println!(
        "exported {} (step {}) to {}",
        loaded.checkpoint.display(),
        loaded.step,
        a.to.display()
    );
    Ok(())
}

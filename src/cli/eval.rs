//! `kiln eval`: loss and bits per token of a checkpoint on its run's validation split (the
//! held-out tail of its corpus, its validation file, or its fine-tuning data's held-out
//! examples), as its training evaluated it.

use crate::data;
use crate::error::{KilnError, Result};
use crate::train;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln eval                         evaluate the most recent run
  kiln eval --run runs/big --batches 64 --seq-len 64
  kiln eval --init-from SmolLM2-135M-Instruct.Q4_1.gguf --seq-len 256   a pretrained model on the corpus
  kiln eval --run runs/big --checkpoint step_400    an earlier checkpoint

The checkpoint is verified against its manifest first; a damaged one exits with code 4 and
lists the checkpoints of the run that verify.")]
pub struct EvalArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(long, value_name = "DIR", conflicts_with = "init_from")]
    pub run: Option<PathBuf>,
    /// Evaluate a pretrained model (Hugging Face directory or GGUF file) on the bundled
    /// corpus's validation tail, with its own tokenizer.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
    /// With --init-from: low-rank adapters in PEFT's format (adapter_config.json and
    /// adapter_model.safetensors, e.g. a fine-tune's DIR/adapter) applied to the base.
    #[arg(long, value_name = "DIR", requires = "init_from")]
    pub adapter: Option<PathBuf>,
    /// Number of evaluation batches (default: the run's train.eval_batches).
    #[arg(long)]
    pub batches: Option<usize>,
    /// Tokens per evaluated sequence (default: the run's train.seq_len; at most its context).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Evaluate this checkpoint (step_N, N, or best: a train.keep_best run's lowest
    /// validation loss) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
}

/// A pretrained model as a run without checkpoints: default settings with its shape and
/// tokenizer, its weights loaded on the CPU.
fn load_pretrained(
    path: &std::path::Path,
    adapter: Option<&std::path::Path>,
) -> Result<train::LoadedRun> {
    let p = crate::models::import::pretrained::open(path)?;
    let config = crate::config::ResolvedConfig::resolve(None, &p.overrides())?.config;
    let mut model = p.build_on_cpu()?;
    if let Some(dir) = adapter {
        crate::models::peft::apply(model.as_mut(), dir)?;
    }
    Ok(train::LoadedRun {
        config,
        model,
        step: 0,
        checkpoint: path.to_path_buf(),
        unverified: None,
    })
}

pub fn run(a: EvalArgs) -> Result<()> {
    if a.batches == Some(0) {
        return Err(KilnError::Setting(
            "--batches 0 evaluates nothing; give 1 or more (default: the run's train.eval_batches)"
                .into(),
        ));
    }
    if a.seq_len == Some(0) {
        return Err(KilnError::Setting(
            "--seq-len 0 holds no tokens; give 1 or more, at most the model's context".into(),
        ));
    }
    let loaded = match &a.init_from {
        Some(path) => load_pretrained(path, a.adapter.as_deref())?,
        None => train::load_run(&super::find_run(a.run.clone())?, a.checkpoint.as_deref())?,
    };
    if let Some(w) = &loaded.unverified {
        eprintln!("warning: {w}");
    }
    let cfg = &loaded.config;
    let seq = a.seq_len.unwrap_or(cfg.train.seq_len);
    if seq > cfg.model.context {
        return Err(KilnError::Setting(format!(
            "--seq-len {seq} is longer than the model's context of {}; give at most {}",
            cfg.model.context, cfg.model.context
        )));
    }
    // The validation split as the run's training evaluated it: the corpus's tail or
    // data.val_corpus, and for fine-tuning data (JSON lines) the packed rows whose completion
    // or assistant tokens alone are scored.
    let mut spec = train::data_spec(cfg);
    spec.seq = seq;
    let splits = data::load_splits(&spec)?;
    let n_batches = a.batches.unwrap_or(cfg.train.eval_batches);
    let batches = match &splits.sft {
        Some(d) => data::sft::val_batches(&d.val, n_batches, cfg.train.micro_batch),
        None => data::val_batches(&splits.val, n_batches, cfg.train.micro_batch, seq)?,
    };
    let mut loss = 0.0;
    let mut tokens = 0usize;
    for b in &batches {
        loss += loaded.model.loss(&b.inputs, &b.targets, b.batch, b.seq)?;
        tokens += train::trainer::trained_targets(&b.targets);
    }
    let loss = loss / tokens.max(1) as f64;
    let unigram = data::unigram_cross_entropy(&splits.train, &splits.val, train::model_vocab(cfg)?);
    println!(
        "checkpoint {} (step {})",
        loaded.checkpoint.display(),
        loaded.step
    );
    println!(
        "val loss {loss:.4} nats/token, {:.4} bits/token over {tokens} tokens; unigram baseline {unigram:.4} nats/token",
        loss / std::f64::consts::LN_2
    );
    Ok(())
}

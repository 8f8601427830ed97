//! `kiln finetune`: `kiln train` from a pretrained base, with low-rank adapters by default, on
//! plain text or JSON lines of prompt/completion pairs or chats; saves the adapters in PEFT's
//! format at the end.

use super::train::TrainArgs;
use crate::error::{KilnError, Result};
use crate::train;
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln finetune --init-from SmolLM2-135M-Instruct.Q4_1.gguf --data chats.jsonl --out runs/ft
                       LoRA (rank 16 on q/k/v/o/gate/up/down) on a frozen base; chats rendered
                       with the model's chat template, only assistant turns trained
  kiln finetune --init-from ./Llama-3.2-1B --data pairs.jsonl lora.rank=8 lora.targets=q_proj,v_proj
  kiln finetune --init-from ./base --data corpus.txt --full     every weight trains
  kiln finetune --init-from ./Llama-3.2-1B --data chats.jsonl --qlora
                       QLoRA: the frozen projections kept in 4-bit NF4 (lora.quantize=nf4)
  kiln finetune --resume runs/ft train.steps=2000               continue a fine-tune
  kiln finetune --init-from ./base --data chats.jsonl scu.enabled=true scu.target=0.02
                       with the SCU controller on the adapters' penalty (scu_history.jsonl)

--data takes plain text (every token trained) or JSON lines, detected from the first line:
{\"prompt\": ..., \"completion\": ...} trains the completion, {\"messages\": [...]} trains the
assistant turns. data.format=text|prompt_completion|chat overrides the detection. At the end
the adapters are written to DIR/adapter (adapter_model.safetensors + adapter_config.json),
which peft.PeftModel.from_pretrained(base, DIR/adapter) loads; `kiln export --run DIR` writes
the merged model.

EXIT CODES: as kiln train.")]
pub struct FinetuneArgs {
    /// The fine-tuning data: a text file or JSON lines (see below).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Train every weight instead of low-rank adapters over a frozen base.
    #[arg(long)]
    pub full: bool,
    /// QLoRA: keep the frozen projections in 4-bit NF4 (the same as lora.quantize=nf4),
    /// quantised at load from the base's weights; adapters train as with LoRA.
    #[arg(long, conflicts_with = "full")]
    pub qlora: bool,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `data.format` for a file: JSON lines with `messages` are chats, with `prompt` pairs;
/// anything else is text.
pub fn detect_format(path: &Path) -> Result<&'static str> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        KilnError::Data(crate::data::DataError::File {
            path: path.to_path_buf(),
            reason: format!("cannot be read ({e}); --data takes a text or JSON-lines file"),
        })
    })?;
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    Ok(match serde_json::from_str::<serde_json::Value>(first) {
        Ok(v) if v.get("messages").is_some() => "chat",
        Ok(v) if v.get("prompt").is_some() || v.get("completion").is_some() => "prompt_completion",
        _ => "text",
    })
}

pub fn run(mut a: FinetuneArgs) -> Result<()> {
    let resuming = a.train.resume.is_some();
    if !resuming && a.train.init_from.is_none() {
        return Err(KilnError::Setting(
            "kiln finetune starts from a pretrained model: give --init-from PATH (a Hugging Face directory or .gguf file), or --resume DIR to continue a fine-tune".into(),
        ));
    }
    if a.qlora && resuming {
        return Err(KilnError::Setting(
            "--qlora starts a fine-tune over an NF4 base; a resumed run keeps the base its config.toml names (lora.quantize), so drop --qlora".into(),
        ));
    }
    let mut pre: Vec<String> = Vec::new();
    if let Some(data) = &a.data {
        pre.push(format!("data.corpus={}", data.display()));
        if !a
            .train
            .overrides
            .iter()
            .any(|o| o.starts_with("data.format="))
        {
            pre.push(format!("data.format={}", detect_format(data)?));
        }
    } else if !resuming {
        return Err(KilnError::Setting(
            "kiln finetune needs --data FILE (text, or JSON lines of prompt/completion pairs or chats)".into(),
        ));
    }
    if let (Some(base), false) = (&a.train.init_from, a.full) {
        let base = std::path::absolute(base).unwrap_or_else(|_| base.clone());
        pre.push("lora.enabled=true".into());
        pre.push(format!("lora.base={}", base.display()));
    }
    if a.qlora {
        pre.push("lora.quantize=nf4".into());
    }
    // The user's own overrides come last and win.
    pre.append(&mut a.train.overrides);
    a.train.overrides = pre;
    if a.train.print_config {
        return super::train::run(a.train);
    }
    let run_dir = a
        .train
        .resume
        .clone()
        .or(a.train.out.clone())
        .unwrap_or_else(super::new_run_dir);
    a.train.out = a.train.resume.is_none().then(|| run_dir.clone());
    super::train::run(a.train)?;
    // The adapters in PEFT's format, from the run's last checkpoint.
    let loaded = train::load_run(&run_dir, None)?;
    let lora = &loaded.config.lora;
    if lora.enabled {
        let dir = run_dir.join("adapter");
        let n = crate::models::peft::save_adapter(loaded.model.as_ref(), lora, &lora.base, &dir)?;
        println!(
            "adapters: {n} modules in PEFT's format in {}   (merged model: kiln export --run {} --to DIR)",
            dir.display(),
            run_dir.display()
        );
    }
    Ok(())
}

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
                       LoRA (rank 16 on every block projection) on a frozen base; chats
                       rendered with the model's chat template, only assistant turns trained
  kiln finetune --init-from ./gpt2 --data corpus.txt lora.targets=c_attn
                       a GPT-2 base (GPT2LMHeadModel), adapters on its fused q/k/v only
  kiln finetune --init-from ./Llama-3.2-1B --data pairs.jsonl lora.rank=8 lora.targets=q_proj,v_proj
  kiln finetune --init-from ./base --data corpus.txt --full     every weight trains
  kiln finetune --init-from ./Llama-3.2-1B --data chats.jsonl --qlora
                       QLoRA: the frozen projections kept in 4-bit NF4 (lora.quantize=nf4)
  kiln finetune --resume runs/ft train.steps=2000               continue a fine-tune
  kiln finetune --init-from ./base --data chats.jsonl scu.enabled=true scu.target=0.02
                       with the SCU controller on the adapters' penalty (scu_history.jsonl)
  kiln finetune --init-from SmolLM2-135M-Instruct.Q4_1.gguf --data cues.jsonl
       --objective polychromic --diversity-lambda 0.5 --samples 8 --embedder all-MiniLM-L6-v2
                       CE - 0.5 * D: 8 replies sampled per prompt, their diversity rewarded

--data takes plain text (every token trained) or JSON lines, detected from the first line:
{\"prompt\": ..., \"completion\": ...} trains the completion; Alpaca's {\"instruction\": ...,
\"input\": ..., \"output\": ...} trains the output under Alpaca's prompt; chats train the
assistant turns through the model's chat template: {\"messages\": [{\"role\", \"content\"}]},
ShareGPT's {\"conversations\": [{\"from\", \"value\"}]} (human, gpt, system), or TRL's
{\"prompt\": [turns], \"completion\": [turns]} (the completion's turns trained).
data.format=text|prompt_completion|alpaca|chat overrides the detection (chat also renders
Alpaca lines as a user turn and its reply). At the end
the adapters are written to DIR/adapter (adapter_model.safetensors + adapter_config.json),
which peft.PeftModel.from_pretrained(base, DIR/adapter) loads; `kiln export --run DIR` writes
the merged model.

--objective polychromic trains on CE - lambda * D, D the mean pairwise cosine distance between
the embeddings of --samples replies the model samples for each of --prompts-per-step training
prompts (all in one batched generation). D's gradient reaches the weights through a
score-function estimate: each reply's tokens are trained with the weight lambda * adv / (n *
prompts), adv its leave-one-out advantage. The embedder defaults to the starting model,
frozen, mean-pooled. metrics.jsonl gets D and the time to generate, embed and run the
forward/backward of each sampling step (\"polychromic\" records) and held-out D at each eval;
the flags are the polychromic.* keys.

EXIT CODES: as kiln train.")]
pub struct FinetuneArgs {
    /// The fine-tuning data: a text file or JSON lines (see below).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// A validation file in the shape of --data (data.val_corpus): every example of --data
    /// then trains, in place of holding out its last data.val_fraction.
    #[arg(long, value_name = "FILE", requires = "data")]
    pub val_data: Option<PathBuf>,
    /// Train every weight instead of low-rank adapters over a frozen base.
    #[arg(long)]
    pub full: bool,
    /// QLoRA: keep the frozen projections in 4-bit NF4 (the same as lora.quantize=nf4),
    /// quantised at load from the base's weights; adapters train as with LoRA.
    #[arg(long, conflicts_with = "full")]
    pub qlora: bool,
    /// What to train on: ce (the cross-entropy of the data's completions) or polychromic
    /// (CE minus lambda times the diversity of sampled replies).
    #[arg(long, value_name = "NAME", default_value = "ce", value_parser = ["ce", "polychromic"])]
    pub objective: String,
    #[command(flatten)]
    pub polychromic: PolychromicArgs,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The settings of `--objective polychromic` (the polychromic.* keys).
#[derive(Args, Debug, Default)]
pub struct PolychromicArgs {
    /// Weight lambda of the diversity D (default 0.5); negative only with
    /// --allow-negative-lambda.
    #[arg(long, value_name = "F", allow_negative_numbers = true)]
    pub diversity_lambda: Option<f64>,
    /// Accept a negative lambda, which rewards replies for resembling each other.
    #[arg(long)]
    pub allow_negative_lambda: bool,
    /// Replies sampled per prompt, at least 2 (default 4).
    #[arg(long, value_name = "N")]
    pub samples: Option<usize>,
    /// Training prompts per step that get replies (default 4).
    #[arg(long, value_name = "N")]
    pub prompts_per_step: Option<usize>,
    /// Sample replies and add D every K optimizer steps (default 1).
    #[arg(long, value_name = "K")]
    pub diversity_every: Option<usize>,
    /// Temperature of the sampled replies (default 1).
    #[arg(long, value_name = "T", allow_negative_numbers = true)]
    pub sample_temperature: Option<f64>,
    /// Nucleus sampling of the replies (default 1: the whole distribution).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub sample_top_p: Option<f64>,
    /// Longest sampled reply in tokens (default 32).
    #[arg(long, value_name = "N")]
    pub max_new_tokens: Option<usize>,
    /// The encoder that embeds replies: a BERT-family directory such as all-MiniLM-L6-v2, or
    /// a Llama-family directory or GGUF (default: the starting model, frozen, mean-pooled).
    #[arg(long, value_name = "DIR")]
    pub embedder: Option<PathBuf>,
}

impl PolychromicArgs {
    /// The polychromic.* overrides the flags given ask for, with the flag each came from.
    fn overrides(&self) -> Vec<(&'static str, String)> {
        let mut o = Vec::new();
        let mut put = |flag: &'static str, key: &str, value: Option<String>| {
            if let Some(v) = value {
                o.push((flag, format!("polychromic.{key}={v}")));
            }
        };
        put(
            "--diversity-lambda",
            "lambda",
            self.diversity_lambda.map(|v| v.to_string()),
        );
        put(
            "--allow-negative-lambda",
            "allow_negative_lambda",
            self.allow_negative_lambda.then(|| "true".into()),
        );
        put("--samples", "samples", self.samples.map(|v| v.to_string()));
        put(
            "--prompts-per-step",
            "prompts",
            self.prompts_per_step.map(|v| v.to_string()),
        );
        put(
            "--diversity-every",
            "every",
            self.diversity_every.map(|v| v.to_string()),
        );
        put(
            "--sample-temperature",
            "temperature",
            self.sample_temperature.map(|v| v.to_string()),
        );
        put(
            "--sample-top-p",
            "top_p",
            self.sample_top_p.map(|v| v.to_string()),
        );
        put(
            "--max-new-tokens",
            "max_new_tokens",
            self.max_new_tokens.map(|v| v.to_string()),
        );
        put(
            "--embedder",
            "embedder",
            self.embedder.as_ref().map(|p| {
                let abs = std::path::absolute(p).unwrap_or_else(|_| p.clone());
                abs.display().to_string()
            }),
        );
        o
    }
}

/// `data.format` for a file, from its first line: JSON with `messages` or `conversations`
/// (ShareGPT), or with `prompt` as a list of turns (TRL's conversational form), is a chat; with
/// `instruction`, an Alpaca line; with a `prompt` or `completion` string, a pair; anything else
/// is text.
pub fn detect_format(path: &Path) -> Result<&'static str> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        KilnError::Data(crate::data::DataError::File {
            path: path.to_path_buf(),
            reason: format!(
                "cannot be read ({e}); --data and --val-data take a text or JSON-lines file"
            ),
        })
    })?;
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    Ok(match serde_json::from_str::<serde_json::Value>(first) {
        Ok(v) if v.get("messages").is_some() || v.get("conversations").is_some() => "chat",
        Ok(v) if v.get("prompt").is_some_and(|p| p.is_array()) => "chat",
        Ok(v) if v.get("instruction").is_some() => "alpaca",
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
        if let Some(val) = &a.val_data {
            let (shape, val_shape) = (detect_format(data)?, detect_format(val)?);
            if shape != val_shape {
                return Err(KilnError::Setting(format!(
                    "--val-data {} reads as {val_shape} and --data {} as {shape}; give the validation examples in the shape of the training ones",
                    val.display(),
                    data.display()
                )));
            }
            pre.push(format!("data.val_corpus={}", val.display()));
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
    let polychromic = a.polychromic.overrides();
    if a.objective == "polychromic" {
        if a.polychromic.samples.is_some_and(|n| n < 2) {
            return Err(KilnError::Setting(format!(
                "--samples {}: D is the mean distance over pairs of one prompt's replies, so it needs at least 2 replies per prompt (e.g. --samples 4)",
                a.polychromic.samples.unwrap_or(0)
            )));
        }
        pre.push("polychromic.enabled=true".into());
        if let (None, Some(base)) = (&a.polychromic.embedder, &a.train.init_from) {
            let base = std::path::absolute(base).unwrap_or_else(|_| base.clone());
            pre.push(format!("polychromic.embedder={}", base.display()));
        }
    } else if let (Some((flag, _)), false) = (polychromic.first(), resuming) {
        // A resumed run keeps its objective (polychromic.enabled in its config.toml).
        return Err(KilnError::Setting(format!(
            "{flag} is a setting of the polychromic objective; add --objective polychromic"
        )));
    }
    pre.extend(polychromic.into_iter().map(|(_, o)| o));
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
    // The adapters in PEFT's format, from the run's best checkpoint (train.keep_best) or its
    // last; a run told to keep none (train.save_final=false, no periodic checkpoints) has
    // nothing to write them from.
    if train::checkpoint::latest(&run_dir)?.is_none() {
        println!("adapters: not written (the run kept no checkpoint: train.save_final=false)");
        return Ok(());
    }
    let best = train::checkpoint::best(&run_dir).filter(|b| b.is_dir());
    let loaded = train::load_run(&run_dir, best.as_ref().map(|_| "best"))?;
    let lora = &loaded.config.lora;
    if lora.enabled {
        let dir = run_dir.join("adapter");
        let n = crate::models::peft::save_adapter(loaded.model.as_ref(), lora, &lora.base, &dir)?;
        let from = match &best {
            Some(_) => format!(" from the best checkpoint (step {})", loaded.step),
            None => String::new(),
        };
        println!(
            "adapters: {n} modules in PEFT's format in {}{from}   (merged model: kiln export --run {} --to DIR)",
            dir.display(),
            run_dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::detect_format;

    #[test]
    fn the_first_line_decides_the_format() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (r#"{"messages": []}"#, "chat"),
            (
                r#"{"conversations": [{"from": "human", "value": "hi"}]}"#,
                "chat",
            ),
            (
                r#"{"prompt": [{"role": "user", "content": "hi"}], "completion": []}"#,
                "chat",
            ),
            (r#"{"instruction": "hi", "output": "ho"}"#, "alpaca"),
            (
                r#"{"prompt": "hi", "completion": "ho"}"#,
                "prompt_completion",
            ),
            ("Plain text, not JSON.", "text"),
        ];
        for (i, (first, want)) in cases.iter().enumerate() {
            let path = dir.path().join(format!("{i}.jsonl"));
            std::fs::write(&path, format!("\n{first}\nanything\n")).unwrap();
            assert_eq!(detect_format(&path).unwrap(), *want, "{first}");
        }
    }
}

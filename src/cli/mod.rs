//! Command-line interface: one file per subcommand, each a thin layer over the library.

pub mod bench;
pub mod classify;
pub mod diversity;
pub mod embed;
pub mod eval;
pub mod export;
pub mod finetune;
pub mod generate;
pub mod hw;
pub mod make_dataset;
pub mod nf4_export;
pub mod plan;
pub mod tokenize;
pub mod train;
pub mod verify;

use crate::error::{KilnError, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "A hardware-aware training engine for language models and encoders, on the CPU or NVIDIA GPUs.",
    long_about = "kiln trains, fine-tunes and samples from language models (GPT, Llama-family \
decoders, ResNet-BK) and runs BERT-family encoders, from scratch or from Hugging Face \
directories and GGUF files, on the CPU or NVIDIA GPUs. `kiln train` with no arguments trains a \
small model on the bundled Shakespeare corpus; `kiln generate` then samples from it.\n\n\
Settings come from defaults, then an optional --config TOML file, then KEY=VALUE overrides \
(for example train.steps=100 optim.lr=1e-3); `kiln train --print-config` shows every key, its \
value and where the value came from.\n\n\
Exit codes: 0 success; 1 a device or library failure none of the others describes; 2 a bad \
setting or argument; 3 bad data; 4 a bad or damaged checkpoint or run directory; 5 a NaN/inf \
loss; 6 out of memory (device or host); 7 an unwritable output; 8 selftest failed; 9 the run \
directory is locked by another live process; 10 `kiln verify` found only legacy checkpoints \
without a manifest (unverified, nothing damaged); 11 another rank of a data-parallel run \
failed or vanished, or its rendezvous failed; 75 stopped by SIGTERM/SIGINT after saving a \
checkpoint (requeue and resume); 130 a second SIGINT (stopped at once)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model (a small GPT on the bundled corpus by default).
    Train(train::TrainArgs),
    /// Fine-tune a pretrained model: LoRA adapters over a frozen base (or every weight), on
    /// text, prompt/completion pairs or chats; adapters saved in PEFT's format.
    Finetune(Box<finetune::FinetuneArgs>),
    /// Evaluate a run's latest checkpoint (or a pretrained model) on held-out text.
    Eval(eval::EvalArgs),
    /// Sample text from a run's latest checkpoint or a pretrained model (one prompt or many).
    Generate(generate::GenerateArgs),
    /// Write a run's model as a Hugging Face directory (safetensors, config.json, tokenizer).
    Export(export::ExportArgs),
    /// Fold low-rank adapters into their base and write the merged model as a Hugging Face
    /// directory (a fine-tuning run's, or a PEFT adapter over a base from disk).
    Merge(export::MergeArgs),
    /// Plan the memory and FLOPs of a training step and the largest micro-batch that fits.
    Plan(plan::PlanArgs),
    /// Measure performance; most suites write report.md, results.json and plots (`kiln bench <suite>`).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Check every GPU kernel against its CPU reference (skips, exit 0, with no GPU).
    Selftest(crate::selftest::SelftestArgs),
    /// Show the GPUs, driver, CPU and RAM, and the settings kiln recommends for them.
    #[command(alias = "check-hardware")]
    Hw(hw::HwArgs),
    /// Check every checkpoint of a run against its manifest (sizes and CRC-32s).
    Verify(verify::VerifyArgs),
    /// Print the token ids of each input line as a JSON array (any tokenizer data.tokenizer takes).
    Tokenize(tokenize::TokenizeArgs),
    /// Quantise a raw f32 weight to NF4 and write its parts as raw files (for comparisons
    /// with bitsandbytes).
    #[command(hide = true)]
    Nf4Export(nf4_export::Nf4ExportArgs),
    /// Sentence embeddings of texts from a pretrained encoder or decoder.
    Embed(embed::EmbedArgs),
    /// Cross-validate a classifier head on a frozen encoder's features (grouped, stratified folds).
    Classify(classify::ClassifyArgs),
    /// Write a labelled or fine-tuning dataset made from the bundled corpus (JSON lines).
    #[command(subcommand)]
    MakeDataset(make_dataset::DatasetCommand),
    /// Diversity of several samples per prompt: distinct-n, Self-BLEU, semantic diversity
    /// with an encoder, and pass@k and DER(k) with a checker command.
    Diversity(diversity::DiversityArgs),
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::Finetune(a) => finetune::run(*a),
        Command::Eval(a) => eval::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Export(a) => export::run(a),
        Command::Merge(a) => export::merge(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Selftest(a) => crate::selftest::run(a),
        Command::Hw(a) => hw::run(a),
        Command::Verify(a) => verify::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Nf4Export(a) => nf4_export::run(a),
        Command::Embed(a) => embed::run(a),
        Command::Classify(a) => classify::run(a),
        Command::MakeDataset(c) => make_dataset::run(c),
        Command::Diversity(a) => diversity::run(a),
    }
}

/// Where runs go by default, and the file naming the most recent one.
pub const RUNS_DIR: &str = "runs";
const LATEST_RUN: &str = "LATEST";

/// `runs/LATEST` records the newest run so `eval` and `generate` find it without flags.
pub fn record_latest_run(run_dir: &Path) {
    let _ = std::fs::write(
        Path::new(RUNS_DIR).join(LATEST_RUN),
        run_dir.display().to_string(),
    );
}

/// The run directory a command should read: the one given, or the most recent run.
pub fn find_run(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p);
    }
    let pointer = Path::new(RUNS_DIR).join(LATEST_RUN);
    std::fs::read_to_string(&pointer).map(|s| PathBuf::from(s.trim())).map_err(|_| {
        KilnError::Setting(format!(
            "no run given and no {} found; pass --run DIR (a directory written by `kiln train`) or train first",
            pointer.display()
        ))
    })
}

/// A new run directory name from the current UTC time, `runs/run-YYYYMMDD-HHMMSS`.
pub fn new_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    Path::new(RUNS_DIR).join(format!(
        "run-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    ))
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_778), (2026, 11, 21));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}

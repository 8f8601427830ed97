//! `kiln classify`: cross-validate a classifier head on a frozen encoder's features.

use crate::classify::head::{HeadKind, HeadOptions};
use crate::classify::{self, ClassifyOptions};
use crate::embed::EncoderOptions;
use crate::error::{KilnError, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln make-dataset play-pairs --out pairs.jsonl
  kiln classify --init-from all-MiniLM-L6-v2 --data pairs.jsonl --folds 5 --out cls-minilm
  kiln classify --init-from SmolLM2-135M-Instruct.Q4_1.gguf --data pairs.jsonl --folds 5 --out cls-smol --head mlp

--data is JSON lines: {\"text\": ..., \"text_pair\": ... (optional), \"label\": ..., \"group\": ...
(optional)}. Records of one group never sit on both sides of a fold; folds are stratified by
label as far as the groups allow. Features are computed once and cached under --cache-dir,
keyed by the encoder and the texts, so a rerun (another head, more epochs, another seed)
costs only the head. DIR gets report.md, metrics.json (the fold of every record included)
and folds.png.

Bad data exits 3: a record that is not JSON or lacks text or label (the line is named), a
single class, fewer groups than folds. Bad settings exit 2; an encoder directory without a
tokenizer exits 4.")]
pub struct ClassifyArgs {
    /// The frozen encoder: a BERT-family or Llama-family Hugging Face directory, or a GGUF file.
    #[arg(long, value_name = "PATH")]
    pub init_from: PathBuf,
    /// Labelled records, JSON lines.
    #[arg(long, value_name = "FILE.jsonl")]
    pub data: PathBuf,
    /// Number of cross-validation folds.
    #[arg(long, default_value_t = 5)]
    pub folds: usize,
    /// Directory for report.md, metrics.json and folds.png.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Head: linear or mlp (one ReLU hidden layer of --hidden units).
    #[arg(long, default_value = "linear", value_name = "linear|mlp")]
    pub head: String,
    /// Hidden units of the MLP head.
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    /// Most epochs of head training per fold.
    #[arg(long, default_value_t = 200)]
    pub epochs: usize,
    /// Stop after this many epochs without a better validation macro-F1.
    #[arg(long, default_value_t = 20)]
    pub patience: usize,
    /// AdamW learning rate of the head.
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    pub lr: f32,
    /// AdamW weight decay of the head's weights.
    #[arg(long, default_value_t = 1e-2, allow_negative_numbers = true)]
    pub weight_decay: f32,
    /// Records per head training step.
    #[arg(long, default_value_t = 64)]
    pub head_batch_size: usize,
    /// Seed of the folds and the head.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where features are cached.
    #[arg(long, default_value = ".cache/kiln/features", value_name = "DIR")]
    pub cache_dir: PathBuf,
    /// Encode every time, caching nothing.
    #[arg(long)]
    pub no_cache: bool,
    /// Where the encoder runs: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Encoder precision: fp32, bf16 or f16 (the last two on a GPU).
    #[arg(long, value_name = "fp32|bf16|f16")]
    pub precision: Option<String>,
    /// Longest input in tokens; longer ones are truncated and counted in the report.
    #[arg(long, value_name = "TOKENS")]
    pub max_length: Option<usize>,
    /// Texts per encoder batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Records with a text_pair: cross (both texts through the encoder at once; BERT's
    /// [CLS] a [SEP] b [SEP]) or bi (each embedded alone, features [u, v, |u-v|, u*v]).
    #[arg(long, default_value = "cross", value_name = "cross|bi")]
    pub pair_encoding: String,
    /// Train the BERT-family encoder with the head: lora (adapters on query, key, value and
    /// dense, base frozen) or full. Left out, the encoder stays frozen and features are cached.
    #[arg(long, value_name = "lora|full")]
    pub finetune: Option<String>,
    /// AdamW learning rate of the encoder under --finetune (default 1e-4 lora, 2e-5 full).
    #[arg(long, value_name = "LR", allow_negative_numbers = true)]
    pub encoder_lr: Option<f32>,
}

pub fn run(a: ClassifyArgs) -> Result<()> {
    let kind = match a.head.as_str() {
        "linear" => HeadKind::Linear,
        "mlp" => HeadKind::Mlp { hidden: a.hidden },
        other => {
            return Err(KilnError::Setting(format!(
                "--head {other} is not a head kiln trains; use linear or mlp"
            )));
        }
    };
    let pair_encoding = match a.pair_encoding.as_str() {
        "cross" => classify::PairEncoding::Cross,
        "bi" => classify::PairEncoding::Bi,
        other => {
            return Err(KilnError::Setting(format!(
                "--pair-encoding {other} is not one kiln knows; use cross or bi"
            )));
        }
    };
    if !(a.lr.is_finite() && a.lr > 0.0 && a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
        return Err(KilnError::Setting(format!(
            "--lr {} must be a positive number and --weight-decay {} zero or more",
            a.lr, a.weight_decay
        )));
    }
    let finetune = match a.finetune.as_deref() {
        None => classify::finetune::Finetune::Frozen,
        Some(m) => classify::finetune::Finetune::parse(m).map_err(KilnError::Setting)?,
    };
    if let Some(lr) = a.encoder_lr
        && !(lr.is_finite() && lr > 0.0)
    {
        return Err(KilnError::Setting(format!(
            "--encoder-lr {lr} must be a positive number"
        )));
    }
    if a.encoder_lr.is_some() && finetune == classify::finetune::Finetune::Frozen {
        return Err(KilnError::Setting(
            "--encoder-lr applies only with --finetune lora or full".into(),
        ));
    }
    let o = ClassifyOptions {
        init_from: a.init_from,
        data: a.data,
        folds: a.folds,
        out: a.out,
        encoder: EncoderOptions {
            device: a.device,
            precision: a.precision,
            max_length: a.max_length,
        },
        batch_size: a.batch_size,
        head: HeadOptions {
            kind,
            lr: a.lr,
            weight_decay: a.weight_decay,
            max_epochs: a.epochs,
            patience: a.patience,
            batch_size: a.head_batch_size,
            seed: a.seed,
        },
        cache_dir: (!a.no_cache).then_some(a.cache_dir),
        pair_encoding,
        finetune,
        encoder_lr: a.encoder_lr,
    };
    let out = classify::run(&o)?;
    let f1: Vec<f64> = out.fold_results.iter().map(|f| f.metrics.f1).collect();
    let (m, sd) = classify::metrics::mean_std(&f1);
    println!(
        "macro-F1 {m:.4} ± {sd:.4} over {} folds; report in {}",
        out.folds,
        o.out.join("report.md").display()
    );
    Ok(())
}

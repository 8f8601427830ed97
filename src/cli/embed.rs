//! `kiln embed`: sentence embeddings from a pretrained encoder or decoder.

use crate::embed::{EncoderOptions, TextEncoder, io};
use crate::error::{KilnError, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln embed --init-from all-MiniLM-L6-v2 --input texts.txt --out emb.jsonl
  kiln embed --init-from all-MiniLM-L6-v2 --input texts.jsonl --out emb.safetensors --device cuda --precision fp32
  kiln embed --init-from SmolLM2-135M-Instruct.Q4_1.gguf --input texts.txt --out emb.jsonl --max-length 128

--input is one text per line, or JSON lines with a \"text\" field (.jsonl, .json, .ndjson).
--out is JSON lines ({\"index\": i, \"embedding\": [...]}, in input order) or, for a .safetensors
file, one f32 tensor \"embeddings\" of [texts, width]. A BERT-family directory embeds as
sentence-transformers does (its pooling and normalisation); a Llama-family decoder (Hugging
Face directory or GGUF file) gives the mean of its final hidden states. Texts longer than
--max-length tokens are truncated and counted in the summary on standard error.")]
pub struct EmbedArgs {
    /// The model: a BERT-family or Llama-family Hugging Face directory, or a GGUF file.
    #[arg(long, value_name = "PATH")]
    pub init_from: PathBuf,
    /// Texts: one per line, or JSON lines with a "text" field.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where the embeddings go: .jsonl (JSON lines) or .safetensors.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Where to run: auto (the first GPU, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// fp32, bf16 or f16 (the last two on a GPU; default bf16 there, fp32 on the CPU).
    #[arg(long, value_name = "fp32|bf16|f16")]
    pub precision: Option<String>,
    /// Longest input in tokens, special tokens included (default: the model's maximum,
    /// 512 for decoders).
    #[arg(long, value_name = "TOKENS")]
    pub max_length: Option<usize>,
    /// Texts per batch (texts are sorted by length, so a batch pads little).
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
}

pub fn run(a: EmbedArgs) -> Result<()> {
    if a.batch_size == 0 {
        return Err(KilnError::Setting(
            "--batch-size 0 embeds nothing; give 1 or more (64 is a good start)".into(),
        ));
    }
    let texts = io::read_texts(&a.input)?;
    let encoder = TextEncoder::open(
        &a.init_from,
        &EncoderOptions {
            device: a.device.clone(),
            precision: a.precision.clone(),
            max_length: a.max_length,
        },
    )?;
    eprintln!("encoder: {}", encoder.description);
    // Timed from tokenisation to the last embedding on the host (what a caller waits for
    // once the model is loaded), as sentence-transformers' encode is usually timed.
    let start = Instant::now();
    let pairs: Vec<(&str, Option<&str>)> = texts.iter().map(|t| (t.as_str(), None)).collect();
    let encoded = encoder.encode_all(&pairs)?;
    let tokenised = start.elapsed().as_secs_f64();
    let truncated = encoded.iter().filter(|e| e.truncated).count();
    let tokens: usize = encoded.iter().map(|e| e.ids.len()).sum();
    let rows = encoder.embed(&encoded, a.batch_size)?;
    let secs = start.elapsed().as_secs_f64();
    io::write_embeddings(&a.out, &rows)?;
    eprintln!(
        "embedded {} texts ({tokens} tokens, {truncated} truncated to {} tokens) into {} dimensions in {secs:.2} s ({:.0} texts/s; tokenising {tokenised:.2} s); wrote {}",
        rows.len(),
        encoder.max_length(),
        encoder.dim(),
        rows.len() as f64 / secs.max(1e-9),
        a.out.display()
    );
    Ok(())
}

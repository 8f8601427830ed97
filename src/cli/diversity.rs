//! `kiln diversity`: how different the samples of each prompt are (distinct-n, Self-BLEU,
//! semantic diversity with an encoder) and, with a checker, pass@k and DER(k); the metrics
//! are in [`crate::eval::diversity`].

use crate::data::DataError;
use crate::embed::{EncoderOptions, TextEncoder};
use crate::error::{KilnError, Result};
use crate::eval::diversity::{self as metrics, PromptSamples};
use clap::Args;
use std::io::BufRead;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln generate --init-from DIR --prompts prompts.jsonl --num-samples 8 --out replies.jsonl
  kiln diversity replies.jsonl
  kiln diversity replies.jsonl --embedder all-MiniLM-L6-v2 --out metrics.json
  kiln diversity replies.jsonl --checker 'grep -qi love' --k 1,2,4,8

FILE is what `kiln generate --prompts ... --num-samples N --out` writes: one JSON object per
prompt with \"prompt\" and \"samples\" (each with a \"text\"); a line may also give \"samples\"
as plain strings. Every metric is computed over one prompt's samples and averaged over
prompts: distinct-1/2/3 (distinct n-grams over all n-grams), Self-BLEU (BLEU-4 of each
sample against the others, smoothed with Chen and Cherry's method 1 as NLTK's
SmoothingFunction().method1; lower is more diverse), and with --embedder the semantic
diversity D (mean pairwise cosine distance of the samples' embeddings). --checker runs a
command through sh once per sample, the sample on its standard input and the prompt in
$KILN_PROMPT; exit status 0 passes. pass@k is the unbiased estimator 1 - C(n-c,k)/C(n,k),
and DER(k) = pass@k / (k pass@1).")]
pub struct DiversityArgs {
    /// JSON lines of prompts with their samples.
    #[arg(value_name = "FILE.jsonl")]
    pub file: PathBuf,
    /// A sentence encoder for semantic diversity: a BERT-family directory such as
    /// all-MiniLM-L6-v2, or a Llama-family directory or GGUF file (default: none).
    #[arg(long, value_name = "DIR")]
    pub embedder: Option<PathBuf>,
    /// A shell command that passes (exit 0) or fails each sample, read on standard input.
    #[arg(long, value_name = "CMD")]
    pub checker: Option<String>,
    /// The k of pass@k and DER(k) (default: 1 and the powers of two up to the fewest
    /// samples of a prompt, and that number).
    #[arg(long, value_delimiter = ',', requires = "checker")]
    pub k: Vec<usize>,
    /// Where the encoder runs: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Texts per encoder batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Also write the metrics as one JSON object to this file.
    #[arg(long, value_name = "FILE.json")]
    pub out: Option<PathBuf>,
}

/// A `samples` entry: a `kiln generate` completion (with its text) or a plain string.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Sample {
    Text(String),
    Completion { text: String },
}

#[derive(serde::Deserialize)]
struct Line {
    #[serde(default)]
    prompt: String,
    samples: Vec<Sample>,
}

fn read_samples(path: &Path) -> Result<Vec<PromptSamples>> {
    let bad = |reason: String| {
        KilnError::Data(DataError::File {
            path: path.to_path_buf(),
            reason,
        })
    };
    let f = std::fs::File::open(path)
        .map_err(|e| bad(format!("cannot be read ({e}); check the path")))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(&line).map_err(|e| {
            bad(format!(
                "line {} is not a prompt with samples ({e}); give {{\"prompt\": ..., \"samples\": [{{\"text\": ...}}, ...]}} as kiln generate --prompts --num-samples N writes",
                i + 1
            ))
        })?;
        out.push(PromptSamples {
            prompt: l.prompt,
            samples: l
                .samples
                .into_iter()
                .map(|s| match s {
                    Sample::Text(t) | Sample::Completion { text: t } => t,
                })
                .collect(),
        });
    }
    metrics::check_samples(&out).map_err(bad)?;
    Ok(out)
}

/// 1, the powers of two below `fewest`, and `fewest`.
fn default_ks(fewest: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = std::iter::successors(Some(1usize), |k| Some(k * 2))
        .take_while(|&k| k < fewest)
        .collect();
    ks.push(fewest);
    ks
}

#[derive(serde::Serialize)]
struct Summary {
    prompts: usize,
    samples: usize,
    #[serde(flatten)]
    lexical: metrics::LexicalDiversity,
    semantic_diversity: Option<f64>,
    semantic_diversity_per_prompt: Option<Vec<f32>>,
    pass: Option<Vec<metrics::PassAtK>>,
}

pub fn run(a: DiversityArgs) -> Result<()> {
    if a.batch_size == 0 {
        return Err(KilnError::Setting(
            "--batch-size 0 embeds nothing; give 1 or more".into(),
        ));
    }
    let prompts = read_samples(&a.file)?;
    let samples: usize = prompts.iter().map(|p| p.samples.len()).sum();
    let lexical = metrics::lexical(&prompts);
    let semantic = match &a.embedder {
        None => None,
        Some(dir) => {
            let encoder = TextEncoder::open(
                dir,
                &EncoderOptions {
                    device: a.device.clone(),
                    precision: Some("fp32".into()),
                    max_length: None,
                },
            )?;
            eprintln!("encoder: {}", encoder.description);
            Some(metrics::semantic(&encoder, &prompts, a.batch_size)?)
        }
    };
    let pass = match &a.checker {
        None => None,
        Some(cmd) => {
            let verdicts = metrics::check_with(cmd, &prompts)?;
            let fewest = prompts.iter().map(|p| p.samples.len()).min().unwrap_or(0);
            let ks = if a.k.is_empty() {
                default_ks(fewest)
            } else {
                a.k.clone()
            };
            Some(metrics::pass_rates(&verdicts, &ks).map_err(KilnError::Setting)?)
        }
    };
    let summary = Summary {
        prompts: prompts.len(),
        samples,
        lexical,
        semantic_diversity: semantic
            .as_ref()
            .map(|d| d.iter().map(|&v| v as f64).sum::<f64>() / d.len() as f64),
        semantic_diversity_per_prompt: semantic,
        pass,
    };
    print_summary(&summary);
    if let Some(out) = &a.out {
        let body = serde_json::to_string_pretty(&summary).map_err(|e| KilnError::output(out, e))?;
        std::fs::write(out, body + "\n").map_err(|e| KilnError::output(out, e))?;
    }
    Ok(())
}

fn print_summary(s: &Summary) {
    println!("{} prompts, {} samples", s.prompts, s.samples);
    println!(
        "distinct-1 {:.4}  distinct-2 {:.4}  distinct-3 {:.4}  self-BLEU {:.4}",
        s.lexical.distinct_1, s.lexical.distinct_2, s.lexical.distinct_3, s.lexical.self_bleu
    );
    if let Some(d) = s.semantic_diversity {
        println!("semantic diversity D {d:.4} (mean over prompts of mean pairwise 1 - cos)");
    }
    for p in s.pass.iter().flatten() {
        let der = p
            .der
            .map_or("n/a (nothing passed)".to_string(), |d| format!("{d:.4}"));
        println!("pass@{} {:.4}  DER({}) {der}", p.k, p.pass_at_k, p.k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ks_are_one_the_powers_of_two_and_the_samples() {
        assert_eq!(default_ks(8), vec![1, 2, 4, 8]);
        assert_eq!(default_ks(6), vec![1, 2, 4, 6]);
        assert_eq!(default_ks(2), vec![1, 2]);
    }
}

//! `kiln generate`: sample text from a trained checkpoint.

use crate::data;
use crate::engine::rng::{Rng, stream};
use crate::error::{KilnError, Result};
use crate::train;
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln generate                                     sample from the most recent run
  kiln generate --prompt 'JULIET:' --tokens 400 --temperature 0.7
  kiln generate --run runs/big --top-k 0 --seed 7   top-k 0 samples from the full distribution
  kiln generate --run runs/big --checkpoint step_400  an earlier checkpoint")]
pub struct GenerateArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(long, value_name = "DIR")]
    pub run: Option<PathBuf>,
    /// Text to continue.
    #[arg(long, default_value = "ROMEO:")]
    pub prompt: String,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 300)]
    pub tokens: usize,
    /// Softmax temperature; lower is more conservative, 0 picks the most likely token.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample only among the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed for sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Sample from this checkpoint (step_N or N) instead of the latest.
    #[arg(long, value_name = "step_N")]
    pub checkpoint: Option<String>,
}

impl GenerateArgs {
    /// Refuses arguments that would print garbage or nothing, before the model is loaded.
    fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(KilnError::Setting(format!(
                "--temperature {} must be a finite number of 0 or more (0 picks the most likely token; 0.7 to 1.0 is usual)",
                self.temperature
            )));
        }
        if self.tokens == 0 {
            return Err(KilnError::Setting(
                "--tokens 0 generates nothing; give 1 or more".into(),
            ));
        }
        Ok(())
    }
}

/// Draws a token from `logits` at `temperature` among the `top_k` most likely.
pub fn sample(logits: &[f32], temperature: f32, top_k: usize, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if top_k > 0 && top_k < idx.len() {
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        idx.truncate(top_k);
    }
    let max = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - max) / temperature) as f64).exp())
        .collect();
    let mut u = rng.next_f64() * weights.iter().sum::<f64>();
    for (&i, w) in idx.iter().zip(&weights) {
        u -= w;
        if u <= 0.0 {
            return i as u32;
        }
    }
    idx[idx.len() - 1] as u32
}

pub fn run(a: GenerateArgs) -> Result<()> {
    a.validate()?;
    let run_dir = super::find_run(a.run.clone())?;
    let loaded = train::load_run(&run_dir, a.checkpoint.as_deref())?;
    let tokenizer = data::tokenizer_by_name(&loaded.config.data.tokenizer)?;

    let mut tokens = tokenizer.encode(&a.prompt);
    if tokens.is_empty() {
        return Err(KilnError::Setting(
            "--prompt is empty; give at least one character to continue".into(),
        ));
    }
    let context = loaded.model.context();
    let mut rng = Rng::new(a.seed, stream::SAMPLE);
    let mut out = std::io::stdout();
    print!("{}", a.prompt);
    let mut pending: Vec<u32> = Vec::new();
    for _ in 0..a.tokens {
        // The model sees at most its context: slide the window over the text so far.
        let window = &tokens[tokens.len().saturating_sub(context)..];
        let logits = loaded.model.next_logits(window)?;
        let next = sample(&logits, a.temperature, a.top_k, &mut rng);
        tokens.push(next);
        // Bytes of one character may arrive over several tokens: print whole characters only.
        pending.push(next);
        let text = tokenizer.decode(&pending);
        if !text.ends_with('\u{FFFD}') {
            print!("{text}");
            let _ = out.flush();
            pending.clear();
        }
    }
    println!("{}", tokenizer.decode(&pending));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_respects_temperature_zero_and_top_k() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut rng = Rng::new(1, stream::SAMPLE);
        assert_eq!(sample(&logits, 0.0, 0, &mut rng), 1);
        for _ in 0..200 {
            let t = sample(&logits, 1.0, 2, &mut rng);
            assert!(t == 1 || t == 2, "top-2 drew {t}");
        }
    }
}

//! Polychromic fine-tuning: the cross-entropy of the reference replies minus lambda times the
//! diversity D of replies the model samples itself, `L = CE - lambda * D`.
//!
//! Every `polychromic.every` steps, `polychromic.prompts` training prompts (drawn from the
//! step's counter) get `polychromic.samples` replies each, all of them in one call of the
//! batched generation engine; an encoder embeds the replies; each prompt's leave-one-out
//! advantages come from [`super::diversity`]; and the prompt-plus-reply sequences, their
//! reply tokens' losses weighted by `lambda * adv_i / (n * prompts)`, join the step's
//! forward/backward beside the CE batch ([`Trainer::weighted`]). The gradient of that
//! weighted loss is the score-function estimate of `-lambda * grad E[D]` averaged over the
//! prompts, so D's gradient reaches whatever trains (the adapters, or every weight).
//!
//! Choices, and why:
//! - The embedder defaults to the starting model, frozen, with its final hidden states
//!   mean-pooled (what `kiln embed` does with a decoder): there is no second model to fetch,
//!   and the yardstick stays fixed while the policy trains, so the policy cannot win by
//!   moving it. `polychromic.embedder` takes any kiln encoder, all-MiniLM-L6-v2 for one.
//! - The score is the log-probability at temperature 1 (the model's own), which is what
//!   the forward/backward computes. At the defaults (temperature 1, top-p 1) replies are
//!   drawn from that distribution and the estimate is unbiased; with another temperature or
//!   top-p it is the gradient of the untempered policy weighted by tempered samples, an
//!   approximation.
//! - A reply that ended with the end-of-sequence token keeps it in its log-probability:
//!   ending is part of the reply. Generation stops at the token fine-tuning trains as the
//!   end of a completion (the tokenizer's first EOS id).
//! - With lambda = 0 replies are still sampled and D reported, but the weights are all zero
//!   and nothing joins the backward: the step is plain fine-tuning, bit for bit.
//! - Held-out D: at each evaluation, `polychromic.samples` replies to each of up to
//!   [`HELD_OUT_PROMPTS`] validation prompts, drawn from the same random streams at every
//!   evaluation, so the numbers of two evaluations (or two runs) differ only by the weights.

use super::diversity;
use super::trainer::Trainer;
use crate::config::{Config, PolychromicConfig};
use crate::data::sft::{self, SftFormat, SftTokenizer};
use crate::data::{Batch, DataError, HfTokenizer, is_tokenizer_path, tokenizer_from_path};
use crate::embed::{EncoderOptions, TextEncoder};
use crate::engine::ops::IGNORE_TARGET;
use crate::engine::rng::{Rng, hash3, stream};
use crate::error::{KilnError, Result};
use crate::generate::{self, Completion, Finish, Options, Request, Sampling};
use crate::models::Model;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Validation prompts (evenly spaced) that held-out D samples replies for.
pub const HELD_OUT_PROMPTS: usize = 32;

/// Replies per encoder batch.
const EMBED_BATCH: usize = 64;

/// Sequences whose token losses join a step's gradient, each row with its own weight.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedBatch {
    pub batch: Batch,
    pub row_weights: Vec<f32>,
}

/// What sampling for one step found, and when its phases ran.
#[derive(Debug, Clone)]
pub struct Sampled {
    /// D averaged over the step's prompts.
    pub diversity: f64,
    pub prompts: usize,
    pub replies: usize,
    /// Generated tokens over all replies.
    pub reply_tokens: usize,
    pub generate: (Instant, Instant),
    pub embed: (Instant, Instant),
}

impl Sampled {
    pub fn generate_s(&self) -> f64 {
        (self.generate.1 - self.generate.0).as_secs_f64()
    }

    pub fn embed_s(&self) -> f64 {
        (self.embed.1 - self.embed.0).as_secs_f64()
    }
}

/// One polychromic step in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub kind: &'static str,
    pub step: u64,
    pub diversity: f64,
    pub lambda: f64,
    pub prompts: usize,
    pub replies: usize,
    pub reply_tokens: usize,
    pub generate_s: f64,
    pub embed_s: f64,
    /// The step's forward and backward passes, CE batch and replies together.
    pub forward_backward_s: f64,
}

/// Held-out D at an evaluation, in `metrics.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecord {
    pub kind: &'static str,
    pub step: u64,
    pub val_diversity: f64,
    pub prompts: usize,
}

/// The prompts, the tokenizer and the encoder of a polychromic run.
pub struct Polychromic {
    cfg: PolychromicConfig,
    seed: u64,
    train_prompts: Vec<Vec<u32>>,
    held_out: Vec<Vec<u32>>,
    tokenizer: HfTokenizer,
    stop: Option<u32>,
    encoder: TextEncoder,
}

fn data_error(path: &Path, reason: String) -> KilnError {
    KilnError::Data(DataError::File {
        path: path.to_path_buf(),
        reason,
    })
}

/// The prompt of a tokenised example: its tokens before the first trained one (the BOS and
/// prompt of a pair, a chat up to its first assistant reply).
fn prompt_of(ex: &sft::SftExample) -> &[u32] {
    let first = ex
        .trained
        .iter()
        .position(|&t| t)
        .unwrap_or(ex.tokens.len());
    &ex.tokens[..first]
}

impl Polychromic {
    /// Reads the prompts of the fine-tuning data and opens the encoder. `context` is the
    /// policy's: every prompt must leave room for `polychromic.max_new_tokens`.
    pub fn open(cfg: &Config, context: usize) -> Result<Polychromic> {
        let p = &cfg.polychromic;
        let format = SftFormat::from_setting(&cfg.data.format).ok_or_else(|| {
            KilnError::Setting(format!(
                "polychromic fine-tuning samples replies to prompts, and data.format={} has none; give JSON lines of prompt/completion pairs or chats (kiln make-dataset cue-reply writes pairs)",
                cfg.data.format
            ))
        })?;
        if !is_tokenizer_path(&cfg.data.tokenizer) {
            return Err(KilnError::Setting(format!(
                "polychromic fine-tuning needs the pretrained model's own tokenizer, not data.tokenizer={}; start from a pretrained model (kiln finetune --init-from PATH)",
                cfg.data.tokenizer
            )));
        }
        let tokenizer = tokenizer_from_path(Path::new(&cfg.data.tokenizer))?;
        let path = PathBuf::from(&cfg.data.corpus);
        let val_file =
            (!cfg.data.val_corpus.is_empty()).then(|| PathBuf::from(&cfg.data.val_corpus));
        let holdout = match &val_file {
            Some(f) => sft::Holdout::File(f),
            None => sft::Holdout::Fraction(cfg.data.val_fraction),
        };
        let (train, val) = sft::split_examples(
            &path,
            format,
            &SftTokenizer::Pretrained(&tokenizer),
            holdout,
        )?;
        // Each example named by its file and its number there.
        let numbered = train
            .iter()
            .enumerate()
            .map(|(i, ex)| (&path, i + 1, ex))
            .chain(val.iter().enumerate().map(|(i, ex)| match &val_file {
                Some(f) => (f, i + 1, ex),
                None => (&path, train.len() + i + 1, ex),
            }));
        for (file, n, ex) in numbered {
            let len = prompt_of(ex).len();
            if len == 0 {
                return Err(data_error(
                    file,
                    format!(
                        "example {n} has an empty prompt, and a reply needs something to follow; give every example a prompt"
                    ),
                ));
            }
            if len + p.max_new_tokens > context {
                let fix = if len < context {
                    format!(
                        "shorten it, or lower polychromic.max_new_tokens to at most {}",
                        context - len
                    )
                } else {
                    "shorten it: the prompt alone fills the context".into()
                };
                return Err(data_error(
                    file,
                    format!(
                        "example {n}'s prompt has {len} tokens, and with polychromic.max_new_tokens={} new ones that is longer than the model's context of {context}; {fix}",
                        p.max_new_tokens
                    ),
                ));
            }
        }
        let train_prompts: Vec<Vec<u32>> = train.iter().map(|e| prompt_of(e).to_vec()).collect();
        let picks = HELD_OUT_PROMPTS.min(val.len());
        let held_out = (0..picks)
            .map(|i| prompt_of(&val[i * val.len() / picks]).to_vec())
            .collect();
        let embedder = if !p.embedder.is_empty() {
            PathBuf::from(&p.embedder)
        } else if !cfg.lora.base.is_empty() {
            PathBuf::from(&cfg.lora.base)
        } else {
            return Err(KilnError::Setting(
                "polychromic.embedder is empty and there is no lora.base to embed with; name an encoder (--embedder DIR, e.g. all-MiniLM-L6-v2) or the starting model".into(),
            ));
        };
        let encoder = TextEncoder::open(
            &embedder,
            &EncoderOptions {
                device: cfg.train.device.clone(),
                precision: None,
                max_length: None,
            },
        )
        .map_err(|e| match e {
            KilnError::Checkpoint { path, reason } => KilnError::Checkpoint {
                path,
                reason: format!(
                    "{reason} (this is the embedder of polychromic fine-tuning, polychromic.embedder or --embedder: give a kiln encoder whose config, tokenizer and weights agree, e.g. all-MiniLM-L6-v2)"
                ),
            },
            other => other,
        })?;
        Ok(Polychromic {
            cfg: p.clone(),
            seed: cfg.train.seed,
            stop: tokenizer.eos_ids().first().copied(),
            train_prompts,
            held_out,
            tokenizer,
            encoder,
        })
    }

    /// What embeds the replies, for the run's log.
    pub fn embedder(&self) -> &str {
        &self.encoder.description
    }

    pub fn held_out_prompts(&self) -> usize {
        self.held_out.len()
    }

    /// Whether optimizer step `step` (counted from 1) samples replies.
    pub fn due(&self, step: u64) -> bool {
        (step.max(1) - 1).is_multiple_of(self.cfg.every as u64)
    }

    /// Samples, embeds and weighs the replies of step `step` (counted from 1) and hands the
    /// weighted sequences to `trainer` for its next step; on a step that does not sample,
    /// or with lambda = 0, the trainer gets none.
    pub fn prepare(&self, trainer: &mut Trainer, step: u64) -> Result<Option<Sampled>> {
        trainer.weighted.clear();
        if !self.due(step) {
            return Ok(None);
        }
        let chosen = choose_prompts(self.train_prompts.len(), self.cfg.prompts, self.seed, step);
        let prompts: Vec<&[u32]> = chosen
            .iter()
            .map(|&i| self.train_prompts[i].as_slice())
            .collect();
        let n = self.cfg.samples;
        let gen_start = Instant::now();
        let replies = self.sample(
            trainer.model.as_ref(),
            &prompts,
            hash3(self.seed, stream::POLYCHROMIC, step),
        )?;
        let gen_end = Instant::now();
        let sets = self.advantages(&replies, prompts.len())?;
        let embed_end = Instant::now();
        let scale = self.cfg.lambda / (n * prompts.len()) as f64;
        let row_weights: Vec<f32> = sets
            .iter()
            .flat_map(|s| s.advantages.iter().map(|a| (scale * a) as f32))
            .collect();
        if row_weights.iter().any(|&w| w != 0.0) {
            trainer.weighted.push(WeightedBatch {
                batch: reply_rows(&prompts, n, &replies, self.stop),
                row_weights,
            });
        }
        Ok(Some(Sampled {
            diversity: sets.iter().map(|s| s.diversity).sum::<f64>() / sets.len() as f64,
            prompts: prompts.len(),
            replies: replies.len(),
            reply_tokens: replies.iter().map(|c| c.tokens.len()).sum(),
            generate: (gen_start, gen_end),
            embed: (gen_end, embed_end),
        }))
    }

    /// D of `model`'s replies to the held-out prompts, averaged over the prompts.
    pub fn held_out_diversity(&self, model: &dyn Model) -> Result<f64> {
        let prompts: Vec<&[u32]> = self.held_out.iter().map(Vec::as_slice).collect();
        let replies = self.sample(
            model,
            &prompts,
            hash3(self.seed, stream::POLYCHROMIC, u64::MAX),
        )?;
        let sets = self.advantages(&replies, prompts.len())?;
        Ok(sets.iter().map(|s| s.diversity).sum::<f64>() / sets.len().max(1) as f64)
    }

    /// `polychromic.samples` replies to each prompt, in one batched call, ordered by prompt
    /// then sample.
    fn sample(&self, model: &dyn Model, prompts: &[&[u32]], seed: u64) -> Result<Vec<Completion>> {
        let reqs: Vec<Request> = prompts
            .iter()
            .map(|p| Request {
                prompt: p.to_vec(),
                samples: self.cfg.samples,
            })
            .collect();
        let mut o = Options::new(
            self.cfg.max_new_tokens,
            Sampling {
                temperature: self.cfg.temperature as f32,
                top_k: 0,
                top_p: self.cfg.top_p as f32,
                min_p: 0.0,
                repetition_penalty: 1.0,
            },
        );
        o.stop_ids = self.stop.into_iter().collect();
        o.seed = seed;
        let (replies, _) =
            generate::generate(model, &self.tokenizer, &reqs, &o, &mut |_, _, _| {})?;
        Ok(replies)
    }

    /// Embeds the replies (`samples` per prompt, in order) and scores each prompt's set.
    fn advantages(
        &self,
        replies: &[Completion],
        prompts: usize,
    ) -> Result<Vec<diversity::SetAdvantages>> {
        let texts: Vec<(&str, Option<&str>)> =
            replies.iter().map(|c| (c.text.as_str(), None)).collect();
        let encoded = self.encoder.encode_all(&texts)?;
        let vectors = self.encoder.embed(&encoded, EMBED_BATCH)?;
        let (n, d) = (self.cfg.samples, self.encoder.dim());
        (0..prompts)
            .map(|p| {
                let flat: Vec<f32> = vectors[p * n..(p + 1) * n].concat();
                diversity::advantages(&flat, n, d).map_err(|e| {
                    KilnError::Setting(format!("the embedder {}: {e}", self.encoder.description))
                })
            })
            .collect()
    }
}

/// `count` distinct prompts out of `total` (all of them when there are fewer), a pure
/// function of `(seed, step)`: a partial Fisher-Yates shuffle.
pub fn choose_prompts(total: usize, count: usize, seed: u64, step: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..total).collect();
    let mut rng = Rng::new(hash3(seed, stream::POLYCHROMIC, step), stream::POLYCHROMIC);
    let count = count.min(total);
    for i in 0..count {
        let j = i + (rng.next_u64() % (total - i) as u64) as usize;
        order.swap(i, j);
    }
    order.truncate(count);
    order
}

/// The replies as training rows: prompt and reply (with the stop token when the reply ended
/// on it), targets only on the reply, padded to the longest row with ignored targets.
pub fn reply_rows(
    prompts: &[&[u32]],
    samples: usize,
    replies: &[Completion],
    stop: Option<u32>,
) -> Batch {
    let full: Vec<(usize, Vec<u32>)> = replies
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let prompt = prompts[i / samples];
            let mut tokens = prompt.to_vec();
            tokens.extend_from_slice(&c.tokens);
            if let (Finish::Stop, Some(s)) = (c.finish, stop) {
                tokens.push(s);
            }
            (prompt.len(), tokens)
        })
        .collect();
    let seq = full
        .iter()
        .map(|(_, t)| t.len() - 1)
        .max()
        .unwrap_or(1)
        .max(1);
    let pad = stop.unwrap_or(0);
    let mut b = Batch {
        inputs: Vec::with_capacity(full.len() * seq),
        targets: Vec::with_capacity(full.len() * seq),
        batch: full.len(),
        seq,
    };
    for (prompt_len, tokens) in &full {
        let len = tokens.len() - 1;
        b.inputs.extend_from_slice(&tokens[..len]);
        b.inputs.extend(std::iter::repeat_n(pad, seq - len));
        // Position t predicts token t + 1, trained from the first reply token on.
        b.targets.extend((0..len).map(|t| {
            if t + 1 >= *prompt_len {
                tokens[t + 1]
            } else {
                IGNORE_TARGET
            }
        }));
        b.targets
            .extend(std::iter::repeat_n(IGNORE_TARGET, seq - len));
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(tokens: &[u32], finish: Finish) -> Completion {
        Completion {
            prompt: 0,
            sample: 0,
            tokens: tokens.to_vec(),
            logprobs: vec![-1.0; tokens.len()],
            text: String::new(),
            finish,
            truncated: 0,
        }
    }

    #[test]
    fn reply_rows_train_only_the_reply_and_its_stop_token() {
        let prompts: Vec<&[u32]> = vec![&[1, 2, 3], &[4]];
        let replies = [
            reply(&[10, 11], Finish::Stop),
            reply(&[12], Finish::Length),
            reply(&[], Finish::Stop),
            reply(&[13, 14, 15], Finish::Length),
        ];
        let b = reply_rows(&prompts, 2, &replies, Some(99));
        let ig = IGNORE_TARGET;
        assert_eq!((b.batch, b.seq), (4, 5));
        // [1 2 3 10 11 99]: inputs are all but the last, targets from the reply on.
        assert_eq!(&b.inputs[0..5], &[1, 2, 3, 10, 11]);
        assert_eq!(&b.targets[0..5], &[ig, ig, 10, 11, 99]);
        // [1 2 3 12], cut by length: no stop token, padded.
        assert_eq!(&b.inputs[5..10], &[1, 2, 3, 99, 99]);
        assert_eq!(&b.targets[5..10], &[ig, ig, 12, ig, ig]);
        // An empty reply that stopped at once still trains its stop token.
        assert_eq!(&b.inputs[10..15], &[4, 99, 99, 99, 99]);
        assert_eq!(&b.targets[10..15], &[99, ig, ig, ig, ig]);
        assert_eq!(&b.targets[15..20], &[13, 14, 15, ig, ig]);
    }

    #[test]
    fn prompts_are_distinct_and_a_function_of_seed_and_step() {
        let a = choose_prompts(50, 8, 7, 3);
        assert_eq!(a, choose_prompts(50, 8, 7, 3));
        assert_ne!(a, choose_prompts(50, 8, 7, 4));
        let mut sorted = a.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 8);
        assert!(a.iter().all(|&i| i < 50));
        let mut all = choose_prompts(5, 9, 7, 3);
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3, 4]);
    }
}

//! The generation engine: many prompts, several samples per prompt, one batched decode.
//!
//! Every prompt is prefilled once into a slot of the model's key/value cache, the slot is
//! copied to the prompt's other samples, and then every live sequence advances by one token
//! per decode step (one batched forward of one row per sequence). A sequence that meets a
//! stop token, a stop string or its length limit leaves the batch. Each sample draws from a
//! random stream keyed by (seed, prompt, sample), so its text does not depend on which other
//! sequences share the batch. Models without a cached decoder fall back to re-running their
//! window for each token.
//!
//! Training code calls [`generate`] directly between optimizer steps: it reads the model's
//! weights where they are and returns token ids, texts and the model's log-probabilities of
//! each drawn token.

pub mod sampling;

pub use sampling::{Sampling, log_prob, sample};

use crate::data::Tokenizer;
use crate::engine::rng::{Rng, hash3, stream};
use crate::error::{KilnError, Result};
use crate::models::Model;
use rayon::prelude::*;
use std::time::Instant;

/// One prompt and how many replies to draw from it.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub samples: usize,
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct Options {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Token ids that end a sequence (kept out of its text).
    pub stop_ids: Vec<u32>,
    /// Strings that end a sequence where they appear (cut from its text).
    pub stop_strings: Vec<String>,
    pub seed: u64,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    Stop,
    Length,
}

/// One generated reply.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Completion {
    pub prompt: usize,
    pub sample: usize,
    /// The generated token ids (without the prompt or the stop token).
    pub tokens: Vec<u32>,
    /// The model's log-probability (temperature 1, no penalties) of each generated token.
    pub logprobs: Vec<f32>,
    pub text: String,
    pub finish: Finish,
}

/// Throughput of one call.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Stats {
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    pub decode_tokens: usize,
    pub decode_secs: f64,
    pub cache_bytes: usize,
}

impl Stats {
    pub fn prefill_rate(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    pub fn decode_rate(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_secs.max(1e-9)
    }
}

/// A sequence being generated.
struct Live {
    prompt: usize,
    sample: usize,
    slot: u32,
    /// Prompt and generated tokens so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    logprobs: Vec<f32>,
    rng: Rng,
    finish: Option<Finish>,
    /// Bytes of text already checked for stop strings.
    checked: usize,
}

impl Live {
    fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

fn check_requests(model: &dyn Model, reqs: &[Request], o: &Options) -> Result<()> {
    o.sampling.check().map_err(KilnError::Setting)?;
    if o.max_new_tokens == 0 {
        return Err(KilnError::Setting(
            "the number of new tokens is 0; ask for at least 1".into(),
        ));
    }
    for (i, r) in reqs.iter().enumerate() {
        if r.samples == 0 {
            return Err(KilnError::Setting(format!(
                "prompt {i} asks for 0 samples; use --num-samples 1 or more"
            )));
        }
        if r.prompt.is_empty() {
            return Err(KilnError::Setting(format!(
                "prompt {i} is empty; give at least one token to continue"
            )));
        }
        if r.prompt.len() >= model.context() {
            return Err(KilnError::Setting(format!(
                "prompt {i} has {} tokens, {} more than the model's context of {} leaves room for (at least one new token); shorten it",
                r.prompt.len(),
                r.prompt.len() + 1 - model.context(),
                model.context()
            )));
        }
    }
    Ok(())
}

/// Decides whether `s` just ended; when a stop string ended it, `text` is its text cut there.
fn stopped(
    s: &mut Live,
    tok: &dyn Tokenizer,
    o: &Options,
    max_len: usize,
    text: &mut Option<String>,
) -> bool {
    let last = *s.tokens.last().expect("a token was just drawn");
    if o.stop_ids.contains(&last) {
        s.tokens.pop();
        s.logprobs.pop();
        s.finish = Some(Finish::Stop);
        return true;
    }
    if !o.stop_strings.is_empty() {
        let mut t = tok.decode(s.generated());
        // Search only the tail that could hold a stop string not seen before.
        let longest = o.stop_strings.iter().map(String::len).max().unwrap_or(0);
        let mut from = s.checked.saturating_sub(longest).min(t.len());
        while !t.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(at) = o
            .stop_strings
            .iter()
            .filter_map(|st| t[from..].find(st.as_str()).map(|i| from + i))
            .min()
        {
            t.truncate(at);
            *text = Some(t);
            s.finish = Some(Finish::Stop);
            return true;
        }
        s.checked = t.len();
    }
    // The cache holds positions `0..max_len`; the newest token would be fed at `len - 1`.
    if s.generated().len() >= o.max_new_tokens || s.tokens.len() > max_len {
        s.finish = Some(Finish::Length);
        return true;
    }
    false
}

/// A cache for `slots` sequences of `max_len` positions, or, when it does not fit, an error
/// with its size, the memory there was, and the most sequences that would fit.
fn new_cache(
    model: &dyn Model,
    d: &dyn crate::models::Decoder,
    slots: usize,
    max_len: usize,
) -> Result<crate::models::KvCache> {
    let pool = model.params()[0].value.pool().clone();
    let before = pool.stats().current;
    d.new_cache(slots, max_len).map_err(|e| {
        if !e.is_out_of_memory() {
            return KilnError::Engine(e);
        }
        let per_slot = d.cache_bytes(1, max_len).max(1);
        let room = pool.capacity().unwrap_or(0).saturating_sub(before);
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        KilnError::DoesNotFit(format!(
            "the key/value cache for {slots} sequences of up to {max_len} tokens needs {:.2} GiB on {} and {:.2} GiB is left beside the model; at most {} sequences of that length fit: use fewer prompts or --num-samples, or fewer --tokens",
            gib(per_slot * slots),
            pool.device(),
            gib(room),
            room / per_slot
        ))
    })
}

/// Generates `o.max_new_tokens` (at most) for each sample of each request. `on_token` sees
/// every drawn token as `(prompt, sample, token)`, for streaming.
pub fn generate(
    model: &dyn Model,
    tok: &dyn Tokenizer,
    reqs: &[Request],
    o: &Options,
    on_token: &mut dyn FnMut(usize, usize, u32),
) -> Result<(Vec<Completion>, Stats)> {
    check_requests(model, reqs, o)?;
    let vocab = model.vocab();
    let max_len = reqs
        .iter()
        .map(|r| r.prompt.len() + o.max_new_tokens)
        .max()
        .unwrap_or(1)
        .min(model.context());
    let slots: usize = reqs.iter().map(|r| r.samples).sum();
    let mut cache = match model.decoder() {
        Some(d) => Some(new_cache(model, d, slots, max_len)?),
        None => None,
    };
    let mut stats = Stats {
        cache_bytes: cache.as_ref().map_or(0, |c| c.bytes()),
        ..Stats::default()
    };
    let mut live: Vec<Live> = Vec::with_capacity(slots);
    let mut done: Vec<Completion> = Vec::with_capacity(slots);

    // Prefill: each prompt once, its logits shared by its samples.
    let t0 = Instant::now();
    let mut first_logits: Vec<Vec<f32>> = Vec::with_capacity(reqs.len());
    let mut slot = 0u32;
    for r in reqs {
        let t = r.prompt.len();
        let logits = match (&mut cache, model.decoder()) {
            (Some(c), Some(d)) => {
                let pos: Vec<u32> = (0..t as u32).collect();
                let l = d.decode(c, &r.prompt, &vec![slot; t], &pos, &[t as u32 - 1])?;
                for s in 1..r.samples {
                    c.copy_slot(slot as usize, slot as usize + s, t)?;
                }
                l
            }
            _ => model.next_logits(&r.prompt)?,
        };
        stats.prefill_tokens += t;
        first_logits.push(logits);
        slot += r.samples as u32;
    }
    stats.prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut slot = 0u32;
    for (p, r) in reqs.iter().enumerate() {
        for s in 0..r.samples {
            let mut seq = Live {
                prompt: p,
                sample: s,
                slot,
                tokens: r.prompt.clone(),
                prompt_len: r.prompt.len(),
                logprobs: Vec::new(),
                rng: Rng::new(hash3(o.seed, p as u64, s as u64), stream::SAMPLE),
                finish: None,
                checked: 0,
            };
            let mut logits = first_logits[p].clone();
            let lp_src = logits.clone();
            let next = sample(&mut logits, &seq.tokens, &o.sampling, &mut seq.rng);
            seq.logprobs.push(log_prob(&lp_src, next));
            seq.tokens.push(next);
            on_token(p, s, next);
            live.push(seq);
            slot += 1;
        }
    }
    stats.decode_tokens += live.len();
    loop {
        // Retire the sequences that just ended.
        let mut i = 0;
        while i < live.len() {
            let mut cut = None;
            if stopped(&mut live[i], tok, o, max_len, &mut cut) {
                let s = live.swap_remove(i);
                let text = cut.unwrap_or_else(|| tok.decode(s.generated()));
                done.push(Completion {
                    prompt: s.prompt,
                    sample: s.sample,
                    tokens: s.generated().to_vec(),
                    logprobs: s.logprobs,
                    text,
                    finish: s.finish.unwrap_or(Finish::Length),
                });
            } else {
                i += 1;
            }
        }
        if live.is_empty() {
            break;
        }
        // One decode step for every live sequence.
        let logits: Vec<f32> = match (&mut cache, model.decoder()) {
            (Some(c), Some(d)) => {
                let tokens: Vec<u32> = live
                    .iter()
                    .map(|s| *s.tokens.last().expect("non-empty"))
                    .collect();
                let slots: Vec<u32> = live.iter().map(|s| s.slot).collect();
                let pos: Vec<u32> = live.iter().map(|s| s.tokens.len() as u32 - 1).collect();
                let emit: Vec<u32> = (0..live.len() as u32).collect();
                d.decode(c, &tokens, &slots, &pos, &emit)?
            }
            _ => {
                let mut all = Vec::with_capacity(live.len() * vocab);
                for s in &live {
                    let window = &s.tokens[s.tokens.len().saturating_sub(model.context())..];
                    all.extend(model.next_logits(window)?);
                }
                all
            }
        };
        // Each sequence draws from its own random stream, so drawing in parallel gives the
        // same tokens as drawing in order.
        live.par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .for_each(|(s, row)| {
                let mut l = row.to_vec();
                let next = sample(&mut l, &s.tokens, &o.sampling, &mut s.rng);
                s.logprobs.push(log_prob(row, next));
                s.tokens.push(next);
            });
        for s in &live {
            on_token(
                s.prompt,
                s.sample,
                *s.tokens.last().expect("a token was just drawn"),
            );
        }
        stats.decode_tokens += live.len();
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    done.sort_by_key(|c| (c.prompt, c.sample));
    Ok((done, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ByteTokenizer;
    use crate::engine::{Device, MemoryPool};
    use crate::models::llama::{Llama, LlamaConfig};

    fn tiny() -> Llama {
        let cfg = LlamaConfig {
            vocab: 256,
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            ffn_hidden: 48,
            context: 64,
            rope_theta: 1000.0,
            rot_dim: 8,
            rope_scaling: None,
            norm_eps: 1e-5,
            tied_head: true,
            qkv_bias: false,
        };
        Llama::new(&MemoryPool::new(Device::Cpu), cfg, 11).unwrap()
    }

    fn opts(sampling: Sampling, max_new_tokens: usize) -> Options {
        Options {
            max_new_tokens,
            sampling,
            stop_ids: vec![],
            stop_strings: vec![],
            seed: 5,
        }
    }

    fn run(model: &Llama, reqs: &[Request], o: &Options) -> Vec<Completion> {
        generate(model, &ByteTokenizer, reqs, o, &mut |_, _, _| {})
            .unwrap()
            .0
    }

    /// Greedy decoding through the cache equals re-running the whole window for each token.
    #[test]
    fn cached_greedy_decoding_matches_full_windows() {
        let model = tiny();
        let prompt: Vec<u32> = b"ROMEO:".iter().map(|&b| b as u32).collect();
        let got = run(
            &model,
            &[Request {
                prompt: prompt.clone(),
                samples: 1,
            }],
            &opts(Sampling::GREEDY, 12),
        );
        let mut tokens = prompt;
        for _ in 0..12 {
            let logits = model.next_logits(&tokens).unwrap();
            tokens.push(sampling::sample(
                &mut logits.clone(),
                &[],
                &Sampling::GREEDY,
                &mut Rng::new(0, 0),
            ));
        }
        assert_eq!(got[0].tokens, tokens[6..]);
        assert_eq!(got[0].finish, Finish::Length);
        assert_eq!(got[0].logprobs.len(), 12);
    }

    /// A sample's tokens depend on (seed, prompt, sample) only: the same with other prompts
    /// in the batch, different between samples of one prompt, and stop tokens end it.
    #[test]
    fn samples_are_reproducible_and_independent_of_the_batch() {
        let model = tiny();
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            ..Sampling::default()
        };
        let a = Request {
            prompt: vec![72, 101, 108],
            samples: 3,
        };
        let b = Request {
            prompt: vec![66, 97, 121, 32, 111],
            samples: 2,
        };
        let both = run(&model, &[a.clone(), b], &opts(s, 10));
        let alone = run(&model, &[a], &opts(s, 10));
        assert_eq!(both.len(), 5);
        for i in 0..3 {
            assert_eq!(both[i].tokens, alone[i].tokens, "sample {i} of prompt 0");
        }
        assert!(both[0].tokens != both[1].tokens || both[1].tokens != both[2].tokens);
        let mut stop = opts(s, 10);
        stop.stop_ids = vec![alone[0].tokens[2]];
        let cut = run(
            &model,
            &[Request {
                prompt: vec![72, 101, 108],
                samples: 1,
            }],
            &stop,
        );
        assert_eq!(cut[0].finish, Finish::Stop);
        assert_eq!(cut[0].tokens, alone[0].tokens[..2]);
    }

    /// A cache too large for the memory left is exit code 6 with the most sequences that fit.
    #[test]
    fn a_cache_that_cannot_fit_says_how_many_would() {
        let model = tiny();
        let pool = model.params()[0].value.pool().clone();
        // 2 layers x (K + V) x 2 heads x 8 dims x 4 bytes = 256 bytes per position and slot.
        let per_slot = 256 * 20;
        pool.set_limit(pool.stats().current + 3 * per_slot + 100);
        let req = Request {
            prompt: vec![1; 10],
            samples: 8,
        };
        let e = generate(
            &model,
            &ByteTokenizer,
            &[req],
            &opts(Sampling::GREEDY, 10),
            &mut |_, _, _| {},
        )
        .unwrap_err();
        assert_eq!(e.exit_code(), 6, "{e}");
        assert!(e.to_string().contains("at most 3 sequences"), "{e}");
    }

    #[test]
    fn bad_requests_are_refused() {
        let model = tiny();
        let o = opts(Sampling::GREEDY, 4);
        let none = Request {
            prompt: vec![1],
            samples: 0,
        };
        let long = Request {
            prompt: vec![1; 64],
            samples: 1,
        };
        for (r, phrase) in [
            (none, "0 samples"),
            (long, "1 more than the model's context"),
        ] {
            let e = generate(&model, &ByteTokenizer, &[r], &o, &mut |_, _, _| {}).unwrap_err();
            assert!(e.to_string().contains(phrase), "{e}");
        }
    }
}

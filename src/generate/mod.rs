//! The generation engine: many prompts, several samples per prompt, one batched decode.
//!
//! Prompts are prefilled into the model's key/value cache a chunk of prompts per forward
//! pass; each prompt's cache slot is copied to its other samples. Then every slot advances
//! by one token per decode step (one batched forward of one row per slot). The logits stay
//! on the model's device: a sampler there (`engine::cpu::sampling` is its reference) draws
//! each slot's next token, writes it where the next step reads its input and advances the
//! slot's position, and only the drawn tokens and their log-probabilities come back to the
//! host. Each sample draws from a random stream keyed by (seed, prompt, sample), so its text
//! does not depend on which other sequences share the batch. On a GPU the decode step is
//! replayed from a CUDA graph once its shapes settle ([`graph`]).
//!
//! Steps run one ahead of the host: step n + 1 is queued (its input tokens are already where
//! step n's sampler wrote them) before the host reads step n's tokens, so the device does not
//! wait while the host copies tokens back, checks stops and launches the next step. A
//! sequence that step n ends with a stop token or string has then run one step more than it
//! needed, whose token is dropped; one that step n ends by length is left out of step n + 1,
//! since the host knows that in advance. A step in flight lands before sequences enter freed
//! slots or the step's buffers change.
//!
//! The host decides when a sequence ends: stop tokens, stop strings (checked on the text of
//! the drawn ids) and length. A finished sequence frees its slot: each step runs only the
//! live slots (on a GPU as a bucketed number of rows, so that few graphs serve a shrinking
//! batch), and sequences beyond the cache's capacity (`Options::max_batch`, or what fits in
//! memory) wait and take freed slots, their prompts prefilled as they enter. Models without a
//! cached decoder fall back to re-running their window for each token and sampling on the
//! host.
//!
//! Training code calls [`generate`] directly between optimizer steps: it reads the model's
//! weights where they are and returns token ids, texts and the model's log-probabilities of
//! each drawn token.

pub mod bench;
pub mod graph;
pub mod load;
pub mod sampling;
pub mod stops;
pub mod text_stream;

pub use sampling::{Sampling, log_prob, sample};

use crate::data::Tokenizer;
use crate::engine::Tensor;
use crate::engine::cpu::sampling::{HostSlots, draw_bits, mark, mask_words, sample_row};
use crate::engine::cuda::CudaBackend;
use crate::engine::ops::{self, DrawnRead, Ids, SlotState, StepRows};
use crate::engine::rng::hash3;
use crate::error::{KilnError, Result};
use crate::models::{DecodeRows, Decoder, KvCache, Model};
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
    /// Replay decode steps from CUDA graphs on a GPU (`--no-cuda-graphs` turns it off).
    pub cuda_graphs: bool,
    /// Queue each decode step before reading the previous step's tokens, so that the host's
    /// reading and bookkeeping overlap the device's work; false waits for each step's tokens
    /// before the next step starts. The same tokens either way.
    pub overlap_steps: bool,
    /// Cut prompts too long for the model from the left, keeping their end and room for
    /// the new tokens, instead of refusing them.
    pub truncate_left: bool,
    /// The most sequences decoded at once (the cache's slots); the others wait for a slot.
    /// `None`: all of them, or as many as fit in memory.
    pub max_batch: Option<usize>,
}

impl Options {
    /// Defaults for everything but the length and the sampling.
    pub fn new(max_new_tokens: usize, sampling: Sampling) -> Options {
        Options {
            max_new_tokens,
            sampling,
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            seed: 1,
            cuda_graphs: true,
            overlap_steps: true,
            truncate_left: false,
            max_batch: None,
        }
    }
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
    /// Prompt tokens cut from the left to fit the model (`Options::truncate_left`).
    #[serde(skip_serializing_if = "is_zero")]
    pub truncated: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Throughput of one call. The prefill phase runs the prompts and draws every sequence's
/// first token; the decode phase draws the rest.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    pub decode_tokens: usize,
    pub decode_secs: f64,
    /// Decode steps run (each advances every live sequence by one token).
    pub decode_steps: usize,
    /// Sequences decoded at once at most (the cache's slots).
    pub slots: usize,
    pub cache_bytes: usize,
    /// Decode steps replayed from CUDA graphs, and graphs captured.
    pub graph_replays: usize,
    pub graph_captures: usize,
    /// Why CUDA graphs were not used, when they were asked for on a GPU and failed.
    pub graphs_off: Option<String>,
    /// Sequences prefilled again at LongRoPE's trained context
    /// ([`crate::models::Decoder::restart_at`]); their tokens count as prefill tokens.
    #[serde(skip_serializing_if = "is_zero")]
    pub restarts: usize,
    /// Prompt tokens whose keys and values a conversation's cache already held
    /// ([`generate_turn`]): not run again, and not counted in `prefill_tokens`.
    #[serde(skip_serializing_if = "is_zero")]
    pub reused_tokens: usize,
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
    slot: usize,
    /// Prompt and generated tokens so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    logprobs: Vec<f32>,
    /// The key of its random stream.
    seed: u64,
    finish: Option<Finish>,
    /// Bytes of text already checked for stop strings (as of the last decode of the whole
    /// text; a step whose last tokens hold none leaves it).
    checked: usize,
    truncated: usize,
    /// Positions of its prompt whose keys and values its slot already holds when it enters
    /// (a conversation's earlier turns, [`generate_turn`]); its prefill runs the rest.
    cached: usize,
}

impl Live {
    /// Sample `sample` of prompt `prompt` (its tokens, `cut` from the left), in `slot`, with
    /// `cached` of its positions already in the slot's cache.
    fn new(
        prompt: usize,
        sample: usize,
        slot: usize,
        (tokens, cut): &(Vec<u32>, usize),
        seed: u64,
        cached: usize,
    ) -> Live {
        Live {
            prompt,
            sample,
            slot,
            tokens: tokens.clone(),
            prompt_len: tokens.len(),
            logprobs: Vec::new(),
            seed: hash3(seed, prompt as u64, sample as u64),
            finish: None,
            checked: 0,
            truncated: *cut,
            cached,
        }
    }

    fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// Checks the requests and settings; cuts over-long prompts when asked. Returns the prompts
/// to run and how many tokens each lost.
fn prepare(model: &dyn Model, reqs: &[Request], o: &Options) -> Result<Vec<(Vec<u32>, usize)>> {
    o.sampling.check().map_err(KilnError::Setting)?;
    if o.max_new_tokens == 0 {
        return Err(KilnError::Setting(
            "the number of new tokens is 0; ask for at least 1".into(),
        ));
    }
    let context = model.context();
    reqs.iter()
        .enumerate()
        .map(|(i, r)| {
            // Counted from 1, as the lines of a --prompts file are.
            let i = i + 1;
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
            if r.prompt.len() < context {
                return Ok((r.prompt.clone(), 0));
            }
            if !o.truncate_left {
                return Err(KilnError::Setting(format!(
                    "prompt {i} has {} tokens, {} more than the model's context of {} leaves room for (at least one new token); shorten it or pass --truncate-left",
                    r.prompt.len(),
                    r.prompt.len() + 1 - context,
                    context
                )));
            }
            let keep = context.saturating_sub(o.max_new_tokens).max(1);
            let cut = r.prompt.len() - keep;
            Ok((r.prompt[cut..].to_vec(), cut))
        })
        .collect()
}

/// Refuses a stop string the model can never write: one whose text does not come back
/// from its own tokens (characters the tokenizer maps to an unknown token, or case an
/// uncased vocabulary folds). Leading and trailing whitespace is not compared, since
/// decoders may add or strip a space at a text's edges.
pub fn check_stop_strings(tok: &dyn Tokenizer, stops: &[String]) -> Result<()> {
    for s in stops {
        if s.is_empty() {
            return Err(KilnError::Setting("--stop needs a non-empty text".into()));
        }
        let back = tok.decode(&tok.encode(s));
        if !back.contains(s.trim()) {
            return Err(KilnError::Setting(format!(
                "--stop {s:?} cannot appear in this model's output: its tokenizer ({}) turns it into {back:?}; give a text the model can write",
                tok.name()
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
    let longest = o.stop_strings.iter().map(String::len).max().unwrap_or(0);
    // The whole text is decoded only when the last tokens' text holds a stop string (see
    // [`stops`]); `checked` then still bounds the search from below, since every stop string
    // completed at an earlier step was found then.
    if !o.stop_strings.is_empty()
        && stops::tail_may_stop(tok, s.generated(), &o.stop_strings, longest)
    {
        let mut t = tok.decode(s.generated());
        // Search only the tail that could hold a stop string not seen before.
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
    if at_length(s, 0, o, max_len) {
        s.finish = Some(Finish::Length);
        return true;
    }
    false
}

/// Moves the sequences that just ended from `live` to `done`; returns the slots they free.
fn retire(
    live: &mut Vec<Live>,
    done: &mut Vec<Completion>,
    tok: &dyn Tokenizer,
    o: &Options,
    max_len: usize,
) -> Vec<usize> {
    let mut freed = Vec::new();
    let mut i = 0;
    while i < live.len() {
        let mut cut = None;
        if stopped(&mut live[i], tok, o, max_len, &mut cut) {
            let s = live.swap_remove(i);
            freed.push(s.slot);
            let text = cut.unwrap_or_else(|| tok.decode(s.generated()));
            done.push(Completion {
                prompt: s.prompt,
                sample: s.sample,
                tokens: s.generated().to_vec(),
                logprobs: s.logprobs,
                text,
                finish: s.finish.unwrap_or(Finish::Length),
                truncated: s.truncated,
            });
        } else {
            i += 1;
        }
    }
    freed
}

/// A cache for up to `wanted` sequences of `max_len` positions: all of them when they fit,
/// else as many as fit (halving until one does; the rest wait for a slot), or, when not even
/// one fits, an error with its size and the memory there was.
fn new_cache(
    model: &dyn Model,
    d: &dyn Decoder,
    wanted: usize,
    max_len: usize,
) -> Result<(KvCache, usize)> {
    let pool = model.params()[0].value.pool().clone();
    let before = pool.stats().current;
    let mut slots = wanted.max(1);
    loop {
        match d.new_cache(slots, max_len) {
            Ok(cache) => return Ok((cache, slots)),
            Err(e) if !e.is_out_of_memory() => return Err(KilnError::Engine(e)),
            Err(_) if slots > 1 => slots /= 2,
            Err(_) => {
                let per_slot = d.cache_bytes(1, max_len).max(1);
                let room = pool.capacity().unwrap_or(0).saturating_sub(before);
                let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
                return Err(KilnError::DoesNotFit(format!(
                    "the key/value cache for one sequence of up to {max_len} tokens needs {:.2} GiB on {} and {:.2} GiB is left beside the model: ask for fewer --tokens or use shorter prompts",
                    gib(per_slot),
                    pool.device(),
                    gib(room),
                )));
            }
        }
    }
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
    let prompts = prepare(model, reqs, o)?;
    let max_len = prompts
        .iter()
        .map(|(p, _)| p.len() + o.max_new_tokens)
        .max()
        .unwrap_or(1)
        .min(model.context());
    // The samples of prompt p take consecutive slots.
    let mut live: Vec<Live> = Vec::new();
    for (p, (prompt, r)) in prompts.iter().zip(reqs).enumerate() {
        for s in 0..r.samples {
            live.push(Live::new(p, s, live.len(), prompt, o.seed, 0));
        }
    }
    let mut done = Vec::with_capacity(live.len());
    let stats = match model.decoder() {
        Some(d) => {
            let cache = new_cache(
                model,
                d,
                live.len().min(o.max_batch.unwrap_or(usize::MAX)),
                max_len,
            )?;
            cached(
                model, d, tok, &prompts, o, max_len, live, &mut done, on_token, cache,
            )?
            .0
        }
        None => windows(model, tok, o, live, &mut done, on_token)?,
    };
    done.sort_by_key(|c| (c.prompt, c.sample));
    Ok((done, stats))
}

/// A conversation's key/value cache, kept between the turns of [`generate_turn`]: each turn
/// runs only the prompt tokens after the longest prefix the cache already holds (the earlier
/// turns and replies, where the chat template renders them again as before), instead of
/// prefilling the whole conversation again.
#[derive(Default)]
pub struct Conversation {
    /// The cache (one slot) and the tokens whose keys and values it holds, from position 0.
    held: Option<(KvCache, Vec<u32>)>,
}

impl Conversation {
    pub fn new() -> Conversation {
        Conversation::default()
    }

    /// Forgets the cache: the next turn prefills its whole prompt.
    pub fn forget(&mut self) {
        self.held = None;
    }

    /// Tokens whose keys and values the cache holds.
    pub fn held_tokens(&self) -> usize {
        self.held.as_ref().map_or(0, |h| h.1.len())
    }
}

/// One reply to `prompt` (a whole conversation so far), reusing what `conv` holds from the
/// turns before: the prompt's tokens agreeing with the cache's run no more, and the reply's
/// are kept for the next turn. The reply is the one [`generate`] gives for the same prompt
/// and options, but for the rounding of keys and values that a decode step computed where a
/// prefill would (exact on the CPU in f32 up to the order of sums). A model without a cache,
/// or one that prefills again at LongRoPE's trained context, runs [`generate`] each turn.
pub fn generate_turn(
    model: &dyn Model,
    tok: &dyn Tokenizer,
    conv: &mut Conversation,
    prompt: &[u32],
    o: &Options,
    on_token: &mut dyn FnMut(usize, usize, u32),
) -> Result<(Completion, Stats)> {
    let reqs = [Request {
        prompt: prompt.to_vec(),
        samples: 1,
    }];
    let d = match model.decoder() {
        Some(d) if d.restart_at().is_none() => d,
        _ => {
            conv.forget();
            let (mut done, stats) = generate(model, tok, &reqs, o, on_token)?;
            return Ok((done.remove(0), stats));
        }
    };
    let prompts = prepare(model, &reqs, o)?;
    let prompt = &prompts[0].0;
    let max_len = (prompt.len() + o.max_new_tokens).min(model.context());
    let (cache, reused) = match conv.held.take() {
        Some((cache, held)) if cache.shape.max_len >= max_len => {
            let same = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            // The last prompt token runs in any case: its logits draw the first new token.
            (cache, same.min(prompt.len() - 1))
        }
        old => {
            // The old cache goes first.
            drop(old);
            let room = turn_room(max_len, model.context());
            let cache = match new_cache(model, d, 1, room) {
                Ok((cache, _)) => cache,
                // No room to grow: a cache of this turn's length, if that fits.
                Err(KilnError::DoesNotFit(_)) if room > max_len => {
                    new_cache(model, d, 1, max_len)?.0
                }
                Err(e) => return Err(e),
            };
            (cache, 0)
        }
    };
    let live = vec![Live::new(0, 0, 0, &prompts[0], o.seed, reused)];
    let mut done = Vec::with_capacity(1);
    let (mut stats, cache) = cached(
        model,
        d,
        tok,
        &prompts,
        o,
        max_len,
        live,
        &mut done,
        on_token,
        (cache, 1),
    )?;
    stats.reused_tokens = reused;
    let reply = done.remove(0);
    // Every token but the last drawn one ran through the model (a stop token is not in
    // `reply.tokens`, so this may keep one position fewer than the cache holds).
    let mut held = prompt.clone();
    held.extend_from_slice(&reply.tokens[..reply.tokens.len().saturating_sub(1)]);
    conv.held = Some((cache, held));
    Ok((reply, stats))
}

/// The positions a conversation's cache is made with for a turn of up to `max_len`: twice
/// that rounded up to a power of two, and at least 1024, within the context. The next turns
/// fit in it for a while, so that a conversation makes a new cache (and prefills everything
/// again) a few times only, however many turns it has.
fn turn_room(max_len: usize, context: usize) -> usize {
    (2 * max_len)
        .next_power_of_two()
        .max(1024)
        .min(context)
        .max(max_len)
}

/// Prompt tokens per prefill forward pass: long enough to fill a GPU, short enough that the
/// pass's activations stay small beside the weights.
const PREFILL_ROWS: usize = 8192;

/// A prefill run: tokens, the slot they go into, and the position of the first of them.
type Run<'t> = (&'t [u32], usize, usize);

/// What the cached path works with while it admits and decodes sequences.
struct Engine<'a> {
    d: &'a dyn Decoder,
    prompts: &'a [(Vec<u32>, usize)],
    o: &'a Options,
    cache: KvCache,
    st: SlotState,
}

impl Engine<'_> {
    /// Prefills the prompts of `entering` (sequences already given free slots), a chunk of
    /// whole prompts per pass; each prompt runs once, in the slot of its first entering
    /// sample, and is copied to the others; then every entering sequence draws its first
    /// token. Returns the prompt tokens run.
    fn admit(
        &mut self,
        entering: &mut [Live],
        on_token: &mut dyn FnMut(usize, usize, u32),
    ) -> Result<usize> {
        let penalised = self.o.sampling.repetition_penalty != 1.0;
        for s in entering.iter() {
            let history = if penalised { &s.tokens[..] } else { &[][..] };
            self.st
                .reset_slot(s.slot, s.prompt_len as u32 - 1, s.seed, history)?;
        }
        // (prompt, slots of its entering samples), in order of entering.
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for s in entering.iter() {
            match groups.iter_mut().find(|g| g.0 == s.prompt) {
                Some(g) => g.1.push(s.slot),
                None => groups.push((s.prompt, vec![s.slot])),
            }
        }
        // The positions of each prompt already in its first slot (see `Live::cached`).
        let held = |slot: usize| {
            entering
                .iter()
                .find(|s| s.slot == slot)
                .map_or(0, |s| s.cached)
        };
        let mut run = 0;
        let mut g = 0;
        while g < groups.len() {
            let mut end = g;
            let mut rows = 0;
            let new_rows =
                |(p, slots): &(usize, Vec<usize>)| self.prompts[*p].0.len() - held(slots[0]);
            // A pass's prompts share their rotary tables (LongRoPE: their own lengths' choice).
            let variant = |p: usize| self.d.rotary_variant(self.prompts[p].0.len());
            while end < groups.len()
                && (end == g
                    || (rows + new_rows(&groups[end]) <= PREFILL_ROWS
                        && variant(groups[end].0) == variant(groups[g].0)))
            {
                rows += new_rows(&groups[end]);
                end += 1;
            }
            let runs: Vec<Run> = groups[g..end]
                .iter()
                .map(|(p, slots)| {
                    let from = held(slots[0]);
                    (&self.prompts[*p].0[from..], slots[0], from)
                })
                .collect();
            let draws: Vec<(usize, usize)> = groups[g..end]
                .iter()
                .enumerate()
                .flat_map(|(q, (_, slots))| slots.iter().map(move |&s| (q, s)))
                .collect();
            self.prefill_pass(&runs, &draws, |cache| {
                // The prompt's other samples start from its cached keys.
                for (p, slots) in &groups[g..end] {
                    for &to in &slots[1..] {
                        cache.copy_slot(slots[0], to, self.prompts[*p].0.len())?;
                    }
                }
                Ok(())
            })?;
            run += rows;
            g = end;
        }
        let drawn = self.st.read()?;
        take_drawn(entering.iter_mut(), &drawn, on_token);
        Ok(run)
    }

    /// Prefills the sequences `which` (ascending indices) of `live` again from their first token (the decoder's
    /// [`Decoder::restart_at`]: each one's next token sits at LongRoPE's trained context),
    /// in their own slots, then each draws its next token as a decode step would have.
    /// Returns the tokens run.
    fn restart(
        &mut self,
        live: &mut [Live],
        which: &[usize],
        on_token: &mut dyn FnMut(usize, usize, u32),
    ) -> Result<usize> {
        let mut run = 0;
        let per_pass = (PREFILL_ROWS / live[which[0]].tokens.len()).max(1);
        for chunk in which.chunks(per_pass) {
            let runs: Vec<Run> = chunk
                .iter()
                .map(|&i| (&live[i].tokens[..], live[i].slot, 0))
                .collect();
            let draws: Vec<(usize, usize)> = chunk
                .iter()
                .enumerate()
                .map(|(q, &i)| (q, live[i].slot))
                .collect();
            self.prefill_pass(&runs, &draws, |_| Ok(()))?;
            run += runs.iter().map(|r| r.0.len()).sum::<usize>();
        }
        let drawn = self.st.read()?;
        let restarted = live
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| which.binary_search(i).is_ok())
            .map(|(_, s)| s);
        take_drawn(restarted, &drawn, on_token);
        Ok(run)
    }

    /// One prefill pass: each run's tokens into its slot at positions from its start,
    /// emitting its last row's logits; `then` works on the cache; then each draw
    /// `(run, slot)` samples `slot`'s next token from that run's logits.
    fn prefill_pass(
        &mut self,
        runs: &[Run],
        draws: &[(usize, usize)],
        then: impl FnOnce(&mut KvCache) -> Result<()>,
    ) -> Result<()> {
        let (mut tokens, mut slot, mut pos, mut emit) = (vec![], vec![], vec![], vec![]);
        for &(run, s, from) in runs {
            tokens.extend_from_slice(run);
            slot.extend(std::iter::repeat_n(s as u32, run.len()));
            pos.extend(from as u32..(from + run.len()) as u32);
            emit.push(tokens.len() as u32 - 1);
        }
        let longest = runs.iter().map(|r| r.2 + r.0.len()).max().unwrap_or(1);
        let mut logits = self.d.new_logits(runs.len())?;
        self.d.decode_into(
            &mut self.cache,
            &DecodeRows {
                tokens: Ids::Host(&tokens),
                slot: Ids::Host(&slot),
                pos: Ids::Host(&pos),
                longest,
                positions: longest,
                distinct_slots: false,
                emit: Some(Ids::Host(&emit)),
            },
            &mut logits,
        )?;
        then(&mut self.cache)?;
        let src_row: Vec<u32> = draws.iter().map(|d| d.0 as u32).collect();
        let sample_slot: Vec<u32> = draws.iter().map(|d| d.1 as u32).collect();
        ops::sample_rows(
            &logits,
            Some(Ids::Host(&src_row)),
            Some(Ids::Host(&sample_slot)),
            draws.len(),
            &mut self.st,
            &self.o.sampling.params(),
        )?;
        Ok(())
    }
}

/// Generation through the model's key/value cache `cache` (its slots the most sequences
/// decoded at once), sampling where the logits are. Gives the cache back.
#[allow(clippy::too_many_arguments)]
fn cached(
    model: &dyn Model,
    d: &dyn Decoder,
    tok: &dyn Tokenizer,
    prompts: &[(Vec<u32>, usize)],
    o: &Options,
    max_len: usize,
    sequences: Vec<Live>,
    done: &mut Vec<Completion>,
    on_token: &mut dyn FnMut(usize, usize, u32),
    (cache, slots): (KvCache, usize),
) -> Result<(Stats, KvCache)> {
    let pool = model.params()[0].value.pool().clone();
    let mut stats = Stats {
        cache_bytes: cache.bytes(),
        slots,
        ..Stats::default()
    };
    // Every slot's state is set as a sequence enters it.
    let init = HostSlots::new(vec![0; slots], vec![0; slots], &[], model.vocab(), max_len);
    let st = SlotState::new(&pool, init)?;
    let mut eng = Engine {
        d,
        prompts,
        o,
        cache,
        st,
    };
    let mut waiting: std::collections::VecDeque<Live> = sequences.into();
    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut live: Vec<Live> = Vec::new();
    let params = o.sampling.params();
    let gpu = match &eng.st {
        SlotState::Gpu(g, _, _) => Some(g.clone()),
        _ => None,
    };
    let restart_at = d.restart_at();
    let mut graphs = gpu
        .clone()
        .filter(|_| o.cuda_graphs)
        .map(graph::StepGraphs::new);
    // The rows of the current step and their logits, rebuilt when the row count changes.
    let mut step_rows: Option<(StepRows, Tensor)> = None;
    let mut rows_of: Vec<u32> = Vec::new();
    let mut decode_time = std::time::Duration::ZERO;
    let mut prefill_time = std::time::Duration::ZERO;
    // The last decode step queued whose tokens the host has not read yet.
    let mut in_flight: Option<DrawnRead> = None;
    loop {
        free.extend(retire(&mut live, done, tok, o, max_len));
        let admitting = !waiting.is_empty() && !free.is_empty();
        if admitting || live.is_empty() {
            // Entering sequences may take slots the step in flight still runs: it lands first.
            if let Some(read) = in_flight.take() {
                let t = Instant::now();
                stats.decode_tokens += land(&mut eng.st, read, &mut live, on_token)?;
                decode_time += t.elapsed();
                continue;
            }
        }
        if admitting {
            let t0 = Instant::now();
            // Lowest free slots first, so a run's slot use does not depend on timing.
            free.sort_unstable_by(|a, b| b.cmp(a));
            let first = live.len();
            while let (Some(_), Some(slot)) = (waiting.front(), free.pop()) {
                let mut s = waiting.pop_front().expect("checked above");
                s.slot = slot;
                live.push(s);
            }
            stats.prefill_tokens += eng.admit(&mut live[first..], on_token)?;
            prefill_time += t0.elapsed();
            // The entering sequences may already be done (one new token).
            continue;
        }
        if live.is_empty() {
            break;
        }
        if let Some(at) = restart_at {
            // A sequence whose next token would sit at the trained context is prefilled
            // again (see Decoder::restart_at); the step in flight, which gives it that
            // token, lands first.
            let ahead = usize::from(in_flight.is_some());
            if live.iter().any(|s| s.tokens.len() + ahead == at + 1) {
                let t = Instant::now();
                if let Some(read) = in_flight.take() {
                    stats.decode_tokens += land(&mut eng.st, read, &mut live, on_token)?;
                    decode_time += t.elapsed();
                    continue;
                }
                let which: Vec<usize> = (0..live.len())
                    .filter(|&i| live[i].tokens.len() == at + 1)
                    .collect();
                stats.prefill_tokens += eng.restart(&mut live, &which, on_token)?;
                stats.restarts += which.len();
                prefill_time += t.elapsed();
                continue;
            }
        }
        let t1 = Instant::now();
        // Every live sequence gains a token from the step in flight; those that it ends by
        // length do not run this step.
        let ahead = usize::from(in_flight.is_some());
        let running: Vec<&Live> = live
            .iter()
            .filter(|s| ahead == 0 || !at_length(s, ahead, o, max_len))
            .collect();
        if running.is_empty() {
            let read = in_flight
                .take()
                .expect("a live sequence runs unless a step is in flight");
            stats.decode_tokens += land(&mut eng.st, read, &mut live, on_token)?;
            decode_time += t1.elapsed();
            continue;
        }
        let longest = running.iter().map(|s| s.tokens.len()).max().unwrap_or(1) + ahead;
        let mut live_slots: Vec<u32> = running.iter().map(|s| s.slot as u32).collect();
        live_slots.sort_unstable();
        let rows = match graphs {
            Some(_) => graph::row_bucket(live_slots.len(), slots),
            None => live_slots.len(),
        };
        if live_slots != rows_of {
            match &mut step_rows {
                // Rewritten in stream order: a step in flight still reads the old rows.
                Some((r, _)) if r.len() == rows => r.refill(&live_slots)?,
                _ => {
                    if let Some(read) = in_flight.take() {
                        // New buffers and graphs: the step in flight, which uses the old ones,
                        // lands first, and the rows are chosen again.
                        stats.decode_tokens += land(&mut eng.st, read, &mut live, on_token)?;
                        decode_time += t1.elapsed();
                        continue;
                    }
                    // A new row count: the old buffers go, and the graphs that read them.
                    drop(step_rows.take());
                    if let Some(g) = &mut graphs {
                        g.forget();
                    }
                    let r = StepRows::new(&eng.st, &live_slots, rows)?;
                    step_rows = Some((r, d.new_logits(rows)?));
                }
            }
            rows_of = live_slots;
        }
        let (r, logits) = step_rows.as_mut().expect("built above");
        let bound = graph::attention_bound(longest, max_len);
        let Engine { cache, st, .. } = &mut eng;
        let mut step = || -> crate::engine::Result<()> {
            // A decode step's chain of kernels may overlap (engine/cuda/overlap.rs).
            let _overlapped = gpu.as_deref().map(CudaBackend::overlapped);
            ops::gather_step_rows(st, r)?;
            d.decode_into(
                cache,
                &DecodeRows {
                    tokens: r.tokens(),
                    slot: r.slots(),
                    pos: r.pos(),
                    longest: bound,
                    positions: longest,
                    distinct_slots: true,
                    emit: None,
                },
                logits,
            )?;
            ops::sample_rows(logits, None, Some(r.slots()), rows, st, &params)
        };
        match &mut graphs {
            Some(g) => g.run((bound, rows), &mut step)?,
            None => step()?,
        }
        stats.decode_steps += 1;
        let read = eng.st.start_read()?;
        // The previous step's tokens, read while this one runs.
        let previous = in_flight.replace(read);
        if let Some(prev) = previous {
            stats.decode_tokens += land(&mut eng.st, prev, &mut live, on_token)?;
        }
        if !o.overlap_steps
            && let Some(read) = in_flight.take()
        {
            stats.decode_tokens += land(&mut eng.st, read, &mut live, on_token)?;
        }
        decode_time += t1.elapsed();
    }
    stats.prefill_secs = prefill_time.as_secs_f64();
    stats.decode_secs = decode_time.as_secs_f64();
    if let Some(g) = graphs {
        stats.graph_replays = g.replays;
        stats.graph_captures = g.captures;
        stats.graphs_off = g.failed;
    }
    Ok((stats, eng.cache))
}

/// Whether `s` has reached its length once it holds `ahead` more tokens: its limit of new
/// tokens, or the cache's `max_len` positions (the newest token would be fed at `len - 1`).
/// [`stopped`] asks with none ahead; a step queued behind one in flight with one.
fn at_length(s: &Live, ahead: usize, o: &Options, max_len: usize) -> bool {
    s.generated().len() + ahead >= o.max_new_tokens || s.tokens.len() + ahead > max_len
}

/// Waits for the draws of a queued step and gives each live sequence its token; returns how
/// many. Every live sequence ran that step: none enters while a step is in flight, and one
/// that ends before the step runs is retired before it is read.
fn land(
    st: &mut SlotState,
    read: DrawnRead,
    live: &mut [Live],
    on_token: &mut dyn FnMut(usize, usize, u32),
) -> Result<usize> {
    let drawn = st.finish_read(read)?;
    Ok(take_drawn(live.iter_mut(), &drawn, on_token))
}

/// Appends each sequence's drawn token and log-probability (by slot); returns how many.
fn take_drawn<'a>(
    seqs: impl IntoIterator<Item = &'a mut Live>,
    (tokens, logprobs): &(Vec<u32>, Vec<f32>),
    on_token: &mut dyn FnMut(usize, usize, u32),
) -> usize {
    let mut n = 0;
    for s in seqs {
        s.tokens.push(tokens[s.slot]);
        s.logprobs.push(logprobs[s.slot]);
        on_token(s.prompt, s.sample, tokens[s.slot]);
        n += 1;
    }
    n
}

/// Generation for models without a cache: each token re-runs the sequence's window, and
/// the host samples with the same rules and random streams as the cached path.
fn windows(
    model: &dyn Model,
    tok: &dyn Tokenizer,
    o: &Options,
    mut live: Vec<Live>,
    done: &mut Vec<Completion>,
    on_token: &mut dyn FnMut(usize, usize, u32),
) -> Result<Stats> {
    let mut stats = Stats::default();
    let (vocab, context) = (model.vocab(), model.context());
    let params = o.sampling.params();
    let t0 = Instant::now();
    let mut first = true;
    loop {
        if !first {
            retire(&mut live, done, tok, o, context);
        }
        if live.is_empty() {
            break;
        }
        let mut logits = Vec::with_capacity(live.len() * vocab);
        for s in &live {
            let window = &s.tokens[s.tokens.len().saturating_sub(context)..];
            logits.extend(model.next_logits(window)?);
        }
        live.par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .for_each(|(s, row)| {
                let mut mask = Vec::new();
                if o.sampling.repetition_penalty != 1.0 {
                    mask = vec![0u32; mask_words(vocab)];
                    s.tokens.iter().for_each(|&t| mark(&mut mask, t));
                }
                let counter = s.generated().len() as u64;
                let (t, lp) = sample_row(row, &mask, &params, draw_bits(s.seed, counter));
                s.tokens.push(t);
                s.logprobs.push(lp);
            });
        for s in &live {
            on_token(s.prompt, s.sample, *s.tokens.last().expect("just drawn"));
        }
        if first {
            stats.prefill_tokens = live.iter().map(|s| s.prompt_len).sum();
            stats.prefill_secs = t0.elapsed().as_secs_f64();
            first = false;
        } else {
            stats.decode_tokens += live.len();
            stats.decode_steps += 1;
        }
    }
    stats.decode_secs = t0.elapsed().as_secs_f64() - stats.prefill_secs;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ByteTokenizer;
    use crate::engine::rng::Rng;
    use crate::engine::{Device, MemoryPool};
    use crate::models::llama::{Llama, LlamaConfig};
    use crate::nn::Params;

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
            rope_factors: None,
            rope_long_factors: None,
            rope_trained_context: 0,
            rope_attention_factor: 1.0,
            norm_eps: 1e-5,
            tied_head: true,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: 0,
            full_attention_layers: 0,
        };
        Llama::new(&MemoryPool::new(Device::Cpu), cfg, 11).unwrap()
    }

    /// [`tiny`] with LongRoPE: short factors for passes up to 24 positions, long ones past.
    fn tiny_longrope(long: bool) -> Llama {
        use crate::engine::cpu::rope::PairFactors;
        let mut cfg = tiny().cfg;
        cfg.rope_factors = PairFactors::new(&[1.0, 1.3, 1.7, 2.0]);
        cfg.rope_long_factors = long.then(|| PairFactors::new(&[2.0, 4.0, 8.0, 16.0]).unwrap());
        cfg.rope_trained_context = 24;
        cfg.rope_attention_factor = 1.1;
        Llama::new(&MemoryPool::new(Device::Cpu), cfg, 11).unwrap()
    }

    fn opts(sampling: Sampling, max_new_tokens: usize) -> Options {
        Options {
            seed: 5,
            ..Options::new(max_new_tokens, sampling)
        }
    }

    fn run(model: &Llama, reqs: &[Request], o: &Options) -> Vec<Completion> {
        generate(model, &ByteTokenizer, reqs, o, &mut |_, _, _| {})
            .unwrap()
            .0
    }

    /// A conversation's turns, each reusing the keys and values of the turns before, reply
    /// as a fresh generation of the same prompt does (greedy and sampled, with a repetition
    /// penalty reading the whole prompt), and run only the prompt tokens the cache lacks:
    /// after a reply, everything but the reply's last token; after an edit in the middle,
    /// up to the edit; past the cache's room, all of it again in a larger cache.
    #[test]
    fn conversation_turns_reuse_the_cache_and_reply_as_fresh_prompts_do() {
        let mut cfg = tiny().cfg;
        cfg.context = 4096;
        let model = Llama::new(&MemoryPool::new(Device::Cpu), cfg, 11).unwrap();
        for sampling in [
            Sampling::GREEDY,
            Sampling {
                temperature: 0.9,
                top_k: 0,
                top_p: 0.95,
                min_p: 0.0,
                repetition_penalty: 1.2,
            },
        ] {
            let o = opts(sampling, 8);
            let mut conv = Conversation::new();
            let fresh = |prompt: &[u32]| {
                let req = [Request {
                    prompt: prompt.to_vec(),
                    samples: 1,
                }];
                generate(&model, &ByteTokenizer, &req, &o, &mut |_, _, _| {}).unwrap()
            };
            let turn = |conv: &mut Conversation, prompt: &[u32]| {
                let (got, stats) =
                    generate_turn(&model, &ByteTokenizer, conv, prompt, &o, &mut |_, _, _| {})
                        .unwrap();
                let (want, fresh_stats) = fresh(prompt);
                assert_eq!(got.tokens, want[0].tokens, "{sampling:?}");
                for (a, b) in got.logprobs.iter().zip(&want[0].logprobs) {
                    assert!((a - b).abs() < 1e-4, "{a} against {b}");
                }
                assert_eq!(stats.prefill_tokens + stats.reused_tokens, prompt.len());
                assert_eq!(fresh_stats.prefill_tokens, prompt.len());
                (got, stats)
            };
            let first: Vec<u32> = b"ROMEO: say".iter().map(|&b| b as u32).collect();
            let (reply, stats) = turn(&mut conv, &first);
            assert_eq!(stats.reused_tokens, 0);
            assert_eq!(reply.tokens.len(), 8);
            // The next prompt repeats the first and its reply, then says more (within the
            // first turn's cache of 1024 positions).
            let mut second = first.clone();
            second.extend(&reply.tokens);
            second.extend(b" JUL:".iter().map(|&b| b as u32));
            let (_, stats) = turn(&mut conv, &second);
            assert_eq!(stats.reused_tokens, first.len() + reply.tokens.len() - 1);
            // An edit at position 3: the cache serves the three before it.
            let mut edited = second.clone();
            edited[3] = b'X' as u32;
            let (_, stats) = turn(&mut conv, &edited);
            assert_eq!(stats.reused_tokens, 3);
            assert_eq!(conv.held_tokens(), edited.len() + 7);
            // A prompt past the cache's 1024 positions (with its 8 new tokens): a cache of
            // 4096, filled from the start.
            let long: Vec<u32> = edited.iter().cycle().take(1020).copied().collect();
            assert_eq!(turn_room(long.len() + 8, 4096), 4096);
            let (_, stats) = turn(&mut conv, &long);
            assert_eq!(stats.reused_tokens, 0);
            let (_, stats) = turn(&mut conv, &long);
            assert_eq!(stats.reused_tokens, long.len() - 1);
            conv.forget();
            assert_eq!(turn(&mut conv, &long).1.reused_tokens, 0);
        }
    }

    /// Where memory leaves no room for a conversation's cache to grow, it is made the turn's
    /// length and the turn goes on.
    #[test]
    fn a_conversation_cache_without_room_to_grow_takes_the_turns_length() {
        let mut cfg = tiny().cfg;
        cfg.context = 4096;
        let pool = MemoryPool::new(Device::Cpu);
        let model = Llama::new(&pool, cfg, 11).unwrap();
        // 1024 positions of cache take 256 KiB here; the turn's 14 take 3.5 KiB.
        pool.set_limit(pool.stats().current + 128 * 1024);
        let prompt: Vec<u32> = b"ROMEO:".iter().map(|&b| b as u32).collect();
        let o = opts(Sampling::GREEDY, 8);
        let mut conv = Conversation::new();
        let (got, stats) = generate_turn(
            &model,
            &ByteTokenizer,
            &mut conv,
            &prompt,
            &o,
            &mut |_, _, _| {},
        )
        .unwrap();
        assert_eq!(got.tokens.len(), 8);
        assert_eq!(stats.cache_bytes, model.cache_bytes(1, 14));
    }

    /// A conversation's cache: twice the turn, a power of two, at least 1024, within the
    /// context, and never short of the turn.
    #[test]
    fn a_conversation_cache_leaves_room_for_the_next_turns() {
        assert_eq!(turn_room(59, 8192), 1024);
        assert_eq!(turn_room(600, 8192), 2048);
        assert_eq!(turn_room(5000, 8192), 8192);
        assert_eq!(turn_room(59, 512), 512);
        assert_eq!(turn_room(40, 40), 40);
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
                &logits,
                &[],
                &Sampling::GREEDY,
                &mut Rng::new(0, 0),
            ));
        }
        assert_eq!(got[0].tokens, tokens[6..]);
        assert_eq!(got[0].finish, Finish::Length);
        assert_eq!(got[0].logprobs.len(), 12);
    }

    /// A LongRoPE model decoding across its trained context does what transformers' Phi-3
    /// generation does: the short factors while the sequence fits that context, then its
    /// cache computed again with the long ones, so that every token's logits are those of a
    /// forward call over the whole sequence so far (the window path, which re-runs it for
    /// each token). Steps queued ahead agree, and the switch changes the output.
    #[test]
    fn longrope_generation_recomputes_the_cache_past_the_trained_context() {
        let model = tiny_longrope(true);
        let prompt: Vec<u32> = (0..20).map(|i| 65 + (i * 5) % 26).collect();
        let n = 16;
        let req = [Request {
            prompt: prompt.clone(),
            samples: 1,
        }];
        let mut o = opts(Sampling::GREEDY, n);
        let (got, stats) = generate(&model, &ByteTokenizer, &req, &o, &mut |_, _, _| {}).unwrap();
        assert_eq!(stats.restarts, 1);
        o.overlap_steps = !o.overlap_steps;
        assert_eq!(run(&model, &req, &o)[0].logprobs, got[0].logprobs);

        let mut tokens = prompt.clone();
        for i in 0..n {
            let logits = model.next_logits(&tokens).unwrap();
            let next = sampling::sample(&logits, &[], &Sampling::GREEDY, &mut Rng::new(0, 0));
            let max = logits.iter().fold(f32::MIN, |m, &v| m.max(v));
            let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
            let logprob = logits[next as usize] - max - sum.ln();
            assert!((got[0].logprobs[i] - logprob).abs() < 1e-5, "step {i}");
            tokens.push(next);
        }
        assert_eq!(got[0].tokens, tokens[prompt.len()..]);
        assert!(tokens.len() > 24 + 1, "the steps pass the trained context");
        let short_only = run(&tiny_longrope(false), &req, &o);
        assert_ne!(short_only[0].logprobs, got[0].logprobs);
    }

    /// Each sequence of a LongRoPE batch takes the factors its own length calls for, as
    /// transformers does generating it alone: a prompt past the trained context prefills with
    /// the long factors while a shorter one in the same call keeps the short ones, and in
    /// decode steps a row reads the long factors once its own cache was recomputed with them,
    /// not when the batch's longest sequence passes the trained context. So every sequence's
    /// tokens and log-probabilities are those it gets alone.
    #[test]
    fn longrope_sequences_switch_factors_each_by_its_own_length() {
        let model = tiny_longrope(true);
        let prompt = |n: u32| (0..n).map(|i| 65 + (i * 7) % 26).collect::<Vec<u32>>();
        // Past the trained 24 positions from the start; crossing them at the 5th step; at the 12th.
        let reqs: Vec<Request> = [30, 20, 13]
            .into_iter()
            .map(|n| Request {
                prompt: prompt(n),
                samples: 1,
            })
            .collect();
        let o = opts(Sampling::GREEDY, 16);
        let together = run(&model, &reqs, &o);
        for (i, req) in reqs.iter().enumerate() {
            let alone = run(&model, std::slice::from_ref(req), &o);
            assert_eq!(together[i].tokens, alone[0].tokens, "prompt {i}");
            assert_eq!(together[i].logprobs, alone[0].logprobs, "prompt {i}");
        }
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

    /// Sequences that end free their slot: outputs do not depend on how many run at once
    /// (every step runs only the live slots, and waiting sequences enter freed slots), with
    /// stops ending samples at different steps and a repetition penalty in the slot state.
    #[test]
    fn finished_sequences_free_their_slots_without_changing_outputs() {
        let model = tiny();
        let s = Sampling {
            temperature: 1.0,
            top_k: 30,
            top_p: 0.9,
            min_p: 0.0,
            repetition_penalty: 1.1,
        };
        let reqs = [
            Request {
                prompt: vec![72, 101, 108],
                samples: 3,
            },
            Request {
                prompt: vec![66, 97, 121, 32, 111, 33],
                samples: 2,
            },
            Request {
                prompt: vec![40],
                samples: 2,
            },
        ];
        let mut o = opts(s, 12);
        let all = run(&model, &reqs, &o);
        // Stop on a token some samples draw early, so the batch shrinks as it goes.
        o.stop_ids = vec![all[1].tokens[3], all[4].tokens[1]];
        let generate_all =
            |o: &Options| generate(&model, &ByteTokenizer, &reqs, o, &mut |_, _, _| {}).unwrap();
        let (free_all, stats) = generate_all(&o);
        assert_eq!(stats.slots, 7);
        let lengths: std::collections::BTreeSet<usize> =
            free_all.iter().map(|c| c.tokens.len()).collect();
        assert!(
            lengths.len() > 1,
            "every sample ended together: {lengths:?}"
        );
        for cap in [1, 2, 3, 6] {
            o.max_batch = Some(cap);
            let (got, stats) = generate_all(&o);
            assert_eq!(stats.slots, cap);
            assert_eq!(got.len(), 7);
            for (a, b) in got.iter().zip(&free_all) {
                assert_eq!((a.prompt, a.sample), (b.prompt, b.sample));
                assert_eq!(
                    a.tokens, b.tokens,
                    "capacity {cap}: prompt {} sample {}",
                    a.prompt, a.sample
                );
                assert_eq!(a.finish, b.finish);
                assert_eq!(a.logprobs, b.logprobs);
            }
        }
    }

    /// Steps queued one ahead of the host's reading give the tokens, log-probabilities,
    /// endings and streamed tokens of steps read one by one: with stop tokens and a stop
    /// string ending samples at different steps (their extra step's token dropped), a sample
    /// ended by the context (left out of the step after its last), and fewer slots than
    /// samples (the step in flight lands before a waiting sample enters).
    #[test]
    fn steps_queued_ahead_give_the_same_tokens() {
        let model = tiny();
        let s = Sampling {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            repetition_penalty: 1.05,
        };
        let long: Vec<u32> = (0..58).map(|i| 65 + (i * 7) % 26).collect();
        let reqs = [
            Request {
                prompt: vec![72, 101, 108],
                samples: 3,
            },
            Request {
                prompt: vec![66, 97, 121, 32, 111, 33],
                samples: 2,
            },
            Request {
                prompt: long,
                samples: 1,
            },
        ];
        let mut o = opts(s, 12);
        let plain = run(&model, &reqs, &o);
        o.stop_ids = vec![plain[1].tokens[3], plain[3].tokens[1]];
        o.stop_strings = vec![ByteTokenizer.decode(&plain[0].tokens[4..6])];
        let go = |o: &Options| {
            let mut streamed: std::collections::BTreeMap<(usize, usize), Vec<u32>> =
                Default::default();
            let (done, stats) = generate(&model, &ByteTokenizer, &reqs, o, &mut |p, s, t| {
                streamed.entry((p, s)).or_default().push(t)
            })
            .unwrap();
            (done, stats, streamed)
        };
        for cap in [None, Some(2), Some(4)] {
            o.max_batch = cap;
            o.overlap_steps = false;
            let (one_by_one, stats_one, streamed_one) = go(&o);
            o.overlap_steps = true;
            let (ahead, stats_ahead, streamed_ahead) = go(&o);
            let finishes: Vec<Finish> = one_by_one.iter().map(|c| c.finish).collect();
            assert!(finishes.contains(&Finish::Stop), "{finishes:?}");
            assert_eq!(one_by_one[5].finish, Finish::Length);
            assert_eq!(one_by_one[5].tokens.len(), 64 + 1 - 58);
            assert_eq!(ahead.len(), one_by_one.len());
            for (a, b) in ahead.iter().zip(&one_by_one) {
                let which = format!("capacity {cap:?}: prompt {} sample {}", b.prompt, b.sample);
                assert_eq!((a.prompt, a.sample), (b.prompt, b.sample));
                assert_eq!(a.tokens, b.tokens, "{which}");
                assert_eq!(a.logprobs, b.logprobs, "{which}");
                assert_eq!(a.finish, b.finish, "{which}");
                assert_eq!(a.text, b.text, "{which}");
            }
            assert_eq!(streamed_ahead, streamed_one, "capacity {cap:?}");
            assert_eq!(stats_ahead.decode_tokens, stats_one.decode_tokens);
            assert!(stats_ahead.decode_steps >= stats_one.decode_steps);
        }
    }

    /// A cache too large for the memory left holds as many sequences as fit, the others
    /// waiting for its slots; one that cannot hold a single sequence is exit code 6.
    #[test]
    fn a_cache_that_cannot_fit_runs_fewer_sequences_at_once() {
        let model = tiny();
        let pool = model.params()[0].value.pool().clone();
        let req = Request {
            prompt: vec![1; 10],
            samples: 8,
        };
        let o = opts(Sampling::GREEDY, 40);
        let free = run(&model, std::slice::from_ref(&req), &o);
        // The peak of a run holding two sequences at once, and a slot's cache beside it.
        let before = pool.stats().current;
        pool.reset_peak();
        let two = Options {
            max_batch: Some(2),
            ..o.clone()
        };
        run(&model, std::slice::from_ref(&req), &two);
        let peak = pool.stats().peak;
        pool.set_limit(peak);
        let (got, stats) = generate(
            &model,
            &ByteTokenizer,
            std::slice::from_ref(&req),
            &o,
            &mut |_, _, _| {},
        )
        .unwrap();
        assert!(stats.slots < 8 && stats.slots >= 1, "{}", stats.slots);
        for (a, b) in got.iter().zip(&free) {
            assert_eq!(a.tokens, b.tokens);
        }
        pool.set_limit(before + 100);
        let e = generate(&model, &ByteTokenizer, &[req], &o, &mut |_, _, _| {}).unwrap_err();
        assert_eq!(e.exit_code(), 6, "{e}");
        assert!(e.to_string().contains("one sequence"), "{e}");
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
    /// A model without its cache: generation re-runs windows and samples on the host.
    struct Uncached<M: Model>(M);

    crate::nn::params!(impl[M: Model] Uncached<M> { 0 });

    impl<M: Model> Model for Uncached<M> {
        fn forward_backward(
            &mut self,
            inputs: &[u32],
            targets: &[u32],
            batch: usize,
            seq: usize,
            step: crate::models::StepPrecision,
        ) -> crate::engine::Result<f64> {
            self.0.forward_backward(inputs, targets, batch, seq, step)
        }
        fn loss(&self, i: &[u32], t: &[u32], b: usize, s: usize) -> crate::engine::Result<f64> {
            self.0.loss(i, t, b, s)
        }
        fn next_logits(&self, tokens: &[u32]) -> crate::engine::Result<Vec<f32>> {
            self.0.next_logits(tokens)
        }
        fn context(&self) -> usize {
            self.0.context()
        }
        fn vocab(&self) -> usize {
            self.0.vocab()
        }
        fn cost(&self, batch: usize, seq: usize) -> crate::nn::Cost {
            self.0.cost(batch, seq)
        }
    }

    /// The cached engine (batched prefill, sampler state per slot, every slot decoded each
    /// step) draws the same tokens as re-running each window and sampling on the host, with
    /// top-p, min-p, the repetition penalty and several samples per prompt.
    #[test]
    fn cached_sampling_matches_the_window_path() {
        let s = Sampling {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.02,
            repetition_penalty: 1.2,
        };
        let reqs = [
            Request {
                prompt: vec![72, 101, 108],
                samples: 3,
            },
            Request {
                prompt: vec![66, 97, 121, 32, 111, 33],
                samples: 2,
            },
        ];
        let mut o = opts(s, 9);
        o.stop_ids = vec![101];
        let cached = run(&tiny(), &reqs, &o);
        let windows = generate(
            &Uncached(tiny()),
            &ByteTokenizer,
            &reqs,
            &o,
            &mut |_, _, _| {},
        )
        .unwrap()
        .0;
        assert_eq!(cached.len(), 5);
        for (c, w) in cached.iter().zip(&windows) {
            assert_eq!((c.prompt, c.sample), (w.prompt, w.sample));
            assert_eq!(
                c.tokens, w.tokens,
                "prompt {} sample {}",
                c.prompt, c.sample
            );
            assert_eq!(c.finish, w.finish);
            for (a, b) in c.logprobs.iter().zip(&w.logprobs) {
                assert!((a - b).abs() < 1e-3, "{a} vs {b}");
            }
        }
    }

    /// A GPT (learned positions, no rotation, as many key/value heads as heads) decodes
    /// through its cache as re-running each window does: greedy tokens equal, sampled
    /// tokens equal with several samples a prompt, log-probabilities within float rounding,
    /// and the cache ends at the position table's end (the context).
    #[test]
    fn a_gpt_decodes_through_its_cache_as_through_windows() {
        use crate::models::gpt::{Gpt, GptConfig};
        let gpt = || {
            let cfg = GptConfig {
                vocab: 256,
                d_model: 32,
                n_layers: 2,
                n_heads: 4,
                context: 40,
                tied_head: true,
            };
            Gpt::new(&MemoryPool::new(Device::Cpu), cfg, 9).unwrap()
        };
        let reqs = [
            Request {
                prompt: b"ROMEO:".iter().map(|&b| b as u32).collect(),
                samples: 1,
            },
            Request {
                prompt: vec![66, 97, 121, 32, 111, 33, 10],
                samples: 3,
            },
        ];
        let sampled = Sampling {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
            repetition_penalty: 1.1,
        };
        for s in [Sampling::GREEDY, sampled] {
            // 40 positions: the prompts plus every new token fill the context.
            let o = opts(s, 34);
            let cached = generate(&gpt(), &ByteTokenizer, &reqs, &o, &mut |_, _, _| {})
                .unwrap()
                .0;
            let windows = generate(
                &Uncached(gpt()),
                &ByteTokenizer,
                &reqs,
                &o,
                &mut |_, _, _| {},
            )
            .unwrap()
            .0;
            assert_eq!(cached.len(), 4);
            for (c, w) in cached.iter().zip(&windows) {
                assert_eq!(
                    c.tokens, w.tokens,
                    "prompt {} sample {}",
                    c.prompt, c.sample
                );
                assert_eq!(c.finish, w.finish);
                for (a, b) in c.logprobs.iter().zip(&w.logprobs) {
                    assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                }
            }
            // The last token, drawn at the context's last position, needs none of its own.
            assert!(
                cached
                    .iter()
                    .all(|c| c.tokens.len() + reqs[c.prompt].prompt.len() <= 40 + 1)
            );
            assert!(cached.iter().any(|c| c.finish == Finish::Length));
        }
        assert!(gpt().decoder().is_some());
    }

    /// An over-long prompt is cut from the left only when asked, keeping room for the new
    /// tokens, and the completion says how much it lost.
    #[test]
    fn truncation_from_the_left_is_asked_for() {
        let model = tiny();
        let long = Request {
            prompt: (0..70).map(|i| 40 + i % 50).collect(),
            samples: 1,
        };
        let mut o = opts(Sampling::GREEDY, 5);
        let e = generate(
            &model,
            &ByteTokenizer,
            std::slice::from_ref(&long),
            &o,
            &mut |_, _, _| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("--truncate-left"), "{e}");
        o.truncate_left = true;
        let got = run(&model, std::slice::from_ref(&long), &o);
        // Context 64, 5 new tokens: the last 59 prompt tokens stay.
        assert_eq!(got[0].truncated, 70 - 59);
        assert_eq!(got[0].tokens.len(), 5);
        let kept = Request {
            prompt: long.prompt[11..].to_vec(),
            samples: 1,
        };
        assert_eq!(run(&model, &[kept], &o)[0].tokens, got[0].tokens);
    }
}

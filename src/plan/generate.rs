//! Planning generation by running it on a meta device: the model readied for generation as
//! `kiln generate` readies it, then the generation engine itself over synthetic prompts of
//! the asked shape — the key/value cache, every prefill pass and every decode step with its
//! sampler — booking on a meta pool and computing nothing. Its peak is what a real call
//! books; the largest number of sequences whose cache and buffers fit is found by running it
//! again at other sizes.
//!
//! The meta device draws token 0 at every step (its reads are zeros), which ends no
//! sequence, so every sequence runs to its full length: the worst case, which is what a
//! generation without stop tokens does.

use crate::config::ModelConfig;
use crate::data::ByteTokenizer;
use crate::engine::{DType, Device, MemoryPool};
use crate::error::{KilnError, Result};
use crate::generate::{self, Options, Request, Sampling};
use std::time::Instant;

/// What to generate: `prompts` prompts of `prompt_tokens` tokens, `samples` replies each,
/// `new_tokens` new tokens per reply, at most `max_batch` sequences at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GenerateShape {
    pub prompts: usize,
    pub samples: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub max_batch: Option<usize>,
}

impl GenerateShape {
    /// Sequences in all: every sample of every prompt.
    pub fn sequences(&self) -> usize {
        self.prompts * self.samples
    }

    /// Sequences at once when memory allows: all of them, or `max_batch`.
    pub fn most_at_once(&self) -> usize {
        self.max_batch.unwrap_or(usize::MAX).min(self.sequences())
    }

    /// The same shape with `n` sequences at once (the cache's slots).
    pub fn at_once(&self, n: usize) -> GenerateShape {
        GenerateShape {
            max_batch: Some(n),
            ..*self
        }
    }

    /// The first `n` sequences alone, `n` at once: a quick lower bound of the whole shape's
    /// peak at `n` at once. It is not always the peak itself: a later wave's prefill runs
    /// while the decode step's row buffers and logits of the wave before are still held.
    pub fn first_wave(&self, n: usize) -> GenerateShape {
        GenerateShape {
            prompts: n.div_ceil(self.samples).min(self.prompts),
            samples: self.samples.min(n),
            max_batch: Some(n),
            ..*self
        }
    }
}

/// What a meta run of one generation call booked.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GeneratePlan {
    /// The pool's peak over loading and generating.
    pub pool_peak: usize,
    /// The pool's peak plus what kernels take outside it at the same time.
    pub device_peak: usize,
    /// Bytes held once the model is ready, before the first prompt: the weights as
    /// generation keeps them.
    pub weights: usize,
    /// The key/value cache and how many sequences it holds at once.
    pub cache_bytes: usize,
    pub slots: usize,
    /// Positions per cache slot: the longest prompt plus the new tokens, within the context.
    pub max_len: usize,
    pub seconds: f64,
}

/// Runs one generation call of `shape` on a meta device standing in for `device`, with the
/// model of `cfg` readied for generation in `dtype` (`None`: fp32).
pub fn meta_generate(
    cfg: &ModelConfig,
    vocab: usize,
    device: Device,
    dtype: Option<DType>,
    shape: &GenerateShape,
) -> Result<GeneratePlan> {
    if shape.prompts == 0 || shape.samples == 0 {
        return Err(KilnError::Setting(
            "plan at least one prompt with at least one sample (--prompts, --num-samples)".into(),
        ));
    }
    if shape.prompt_tokens == 0 {
        return Err(KilnError::Setting(
            "--prompt-tokens 0: a prompt needs at least one token".into(),
        ));
    }
    let start = Instant::now();
    let pool = MemoryPool::meta(device);
    // As generation loads a model onto its device: frozen from the start.
    let mut model =
        crate::models::build_for(cfg, vocab, &pool, 0, crate::models::Role::Run(dtype))?;
    generate::load::ready_for_generation(model.as_mut(), dtype)?;
    let weights = pool.stats().current;
    // Ids spread over the vocabulary; their values change no booking.
    let reqs: Vec<Request> = (0..shape.prompts)
        .map(|p| Request {
            prompt: (0..shape.prompt_tokens)
                .map(|i| ((p * 31 + i * 7) % vocab.max(1)) as u32)
                .collect(),
            samples: shape.samples,
        })
        .collect();
    let mut o = Options::new(shape.new_tokens, Sampling::default());
    o.max_batch = shape.max_batch;
    // The byte tokenizer only turns the drawn ids (all 0 on a meta device) into text.
    let (_, stats) =
        generate::generate(model.as_ref(), &ByteTokenizer, &reqs, &o, &mut |_, _, _| {})?;
    let max_len = (shape.prompt_tokens + shape.new_tokens).min(model.context());
    Ok(GeneratePlan {
        pool_peak: pool.stats().peak,
        device_peak: pool.device_peak(),
        weights,
        cache_bytes: stats.cache_bytes,
        slots: stats.slots,
        max_len,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The most sequences at once (up to all of `shape`'s, or its `max_batch`) whose generation
/// peaks within `fits`, or `None` when not even one does. Memory grows with the sequences at
/// once. The search bisects over first waves ([`GenerateShape::first_wave`]), so it does not
/// decode every wave of every size, then confirms its answer with whole calls, stepping down
/// while the whole call does not fit.
pub fn largest_at_once(
    cfg: &ModelConfig,
    vocab: usize,
    device: Device,
    dtype: Option<DType>,
    shape: &GenerateShape,
    fits: &dyn Fn(&GeneratePlan) -> bool,
) -> Result<Option<usize>> {
    let wave = |n: usize| meta_generate(cfg, vocab, device, dtype, &shape.first_wave(n));
    let whole = |n: usize| meta_generate(cfg, vocab, device, dtype, &shape.at_once(n));
    let all = shape.most_at_once();
    if fits(&whole(all)?) {
        return Ok(Some(all));
    }
    if !fits(&wave(1)?) {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1usize, all);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(&wave(mid)?) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    while !fits(&whole(lo)?) {
        if lo == 1 {
            return Ok(None);
        }
        lo -= 1;
    }
    Ok(Some(lo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Device;

    fn tiny(kind: &str) -> ModelConfig {
        let mut m = (crate::models::family::of(kind).unwrap().tiny)();
        m.context = 64;
        m
    }

    /// The plan's peak is the peak a real generation call books on the CPU, byte for byte.
    #[test]
    fn the_plan_is_the_pool_peak_of_a_real_generation() {
        for kind in ["gpt", "llama"] {
            let cfg = tiny(kind);
            for (prompts, samples, max_batch) in [(3, 2, None), (5, 1, Some(2))] {
                let shape = GenerateShape {
                    prompts,
                    samples,
                    prompt_tokens: 9,
                    new_tokens: 12,
                    max_batch,
                };
                let plan = meta_generate(&cfg, 256, Device::Cpu, None, &shape).unwrap();
                let pool = MemoryPool::new(Device::Cpu);
                // As `generate::load::to_device` builds it (loaded instead of drawn).
                let mut model =
                    crate::models::build_for(&cfg, 256, &pool, 7, crate::models::Role::Run(None))
                        .unwrap();
                generate::load::ready_for_generation(model.as_mut(), None).unwrap();
                assert_eq!(pool.stats().current, plan.weights, "{kind}");
                let reqs: Vec<Request> = (0..prompts)
                    .map(|p| Request {
                        prompt: (0..9).map(|i| (40 + p * 3 + i) as u32).collect(),
                        samples,
                    })
                    .collect();
                let mut o = Options::new(12, Sampling::default());
                o.max_batch = max_batch;
                let (done, stats) = generate::generate(
                    model.as_ref(),
                    &ByteTokenizer,
                    &reqs,
                    &o,
                    &mut |_, _, _| {},
                )
                .unwrap();
                assert_eq!(done.len(), prompts * samples, "{kind} {stats:?}");
                assert_eq!(stats.slots, plan.slots, "{kind} {shape:?}");
                assert_eq!(stats.cache_bytes, plan.cache_bytes, "{kind} {shape:?}");
                assert_eq!(pool.stats().peak, plan.pool_peak, "{kind} {shape:?}");
                // Both decode from a cache.
                assert_eq!(plan.slots, max_batch.unwrap_or(prompts * samples), "{kind}");
            }
        }
    }

    /// A model built to run in bf16 holds each matrix in f32 only while converting it: its
    /// peak while loading is its bf16 matrices, its f32 vectors and one matrix in f32, where
    /// one held in f32 first peaks at every value in f32. Generation then keeps the same
    /// bytes either way.
    #[test]
    fn a_model_built_to_run_in_bf16_holds_one_matrix_in_f32_at_most() {
        for kind in ["gpt", "llama"] {
            let cfg = tiny(kind);
            let built = |dtype: Option<DType>| {
                let pool = MemoryPool::meta(Device::Cuda(0));
                let mut model =
                    crate::models::build_for(&cfg, 256, &pool, 0, crate::models::Role::Run(dtype))
                        .unwrap();
                let (loaded, counts) = (pool.stats().peak, model.params().len());
                generate::load::ready_for_generation(model.as_mut(), Some(DType::BF16)).unwrap();
                (loaded, counts, pool.stats().current, model)
            };
            let (peak_f32, _, ready_f32, _) = built(None);
            let (peak, count, ready, model) = built(Some(DType::BF16));
            let (mut matrices, mut vectors, mut largest) = (0, 0, 0);
            for p in model.params() {
                let n = p.value.len();
                if p.value.shape().len() >= 2 {
                    matrices += n;
                    largest = largest.max(n);
                } else {
                    vectors += n;
                }
            }
            assert_eq!(ready, ready_f32, "{kind}");
            assert!(peak_f32 >= 4 * (matrices + vectors), "{kind}");
            // The pool rounds each booking up; a kilobyte a tensor covers it.
            let bound = 2 * matrices + 4 * vectors + 4 * largest + 1024 * count;
            assert!(
                peak <= bound,
                "{kind}: {peak} > {bound} (f32 first: {peak_f32})"
            );
            assert!(peak < peak_f32, "{kind}");
        }
    }

    #[test]
    fn the_largest_batch_is_the_boundary_of_the_budget() {
        let cfg = tiny("llama");
        let shape = GenerateShape {
            prompts: 40,
            samples: 1,
            prompt_tokens: 16,
            new_tokens: 32,
            max_batch: None,
        };
        let at = |n| {
            meta_generate(&cfg, 256, Device::Cpu, None, &shape.at_once(n))
                .unwrap()
                .pool_peak
        };
        // A budget between the peaks of 17 and 18 sequences at once.
        let (p17, p18) = (at(17), at(18));
        assert!(p17 < p18, "{p17} {p18}");
        let limit = (p17 + p18) / 2;
        let fits = |p: &GeneratePlan| p.pool_peak <= limit;
        let n = largest_at_once(&cfg, 256, Device::Cpu, None, &shape, &fits).unwrap();
        // The whole call at the answer fits and at one more does not.
        let n = n.unwrap();
        assert!(p17 <= limit && n >= 1);
        assert!(fits(
            &meta_generate(&cfg, 256, Device::Cpu, None, &shape.at_once(n)).unwrap()
        ));
        assert!(!fits(
            &meta_generate(&cfg, 256, Device::Cpu, None, &shape.at_once(n + 1)).unwrap()
        ));
        let none = largest_at_once(&cfg, 256, Device::Cpu, None, &shape, &|_| false).unwrap();
        assert_eq!(none, None);
    }

    #[test]
    fn a_first_wave_is_a_lower_bound_of_the_whole_call_at_that_many_at_once() {
        let cfg = tiny("llama");
        for (prompts, samples, n) in [(7, 1, 3), (5, 2, 4), (5, 3, 4), (4, 4, 2)] {
            let shape = GenerateShape {
                prompts,
                samples,
                prompt_tokens: 12,
                new_tokens: 10,
                max_batch: None,
            };
            let whole = meta_generate(&cfg, 256, Device::Cpu, None, &shape.at_once(n)).unwrap();
            let first = meta_generate(&cfg, 256, Device::Cpu, None, &shape.first_wave(n)).unwrap();
            assert!(first.pool_peak <= whole.pool_peak, "{shape:?} at {n}");
            assert_eq!(whole.slots, first.slots);
        }
    }

    #[test]
    fn empty_shapes_are_refused_with_the_flag_to_change() {
        let cfg = tiny("gpt");
        let mut shape = GenerateShape {
            prompts: 1,
            samples: 0,
            prompt_tokens: 4,
            new_tokens: 4,
            max_batch: None,
        };
        let e = meta_generate(&cfg, 256, Device::Cpu, None, &shape).unwrap_err();
        assert!(e.to_string().contains("--num-samples"), "{e}");
        shape.samples = 1;
        shape.prompt_tokens = 0;
        let e = meta_generate(&cfg, 256, Device::Cpu, None, &shape).unwrap_err();
        assert!(e.to_string().contains("--prompt-tokens"), "{e}");
    }
}

//! Drawing one token per row of logits: the reference of the GPU sampler
//! (`engine/cuda/sampling.cu`) and the sampler of models that decode on the host.
//!
//! Both devices follow these rules, chosen so that neither needs a sort and both reach the
//! same token from the same logits and the same random number:
//!
//! 1. The repetition penalty divides positive (multiplies negative) logits of the tokens set
//!    in the row's presence mask; NaN counts as -inf.
//! 2. Temperature 0 picks the first index of the largest penalised logit.
//! 3. Otherwise each token gets `e = exp((l - max) / T)` in f32 and the integer weight
//!    `floor(e * 2^40)` (the most likely token weighs 2^40): sums of weights are exact and do
//!    not depend on the order a device adds them in.
//! 4. top-k keeps the tokens whose logit is at least the k-th largest (all ties at the edge
//!    stay); top-p keeps, of those, the tokens at or above the largest logit `v` at which
//!    the weight of tokens `>= v` reaches `ceil(top_p x their total)`; min-p keeps tokens
//!    with `e >= min_p`. Logits compare through [`order_key`], a total order.
//! 5. The row's random 64-bit number `r` (counter-based: `hash3(seed, SAMPLE, counter)`, so a
//!    sequence's draws do not depend on which others share its batch) picks
//!    `target = floor(r x kept / 2^64)`, and the token is the first in id order whose running
//!    kept weight exceeds it: inverse-CDF sampling, walked in id order instead of by
//!    probability, which draws from the same distribution.
//!
//! The returned log-probability is the model's own, `log softmax(logits)[token]` at
//! temperature 1 without the penalty.

use crate::engine::rng::{hash3, stream};
use rayon::prelude::*;

/// The settings of one draw, as the GPU kernel receives them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub struct SampleParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 keeps all.
    pub top_k: u32,
    /// 1 keeps all.
    pub top_p: f32,
    /// 0 keeps all.
    pub min_p: f32,
    /// 1 is off.
    pub repetition_penalty: f32,
}

/// Weight of the most likely token: `2^40`, so a vocabulary of up to 2^23 tokens sums below
/// 2^63 and a probability ratio of 2^-40 still counts.
pub const WEIGHT_ONE: f32 = (1u64 << 40) as f32;

/// A total order of f32 values as u32 keys (larger value, larger key; -0 below +0).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Words of a presence mask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Sets token `t`'s bit in a presence mask (ids past the mask are ignored).
pub fn mark(mask: &mut [u32], t: u32) {
    if let Some(w) = mask.get_mut(t as usize / 32) {
        *w |= 1 << (t % 32);
    }
}

fn marked(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// The logit after the repetition penalty (NaN becomes -inf).
fn penalised(l: f32, seen: bool, penalty: f32) -> f32 {
    let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
    match (seen && penalty != 1.0, l > 0.0) {
        (false, _) => l,
        (true, true) => l / penalty,
        (true, false) => l * penalty,
    }
}

/// `e = exp((l - max) / T)` as in rule 3; exactly 1 for the maximum itself.
pub fn relative(l: f32, max: f32, temperature: f32) -> f32 {
    if order_key(l) == order_key(max) {
        1.0
    } else {
        ((l - max) / temperature).exp()
    }
}

/// Integer weight of a relative probability `e` in [0, 1].
pub fn weight(e: f32) -> u64 {
    (e * WEIGHT_ONE) as u64
}

/// `ceil(top_p x total)`, at most `total`, computed identically on both devices.
pub fn top_p_need(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).min(total)
}

/// `floor(r x total / 2^64)`: a uniform integer below `total` from 64 random bits.
pub fn scaled_target(r: u64, total: u64) -> u64 {
    ((r as u128 * total as u128) >> 64) as u64
}

/// The largest key `v` at which the weight of the entries with key `>= v` reaches `need`
/// (`need` must be positive and at most the total).
fn threshold(mut keyed: Vec<(u32, u64)>, need: u64) -> u32 {
    keyed.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
    let mut cum = 0u64;
    for &(k, w) in &keyed {
        cum += w;
        if cum >= need {
            return k;
        }
    }
    keyed.last().map_or(0, |e| e.0)
}

/// Draws one token from `logits` (`[vocab]`) with `mask` the row's presence bits (may be
/// empty), `r` its random number. Returns the token and its log-probability.
pub fn sample_row(logits: &[f32], mask: &[u32], p: &SampleParams, r: u64) -> (u32, f32) {
    let pen: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| penalised(l, marked(mask, i), p.repetition_penalty))
        .collect();
    let (mut best, mut max) = (0usize, f32::NEG_INFINITY);
    for (i, &l) in pen.iter().enumerate() {
        if order_key(l) > order_key(max) {
            (best, max) = (i, l);
        }
    }
    let token = if p.temperature == 0.0 || max == f32::NEG_INFINITY {
        best as u32
    } else {
        draw(&pen, max, p, r)
    };
    (token, log_prob(logits, token))
}

/// Rules 3 to 5 over penalised logits whose maximum is `max`.
fn draw(pen: &[f32], max: f32, p: &SampleParams, r: u64) -> u32 {
    let keys: Vec<u32> = pen.iter().map(|&l| order_key(l)).collect();
    let weights: Vec<u64> = pen
        .iter()
        .map(|&l| weight(relative(l, max, p.temperature)))
        .collect();
    let top_k = p.top_k as usize;
    let mut floor = 0u32;
    if top_k > 0 && top_k < pen.len() {
        floor = threshold(keys.iter().map(|&k| (k, 1)).collect(), top_k as u64);
    }
    if p.top_p < 1.0 {
        let kept: Vec<(u32, u64)> = keys
            .iter()
            .zip(&weights)
            .filter(|(k, _)| **k >= floor)
            .map(|(&k, &w)| (k, w))
            .collect();
        let total: u64 = kept.iter().map(|e| e.1).sum();
        floor = floor.max(threshold(kept, top_p_need(p.top_p, total)));
    }
    let keep = |i: usize| {
        keys[i] >= floor && (p.min_p <= 0.0 || relative(pen[i], max, p.temperature) >= p.min_p)
    };
    let total: u64 = (0..pen.len())
        .filter(|&i| keep(i))
        .map(|i| weights[i])
        .sum();
    let target = scaled_target(r, total);
    let mut cum = 0u64;
    let mut last = 0;
    for i in (0..pen.len()).filter(|&i| keep(i)) {
        cum += weights[i];
        last = i;
        if cum > target {
            return i as u32;
        }
    }
    last as u32
}

/// `log softmax(logits)[token]` in f64 (NaN logits count as -inf).
pub fn log_prob(logits: &[f32], token: u32) -> f32 {
    let clean = |l: f32| {
        if l.is_nan() {
            f64::NEG_INFINITY
        } else {
            l as f64
        }
    };
    let max = logits
        .iter()
        .map(|&l| clean(l))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|&l| (clean(l) - max).exp()).sum();
    (clean(logits[token as usize]) - max - sum.ln()) as f32
}

/// The random number of a sequence's `counter`-th draw under its `seed`.
pub fn draw_bits(seed: u64, counter: u64) -> u64 {
    hash3(seed, stream::SAMPLE, counter)
}

/// Per-slot state of the sampler on the host: the GPU keeps the same arrays on the device.
/// Each draw writes the slot's token, log-probability and presence bit, advances its
/// position (to at most `max_len - 1`, so a finished slot that keeps being decoded stays in
/// its cache) and its counter.
#[derive(Debug, Clone, Default)]
pub struct HostSlots {
    pub tokens: Vec<u32>,
    pub pos: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub seeds: Vec<u64>,
    pub counters: Vec<u64>,
    /// `[slots, mask_words(vocab)]` presence bits.
    pub presence: Vec<u32>,
    pub vocab: usize,
    pub max_len: usize,
}

impl HostSlots {
    /// Slots whose tokens are fed next at `pos`, drawing from `seeds` with presence masks
    /// holding `history` (the prompt of each slot; empty histories when no penalty is used).
    pub fn new(
        pos: Vec<u32>,
        seeds: Vec<u64>,
        history: &[&[u32]],
        vocab: usize,
        max_len: usize,
    ) -> HostSlots {
        let slots = pos.len();
        let words = mask_words(vocab);
        let mut presence = vec![0u32; slots * words];
        for (s, h) in history.iter().enumerate() {
            for &t in h.iter() {
                mark(&mut presence[s * words..(s + 1) * words], t);
            }
        }
        HostSlots {
            tokens: vec![0; slots],
            pos,
            logprobs: vec![0.0; slots],
            counters: vec![0; slots],
            seeds,
            presence,
            vocab,
            max_len,
        }
    }

    pub fn slots(&self) -> usize {
        self.pos.len()
    }
}

/// One draw for each row of `logits` (`[rows, stride]`, the first `vocab` columns used):
/// row `i` reads logits row `src_row[i]` (or `i`) and the state of slot `slot[i]` (or `i`).
pub fn sample_rows(
    logits: &[f32],
    stride: usize,
    src_row: Option<&[u32]>,
    slot: Option<&[u32]>,
    st: &mut HostSlots,
    p: &SampleParams,
    rows: usize,
) {
    let (vocab, words) = (st.vocab, mask_words(st.vocab));
    let drawn: Vec<(usize, u32, f32)> = (0..rows)
        .into_par_iter()
        .map(|i| {
            let src = src_row.map_or(i, |s| s[i] as usize);
            let s = slot.map_or(i, |s| s[i] as usize);
            let row = &logits[src * stride..src * stride + vocab];
            let mask = &st.presence[s * words..(s + 1) * words];
            let (t, lp) = sample_row(row, mask, p, draw_bits(st.seeds[s], st.counters[s]));
            (s, t, lp)
        })
        .collect();
    for (s, t, lp) in drawn {
        st.tokens[s] = t;
        st.logprobs[s] = lp;
        st.pos[s] = (st.pos[s] + 1).min(st.max_len.saturating_sub(1) as u32);
        st.counters[s] += 1;
        mark(&mut st.presence[s * words..(s + 1) * words], t);
    }
}

/// The inputs of a decode step over some of the slots: `row_tokens[i] = tokens[slot[i]]`,
/// `row_pos[i] = pos[slot[i]]`, and `u32::MAX` for both where `slot[i]` names no slot (a
/// padding row, which the step's kernels skip).
pub fn gather_slot_rows(st: &HostSlots, slot: &[u32], row_tokens: &mut [u32], row_pos: &mut [u32]) {
    for ((&s, t), p) in slot.iter().zip(row_tokens).zip(row_pos) {
        let s = s as usize;
        (*t, *p) = match (st.tokens.get(s), st.pos.get(s)) {
            (Some(&t), Some(&p)) => (t, p),
            _ => (u32::MAX, u32::MAX),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: SampleParams = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };

    fn draws(logits: &[f32], p: &SampleParams, n: usize) -> Vec<usize> {
        let mut counts = vec![0usize; logits.len()];
        for c in 0..n as u64 {
            counts[sample_row(logits, &[], p, draw_bits(11, c)).0 as usize] += 1;
        }
        counts
    }

    /// Pearson's chi-square of `counts` against the probabilities `want` (zero-probability
    /// tokens must never be drawn), with its degrees of freedom.
    fn chi_square(counts: &[usize], want: &[f64]) -> (f64, usize) {
        let n: usize = counts.iter().sum();
        let mut stat = 0.0;
        let mut dof = 0;
        for (&c, &w) in counts.iter().zip(want) {
            if w == 0.0 {
                assert_eq!(c, 0, "a token outside the kept set was drawn");
                continue;
            }
            let e = w * n as f64;
            stat += (c as f64 - e).powi(2) / e;
            dof += 1;
        }
        (stat, dof.max(2) - 1)
    }

    /// The 99.9% quantile of chi-square with `dof` degrees of freedom (Wilson-Hilferty).
    fn chi_square_limit(dof: usize) -> f64 {
        let k = dof as f64;
        let z = 3.09;
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    /// The tempered softmax of `logits`, keeping only `keep`, renormalised.
    fn intended(logits: &[f32], t: f32, keep: impl Fn(usize, &[f64]) -> bool) -> Vec<f64> {
        let e: Vec<f64> = logits.iter().map(|&l| ((l / t) as f64).exp()).collect();
        let z: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|v| v / z).collect();
        let kept: Vec<f64> = (0..p.len())
            .map(|i| if keep(i, &p) { p[i] } else { 0.0 })
            .collect();
        let zk: f64 = kept.iter().sum();
        kept.iter().map(|v| v / zk).collect()
    }

    /// Sampling matches the intended distribution on an 8-token vocabulary (chi-square at
    /// the 99.9% level with a fixed seed) for temperature, top-k, top-p and min-p.
    #[test]
    fn draws_follow_the_intended_distribution() {
        let logits = [2.0f32, 1.5, 1.0, 0.6, 0.0, -0.4, -1.0, -2.0];
        let n = 60_000;
        let t = 0.8f32;
        // Probabilities in logit order (the logits are sorted): the head up to index i.
        let head = |p: &[f64], i: usize| p[..i].iter().sum::<f64>();
        let cases: Vec<(&str, SampleParams, Vec<f64>)> = vec![
            (
                "temperature",
                SampleParams {
                    temperature: t,
                    ..PLAIN
                },
                intended(&logits, t, |_, _| true),
            ),
            (
                "top-k 3",
                SampleParams {
                    temperature: t,
                    top_k: 3,
                    ..PLAIN
                },
                intended(&logits, t, |i, _| i < 3),
            ),
            (
                "top-p 0.8",
                SampleParams {
                    temperature: t,
                    top_p: 0.8,
                    ..PLAIN
                },
                // Keep token i while the mass before it is below 0.8.
                intended(&logits, t, |i, p| head(p, i) < 0.8),
            ),
            (
                "min-p 0.1",
                SampleParams {
                    temperature: t,
                    min_p: 0.1,
                    ..PLAIN
                },
                intended(&logits, t, |i, p| p[i] >= 0.1 * p[0]),
            ),
            (
                "top-k 5 then top-p 0.9",
                SampleParams {
                    temperature: 1.3,
                    top_k: 5,
                    top_p: 0.9,
                    ..PLAIN
                },
                {
                    let k5 = intended(&logits, 1.3, |i, _| i < 5);
                    let keep: Vec<bool> = (0..8).map(|i| head(&k5, i) < 0.9 && i < 5).collect();
                    intended(&logits, 1.3, |i, _| keep[i])
                },
            ),
        ];
        for (name, p, want) in cases {
            // Each case prunes something but keeps more than one token.
            let kept = want.iter().filter(|&&w| w > 0.0).count();
            assert!(
                name == "temperature" || (1 < kept && kept < 8),
                "{name}: {kept}"
            );
            let (stat, dof) = chi_square(&draws(&logits, &p, n), &want);
            assert!(
                stat < chi_square_limit(dof),
                "{name}: chi-square {stat:.1} with {dof} degrees of freedom"
            );
        }
        // The test has power: a temperature of 1 drawn against the 0.8 distribution fails.
        let (stat, dof) = chi_square(
            &draws(&logits, &PLAIN, n),
            &intended(&logits, t, |_, _| true),
        );
        assert!(stat > chi_square_limit(dof), "{stat}");
    }

    #[test]
    fn greedy_penalty_ties_and_nan() {
        let greedy = SampleParams {
            temperature: 0.0,
            ..PLAIN
        };
        let logits = [0.1f32, 3.0, 3.0, -1.0, f32::NAN];
        // The first of tied maxima; NaN is never the maximum.
        assert_eq!(sample_row(&logits, &[], &greedy, 5).0, 1);
        // A penalty of 2 on token 1 (3.0 -> 1.5) leaves token 2.
        let mut mask = vec![0u32; mask_words(5)];
        mark(&mut mask, 1);
        let pen = SampleParams {
            repetition_penalty: 2.0,
            ..greedy
        };
        assert_eq!(sample_row(&logits, &mask, &pen, 5).0, 2);
        // Negative logits are multiplied: token 0 at -0.5 x 2 falls below token 1 at -0.9.
        let neg = [-0.5f32, -0.9];
        let mut m0 = vec![0u32; 1];
        mark(&mut m0, 0);
        assert_eq!(sample_row(&neg, &m0, &pen, 0).0, 1);
        // Ties at the top-k edge all stay: top-1 over two equal maxima draws both.
        let top1 = SampleParams { top_k: 1, ..PLAIN };
        let tied = [1.0f32, 5.0, 5.0, 0.0];
        let seen: std::collections::BTreeSet<u32> = (0..200)
            .map(|c| sample_row(&tied, &[], &top1, draw_bits(3, c)).0)
            .collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        // Log-probabilities ignore the penalty and NaN.
        let lp = sample_row(&[0.0, 0.0, f32::NAN], &[], &greedy, 0).1;
        assert!((lp - 0.5f32.ln()).abs() < 1e-6, "{lp}");
    }

    #[test]
    fn keys_order_floats_and_targets_stay_below_the_total() {
        let xs = [
            f32::NEG_INFINITY,
            -2.0,
            -0.0,
            0.0,
            1e-30,
            1.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
        assert_eq!(scaled_target(u64::MAX, 10), 9);
        assert_eq!(scaled_target(0, 10), 0);
        assert_eq!(top_p_need(0.9, 10), 9);
        assert_eq!(top_p_need(1.0, 10), 10);
        assert_eq!(weight(1.0), 1 << 40);
    }

    /// Rows draw from their slot's stream, so a row's token does not depend on the others,
    /// and each draw advances the slot's position (capped), counter and presence mask.
    #[test]
    fn rows_update_their_slots() {
        let vocab = 40;
        let logits: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 7919) % 23) as f32 * 0.1)
            .collect();
        let p = SampleParams {
            temperature: 1.0,
            top_p: 0.9,
            ..PLAIN
        };
        let mut all = HostSlots::new(vec![3, 5, 9], vec![1, 2, 3], &[], vocab, 10);
        sample_rows(&logits, 64, None, None, &mut all, &p, 3);
        let mut one = HostSlots::new(vec![3, 5, 9], vec![1, 2, 3], &[], vocab, 10);
        // Slot 1 alone, reading logits row 1.
        sample_rows(&logits, 64, Some(&[1]), Some(&[1]), &mut one, &p, 1);
        assert_eq!(one.tokens[1], all.tokens[1]);
        assert_eq!(all.pos, vec![4, 6, 9]);
        assert_eq!(all.counters, vec![1, 1, 1]);
        let t = all.tokens[2] as usize;
        assert!(marked(&all.presence[2 * mask_words(vocab)..], t));
    }
}

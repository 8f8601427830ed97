//! Train/validation splits, batch sampling and the unigram baseline.
//!
//! Training windows are drawn at random positions, but each window's position is a pure
//! function of `(seed, step, micro, row)`. Any batch can therefore be rebuilt from its indices
//! alone: a resumed run sees exactly the batches an uninterrupted one would, and a micro-batch
//! can be split into smaller pieces (to fit memory) without changing which windows it holds.

use std::ops::Range;
use std::sync::Arc;

use super::DataError;
use crate::engine::rng::{hash3, stream};

/// The token stream cut into a training head and a validation tail. For fine-tuning data
/// (`sft`), the streams hold the trained target tokens of each split (what the unigram
/// baseline is measured on) and the packed rows are in `sft`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSplits {
    pub train: Arc<Vec<u32>>,
    pub val: Arc<Vec<u32>>,
    pub sft: Option<Arc<super::sft::SftSplits>>,
}

/// Splits off the last `val_fraction` of `tokens` for validation.
///
/// The validation set is a fixed tail, never a random sample, so every run with the same corpus
/// and fraction evaluates on the same text and no validation token ever appears in a training
/// window. `val_fraction` is clamped to [0, 1] (NaN counts as 0); the tail has
/// `round(len * val_fraction)` tokens.
pub fn split_tokens(mut tokens: Vec<u32>, val_fraction: f64) -> TokenSplits {
    let f = if val_fraction.is_nan() {
        0.0
    } else {
        val_fraction.clamp(0.0, 1.0)
    };
    let n_val = ((tokens.len() as f64 * f).round() as usize).min(tokens.len());
    let val = tokens.split_off(tokens.len() - n_val);
    tokens.shrink_to_fit();
    TokenSplits {
        train: Arc::new(tokens),
        val: Arc::new(val),
        sft: None,
    }
}

/// A batch of windows, row-major `[batch, seq]`; `targets` are `inputs` shifted one token on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
}

impl Batch {
    fn with_capacity(rows: usize, seq: usize) -> Batch {
        Batch {
            inputs: Vec::with_capacity(rows * seq),
            targets: Vec::with_capacity(rows * seq),
            batch: 0,
            seq,
        }
    }

    /// Appends the window starting at `start`; `tokens[start..start + seq + 1]` must exist.
    fn push_window(&mut self, tokens: &[u32], start: usize) {
        let w = &tokens[start..start + self.seq + 1];
        self.inputs.extend_from_slice(&w[..self.seq]);
        self.targets.extend_from_slice(&w[1..]);
        self.batch += 1;
    }
}

/// Checks that the training split holds at least one window of `seq + 1` tokens, which
/// [`train_batch`] and [`train_rows`] require.
pub fn check_train_len(train: &[u32], seq: usize) -> Result<(), DataError> {
    if train.len() < seq + 1 {
        return Err(DataError::TooShort {
            split: "train",
            have: train.len(),
            need: seq + 1,
            hint: "use a longer corpus, lower data.val_fraction, or lower train.seq_len",
        });
    }
    Ok(())
}

/// The counter of the `DATA` stream that places row `row` of micro-batch `micro` of `step`:
/// `(step << 32) | (micro << 16) | row`.
///
/// Distinct for every step below 2^32, micro below 2^16 and row below 2^16, far beyond any
/// real run; beyond those ranges counters still are deterministic but may repeat.
pub fn window_counter(step: u64, micro: u64, row: u64) -> u64 {
    (step << 32) | ((micro & 0xffff) << 16) | (row & 0xffff)
}

/// Micro-batch `micro` of optimizer step `step`: `micro_batch` windows of `seq` tokens whose
/// starts are uniform over `[0, len - seq - 1]`.
///
/// Panics if `tokens.len() < seq + 1`; validate the split first with [`check_train_len`]
/// (the [`Prefetcher`](super::Prefetcher) does).
pub fn train_batch(
    tokens: &[u32],
    seed: u64,
    step: u64,
    micro: u64,
    micro_batch: usize,
    seq: usize,
) -> Batch {
    train_rows(tokens, seed, step, micro, 0..micro_batch, seq)
}

/// Rows `rows` of the micro-batch that [`train_batch`] builds for `(step, micro)`.
///
/// Concatenating `train_rows` over any partition of `0..micro_batch` into consecutive ranges
/// gives exactly `train_batch`. Same precondition as [`train_batch`].
pub fn train_rows(
    tokens: &[u32],
    seed: u64,
    step: u64,
    micro: u64,
    rows: Range<usize>,
    seq: usize,
) -> Batch {
    assert!(
        tokens.len() > seq,
        "train split of {} tokens is shorter than a window of {}; call check_train_len first",
        tokens.len(),
        seq + 1
    );
    let n_starts = (tokens.len() - seq) as u64;
    let mut b = Batch::with_capacity(rows.len(), seq);
    for row in rows {
        let r = hash3(seed, stream::DATA, window_counter(step, micro, row as u64));
        b.push_window(tokens, (r % n_starts) as usize);
    }
    b
}

/// `n_batches` validation batches of `micro_batch` windows each, evenly spaced from the start
/// to the end of `tokens`, with no randomness, so every evaluation sees the same windows.
///
/// When more windows are asked for than fit side by side, they overlap.
pub fn val_batches(
    tokens: &[u32],
    n_batches: usize,
    micro_batch: usize,
    seq: usize,
) -> Result<Vec<Batch>, DataError> {
    if tokens.len() < seq + 1 {
        return Err(DataError::TooShort {
            split: "validation",
            have: tokens.len(),
            need: seq + 1,
            hint: "raise data.val_fraction or lower train.seq_len",
        });
    }
    let n_starts = (tokens.len() - seq) as u128;
    let total = (n_batches * micro_batch) as u128;
    let mut out = Vec::with_capacity(n_batches);
    for b in 0..n_batches {
        let mut batch = Batch::with_capacity(micro_batch, seq);
        for r in 0..micro_batch {
            let i = (b * micro_batch + r) as u128;
            // i < total, so the start is below n_starts: every window fits.
            batch.push_window(tokens, (i * n_starts / total) as usize);
        }
        out.push(batch);
    }
    Ok(out)
}

/// Cross-entropy in nats on `val` of the unigram distribution fitted to `train` with add-one
/// smoothing: `p(t) = (count(t) + 1) / (len(train) + vocab)`.
///
/// A model that has learnt anything beats this level; one that only learnt token frequencies
/// sits on it. Ids at or above `vocab` are not counted in `train` and get the smallest
/// probability in `val`. Returns NaN for an empty `val` or a zero `vocab`.
pub fn unigram_cross_entropy(train: &[u32], val: &[u32], vocab: usize) -> f64 {
    if val.is_empty() || vocab == 0 {
        return f64::NAN;
    }
    let mut train_counts = vec![0u64; vocab];
    let mut counted = 0u64;
    for &t in train {
        if let Some(c) = train_counts.get_mut(t as usize) {
            *c += 1;
            counted += 1;
        }
    }
    let mut val_counts = vec![0u64; vocab];
    let mut val_unknown = 0u64;
    for &t in val {
        match val_counts.get_mut(t as usize) {
            Some(c) => *c += 1,
            None => val_unknown += 1,
        }
    }
    let ln_total = ((counted + vocab as u64) as f64).ln();
    // Summing per vocabulary entry instead of per token: vocab logs instead of len(val).
    let mut nll = val_unknown as f64 * ln_total;
    for (&cv, &ct) in val_counts.iter().zip(&train_counts) {
        if cv > 0 {
            nll += cv as f64 * (ln_total - ((ct + 1) as f64).ln());
        }
    }
    nll / val.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn split_keeps_the_tail() {
        let s = split_tokens(ramp(1000), 0.1);
        assert_eq!(s.train.len() + s.val.len(), 1000);
        assert_eq!(s.val.len(), 100);
        assert_eq!(*s.train, ramp(900));
        assert_eq!(s.val[0], 900);
        assert_eq!(*s.val.last().unwrap(), 999);

        assert_eq!(split_tokens(ramp(10), 0.0).val.len(), 0);
        assert_eq!(split_tokens(ramp(10), 1.5).train.len(), 0);
        assert_eq!(split_tokens(ramp(10), f64::NAN).train.len(), 10);
        assert_eq!(split_tokens(Vec::new(), 0.5).val.len(), 0);
    }

    #[test]
    fn train_batch_is_deterministic_and_shifted() {
        let tokens: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let a = train_batch(&tokens, 42, 7, 1, 8, 16);
        let b = train_batch(&tokens, 42, 7, 1, 8, 16);
        assert_eq!(a, b);
        assert_eq!((a.batch, a.seq), (8, 16));
        assert_eq!(a.inputs.len(), 8 * 16);
        for row in 0..8 {
            let inp = &a.inputs[row * 16..(row + 1) * 16];
            let tgt = &a.targets[row * 16..(row + 1) * 16];
            assert_eq!(&inp[1..], &tgt[..15]);
            let start = tokens.iter().position(|&t| t == inp[0]).unwrap();
            assert_eq!(tgt[15], tokens[start + 16]);
        }
        // Other step, micro or seed: other windows.
        assert_ne!(a, train_batch(&tokens, 42, 8, 1, 8, 16));
        assert_ne!(a, train_batch(&tokens, 42, 7, 0, 8, 16));
        assert_ne!(a, train_batch(&tokens, 43, 7, 1, 8, 16));
    }

    #[test]
    fn windows_cover_both_ends() {
        // seq + 2 tokens: exactly two possible starts, 0 and 1; both must occur.
        let tokens = ramp(10);
        let b = train_batch(&tokens, 1, 0, 0, 64, 8);
        let starts: std::collections::BTreeSet<u32> =
            b.inputs.chunks(8).map(|row| row[0]).collect();
        assert_eq!(starts.into_iter().collect::<Vec<_>>(), vec![0, 1]);
        // The shortest legal split: one window.
        let one = train_batch(&tokens[..9], 1, 0, 0, 2, 8);
        assert_eq!(one.targets[..8], tokens[1..9]);
    }

    #[test]
    fn train_rows_partition_equals_train_batch() {
        let tokens = ramp(3000);
        let full = train_batch(&tokens, 9, 123, 3, 10, 32);
        for cuts in [vec![0, 10], vec![0, 5, 10], vec![0, 1, 4, 4, 9, 10]] {
            let mut inputs = Vec::new();
            let mut targets = Vec::new();
            let mut rows = 0;
            for w in cuts.windows(2) {
                let part = train_rows(&tokens, 9, 123, 3, w[0]..w[1], 32);
                assert_eq!(part.batch, w[1] - w[0]);
                rows += part.batch;
                inputs.extend(part.inputs);
                targets.extend(part.targets);
            }
            assert_eq!(rows, full.batch);
            assert_eq!(inputs, full.inputs);
            assert_eq!(targets, full.targets);
        }
    }

    #[test]
    fn check_train_len_reports_sizes() {
        assert!(check_train_len(&ramp(9), 8).is_ok());
        let err = check_train_len(&ramp(8), 8).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TooShort {
                    split: "train",
                    have: 8,
                    need: 9,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("train.seq_len"), "{err}");
    }

    #[test]
    fn val_batches_are_even_and_deterministic() {
        let tokens = ramp(1000);
        let a = val_batches(&tokens, 3, 4, 10).unwrap();
        assert_eq!(a, val_batches(&tokens, 3, 4, 10).unwrap());
        assert_eq!(a.len(), 3);
        let starts: Vec<u32> = a
            .iter()
            .flat_map(|b| b.inputs.chunks(10).map(|r| r[0]))
            .collect();
        // 12 windows over 990 possible starts: every 82.5 tokens, from the very beginning.
        assert_eq!(starts[0], 0);
        assert_eq!(starts[1], 82);
        assert!(
            starts
                .windows(2)
                .all(|w| w[1] - w[0] >= 82 && w[1] - w[0] <= 83)
        );
        assert!(*starts.last().unwrap() as usize + 10 < 1000);
        for b in &a {
            assert_eq!((b.batch, b.seq), (4, 10));
            assert_eq!(
                b.inputs.iter().map(|t| t + 1).collect::<Vec<_>>(),
                b.targets
            );
        }
        // Exactly one window fits: every row is that window.
        let one = val_batches(&tokens[..11], 1, 3, 10).unwrap();
        assert_eq!(one[0].inputs, [ramp(10), ramp(10), ramp(10)].concat());
        assert!(val_batches(&tokens, 0, 4, 10).unwrap().is_empty());
    }

    #[test]
    fn val_batches_error_when_too_short() {
        let err = val_batches(&ramp(10), 2, 2, 10).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::TooShort {
                    split: "validation",
                    have: 10,
                    need: 11,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("data.val_fraction") && msg.contains("train.seq_len"),
            "{msg}"
        );
    }

    #[test]
    fn unigram_matches_hand_entropy() {
        // Smoothed counts 3 and 2 of 5: p = (0.6, 0.4). A validation set with exactly those
        // frequencies scores the entropy of p.
        let ce = unigram_cross_entropy(&[0, 0, 1], &[0, 1, 0, 1, 0], 2);
        let h = -(0.6f64 * 0.6f64.ln() + 0.4 * 0.4f64.ln());
        assert!((ce - h).abs() < 1e-12, "{ce} vs {h}");
        // Out-of-range validation ids get the smoothing floor 1 / (3 + 2).
        let ce = unigram_cross_entropy(&[0, 0, 1], &[7], 2);
        assert!((ce - 5f64.ln()).abs() < 1e-12);
        assert!(unigram_cross_entropy(&[0], &[], 2).is_nan());
    }

    #[test]
    fn unigram_beats_uniform_on_real_text() {
        let corpus = super::super::Corpus::load(None).unwrap();
        let ids: Vec<u32> = corpus.text.bytes().map(u32::from).collect();
        let s = split_tokens(ids, 0.05);
        let ce = unigram_cross_entropy(&s.train, &s.val, 256);
        assert!(ce < 256f64.ln(), "{ce}");
        // English letters carry a bit over 4 bits each: about 3 nats.
        assert!(ce > 2.5 && ce < 3.5, "{ce}");
    }
}

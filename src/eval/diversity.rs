//! Diversity metrics of several samples per prompt, each computed per prompt over its
//! samples and then averaged over prompts (the diversity a polychromic objective trains is
//! among the replies to one prompt, not across prompts):
//!
//! - distinct-n (n = 1, 2, 3): distinct n-grams over all n-grams of the prompt's samples.
//! - Self-BLEU: each sample's BLEU-4 against the prompt's other samples as references,
//!   averaged over the samples (lower is more diverse). Uniform weights over 1- to 4-grams,
//!   modified precision (each n-gram's count clipped by its largest count in one
//!   reference), brevity penalty against the reference length closest to the sample's
//!   (the shorter on a tie). Smoothing is Chen and Cherry's method 1, as in NLTK's
//!   `SmoothingFunction().method1` and Texygen: an order with no matching n-gram counts
//!   0.1 matches instead of 0, so one missing 4-gram does not zero the score; a sample with
//!   no matching unigram at all scores 0.
//! - Semantic diversity D: the mean pairwise cosine distance of the samples' sentence
//!   embeddings ([`crate::engine::ops::pairwise_diversity`]).
//! - pass@k from a checker's verdict per sample, with the unbiased estimator of Chen et al.
//!   (2021), `1 - C(m - c, k) / C(m, k)` for `c` passing of `m` samples, and the diversity
//!   efficiency ratio `DER(k) = pass@k / (k pass@1)`: 1 when k samples give k times the
//!   first one's chance (their successes never overlap), lower as samples repeat one
//!   another's successes and failures.
//!
//! Words for the n-gram metrics: the text lower-cased, runs of letters, digits and
//! apostrophes as words, and every other non-space character a word of its own.

use crate::embed::TextEncoder;
use crate::engine::{DType, Tensor, ops};
use crate::error::{KilnError, Result};
use std::collections::HashMap;

/// Samples fewer than this per prompt have no pairs to compare.
pub const MIN_SAMPLES: usize = 2;

/// The words of `text` the n-gram metrics count.
pub fn words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars().flat_map(char::to_lowercase) {
        if c.is_alphanumeric() || c == '\'' {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

fn ngram_counts(words: &[String], n: usize) -> HashMap<&[String], usize> {
    let mut counts = HashMap::new();
    if n > 0 {
        for g in words.windows(n) {
            *counts.entry(g).or_insert(0) += 1;
        }
    }
    counts
}

/// Distinct n-grams over all n-grams of `samples` (0 when they hold no n-gram).
pub fn distinct_n(samples: &[Vec<String>], n: usize) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    for s in samples {
        for g in s.windows(n.max(1)) {
            seen.insert(g);
            total += 1;
        }
    }
    if total == 0 {
        0.0
    } else {
        seen.len() as f64 / total as f64
    }
}

/// What method 1 counts for an n-gram order with no match.
const SMOOTHING_EPSILON: f64 = 0.1;

/// BLEU-4 of `hyp` against `refs` (uniform weights, smoothing method 1).
pub fn bleu4(hyp: &[String], refs: &[&[String]]) -> f64 {
    if hyp.is_empty() || refs.is_empty() {
        return 0.0;
    }
    let mut log_sum = 0.0;
    for n in 1..=4 {
        let counts = ngram_counts(hyp, n);
        let ref_counts: Vec<_> = refs.iter().map(|r| ngram_counts(r, n)).collect();
        let matched: usize = counts
            .iter()
            .map(|(g, &c)| {
                let most = ref_counts
                    .iter()
                    .map(|rc| rc.get(g).copied().unwrap_or(0))
                    .max()
                    .unwrap_or(0);
                c.min(most)
            })
            .sum();
        let total = hyp.len().saturating_sub(n - 1).max(1);
        if matched == 0 && n == 1 {
            return 0.0;
        }
        let p = if matched == 0 {
            SMOOTHING_EPSILON / total as f64
        } else {
            matched as f64 / total as f64
        };
        log_sum += 0.25 * p.ln();
    }
    let c = hyp.len();
    let r = refs
        .iter()
        .map(|r| r.len())
        .min_by_key(|&len| (len.abs_diff(c), len))
        .unwrap_or(0);
    let brevity = if c > r {
        1.0
    } else {
        (1.0 - r as f64 / c as f64).exp()
    };
    brevity * log_sum.exp()
}

/// Mean BLEU-4 of each sample against the others.
pub fn self_bleu(samples: &[Vec<String>]) -> f64 {
    if samples.len() < MIN_SAMPLES {
        return 0.0;
    }
    let total: f64 = (0..samples.len())
        .map(|i| {
            let refs: Vec<&[String]> = samples
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, s)| s.as_slice())
                .collect();
            bleu4(&samples[i], &refs)
        })
        .sum();
    total / samples.len() as f64
}

/// The unbiased pass@k of `passed` passing samples out of `samples`: the chance that at
/// least one of k drawn without replacement passes. `k` at most `samples`.
pub fn pass_at_k(samples: usize, passed: usize, k: usize) -> f64 {
    if samples - passed < k {
        return 1.0;
    }
    // 1 - C(m - c, k) / C(m, k) as a product, which stays finite for large m.
    1.0 - (samples - passed + 1..=samples)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// `pass@k / (k pass@1)`, or `None` when pass@1 is 0 (nothing passed: no ratio).
pub fn der(pass_k: f64, pass_1: f64, k: usize) -> Option<f64> {
    (pass_1 > 0.0).then(|| pass_k / (k as f64 * pass_1))
}

/// The samples of one prompt.
#[derive(Debug, Clone)]
pub struct PromptSamples {
    pub prompt: String,
    pub samples: Vec<String>,
}

/// The n-gram metrics, each averaged over prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LexicalDiversity {
    pub distinct_1: f64,
    pub distinct_2: f64,
    pub distinct_3: f64,
    pub self_bleu: f64,
}

/// Why a set of prompts cannot be measured, if it cannot: fewer than two samples anywhere.
pub fn check_samples(prompts: &[PromptSamples]) -> std::result::Result<(), String> {
    if prompts.is_empty() {
        return Err("there are no prompts to measure".into());
    }
    match prompts.iter().position(|p| p.samples.len() < MIN_SAMPLES) {
        Some(i) => Err(format!(
            "prompt {} has {} sample(s); diversity compares samples of one prompt, so each needs at least {MIN_SAMPLES} (kiln generate --num-samples 2 or more)",
            i + 1,
            prompts[i].samples.len()
        )),
        None => Ok(()),
    }
}

/// distinct-1/2/3 and Self-BLEU, per prompt then averaged.
pub fn lexical(prompts: &[PromptSamples]) -> LexicalDiversity {
    let mut sums = [0.0f64; 4];
    for p in prompts {
        let w: Vec<Vec<String>> = p.samples.iter().map(|s| words(s)).collect();
        sums[0] += distinct_n(&w, 1);
        sums[1] += distinct_n(&w, 2);
        sums[2] += distinct_n(&w, 3);
        sums[3] += self_bleu(&w);
    }
    let n = prompts.len().max(1) as f64;
    LexicalDiversity {
        distinct_1: sums[0] / n,
        distinct_2: sums[1] / n,
        distinct_3: sums[2] / n,
        self_bleu: sums[3] / n,
    }
}

/// D of each prompt's samples embedded by `encoder` (on its device).
pub fn semantic(
    encoder: &TextEncoder,
    prompts: &[PromptSamples],
    batch: usize,
) -> Result<Vec<f32>> {
    check_samples(prompts).map_err(KilnError::Setting)?;
    let texts: Vec<&str> = prompts
        .iter()
        .flat_map(|p| p.samples.iter().map(String::as_str))
        .collect();
    let encoded = texts
        .iter()
        .map(|t| encoder.encode(t, None))
        .collect::<Result<Vec<_>>>()?;
    let rows = encoder.embed(&encoded, batch)?;
    let d = encoder.dim();
    let mut out = Vec::with_capacity(prompts.len());
    let mut at = 0;
    // Prompts with the same number of samples could share one call; one per prompt keeps
    // the order plain and costs nothing next to the encoder.
    for p in prompts {
        let n = p.samples.len();
        let flat: Vec<f32> = rows[at..at + n].iter().flatten().copied().collect();
        at += n;
        let e = Tensor::from_vec(encoder.pool(), &[n, d], DType::F32, flat)?;
        out.push(ops::pairwise_diversity(&e, n)?.0[0]);
    }
    Ok(out)
}

/// pass@k and DER(k) at one k, averaged over prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PassAtK {
    pub k: usize,
    pub pass_at_k: f64,
    /// `None` when no sample passed.
    pub der: Option<f64>,
}

/// pass@k for each of `ks` from the verdicts (`passed[prompt][sample]`), averaged over
/// prompts, with DER(k) from the averaged pass@1. Every k must be at most the fewest
/// samples of a prompt.
pub fn pass_rates(passed: &[Vec<bool>], ks: &[usize]) -> std::result::Result<Vec<PassAtK>, String> {
    let fewest = passed.iter().map(Vec::len).min().unwrap_or(0);
    if let Some(&k) = ks.iter().find(|&&k| k == 0 || k > fewest) {
        return Err(format!(
            "pass@{k} needs 1 <= k <= the samples of every prompt (the fewest is {fewest}); lower --k"
        ));
    }
    let mean = |k: usize| {
        passed
            .iter()
            .map(|v| pass_at_k(v.len(), v.iter().filter(|&&p| p).count(), k))
            .sum::<f64>()
            / passed.len().max(1) as f64
    };
    let pass_1 = mean(1);
    Ok(ks
        .iter()
        .map(|&k| {
            let p = mean(k);
            PassAtK {
                k,
                pass_at_k: p,
                der: der(p, pass_1, k),
            }
        })
        .collect())
}

/// Runs `command` through `sh -c` once per sample, the sample's text on its standard input
/// and the prompt in the environment variable `KILN_PROMPT` (with `KILN_PROMPT_INDEX` and
/// `KILN_SAMPLE_INDEX`, counting from 0): exit status 0 passes, anything else fails.
pub fn check_with(command: &str, prompts: &[PromptSamples]) -> Result<Vec<Vec<bool>>> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut out = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let mut verdicts = Vec::with_capacity(p.samples.len());
        for (j, sample) in p.samples.iter().enumerate() {
            let mut child = Command::new("sh")
                .arg("-c")
                .arg(command)
                .env("KILN_PROMPT", &p.prompt)
                .env("KILN_PROMPT_INDEX", i.to_string())
                .env("KILN_SAMPLE_INDEX", j.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| {
                    KilnError::Setting(format!(
                        "--checker {command:?} could not start through sh ({e}); give a command sh can run"
                    ))
                })?;
            // A checker that exits without reading its input closes the pipe: not an error.
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(sample.as_bytes());
            }
            let status = child.wait().map_err(|e| {
                KilnError::Setting(format!(
                    "--checker {command:?} could not be waited for: {e}"
                ))
            })?;
            verdicts.push(status.success());
        }
        out.push(verdicts);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Vec<String> {
        words(text)
    }

    #[test]
    fn words_split_punctuation_and_lower_case() {
        assert_eq!(
            w("Nay, answer me: don't!"),
            vec!["nay", ",", "answer", "me", ":", "don't", "!"]
        );
        assert!(w("  ").is_empty());
    }

    #[test]
    fn distinct_n_counts_repeated_ngrams_across_samples() {
        // Unigrams: a b a | a c -> 5 in all, 3 distinct. Bigrams: ab ba | ac -> 3 of 3.
        let s = vec![w("a b a"), w("a c")];
        assert!((distinct_n(&s, 1) - 3.0 / 5.0).abs() < 1e-12);
        assert!((distinct_n(&s, 2) - 1.0).abs() < 1e-12);
        // Trigrams: aba only.
        assert!((distinct_n(&s, 3) - 1.0).abs() < 1e-12);
        let same = vec![w("x y z"), w("x y z")];
        assert!((distinct_n(&same, 2) - 0.5).abs() < 1e-12);
        assert_eq!(distinct_n(&[w("x")], 2), 0.0);
    }

    #[test]
    fn bleu_of_an_exact_copy_is_one_and_of_a_stranger_zero() {
        let a = w("the cat sat on the mat");
        assert!((bleu4(&a, &[&a]) - 1.0).abs() < 1e-12);
        assert_eq!(bleu4(&a, &[&w("dogs bark loudly")]), 0.0);
    }

    #[test]
    fn bleu_matches_a_hand_computed_smoothed_case() {
        // hyp "the cat sat on the mat" (6 words) against "the cat is on the mat" (6):
        // 1-grams: the x2 (ref has 2), cat, on, mat match, sat does not: 5/6.
        // 2-grams: the cat, on the, the mat match of 5: 3/5.
        // 3-grams: "on the mat" of 4: 1/4. 4-grams: none of 3: smoothed 0.1/3.
        // Equal lengths: no brevity penalty.
        let hyp = w("the cat sat on the mat");
        let r = w("the cat is on the mat");
        let want =
            ((5.0f64 / 6.0).ln() + (0.6f64).ln() + (0.25f64).ln() + (0.1f64 / 3.0).ln()) / 4.0;
        assert!((bleu4(&hyp, &[&r]) - want.exp()).abs() < 1e-12);
        // A shorter hypothesis pays the brevity penalty against the closest reference:
        // "the cat" against "the cat is" (3) and "the cat is on the mat" (6): r = 3.
        let short = w("the cat");
        let want = ((1.0f64).ln() + (1.0f64).ln() + (0.1f64).ln() + (0.1f64).ln()) / 4.0;
        let got = bleu4(&short, &[&w("the cat is"), &r]);
        assert!(
            (got - want.exp() * (1.0f64 - 1.5).exp()).abs() < 1e-12,
            "{got}"
        );
    }

    #[test]
    fn self_bleu_is_one_for_copies_and_falls_with_variety() {
        let copies = vec![w("to be or not to be"); 3];
        assert!((self_bleu(&copies) - 1.0).abs() < 1e-12);
        let varied = vec![
            w("to be or not to be"),
            w("all the world's a stage"),
            w("now is the winter of our discontent"),
        ];
        assert!(self_bleu(&varied) < 0.1, "{}", self_bleu(&varied));
    }

    #[test]
    fn pass_at_k_is_the_unbiased_estimator() {
        // 5 samples, 2 pass: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
        assert!((pass_at_k(5, 2, 1) - 0.4).abs() < 1e-12);
        assert!((pass_at_k(5, 2, 2) - 0.7).abs() < 1e-12);
        // Any 4 of 5 include a passing one when 2 pass.
        assert_eq!(pass_at_k(5, 2, 4), 1.0);
        assert_eq!(pass_at_k(5, 0, 3), 0.0);
        // pass@2 / (2 pass@1) = 0.7 / 0.8.
        assert!((der(0.7, 0.4, 2).unwrap() - 0.875).abs() < 1e-12);
        assert_eq!(der(0.0, 0.0, 2), None);
    }

    #[test]
    fn pass_rates_average_prompts_and_refuse_k_beyond_the_samples() {
        let verdicts = vec![
            vec![true, false, false, false],
            vec![true, true, false, false],
        ];
        let r = pass_rates(&verdicts, &[1, 2]).unwrap();
        // pass@1: (1/4 + 2/4) / 2. pass@2: (1 - C(3,2)/C(4,2) + 1 - C(2,2)/C(4,2)) / 2.
        assert!((r[0].pass_at_k - 0.375).abs() < 1e-12);
        let p2 = (0.5 + 5.0 / 6.0) / 2.0;
        assert!((r[1].pass_at_k - p2).abs() < 1e-12);
        assert!((r[1].der.unwrap() - p2 / 0.75).abs() < 1e-12);
        assert!((r[0].der.unwrap() - 1.0).abs() < 1e-12);
        assert!(
            pass_rates(&verdicts, &[5])
                .unwrap_err()
                .contains("fewest is 4")
        );
    }

    #[test]
    fn lexical_metrics_average_over_prompts_and_one_sample_is_refused() {
        let prompts = vec![
            PromptSamples {
                prompt: "p".into(),
                samples: vec!["a b".into(), "a b".into()],
            },
            PromptSamples {
                prompt: "q".into(),
                samples: vec!["c d".into(), "e f".into()],
            },
        ];
        let m = lexical(&prompts);
        assert!((m.distinct_1 - (0.5 + 1.0) / 2.0).abs() < 1e-12);
        // "a b" against "a b": 1-grams 2/2, 2-grams 1/1, 3- and 4-grams none of (at least)
        // one, smoothed to 0.1 each: sqrt(0.1). "c d" against "e f" matches no unigram: 0.
        assert!(
            (m.self_bleu - 0.1f64.sqrt() / 2.0).abs() < 1e-12,
            "{}",
            m.self_bleu
        );
        let one = vec![PromptSamples {
            prompt: "p".into(),
            samples: vec!["a".into()],
        }];
        assert!(check_samples(&one).unwrap_err().contains("at least 2"));
    }

    #[test]
    fn the_checker_sees_the_sample_and_the_prompt() {
        let prompts = vec![PromptSamples {
            prompt: "say yes".into(),
            samples: vec!["yes".into(), "no".into(), "yes indeed".into()],
        }];
        let v = check_with("grep -q yes && test \"$KILN_PROMPT\" = 'say yes'", &prompts).unwrap();
        assert_eq!(v, vec![vec![true, false, true]]);
    }
}

//! Turning logits into a token: repetition penalty, temperature, top-k, top-p (nucleus) and
//! min-p, applied in that order as Hugging Face's `generate` applies them; temperature 0 is
//! greedy. The rules themselves live with the samplers in `engine` (the host reference
//! [`crate::engine::cpu::sampling`] and its GPU kernel); this module holds the settings.

use crate::engine::cpu::sampling::{self as cpu, SampleParams};
use crate::engine::rng::Rng;

/// How to draw each token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = none).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already in the sequence by this
    /// (1 = off).
    pub repetition_penalty: f32,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };

    /// Why these settings cannot sample, naming the flag to fix.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "--temperature {} is not a temperature; use 0 (greedy) or a positive number such as 0.8",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "--top-p {} must be in (0, 1], e.g. 0.9",
                self.top_p
            ));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(format!(
                "--min-p {} must be in [0, 1), e.g. 0.05",
                self.min_p
            ));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "--repetition-penalty {} must be positive (1 = off, e.g. 1.1)",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

impl Sampling {
    /// The settings as the samplers (host and GPU) take them.
    pub fn params(&self) -> SampleParams {
        SampleParams {
            temperature: self.temperature,
            top_k: self.top_k.min(u32::MAX as usize) as u32,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

/// Draws a token from `logits` given the tokens so far (for the penalty), consuming one
/// number of `rng`'s stream; the same rules and random numbers as the GPU sampler
/// ([`crate::engine::cpu::sampling`]).
pub fn sample(logits: &[f32], history: &[u32], s: &Sampling, rng: &mut Rng) -> u32 {
    let mut mask = Vec::new();
    if s.repetition_penalty != 1.0 {
        mask = vec![0u32; cpu::mask_words(logits.len())];
        for &t in history {
            cpu::mark(&mut mask, t);
        }
    }
    cpu::sample_row(logits, &mask, &s.params(), rng.next_u64()).0
}

pub use cpu::log_prob;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::stream;

    fn frequencies(logits: &[f32], s: &Sampling, n: usize) -> Vec<f64> {
        let mut rng = Rng::new(11, stream::SAMPLE);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            let l = logits.to_vec();
            counts[sample(&l, &[], s, &mut rng) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    /// The drawn frequencies match the intended distribution within 4 standard errors: the
    /// tempered softmax, cut by top-p to the smallest head reaching p, renormalised.
    #[test]
    fn sampling_matches_the_intended_distribution() {
        let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0];
        let n = 40_000;
        let t = 0.7f32;
        let p: Vec<f64> = {
            let e: Vec<f64> = logits.iter().map(|&l| ((l / t) as f64).exp()).collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|v| v / z).collect()
        };
        let check = |got: &[f64], want: &[f64]| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let se = (w * (1.0 - w) / n as f64).sqrt().max(1e-9);
                assert!((g - w).abs() <= 4.0 * se + 1e-12, "token {i}: {g} vs {w}");
            }
        };
        let plain = Sampling {
            temperature: t,
            top_k: 0,
            ..Sampling::default()
        };
        check(&frequencies(&logits, &plain, n), &p);
        // top-p 0.85: p = [0.70, 0.17, 0.08, ...]: the head reaching 0.85 is the first two.
        let nucleus = Sampling {
            top_p: 0.85,
            ..plain
        };
        let head: f64 = p[..2].iter().sum();
        let want: Vec<f64> = (0..5)
            .map(|i| if i < 2 { p[i] / head } else { 0.0 })
            .collect();
        assert!(p[0] < 0.85 && head >= 0.85);
        check(&frequencies(&logits, &nucleus, n), &want);
        // min-p 0.2 keeps tokens with p >= 0.2 * p[0].
        let min_p = Sampling {
            min_p: 0.2,
            ..plain
        };
        let kept: Vec<bool> = p.iter().map(|&v| v >= 0.2 * p[0]).collect();
        let z: f64 = p
            .iter()
            .zip(&kept)
            .filter(|(_, k)| **k)
            .map(|(v, _)| v)
            .sum();
        let want: Vec<f64> = p
            .iter()
            .zip(&kept)
            .map(|(v, k)| if *k { v / z } else { 0.0 })
            .collect();
        check(&frequencies(&logits, &min_p, n), &want);
    }

    #[test]
    fn greedy_top_k_penalty_and_checks() {
        let mut rng = Rng::new(1, stream::SAMPLE);
        let logits = [0.1f32, 3.0, 2.9, -1.0];
        assert_eq!(sample(&logits, &[], &Sampling::GREEDY, &mut rng), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: 2,
            ..Sampling::default()
        };
        for _ in 0..200 {
            let t = sample(&logits, &[], &top2, &mut rng);
            assert!(t == 1 || t == 2, "top-2 drew {t}");
        }
        // A penalty of 2 on token 1 (3.0 -> 1.5) makes token 2 the greedy choice.
        let pen = Sampling {
            repetition_penalty: 2.0,
            ..Sampling::GREEDY
        };
        assert_eq!(sample(&logits, &[1, 1], &pen, &mut rng), 2);
        for bad in [
            Sampling {
                temperature: f32::NAN,
                ..Sampling::default()
            },
            Sampling {
                temperature: -1.0,
                ..Sampling::default()
            },
            Sampling {
                top_p: 0.0,
                ..Sampling::default()
            },
            Sampling {
                top_p: 1.5,
                ..Sampling::default()
            },
            Sampling {
                repetition_penalty: 0.0,
                ..Sampling::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
        assert!((log_prob(&[0.0, 0.0], 1) - 0.5f32.ln()).abs() < 1e-6);
    }
}

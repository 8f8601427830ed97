//! The diversity signal of polychromic fine-tuning: per-reply advantages from the embeddings
//! of n replies sampled for one prompt, and the surrogate loss whose gradient is a
//! score-function (REINFORCE) estimate of the gradient of the expected diversity.
//!
//! D of a set is the mean over pairs of the cosine distance `1 - cos`. D is a function of
//! sampled text, so it has no gradient of its own; what does is its expectation under the
//! policy, `J = E[D(y_1..y_n)]` with the replies drawn independently from `pi(. | prompt)`:
//!
//! `grad J = E[D sum_i grad log pi(y_i)]`.
//!
//! Write `c_i` for reply i's leave-one-out contribution, its mean distance to the other
//! replies, so that `D = mean_i c_i`. A pair term of D moves only with the scores of its
//! own two replies (the others are independent of it and their scores have mean 0), so
//! `grad J = (2 / n) sum_i E[c_i grad log pi(y_i)]`. Any baseline that does not depend on
//! `y_i` may be subtracted from `c_i`; the diversity of the other replies, `D_-i`, is one,
//! and a line of algebra gives `c_i - D_-i = n / (n - 2) (c_i - D)`. So with the set mean
//! `D` as the baseline,
//!
//! `adv_i = 2n / (n - 2) (c_i - D)`,  `L = -lambda / n sum_i adv_i log pi(y_i)`
//!
//! and `E[-grad L] = lambda grad J` exactly: the estimator is unbiased, and replies that
//! are only as far from the others as average get no push at all. With two replies there
//! is no leave-one-out set (`c_1 = c_2 = D`), so the baseline is 0 and `adv_i = 2D`:
//! unbiased, without the variance reduction. Fewer than two replies have no D: an error.
//!
//! The module is pure: embeddings and log-probabilities in, advantages and loss out. The
//! contributions come from the sum of the normalised embeddings as D does
//! ([`crate::engine::cpu::diversity`]): `c_i = 1 - (u_i . s - |u_i|^2) / (n - 1)`.

use crate::engine::cpu::diversity::{SetShape, diversity_forward};

/// One prompt's replies: D, each reply's contribution `c_i` and its advantage `adv_i`.
#[derive(Debug, Clone, PartialEq)]
pub struct SetAdvantages {
    pub diversity: f64,
    pub contributions: Vec<f64>,
    pub advantages: Vec<f64>,
}

/// Advantages of `n` replies from their embeddings `[n, d]`.
pub fn advantages(embeddings: &[f32], n: usize, d: usize) -> Result<SetAdvantages, String> {
    let shape = SetShape { sets: 1, n, d };
    shape.check()?;
    if embeddings.len() != n * d {
        return Err(format!(
            "{} embedding values for {n} replies of width {d}; the encoder's width and the reply count must match",
            embeddings.len()
        ));
    }
    let (mut value, mut s, mut rnorm) = (vec![0.0f32; 1], vec![0.0f32; d], vec![0.0f32; n]);
    diversity_forward(&mut value, &mut s, &mut rnorm, embeddings, shape)?;
    let contributions: Vec<f64> = embeddings
        .chunks(d)
        .zip(&rnorm)
        .map(|(row, &inv)| {
            let (mut us, mut uu) = (0.0f64, 0.0f64);
            for (&x, &sk) in row.iter().zip(&s) {
                let u = x as f64 * inv as f64;
                us += u * sk as f64;
                uu += u * u;
            }
            1.0 - (us - uu) / (n as f64 - 1.0)
        })
        .collect();
    // D as the mean of the contributions (equal to `value[0]` up to f32 rounding), so the
    // advantages sum to exactly zero.
    let diversity = contributions.iter().sum::<f64>() / n as f64;
    let advantages = if n == 2 {
        vec![2.0 * diversity; 2]
    } else {
        let scale = 2.0 * n as f64 / (n as f64 - 2.0);
        contributions
            .iter()
            .map(|c| scale * (c - diversity))
            .collect()
    };
    Ok(SetAdvantages {
        diversity,
        contributions,
        advantages,
    })
}

/// `-lambda / n * sum_i adv_i logp_i`, with `logp_i` the log-probability of reply i.
pub fn surrogate_loss(lambda: f64, advantages: &[f64], logp: &[f64]) -> f64 {
    let n = advantages.len().max(1) as f64;
    -lambda / n * advantages.iter().zip(logp).map(|(a, l)| a * l).sum::<f64>()
}

/// The surrogate's derivative with respect to each reply's log-probability,
/// `-lambda adv_i / n`: the weight each reply's token log-probabilities get in the backward.
pub fn surrogate_logp_weights(lambda: f64, advantages: &[f64]) -> Vec<f64> {
    let n = advantages.len().max(1) as f64;
    advantages.iter().map(|a| -lambda * a / n).collect()
}

/// Refuses a negative lambda unless it is asked for: it rewards replies that resemble each
/// other, which is rarely what is meant.
pub fn check_lambda(lambda: f64, allow_negative: bool) -> Result<(), String> {
    if !lambda.is_finite() {
        return Err(format!("lambda {lambda} must be a finite number"));
    }
    if lambda < 0.0 && !allow_negative {
        return Err(format!(
            "lambda {lambda} is negative, which rewards replies for resembling each other; use 0 or more, or allow it explicitly if sameness is the aim"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::random;

    #[test]
    fn contributions_average_to_d_and_advantages_sum_to_zero() {
        let (n, d) = (5, 8);
        let e = random(n * d, 11, 1.0);
        let a = advantages(&e, n, d).unwrap();
        let (mut v, mut s, mut r) = (vec![0.0; 1], vec![0.0; d], vec![0.0; n]);
        diversity_forward(&mut v, &mut s, &mut r, &e, SetShape { sets: 1, n, d }).unwrap();
        assert!((a.diversity - v[0] as f64).abs() < 1e-6);
        assert!(a.advantages.iter().sum::<f64>().abs() < 1e-12);
        // c_i is reply i's mean distance to the others, from its definition.
        let cos = |i: usize, j: usize| {
            let (x, y) = (&e[i * d..(i + 1) * d], &e[j * d..(j + 1) * d]);
            let dot: f64 = x.iter().zip(y).map(|(a, b)| *a as f64 * *b as f64).sum();
            let nx: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            let ny: f64 = y.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            dot / (nx * ny)
        };
        for i in 0..n {
            let want = (0..n)
                .filter(|&j| j != i)
                .map(|j| 1.0 - cos(i, j))
                .sum::<f64>()
                / (n - 1) as f64;
            assert!((a.contributions[i] - want).abs() < 1e-6, "c_{i}");
        }
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(
            advantages(&[1.0, 2.0], 1, 2)
                .unwrap_err()
                .contains("at least 2")
        );
        assert!(advantages(&[1.0; 6], 2, 4).unwrap_err().contains("width"));
        assert!(check_lambda(-0.1, false).is_err());
        assert!(check_lambda(-0.1, true).is_ok());
        assert!(check_lambda(f64::NAN, true).is_err());
        assert!(check_lambda(0.0, false).is_ok());
    }

    #[test]
    fn lambda_zero_gives_no_gradient() {
        let a = advantages(&random(12, 3, 1.0), 3, 4).unwrap();
        assert!(
            surrogate_logp_weights(0.0, &a.advantages)
                .iter()
                .all(|&w| w == 0.0)
        );
        assert_eq!(surrogate_loss(0.0, &a.advantages, &[-1.0, -2.0, -3.0]), 0.0);
    }

    /// A tabular policy over replies of two tokens from a vocabulary of three: logits
    /// `first[a]` for the first token and `second[a][b]` for the second after `a`, 12
    /// parameters. Each of the 9 replies has a fixed embedding.
    struct Toy {
        theta: Vec<f64>,
        embeddings: Vec<f32>,
    }

    const V: usize = 3;
    const REPLIES: usize = V * V;
    const PARAMS: usize = V + V * V;
    const WIDTH: usize = 4;

    fn softmax(logits: &[f64]) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect()
    }

    impl Toy {
        fn new(seed: u64) -> Toy {
            Toy {
                theta: random(PARAMS, seed, 1.5)
                    .into_iter()
                    .map(f64::from)
                    .collect(),
                embeddings: random(REPLIES * WIDTH, seed + 1, 1.0),
            }
        }

        /// Probability of each reply `a * V + b`.
        fn probs(theta: &[f64]) -> Vec<f64> {
            let first = softmax(&theta[..V]);
            (0..REPLIES)
                .map(|y| {
                    let (a, b) = (y / V, y % V);
                    first[a] * softmax(&theta[V + a * V..V + (a + 1) * V])[b]
                })
                .collect()
        }

        /// d log pi(y) / d theta.
        fn score(&self, y: usize) -> Vec<f64> {
            let (a, b) = (y / V, y % V);
            let mut g = vec![0.0; PARAMS];
            let first = softmax(&self.theta[..V]);
            let second = softmax(&self.theta[V + a * V..V + (a + 1) * V]);
            for k in 0..V {
                g[k] = f64::from(u8::from(k == a)) - first[k];
                g[V + a * V + k] = f64::from(u8::from(k == b)) - second[k];
            }
            g
        }

        fn set_embeddings(&self, set: &[usize]) -> Vec<f32> {
            set.iter()
                .flat_map(|&y| self.embeddings[y * WIDTH..(y + 1) * WIDTH].iter().copied())
                .collect()
        }

        /// Every ordered set of `n` replies with its probability.
        fn sets(theta: &[f64], n: usize) -> Vec<(Vec<usize>, f64)> {
            let p = Toy::probs(theta);
            (0..REPLIES.pow(n as u32))
                .map(|mut code| {
                    let set: Vec<usize> = (0..n)
                        .map(|_| {
                            let y = code % REPLIES;
                            code /= REPLIES;
                            y
                        })
                        .collect();
                    let prob = set.iter().map(|&y| p[y]).product();
                    (set, prob)
                })
                .collect()
        }

        fn expected_d(&self, theta: &[f64], n: usize) -> f64 {
            Toy::sets(theta, n)
                .iter()
                .map(|(set, p)| {
                    p * advantages(&self.set_embeddings(set), n, WIDTH)
                        .unwrap()
                        .diversity
                })
                .sum()
        }

        /// The exact gradient of E[D]: central differences of the enumerated expectation.
        fn exact_gradient(&self, n: usize) -> Vec<f64> {
            let h = 1e-5;
            (0..PARAMS)
                .map(|k| {
                    let (mut p, mut m) = (self.theta.clone(), self.theta.clone());
                    p[k] += h;
                    m[k] -= h;
                    (self.expected_d(&p, n) - self.expected_d(&m, n)) / (2.0 * h)
                })
                .collect()
        }

        /// The expectation of `-grad L / lambda` and its total variance (the trace of its
        /// covariance), enumerated; `advantage` maps a set's result to per-reply weights.
        fn estimator_moments(
            &self,
            n: usize,
            lambda: f64,
            advantage: impl Fn(&SetAdvantages) -> Vec<f64>,
        ) -> (Vec<f64>, f64) {
            let (mut mean, mut second) = (vec![0.0; PARAMS], 0.0);
            for (set, p) in Toy::sets(&self.theta, n) {
                let a = advantages(&self.set_embeddings(&set), n, WIDTH).unwrap();
                let weights = surrogate_logp_weights(lambda, &advantage(&a));
                // grad L = sum_i (dL/dlogp_i) grad log pi(y_i).
                let mut g = vec![0.0; PARAMS];
                for (&y, w) in set.iter().zip(&weights) {
                    for (gk, sk) in g.iter_mut().zip(self.score(y)) {
                        *gk -= w * sk / lambda;
                    }
                }
                for (m, gk) in mean.iter_mut().zip(&g) {
                    *m += p * gk;
                }
                second += p * g.iter().map(|x| x * x).sum::<f64>();
            }
            let variance = second - mean.iter().map(|x| x * x).sum::<f64>();
            (mean, variance)
        }
    }

    fn assert_matches(got: &[f64], want: &[f64], what: &str) {
        let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        assert!(scale > 1e-3, "{what}: the gradient is not trivially zero");
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() < 1e-7 * scale.max(1.0),
                "{what}[{k}]: {g} vs {w}"
            );
        }
    }

    #[test]
    fn the_estimator_is_unbiased_on_an_enumerated_toy_policy() {
        for (n, seed) in [(2, 21), (3, 22), (4, 23)] {
            let toy = Toy::new(seed);
            let exact = toy.exact_gradient(n);
            let (mean, _) = toy.estimator_moments(n, 0.7, |a| a.advantages.clone());
            assert_matches(&mean, &exact, &format!("n={n}"));
        }
    }

    #[test]
    fn the_unscaled_baseline_is_biased_and_the_baseline_cuts_variance() {
        let (n, toy) = (4, Toy::new(31));
        let exact = toy.exact_gradient(n);
        // c_i - D alone: the expectation is (n - 2) / (2n) of the gradient, not the gradient.
        let (biased, _) = toy.estimator_moments(n, 1.0, |a| {
            a.contributions.iter().map(|c| c - a.diversity).collect()
        });
        let k = (n as f64 - 2.0) / (2.0 * n as f64);
        assert_matches(
            &biased,
            &exact.iter().map(|g| k * g).collect::<Vec<_>>(),
            "scaled",
        );
        // Without a baseline (weights 2 c_i, also unbiased) the variance is higher.
        let (plain, var_plain) = toy.estimator_moments(n, 1.0, |a| {
            a.contributions.iter().map(|c| 2.0 * c).collect()
        });
        assert_matches(&plain, &exact, "no baseline");
        let (_, var_baseline) = toy.estimator_moments(n, 1.0, |a| a.advantages.clone());
        assert!(
            var_baseline < 0.5 * var_plain,
            "variance with the baseline {var_baseline}, without {var_plain}"
        );
    }
}

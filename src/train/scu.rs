//! The Shannon control unit (SCU): a controller on the weight lambda of an information
//! penalty on the low-rank adapters, holding the penalty's share of the total bits per token at
//! a target.
//!
//! With `ParamBPT = sum(w^2) / (2 sigma^2 N ln 2)` over the adapter weights (a Gaussian prior of
//! scale sigma, spread over the N training tokens of an epoch) and `DataBPT` the mean token
//! cross-entropy in bits, the share is `S = ParamBPT / (DataBPT + ParamBPT)`. Training
//! minimises `DataBPT + lambda * ParamBPT`. The penalty is part of the gradient: each adapter
//! weight's gradient gains `lambda * w / (sigma^2 N)` (in the trainer's nats,
//! `ln 2 * d(lambda ParamBPT)/dw`), so lambda really moves the weights.
//!
//! Every `scu.every` steps the controller smooths S (an exponential moving average), and
//! outside a dead band around S* changes lambda multiplicatively by `exp(Kp e + I)` with a
//! leaky, clipped integral I that stops integrating while lambda sits at a bound and the error
//! pushes past it (anti-windup).

use crate::config::ScuConfig;
use serde::{Deserialize, Serialize};

/// The controller's state, saved in checkpoints for bit-exact resume.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScuState {
    pub lambda: f64,
    pub integral: f64,
    /// The smoothed share; `None` before the first update.
    pub s_hat: Option<f64>,
}

/// One controller update's record (a line of `scu_history.jsonl`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScuRecord {
    pub step: u64,
    #[serde(rename = "S")]
    pub s: f64,
    #[serde(rename = "S_hat")]
    pub s_hat: f64,
    pub e: f64,
    pub lambda: f64,
    #[serde(rename = "I")]
    pub integral: f64,
    #[serde(rename = "DataBPT")]
    pub data_bpt: f64,
    #[serde(rename = "ParamBPT")]
    pub param_bpt: f64,
}

impl ScuState {
    pub fn new(cfg: &ScuConfig) -> ScuState {
        ScuState {
            lambda: cfg.lambda_init,
            integral: 0.0,
            s_hat: None,
        }
    }

    /// `ParamBPT` of adapter weights whose squares sum to `sum_sq`, over `tokens` per epoch.
    pub fn param_bpt(cfg: &ScuConfig, sum_sq: f64, tokens: f64) -> f64 {
        sum_sq / (2.0 * cfg.sigma * cfg.sigma * tokens * std::f64::consts::LN_2)
    }

    /// The factor of `w` added to each adapter weight's gradient (in nats per token, before
    /// any loss scale): `lambda / (sigma^2 N)`.
    pub fn grad_coefficient(&self, cfg: &ScuConfig, tokens: f64) -> f64 {
        self.lambda / (cfg.sigma * cfg.sigma * tokens)
    }

    /// Updates the state from this step's bits per token; with `scu.control=false` only the
    /// record changes (lambda stays fixed).
    pub fn update(
        &mut self,
        cfg: &ScuConfig,
        step: u64,
        data_bpt: f64,
        param_bpt: f64,
    ) -> ScuRecord {
        let s = param_bpt / (data_bpt + param_bpt);
        let s_hat = match self.s_hat {
            None => s,
            Some(prev) => (1.0 - cfg.ema) * prev + cfg.ema * s,
        };
        self.s_hat = Some(s_hat);
        let e = s_hat - cfg.target;
        if cfg.control {
            if e.abs() <= cfg.deadband {
                self.integral *= cfg.leak;
            } else {
                let at_max = self.lambda >= cfg.lambda_max && e > 0.0;
                let at_min = self.lambda <= cfg.lambda_min && e < 0.0;
                self.integral = if at_max || at_min {
                    cfg.leak * self.integral
                } else {
                    (cfg.leak * self.integral + cfg.ki * e).clamp(-cfg.i_max, cfg.i_max)
                };
                self.lambda = (self.lambda * (cfg.kp * e + self.integral).exp())
                    .clamp(cfg.lambda_min, cfg.lambda_max);
            }
        }
        ScuRecord {
            step,
            s,
            s_hat,
            e,
            lambda: self.lambda,
            integral: self.integral,
            data_bpt,
            param_bpt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ScuConfig {
        ScuConfig {
            enabled: true,
            ..ScuConfig::default()
        }
    }

    #[test]
    fn share_above_target_raises_lambda_and_below_lowers_it() {
        let c = cfg();
        let mut up = ScuState::new(&c);
        let r = up.update(&c, 1, 2.0, 0.2);
        assert!((r.s - 0.2 / 2.2).abs() < 1e-12 && r.e > 0.0);
        assert!(up.lambda > 1.0 && up.integral > 0.0);
        let mut down = ScuState::new(&c);
        down.update(&c, 1, 2.0, 0.001);
        assert!(down.lambda < 1.0 && down.integral < 0.0);
    }

    #[test]
    fn dead_band_holds_lambda_and_leaks_the_integral() {
        let c = cfg();
        let mut s = ScuState {
            lambda: 2.0,
            integral: 0.1,
            s_hat: None,
        };
        // S exactly at the target.
        let data = 1.0;
        let param = c.target / (1.0 - c.target) * data;
        s.update(&c, 1, data, param);
        assert_eq!(s.lambda, 2.0);
        assert!((s.integral - 0.0995).abs() < 1e-12);
    }

    #[test]
    fn integral_is_clipped_and_stops_at_a_bound() {
        let c = cfg();
        let mut s = ScuState::new(&c);
        for step in 0..200 {
            s.update(&c, step, 1.0, 1.0);
            assert!(s.integral.abs() <= c.i_max + 1e-12);
        }
        assert_eq!(s.lambda, c.lambda_max);
        // At the upper bound with the error still positive, the integral only leaks.
        let before = s.integral;
        s.update(&c, 200, 1.0, 1.0);
        assert!((s.integral - c.leak * before).abs() < 1e-12);
    }

    #[test]
    fn fixed_lambda_without_control() {
        let c = ScuConfig {
            control: false,
            lambda_init: 0.5,
            ..cfg()
        };
        let mut s = ScuState::new(&c);
        let r = s.update(&c, 1, 1.0, 1.0);
        assert_eq!((s.lambda, r.lambda), (0.5, 0.5));
        assert!(
            (ScuState::param_bpt(&c, 2.0, 100.0)
                - 2.0 / (2.0 * 1e-4 * 100.0 * std::f64::consts::LN_2))
                .abs()
                < 1e-9
        );
    }
}

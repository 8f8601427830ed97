//! Optimisation: AdamW with fp32 state, the global gradient norm, and the LR schedule.

pub mod adamw;
pub mod schedule;

use crate::engine::{Result, ops};
use crate::nn::Param;

/// Sum of squares of every gradient, in f64. Non-finite if any gradient element is.
pub fn grad_sum_squares(params: &[&Param]) -> Result<f64> {
    ops::sum_squares(&params.iter().map(|p| &p.grad).collect::<Vec<_>>())
}

/// The factor that brings a gradient of norm `norm` within `max_norm` (1 when it already is,
/// or when clipping is off with `max_norm = 0`).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_only_shrinks() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) * 4.0 - 1.0).abs() < 1e-6);
    }
}

//! Dynamic loss scaling for fp16: multiply the loss so small gradients survive fp16, and back
//! off when the scaled gradients overflow.
//!
//! Semantics: start at `init` (65536 by default); after `growth_interval` consecutive clean
//! steps double the scale; on an inf/NaN gradient halve it and skip the step (no update, and
//! the LR schedule does not advance).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub growth_interval: u64,
    /// Clean steps since the last change of scale.
    pub clean_steps: u64,
    /// Steps skipped so far (reported in metrics).
    pub skipped: u64,
}

/// The smallest scale the scaler backs off to; below it fp16 gradients are lost anyway.
const MIN_SCALE: f64 = 1.0 / 65536.0;

impl LossScaler {
    pub fn new(init: f64, growth_interval: u64) -> Self {
        LossScaler {
            scale: init,
            growth_interval,
            clean_steps: 0,
            skipped: 0,
        }
    }

    /// Records the outcome of a step; returns true when the step must be skipped.
    pub fn update(&mut self, found_non_finite: bool) -> bool {
        if found_non_finite {
            self.scale = (self.scale * 0.5).max(MIN_SCALE);
            self.clean_steps = 0;
            self.skipped += 1;
            return true;
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.clean_steps = 0;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_on_overflow_and_doubles_after_clean_run() {
        let mut s = LossScaler::new(65536.0, 3);
        assert!(s.update(true));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(false));
        assert!(!s.update(false));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(false));
        assert_eq!(s.scale, 65536.0, "doubles after 3 clean steps");
        assert!(!s.update(false));
        assert!(s.update(true), "an overflow resets the clean count");
        assert_eq!((s.scale, s.clean_steps, s.skipped), (32768.0, 0, 2));
    }
}

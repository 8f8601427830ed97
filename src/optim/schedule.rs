//! Learning rate: linear warmup, then a decay to a floor at the last step (cosine, as in
//! GPT-style pretraining; linear, the Hugging Face Trainer's default), or none.

/// How the learning rate falls from its peak after warmup (`optim.schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleShape {
    /// Half a cosine from `max_lr` to `min_lr` at the last step.
    Cosine,
    /// A straight line from `max_lr` to `min_lr` at the last step.
    Linear,
    /// `max_lr` until the end (`min_lr` unused).
    Constant,
}

impl ScheduleShape {
    /// The settings' names: cosine, linear, constant.
    pub const NAMES: [&'static str; 3] = ["cosine", "linear", "constant"];

    pub fn from_setting(name: &str) -> Option<ScheduleShape> {
        match name {
            "cosine" => Some(ScheduleShape::Cosine),
            "linear" => Some(ScheduleShape::Linear),
            "constant" => Some(ScheduleShape::Constant),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LrSchedule {
    pub shape: ScheduleShape,
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl LrSchedule {
    /// LR for optimizer step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        let remaining = match self.shape {
            ScheduleShape::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            ScheduleShape::Linear => 1.0 - progress,
            ScheduleShape::Constant => return self.max_lr,
        };
        self.min_lr + (self.max_lr - self.min_lr) * remaining
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(shape: ScheduleShape) -> LrSchedule {
        LrSchedule {
            shape,
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        }
    }

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        let s = schedule(ScheduleShape::Cosine);
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(500) - 0.1).abs() < 1e-12);
        assert!(s.lr(30) > s.lr(31));
    }

    #[test]
    fn linear_and_constant_shapes_share_the_warmup() {
        let (l, c) = (
            schedule(ScheduleShape::Linear),
            schedule(ScheduleShape::Constant),
        );
        for step in 0..10 {
            assert_eq!(l.lr(step), schedule(ScheduleShape::Cosine).lr(step));
            assert_eq!(c.lr(step), l.lr(step));
        }
        // A quarter of the way down the line: 1 - 0.25 * 0.9.
        assert!((l.lr(35) - 0.775).abs() < 1e-12);
        assert!((l.lr(60) - 0.55).abs() < 1e-12);
        assert!((l.lr(110) - 0.1).abs() < 1e-12);
        // Cosine stays above the line in its first half and below it in its second.
        let cos = schedule(ScheduleShape::Cosine);
        assert!(cos.lr(35) > l.lr(35) && cos.lr(85) < l.lr(85));
        for step in [10, 60, 109, 500] {
            assert_eq!(c.lr(step), 1.0);
        }
        for name in ScheduleShape::NAMES {
            assert!(ScheduleShape::from_setting(name).is_some());
        }
        assert_eq!(ScheduleShape::from_setting("step"), None);
    }
}

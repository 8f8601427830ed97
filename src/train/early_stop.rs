//! The best validation loss of a run, for early stopping and the best checkpoint.
//!
//! Early stopping (`train.early_stop_patience`): a run ends, with a checkpoint, once its
//! validation loss has gone that many evaluations without beating the best so far by
//! `train.early_stop_min_delta`, as Lightning's `EarlyStopping` and transformers'
//! `EarlyStoppingCallback` end theirs. `train.keep_best` checkpoints each evaluation that sets
//! a new best and keeps the latest such checkpoint. The state is the evaluations themselves,
//! so a resumed run rebuilds it from the eval records of its `metrics.jsonl` rather than from
//! the checkpoint, and resumes with the patience it had left.

use serde::Serialize;
use std::path::Path;

/// The best validation loss so far and the evaluations since that did not beat it.
#[derive(Debug, Clone)]
pub struct EarlyStop {
    patience: usize,
    min_delta: f64,
    best: f64,
    best_step: u64,
    stale: usize,
}

/// What `summary.json` says of early stopping.
#[derive(Debug, Clone, Serialize)]
pub struct EarlyStopReport {
    /// The step of the lowest validation loss, and that loss.
    pub best_step: u64,
    pub best_val_loss: f64,
    /// Whether the run ended because of it (before `train.steps`).
    pub stopped: bool,
}

impl EarlyStop {
    /// The rule of `patience` evaluations (0: never stop) and improvements of more than
    /// `min_delta`; `None` when there is neither a patience nor a best checkpoint to `keep`.
    pub fn new(patience: usize, min_delta: f64, keep: bool) -> Option<EarlyStop> {
        (patience > 0 || keep).then_some(EarlyStop {
            patience,
            min_delta,
            best: f64::INFINITY,
            best_step: 0,
            stale: 0,
        })
    }

    /// Counts the evaluation at `step`; true when the run should stop there. A loss that is
    /// not a number never improves.
    pub fn observe(&mut self, step: u64, val_loss: f64) -> bool {
        if val_loss < self.best - self.min_delta {
            self.best = val_loss;
            self.best_step = step;
            self.stale = 0;
        } else {
            self.stale += 1;
        }
        self.exhausted()
    }

    /// Whether the patience has run out.
    pub fn exhausted(&self) -> bool {
        self.patience > 0 && self.stale >= self.patience
    }

    /// Whether the evaluation at `step` set the best loss (the last one observed there).
    pub fn best_at(&self, step: u64) -> bool {
        self.best.is_finite() && self.best_step == step && self.stale == 0
    }

    /// Evaluations since the best one.
    pub fn stale(&self) -> usize {
        self.stale
    }

    pub fn best(&self) -> (u64, f64) {
        (self.best_step, self.best)
    }

    /// Replays the evaluations of a run's `metrics.jsonl` at steps up to `step` (a resumed
    /// checkpoint's), each step's last record counting once: an earlier attempt that went past
    /// the checkpoint before it stopped leaves records of its later steps, and a step
    /// evaluated by two attempts is one evaluation. A missing file replays nothing; lines
    /// that are not eval records are skipped.
    pub fn replay(&mut self, metrics: &Path, step: u64) {
        let Ok(text) = std::fs::read_to_string(metrics) else {
            return;
        };
        let mut evals = std::collections::BTreeMap::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v["kind"] != "eval" {
                continue;
            }
            if let (Some(s), Some(loss)) = (v["step"].as_u64(), v["val_loss"].as_f64())
                && s <= step
            {
                evals.insert(s, loss);
            }
        }
        for (s, loss) in evals {
            self.observe(s, loss);
        }
    }

    pub fn report(&self, stopped: bool) -> Option<EarlyStopReport> {
        self.best.is_finite().then_some(EarlyStopReport {
            best_step: self.best_step,
            best_val_loss: self.best,
            stopped,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Improvements reset the count, a fall of no more than `min_delta` does not, and the
    /// third evaluation without one stops the run.
    #[test]
    fn patience_counts_evaluations_without_an_improvement() {
        let mut e = EarlyStop::new(3, 0.01, false).unwrap();
        assert!(!e.observe(10, 2.0));
        assert!(!e.observe(20, 1.5));
        assert!(e.best_at(20));
        assert!(!e.observe(30, 1.495)); // within min_delta: no improvement
        assert!(!e.best_at(30) && !e.best_at(20));
        assert!(!e.observe(40, 1.6));
        assert_eq!(e.stale(), 2);
        assert_eq!(e.best(), (20, 1.5));
        assert!(!e.observe(50, 1.2));
        assert_eq!(e.stale(), 0);
        assert!(!e.observe(60, f64::NAN));
        assert!(!e.observe(70, 1.3));
        assert!(e.observe(80, 1.2));
        assert_eq!(e.best(), (50, 1.2));
        assert!(EarlyStop::new(0, 0.0, false).is_none());
        // Only keeping the best: it never stops.
        let mut keep = EarlyStop::new(0, 0.0, true).unwrap();
        assert!((1..10).all(|s| !keep.observe(s, 1.0)));
        assert_eq!(keep.best(), (1, 1.0));
    }

    /// A resumed run's state is the evaluations up to its checkpoint, each step once, the
    /// last record of a step winning; other records and lines are skipped.
    #[test]
    fn a_resumed_run_replays_its_evaluations_up_to_the_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        let lines = [
            r#"{"kind":"eval","step":0,"val_loss":3.0}"#,
            r#"{"kind":"train","step":10,"loss":0.1}"#,
            r#"{"kind":"eval","step":10,"val_loss":2.0}"#,
            r#"{"kind":"eval","step":20,"val_loss":2.5}"#,
            "not json",
            r#"{"kind":"eval","step":30,"val_loss":1.0}"#,
            // A second attempt resumed from step 20 evaluates 20 again and stops before 30.
            r#"{"kind":"eval","step":20,"val_loss":2.4}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let mut e = EarlyStop::new(5, 0.0, false).unwrap();
        e.replay(&path, 20);
        assert_eq!(e.best(), (10, 2.0));
        assert_eq!(e.stale(), 1);
        let mut all = EarlyStop::new(5, 0.0, false).unwrap();
        all.replay(&path, 30);
        assert_eq!((all.best(), all.stale()), ((30, 1.0), 0));
        let mut none = EarlyStop::new(5, 0.0, true).unwrap();
        none.replay(&tmp.path().join("missing.jsonl"), 30);
        assert!(none.report(false).is_none());
    }
}

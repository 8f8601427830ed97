//! Helpers shared by the integration tests: a tiny model configuration that trains in well
//! under a second, so end-to-end behaviour is tested on real runs.

#![allow(dead_code)]

/// Overrides for a small, fast model on the bundled corpus.
pub fn tiny_overrides() -> Vec<String> {
    [
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.context=32",
        "train.seq_len=32",
        "train.micro_batch=4",
        "train.eval_batches=2",
        "train.log_every=1",
        "optim.warmup_steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

pub fn with(extra: &[&str]) -> Vec<String> {
    let mut v = tiny_overrides();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

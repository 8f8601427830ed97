//! Helpers shared by the integration tests: a tiny model configuration that trains in well
//! under a second, so end-to-end behaviour is tested on real runs.

#![allow(dead_code)]

pub mod fixtures;

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

/// Peak pool bytes (weights, gradients and optimizer state included) over two fp32 CPU
/// optimizer steps of the tiny model with `extra` overrides: what a `train.memory_limit`
/// must allow for a run of that shape to go through without splitting.
pub fn step_peak(extra: &[&str]) -> usize {
    use kiln::data::{self, Corpus, Tokenizer};
    use kiln::engine::{Device, MemoryPool};
    use kiln::train::{Precision, Trainer};
    let cfg = kiln::config::ResolvedConfig::resolve(None, &with(extra))
        .unwrap()
        .config;
    let text = Corpus::load(None).unwrap().text;
    let tokens = data::ByteTokenizer.encode(&text[..100_000]);
    let pool = MemoryPool::new(Device::Cpu);
    let mut t = Trainer::new(&cfg, 256, &pool, Precision::Fp32).unwrap();
    for step in 0..2 {
        let (b, s) = (cfg.train.micro_batch, cfg.train.seq_len);
        let micro: Vec<_> = (0..cfg.train.grad_accum as u64)
            .map(|m| data::train_batch(&tokens, cfg.train.seed, step, m, b, s))
            .collect();
        t.step(&micro).unwrap();
    }
    assert!(t.passes.learned().is_none(), "an uncapped run never splits");
    pool.stats().peak
}

/// Pool bytes a tiny-model trainer holds before its first step (weights, gradients,
/// optimizer state).
pub fn resident_bytes(extra: &[&str]) -> usize {
    use kiln::engine::{Device, MemoryPool};
    use kiln::train::{Precision, Trainer};
    let cfg = kiln::config::ResolvedConfig::resolve(None, &with(extra))
        .unwrap()
        .config;
    let pool = MemoryPool::new(Device::Cpu);
    let _t = Trainer::new(&cfg, 256, &pool, Precision::Fp32).unwrap();
    pool.stats().current
}

/// `kiln ARGS` with `input` on its standard input (then closed), and what it wrote.
pub fn kiln_with_stdin(args: &[&str], input: impl AsRef<[u8]>) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kiln runs");
    // A command that ends before reading its input closes the pipe: not a test failure.
    let written = child.stdin.take().unwrap().write_all(input.as_ref());
    if let Err(e) = written {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    child.wait_with_output().expect("kiln finishes")
}

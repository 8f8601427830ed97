//! `train.offload_optimizer` on the CPU: the offloaded run trains to the same bits as the
//! in-place one, checkpoints and resumes, and can be switched on or off when resuming.

mod common;

use kiln::config::ResolvedConfig;
use kiln::error::KilnError;
use kiln::train::{self, RunOptions};
use std::path::Path;

/// Clipping on (a small threshold it always crosses) and weight decay on, so the fused
/// scale and the decay term are part of what must match.
const OPTIM: [&str; 5] = [
    "optim.grad_clip=0.05",
    "optim.weight_decay=0.1",
    "train.eval_every=0",
    "train.grad_accum=2",
    "train.steps=8",
];

fn run_to(
    dir: &Path,
    extra: &[&str],
    resume: bool,
    stop_after: Option<u64>,
) -> Result<train::Summary, KilnError> {
    let file = resume.then(|| dir.join("config.toml"));
    let mut overrides: Vec<String> = if resume {
        Vec::new()
    } else {
        common::with(&OPTIM)
    };
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let config = ResolvedConfig::resolve(file.as_deref(), &overrides)?;
    train::run(RunOptions {
        config,
        run_dir: dir.to_path_buf(),
        resume,
        checkpoint: None,
        stop_after,
        quiet: true,
        trace: None,
        profile_steps: None,
        init: None,
        world: None,
    })
}

/// The latest checkpoint's weights and optimizer files, as bytes.
fn checkpoint_files(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let ckpt = train::checkpoint::latest(dir).unwrap().unwrap();
    let read = |f: &str| std::fs::read(ckpt.join(f)).unwrap();
    (read("model.safetensors"), read("optimizer.safetensors"))
}

#[test]
fn an_offloaded_run_trains_to_the_same_bits_and_reports_its_host_memory() {
    for precision in ["fp32", "bf16-mixed"] {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("in-place"), tmp.path().join("offloaded"));
        let p = format!("train.precision={precision}");
        let plain = run_to(&a, &[&p], false, None).unwrap();
        let moved = run_to(&b, &[&p, "train.offload_optimizer=true"], false, None).unwrap();
        assert_eq!(
            plain.train_loss.to_bits(),
            moved.train_loss.to_bits(),
            "{precision}: last loss differs"
        );
        assert_eq!(plain.val_loss.to_bits(), moved.val_loss.to_bits());
        let (wa, oa) = checkpoint_files(&a);
        let (wb, ob) = checkpoint_files(&b);
        assert!(wa == wb, "{precision}: weights differ");
        assert!(oa == ob, "{precision}: optimizer state differs");

        // Masters and both moments (12 bytes a parameter) are on the host books, and the
        // device's peak is lower: it no longer holds the moments.
        assert_eq!(plain.host_optimizer_peak_bytes, None);
        let host = moved.host_optimizer_peak_bytes.unwrap();
        assert!(host >= 12 * moved.params, "{precision}: host books {host}");
        assert!(
            moved.peak_memory_bytes + 8 * moved.params <= plain.peak_memory_bytes,
            "{precision}: device peak {} offloaded vs {} in place",
            moved.peak_memory_bytes,
            plain.peak_memory_bytes
        );
        let metrics = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
        assert!(metrics.contains("\"mem_host_optimizer\":"), "{metrics}");
    }
}

#[test]
fn an_offloaded_run_resumes_bit_identically() {
    for precision in ["fp32", "fp16-mixed"] {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let p = format!("train.precision={precision}");
        let args = [
            p.as_str(),
            "train.offload_optimizer=true",
            "train.checkpoint_every=4",
        ];
        let full = run_to(&a, &args, false, None).unwrap();
        run_to(&b, &args, false, Some(4)).unwrap();
        let resumed = run_to(&b, &[], true, None).unwrap();
        assert_eq!(resumed.steps, 8);
        assert_eq!(full.train_loss.to_bits(), resumed.train_loss.to_bits());
        assert!(
            checkpoint_files(&a) == checkpoint_files(&b),
            "{precision}: checkpoint differs after resume"
        );
    }
}

#[test]
fn switching_offload_at_resume_changes_nothing() {
    for (first, then) in [("false", "true"), ("true", "false")] {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let (before, after) = (
            format!("train.offload_optimizer={first}"),
            format!("train.offload_optimizer={then}"),
        );
        let args = [
            "train.precision=bf16-mixed",
            "train.checkpoint_every=4",
            before.as_str(),
        ];
        // `a` never switches; `b` stops at step 4 and resumes with offload switched.
        run_to(&a, &args, false, None).unwrap();
        run_to(&b, &args, false, Some(4)).unwrap();
        let resumed = run_to(&b, &[&after], true, None).unwrap();
        assert_eq!(resumed.steps, 8);
        assert_eq!(
            resumed.host_optimizer_peak_bytes.is_some(),
            then == "true",
            "the resumed part runs with the switched setting"
        );
        assert!(
            checkpoint_files(&a) == checkpoint_files(&b),
            "offload {first} -> {then} at resume changed the result"
        );
    }
}

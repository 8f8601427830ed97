//! Polychromic fine-tuning end to end on the CPU, on a tiny random Llama (exported as a
//! Hugging Face directory with SmolLM2's tokenizer) and cue/reply pairs from the bundled
//! corpus: lambda = 0 is plain fine-tuning bit for bit, a positive lambda moves the weights,
//! held-out diversity rises with lambda while the held-out cross-entropy stays within a
//! stated bound, and bad settings, data and embedders are refused with their exit codes.

mod common;

use common::fixtures::{minilm_dir, smollm2_gguf};
use kiln::config::ResolvedConfig;
use kiln::engine::{Device, MemoryPool};
use kiln::models::{self, export};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "kiln failed: {err}");
    String::from_utf8_lossy(&o.stdout).into_owned() + &err
}

/// The exit code and standard error of a run that must fail.
fn fails(o: &Output) -> (i32, String) {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "kiln should have failed: {err}");
    (o.status.code().unwrap_or(-1), err)
}

const CONTEXT: usize = 96;

/// A tiny random Llama with SmolLM2's tokenizer as a Hugging Face directory, and cue/reply
/// pairs from three plays.
fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    let tok = smollm2_gguf().display().to_string();
    let cfg = ResolvedConfig::resolve(
        None,
        &[
            "model.kind=llama".into(),
            "model.d_model=32".into(),
            "model.n_layers=2".into(),
            "model.n_heads=4".into(),
            "model.n_kv_heads=2".into(),
            "model.ffn_hidden=64".into(),
            format!("model.context={CONTEXT}"),
            format!("train.seq_len={CONTEXT}"),
            format!("data.tokenizer={tok}"),
        ],
    )
    .unwrap()
    .config;
    let vocab = kiln::train::model_vocab(&cfg).unwrap();
    let model = models::build(&cfg.model, vocab, &MemoryPool::new(Device::Cpu), 3).unwrap();
    let base = dir.join("base");
    export::export_hf(model.as_ref(), &cfg.model, vocab, &tok, &base).unwrap();
    let data = dir.join("cues.jsonl");
    ok(&kiln(&[
        "make-dataset",
        "cue-reply",
        "--plays",
        "3",
        "--per-scene",
        "2",
        "--max-words",
        "16",
        "--out",
        data.to_str().unwrap(),
    ]));
    (base, data)
}

/// `kiln finetune` of `base` on `data` into `out` with the common CPU settings and `extra`.
fn finetune(base: &Path, data: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "finetune",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--device",
        "cpu",
        "-q",
        "train.micro_batch=4",
        "train.seq_len=96",
        "train.eval_every=0",
        "train.eval_batches=4",
        "optim.warmup_steps=0",
    ];
    args.extend_from_slice(extra);
    kiln(&args)
}

fn checkpoint_files(run: &Path, step: u32) -> Vec<Vec<u8>> {
    let dir = run.join(format!("checkpoints/step_{step:07}"));
    ["model.safetensors", "optimizer.safetensors"]
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap())
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The "polychromic" records of a run's metrics.
fn sampling_records(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "polychromic")
        .collect()
}

#[test]
fn lambda_zero_is_plain_fine_tuning_and_a_positive_lambda_moves_the_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let steps = ["train.steps=4", "optim.lr=1e-2"];
    let plain = tmp.path().join("plain");
    ok(&finetune(&base, &data, &plain, &steps));
    let poly = |lambda: &str, name: &str| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "--objective",
            "polychromic",
            "--diversity-lambda",
            lambda,
            "--samples",
            "3",
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "8",
        ];
        args.extend_from_slice(&steps);
        ok(&finetune(&base, &data, &out, &args));
        out
    };
    let zero = poly("0", "zero");
    // The run sampled, embedded and timed every step; only its weights are unchanged.
    let records = sampling_records(&zero);
    assert_eq!(records.len(), 4);
    for r in &records {
        assert_eq!(r["replies"], 6);
        let d = r["diversity"].as_f64().unwrap();
        assert!(d.is_finite() && d > 0.0, "{r}");
        assert!(r["generate_s"].as_f64().unwrap() > 0.0);
        assert!(r["forward_backward_s"].as_f64().unwrap() > 0.0);
    }
    assert!(
        json(&zero.join("summary.json"))["val_diversity"]
            .as_f64()
            .is_some()
    );
    assert!(
        checkpoint_files(&zero, 4) == checkpoint_files(&plain, 4),
        "lambda = 0 must train exactly as plain fine-tuning"
    );
    assert_eq!(
        std::fs::read(zero.join("adapter/adapter_model.safetensors")).unwrap(),
        std::fs::read(plain.join("adapter/adapter_model.safetensors")).unwrap()
    );
    let half = poly("0.5", "half");
    let (moved, still) = (checkpoint_files(&half, 4), checkpoint_files(&plain, 4));
    assert!(moved[0] != still[0], "lambda = 0.5 must change the weights");
    // The same replies were drawn (same seed, same weights at step 1): the difference is
    // the diversity term's gradient, not other samples.
    let (a, b) = (sampling_records(&half), sampling_records(&zero));
    assert_eq!(a[0]["diversity"], b[0]["diversity"]);
    assert_ne!(a[3]["diversity"], b[3]["diversity"]);
}

/// Full fine-tunes at lambda 0, 1 and 4 with all-MiniLM-L6-v2 as the embedder, seeded, 30
/// steps: held-out D (4 replies to each of 26 validation prompts, the same random streams
/// in every run) rises with lambda, by more than 0.02 from lambda 0 to 4, and the held-out
/// cross-entropy stays within 0.5 nats of plain fine-tuning's. Measured when written: D 0.829,
/// 0.853, 0.865; CE 7.59, 7.77, 7.90. After the CPU attention moved to blocked products (the
/// same mathematics, sums in another order, so 30 steps of sampled training take another
/// path): D 0.844, 0.873, 0.877; CE 7.60, 7.84, 7.99. The step from 1 to 4 varies with such
/// rounding (0.012 and 0.004), so each step is only required to rise.
#[test]
fn held_out_diversity_rises_with_lambda_within_a_cross_entropy_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let minilm = minilm_dir().display().to_string();
    let run = |lambda: &str| {
        let out = tmp.path().join(format!("lambda-{lambda}"));
        ok(&finetune(
            &base,
            &data,
            &out,
            &[
                "--full",
                "--objective",
                "polychromic",
                "--diversity-lambda",
                lambda,
                "--samples",
                "4",
                "--prompts-per-step",
                "6",
                "--max-new-tokens",
                "10",
                "--embedder",
                &minilm,
                "train.steps=30",
                "optim.lr=1e-2",
                "data.val_fraction=0.2",
            ],
        ));
        let s = json(&out.join("summary.json"));
        (
            s["val_diversity"].as_f64().unwrap(),
            s["val_loss"].as_f64().unwrap(),
        )
    };
    let results: Vec<(f64, f64)> = ["0", "1", "4"].iter().map(|l| run(l)).collect();
    let (d0, ce0) = results[0];
    for w in results.windows(2) {
        assert!(w[1].0 > w[0].0, "D must rise with lambda: {results:?}");
    }
    assert!(
        results[2].0 > d0 + 0.02,
        "D must rise by more than 0.02 from lambda 0 to 4: {results:?}"
    );
    for (d, ce) in &results[1..] {
        assert!(
            *ce < ce0 + 0.5,
            "held-out CE {ce} is more than 0.5 nats above plain fine-tuning's {ce0} (D {d} vs {d0}): {results:?}"
        );
    }
}

#[test]
fn bad_settings_data_and_embedders_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let out = tmp.path().join("run");
    let poly = |extra: &[&str]| {
        let mut args = vec!["--objective", "polychromic", "train.steps=1"];
        args.extend_from_slice(extra);
        finetune(&base, &data, &out, &args)
    };
    let refused = |o: Output, code: i32, says: &str| {
        let (got, err) = fails(&o);
        assert_eq!(got, code, "{err}");
        assert!(err.contains(says), "expected {says:?} in: {err}");
        assert!(!out.exists(), "a refused start leaves no run directory");
    };
    // One reply has no pairs: D is undefined, an error rather than a silent zero.
    refused(poly(&["--samples", "1"]), 2, "at least 2");
    refused(poly(&["polychromic.samples=1"]), 2, "at least 2");
    // A negative lambda rewards sameness: only with the explicit flag.
    refused(
        poly(&["--diversity-lambda", "-0.5"]),
        2,
        "--allow-negative-lambda",
    );
    let allowed = finetune(
        &base,
        &data,
        &out,
        &[
            "--objective",
            "polychromic",
            "--diversity-lambda",
            "-0.5",
            "--allow-negative-lambda",
            "--print-config",
        ],
    );
    assert!(ok(&allowed).contains("polychromic.lambda"));
    refused(poly(&["--sample-temperature", "0"]), 2, "greedy");
    refused(
        finetune(&base, &data, &out, &["--samples", "4"]),
        2,
        "--objective polychromic",
    );
    // Prompts that leave no room for the replies in the model's context.
    let long = tmp.path().join("long.jsonl");
    let words = "and ".repeat(CONTEXT);
    std::fs::write(
        &long,
        format!(
            "{}\n{}\n{}\n",
            serde_json::json!({"prompt": words, "completion": " no"}),
            serde_json::json!({"prompt": "ROMEO: hello\nJULIET:", "completion": " hi"}),
            serde_json::json!({"prompt": "ROMEO: farewell\nJULIET:", "completion": " go"})
        ),
    )
    .unwrap();
    refused(
        finetune(&base, &long, &out, &["--objective", "polychromic"]),
        3,
        "longer than the model's context",
    );
    let edge = tmp.path().join("edge.jsonl");
    let near = "and ".repeat(CONTEXT - 20);
    std::fs::write(
        &edge,
        format!(
            "{}\n{}\n{}\n",
            serde_json::json!({"prompt": near, "completion": " no"}),
            serde_json::json!({"prompt": "ROMEO: hello\nJULIET:", "completion": " hi"}),
            serde_json::json!({"prompt": "ROMEO: farewell\nJULIET:", "completion": " go"})
        ),
    )
    .unwrap();
    refused(
        finetune(
            &base,
            &edge,
            &out,
            &["--objective", "polychromic", "--max-new-tokens", "40"],
        ),
        3,
        "lower polychromic.max_new_tokens",
    );
    // Plain text has no prompts to sample replies for.
    let text = tmp.path().join("plain.txt");
    std::fs::write(
        &text,
        "ROMEO: hello there.\nJULIET: and to you.\n".repeat(200),
    )
    .unwrap();
    refused(
        finetune(&base, &text, &out, &["--objective", "polychromic"]),
        2,
        "has none",
    );
    // Embedders whose files disagree: a tokenizer larger than the embedding, a width that
    // does not match the weights.
    for (key, value, says) in [
        ("vocab_size", 1000, "tokenizer"),
        ("hidden_size", 372, "shape"),
    ] {
        let bad = tmp.path().join(format!("bad-{key}"));
        copy_dir(&minilm_dir(), &bad);
        let mut cfg = json(&bad.join("config.json"));
        cfg[key] = value.into();
        std::fs::write(bad.join("config.json"), cfg.to_string()).unwrap();
        let o = poly(&["--embedder", bad.to_str().unwrap()]);
        let (code, err) = fails(&o);
        assert_eq!(code, 4, "{err}");
        assert!(err.contains(says) && err.contains("embedder"), "{err}");
        assert!(!out.exists());
    }
}

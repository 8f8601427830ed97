//! The command line end to end on a tiny model, and every kind of bad input the trainer must
//! refuse with a clear message, a non-zero exit and nothing lost.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str], extra: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .args(extra)
        .output()
        .expect("kiln runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn assert_fails(o: &Output, code: i32, needles: &[&str]) {
    let t = text(o);
    assert_eq!(o.status.code(), Some(code), "exit code; output:\n{t}");
    for n in needles {
        assert!(t.contains(n), "expected {n:?} in:\n{t}");
    }
}

/// Trains a tiny run for a few steps into `dir`.
fn train_tiny(dir: &Path, extra: &[&str]) {
    let out = kiln(
        &["train", "--quiet", "--out", dir.to_str().unwrap()],
        &common::with(&[&["train.steps=4", "train.checkpoint_every=2"], extra].concat()),
    );
    assert!(out.status.success(), "{}", text(&out));
}

/// Every file under `dir` with its bytes, to show a failed command changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            v.extend(snapshot(&p));
        } else {
            v.push((p.clone(), fs::read(&p).unwrap()));
        }
    }
    v.sort();
    v
}

#[test]
fn train_then_generate_and_eval() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    for f in [
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "checkpoints/latest",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
    let metrics = fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    for key in [
        "step",
        "loss",
        "lr",
        "tokens_per_s",
        "mem_peak",
        "grad_norm",
    ] {
        assert!(
            first.get(key).is_some(),
            "metrics line lacks {key}: {first}"
        );
    }
    let gen_out = kiln(
        &[
            "generate",
            "--run",
            run.to_str().unwrap(),
            "--tokens",
            "40",
            "--prompt",
            "KING:",
        ],
        &[],
    );
    assert!(gen_out.status.success(), "{}", text(&gen_out));
    let sample = String::from_utf8_lossy(&gen_out.stdout);
    assert!(sample.starts_with("KING:") && sample.len() > 30, "{sample}");
    let ev = kiln(&["eval", "--run", run.to_str().unwrap()], &[]);
    assert!(
        ev.status.success() && text(&ev).contains("bits/token"),
        "{}",
        text(&ev)
    );
}

#[test]
fn print_config_shows_values_and_their_origin() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("c.toml");
    fs::write(&file, "[train]\nmicro_batch = 8\n").unwrap();
    let out = kiln(
        &[
            "train",
            "--print-config",
            "--config",
            file.to_str().unwrap(),
            "optim.lr=0.01",
        ],
        &[],
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let line = |key: &str| {
        t.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("{key} missing:\n{t}"))
            .to_string()
    };
    assert!(line("train.micro_batch").contains("c.toml"), "{t}");
    assert!(line("optim.lr").contains("override"), "{t}");
    assert!(line("model.d_model").contains("default"), "{t}");
}

#[test]
fn unknown_key_suggests_the_closest() {
    let out = kiln(&["train", "train.micro_bach=4"], &[]);
    assert_fails(
        &out,
        2,
        &["unknown config key 'train.micro_bach'", "train.micro_batch"],
    );
}

#[test]
fn wrong_type_and_out_of_range_values_are_refused() {
    assert_fails(
        &kiln(&["train", "train.steps=many"], &[]),
        2,
        &["train.steps", "many"],
    );
    assert_fails(
        &kiln(&["train", "model.n_heads=3"], &[]),
        2,
        &["model.d_model", "model.n_heads"],
    );
    assert_fails(&kiln(&["train", "optim.lr=-1"], &[]), 2, &["optim.lr"]);
}

#[test]
fn missing_and_empty_corpus_files_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope.txt");
    let out = kiln(
        &["train", "--out", tmp.path().join("r1").to_str().unwrap()],
        &common::with(&[&format!("data.corpus={}", missing.display())]),
    );
    assert_fails(&out, 3, &["nope.txt"]);
    let empty = tmp.path().join("empty.txt");
    fs::write(&empty, "  \n").unwrap();
    let out = kiln(
        &["train", "--out", tmp.path().join("r2").to_str().unwrap()],
        &common::with(&[&format!("data.corpus={}", empty.display())]),
    );
    assert_fails(&out, 3, &["empty"]);
}

#[test]
fn sequences_longer_than_the_context_are_refused() {
    let out = kiln(&["train"], &common::with(&["train.seq_len=64"]));
    assert_fails(&out, 2, &["train.seq_len", "model.context"]);
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    let out = kiln(
        &["eval", "--run", run.to_str().unwrap(), "--seq-len", "64"],
        &[],
    );
    assert_fails(&out, 1, &["longer than the model's context of 32"]);
}

#[test]
fn damaged_or_foreign_checkpoints_leave_the_run_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    let run_s = run.to_str().unwrap();

    let before = snapshot(&run);
    let out = kiln(
        &[
            "train",
            "--resume",
            run_s,
            "model.d_model=64",
            "train.steps=8",
        ],
        &[],
    );
    assert_fails(
        &out,
        4,
        &[
            "another shape",
            "model.d_model: checkpoint 32, configured 64",
        ],
    );
    assert_eq!(snapshot(&run), before, "a refused resume wrote nothing");

    let latest = fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let weights = run
        .join("checkpoints")
        .join(latest.trim())
        .join("model.safetensors");
    let bytes = fs::read(&weights).unwrap();
    fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let before = snapshot(&run);
    let out = kiln(&["train", "--resume", run_s, "train.steps=8"], &[]);
    assert_fails(&out, 4, &["model.safetensors", "truncated or damaged"]);
    assert_eq!(snapshot(&run), before, "a refused resume wrote nothing");
}

#[test]
fn an_existing_run_is_not_overwritten_without_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    let out = kiln(
        &["train", "--out", run.to_str().unwrap()],
        &common::with(&[]),
    );
    assert_fails(&out, 2, &["already holds a run", "--resume"]);
}

#[test]
fn an_unwritable_output_directory_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    fs::write(&file, "x").unwrap();
    let out = kiln(
        &["train", "--out", file.join("run").to_str().unwrap()],
        &common::with(&["train.steps=1"]),
    );
    assert_fails(&out, 7, &["cannot write", "--out"]);
}

#[test]
fn divergence_exits_with_its_own_code() {
    let tmp = tempfile::tempdir().unwrap();
    let out = kiln(
        &["train", "--out", tmp.path().join("run").to_str().unwrap()],
        &common::with(&[
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "optim.grad_clip=0",
            "train.steps=50",
        ]),
    );
    assert_fails(&out, 5, &["training stopped", "at step"]);
}

#[test]
fn tf32_on_the_cpu_is_refused_with_the_fix() {
    let out = kiln(&["train", "train.device=cpu", "train.precision=tf32"], &[]);
    assert_fails(&out, 2, &["tf32", "train.precision=fp32"]);
}

/// ResNet-BK through the command line: a few steps with routing statistics in the metrics,
/// a run stopped at a checkpoint and resumed ends bit-identical to one that never stopped,
/// and eval and generate read its checkpoint.
#[test]
fn resnet_bk_trains_checkpoints_and_resumes_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (full, parts) = (tmp.path().join("full"), tmp.path().join("parts"));
    let model = [
        "model.kind=resnet_bk",
        "model.moe_experts=3",
        "model.moe_top_k=2",
        "model.moe_capacity_factor=1.0",
        "train.grad_accum=2",
        "train.steps=6",
        "train.checkpoint_every=3",
    ];
    let out = kiln(
        &["train", "--quiet", "--out", full.to_str().unwrap()],
        &common::with(&model),
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = kiln(
        &[
            "train",
            "--quiet",
            "--stop-after",
            "3",
            "--out",
            parts.to_str().unwrap(),
        ],
        &common::with(&model),
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = kiln(
        &["train", "--quiet", "--resume", parts.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let last =
        |dir: &Path, file: &str| fs::read(dir.join("checkpoints/step_0000006").join(file)).unwrap();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            last(&full, file) == last(&parts, file),
            "{file} differs after resume"
        );
    }
    let loss = |dir: &Path| -> serde_json::Value {
        let s = fs::read_to_string(dir.join("summary.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&s).unwrap()["train_loss"].clone()
    };
    assert_eq!(loss(&full), loss(&parts));

    let metrics = fs::read_to_string(full.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let moe = &first["moe"];
    // Two layers, two micro-batches of 4 x 32 tokens, two experts per token.
    assert_eq!(moe["slots"], 2 * 2 * 128 * 2, "{first}");
    let load: u64 = moe["load"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_u64().unwrap())
        .sum();
    assert_eq!(load + moe["dropped"].as_u64().unwrap(), 1024, "{first}");
    assert!(moe["aux_loss"].as_f64().unwrap() >= 1.0 - 1e-9, "{first}");

    let ev = kiln(&["eval", "--run", full.to_str().unwrap()], &[]);
    assert!(text(&ev).contains("bits/token"), "{}", text(&ev));
    let gen_out = kiln(
        &[
            "generate",
            "--run",
            full.to_str().unwrap(),
            "--tokens",
            "20",
        ],
        &[],
    );
    assert!(gen_out.status.success(), "{}", text(&gen_out));
}

#[test]
fn unknown_preset_and_foreign_checkpoint_kind_are_refused() {
    let out = kiln(
        &["train", "model.kind=resnet_bk", "model.preset=giant"],
        &[],
    );
    assert_fails(&out, 2, &["model.preset", "giant", "tiny, small, base"]);
    // A GPT checkpoint is not resumed as ResNet-BK.
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    let toml = run.join("config.toml");
    let cfg = fs::read_to_string(&toml).unwrap();
    fs::write(&toml, cfg.replace("kind = \"gpt\"", "kind = \"resnet_bk\"")).unwrap();
    let out = kiln(&["train", "--resume", run.to_str().unwrap()], &[]);
    assert_fails(
        &out,
        4,
        &["model.kind: checkpoint gpt, configured resnet_bk"],
    );
}

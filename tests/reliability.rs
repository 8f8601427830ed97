//! The bad-input suite: every row is a command line, or a damaged copy of a good run and a
//! command on it, with the exit code and a phrase the message must contain. Every row also
//! checks that the command neither panicked nor aborted, and that the run directory it was
//! given is byte for byte what it was before (a refused command changes nothing; readers
//! never write). Rows that start a run in a new directory check that a failed start leaves
//! nothing behind.
//!
//! Beside the table: two writers and the resume of a live run (the lock), signals (graceful
//! stop, second SIGINT, SIGUSR1), a full disk (a small tmpfs in a private mount namespace,
//! skipped with a message where the machine does not allow one), and a kill test: a run
//! killed with SIGKILL at random points and resumed each time ends bit-identical to a run
//! that was never interrupted.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn kiln_cmd(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args).env("RUST_BACKTRACE", "0");
    c
}

fn run(args: &[String]) -> Output {
    kiln_cmd(args).output().expect("kiln runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// Every file under `dir` with its bytes, the lock file aside (its record is the holder's,
/// not data).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return v;
    };
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            v.extend(snapshot(&p));
        } else if p.file_name().is_some_and(|n| n != "run.lock") {
            v.push((p.clone(), fs::read(&p).unwrap()));
        }
    }
    v.sort();
    v
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            fs::copy(e.path(), &target).unwrap();
        }
    }
}

fn tiny(extra: &[&str]) -> Vec<String> {
    common::with(extra)
}

/// A good run of the tiny model: 4 steps, checkpoints at steps 2 and 4. Made once; each
/// damage row works on a copy.
fn good_run() -> &'static Path {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep().join("good");
        let mut args = s(&["train", "--quiet", "--out", dir.to_str().unwrap()]);
        args.extend(tiny(&["train.steps=4", "train.checkpoint_every=2"]));
        let out = run(&args);
        assert!(out.status.success(), "{}", text(&out));
        dir
    })
}

fn ckpt(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step_{step:07}"))
}

fn flip(path: &Path, offset: usize, mask: u8) {
    let mut b = fs::read(path).unwrap();
    b[offset] ^= mask;
    fs::write(path, b).unwrap();
}

/// Offset of the first byte of tensor data in a safetensors file (after the 8-byte length
/// and the JSON header).
fn data_start(path: &Path) -> usize {
    let b = fs::read(path).unwrap();
    8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize
}

type Damage = fn(&Path);

/// What a row does to its copy of the good run before the command.
fn damages() -> Vec<(&'static str, Damage, &'static str)> {
    vec![
        (
            "truncated weights",
            |r| {
                let p = ckpt(r, 4).join("model.safetensors");
                let b = fs::read(&p).unwrap();
                fs::write(&p, &b[..b.len() / 2]).unwrap();
            },
            "truncated",
        ),
        (
            "bit flipped in the weights' header",
            |r| flip(&ckpt(r, 4).join("model.safetensors"), 12, 0x04),
            "does not match its manifest",
        ),
        (
            "one weight set to 1e30",
            |r| {
                let p = ckpt(r, 4).join("model.safetensors");
                let at = data_start(&p);
                let mut b = fs::read(&p).unwrap();
                b[at..at + 4].copy_from_slice(&1e30f32.to_le_bytes());
                fs::write(&p, b).unwrap();
            },
            "does not match its manifest",
        ),
        (
            "step changed in the trainer state",
            |r| {
                let p = ckpt(r, 4).join("trainer.json");
                let t = fs::read_to_string(&p)
                    .unwrap()
                    .replacen("\"step\": 4", "\"step\": 5", 1);
                fs::write(&p, t).unwrap();
            },
            "does not match its manifest",
        ),
        (
            "weights missing",
            |r| fs::remove_file(ckpt(r, 4).join("model.safetensors")).unwrap(),
            "model.safetensors",
        ),
        (
            "manifest missing",
            |r| fs::remove_file(ckpt(r, 4).join("manifest.json")).unwrap(),
            "manifest.json",
        ),
        (
            "manifest not JSON",
            |r| fs::write(ckpt(r, 4).join("manifest.json"), "{ not json").unwrap(),
            "manifest.json",
        ),
        (
            "latest dangling",
            |r| fs::write(r.join("checkpoints/latest"), "step_0000009").unwrap(),
            "does not exist",
        ),
        (
            "latest checkpoint directory removed",
            |r| fs::remove_dir_all(ckpt(r, 4)).unwrap(),
            "does not exist",
        ),
    ]
}

/// Damage to the optimizer state only: what needs it (resume, verify) refuses it; what does
/// not (eval, generate) is unaffected.
fn optimizer_damages() -> Vec<(&'static str, Damage)> {
    vec![
        ("exponent bit flipped in an optimizer moment", |r| {
            let p = ckpt(r, 4).join("optimizer.safetensors");
            let at = data_start(&p) + 3;
            flip(&p, at, 0x40);
        }),
        ("optimizer state truncated", |r| {
            let p = ckpt(r, 4).join("optimizer.safetensors");
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..b.len() - 7]).unwrap();
        }),
    ]
}

struct Tally {
    by_code: BTreeMap<i32, usize>,
    cases: usize,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            by_code: BTreeMap::new(),
            cases: 0,
        }
    }

    /// Checks one outcome: exit code, phrase, no panic, no abort.
    fn check(&mut self, what: &str, out: &Output, code: i32, phrase: &str) {
        let t = text(out);
        assert!(
            !t.contains("panicked") && !t.contains("RUST_BACKTRACE"),
            "{what}: panicked:\n{t}"
        );
        assert_eq!(
            out.status.code(),
            Some(code),
            "{what}: exit code (a signal ended it if None):\n{t}"
        );
        assert!(t.contains(phrase), "{what}: expected {phrase:?} in:\n{t}");
        *self.by_code.entry(code).or_default() += 1;
        self.cases += 1;
    }

    fn report(&self, suite: &str) {
        let codes: Vec<String> = self
            .by_code
            .iter()
            .map(|(c, n)| format!("exit {c}: {n}"))
            .collect();
        println!(
            "{suite}: {} cases, {}; 0 panics, 0 aborts, 0 changed files",
            self.cases,
            codes.join(", ")
        );
    }
}

/// A command line in a fresh directory: `{out}` stands for a run directory that does not
/// exist yet, `{dir}` for the (existing, empty) scratch directory.
struct ArgRow {
    args: Vec<String>,
    code: i32,
    phrase: &'static str,
}

fn row(args: &[&str], extra: &[&str], code: i32, phrase: &'static str) -> ArgRow {
    let mut a = s(args);
    if !extra.is_empty() {
        a.extend(tiny(extra));
    }
    ArgRow {
        args: a,
        code,
        phrase,
    }
}

#[test]
fn every_bad_argument_and_setting_is_refused_with_its_code() {
    let rows = vec![
        // Settings.
        row(
            &["train", "--out", "{out}"],
            &["foo.bar=1"],
            2,
            "unknown config key",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.steps=abc"],
            2,
            "train.steps",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.steps=0"],
            2,
            "at least 1",
        ),
        row(&["train", "--out", "{out}"], &["optim.lr=nan"], 2, "finite"),
        row(
            &["train", "--out", "{out}"],
            &["train.memory_limit=abc"],
            2,
            "unknown unit",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.checkpoint_async=maybe"],
            2,
            "true or false",
        ),
        row(
            &["train", "--out", "{out}"],
            &["data.tokenizer=nosuch"],
            2,
            "byte, gpt2",
        ),
        row(
            &["train", "--out", "{out}"],
            &["data.val_fraction=1.5"],
            2,
            "out of range",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.seq_len=64"],
            2,
            "model.context",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.precision=tf32"],
            2,
            "fp32",
        ),
        row(
            &["train", "--out", "{out}"],
            &["train.device=tpu"],
            2,
            "cuda:N",
        ),
        row(
            &["train", "--out", "{out}", "--device", "cuda:7"],
            &["train.steps=1"],
            2,
            "cuda:7",
        ),
        row(
            &["train", "--out", "{out}", "--profile", "nosuch"],
            &["train.steps=1"],
            2,
            "unknown profile",
        ),
        row(
            &["train", "--out", "{out}", "--config", "{dir}/missing.toml"],
            &["train.steps=1"],
            2,
            "--config",
        ),
        row(
            &["train", "--out", "{out}", "--stop-after", "0"],
            &["train.steps=1"],
            2,
            "--stop-after",
        ),
        row(
            &["train", "--out", "{out}", "--checkpoint", "step_2"],
            &["train.steps=1"],
            2,
            "--resume",
        ),
        row(
            &[
                "train",
                "--out",
                "{out}",
                "--trace",
                "{dir}/t.json",
                "--trace-steps",
                "5..2",
            ],
            &["train.steps=1"],
            2,
            "--trace-steps",
        ),
        row(&["train", "--bogus"], &[], 2, "--bogus"),
        // Data.
        row(
            &["train", "--out", "{out}"],
            &["data.corpus={dir}/missing.txt"],
            3,
            "does not exist",
        ),
        row(
            &["train", "--out", "{out}"],
            &["data.corpus={dir}/empty.txt"],
            3,
            "empty",
        ),
        // Host memory: typed, exit 6, never an abort.
        row(
            &["train", "--out", "{out}"],
            &["train.micro_batch=50000000"],
            6,
            "token batches",
        ),
        row(
            &["train", "--out", "{out}"],
            &["model.d_model=65536", "model.n_heads=64"],
            6,
            "out of memory",
        ),
        // Run directories that are not runs.
        row(
            &["train", "--resume", "{dir}/missing"],
            &[],
            4,
            "does not exist",
        ),
        row(&["train", "--resume", "{dir}"], &[], 4, "no config.toml"),
        row(
            &["eval", "--run", "{dir}/missing"],
            &[],
            4,
            "does not exist",
        ),
        row(&["generate", "--run", "{dir}"], &[], 4, "no config.toml"),
        row(&["verify", "{dir}/missing"], &[], 4, "does not exist"),
        // Other subcommands' arguments.
        row(&["plan", "--gpu", "nosuch"], &[], 2, "nosuch"),
        row(&["plan", "train.steps=abc"], &[], 2, "train.steps"),
        row(&["generate", "--top-k", "-1"], &[], 2, "'-1'"),
        row(&["generate", "--tokens", "abc"], &[], 2, "--tokens"),
        row(&["hw", "--bogus"], &[], 2, "--bogus"),
        // A negative number reaches kiln's own check, whose message says what to use.
        row(
            &["bench", "generate", "--no-python", "--temperature", "-1"],
            &[],
            2,
            "--temperature -1 is not a temperature",
        ),
        row(
            &["bench", "generate", "--no-python", "--top-p", "-0.5"],
            &[],
            2,
            "must be in (0, 1]",
        ),
        row(
            &[
                "classify",
                "--init-from",
                "{dir}/model",
                "--data",
                "{dir}/empty.txt",
                "--out",
                "{dir}/cv",
                "--lr",
                "-1",
            ],
            &[],
            2,
            "--lr -1 must be a positive number",
        ),
        row(
            &["bench", "amp", "--steps", "0", "--out", "{dir}/amp"],
            &[],
            2,
            "steps",
        ),
        row(&["frobnicate"], &[], 2, "frobnicate"),
    ];
    let mut tally = Tally::new();
    for r in rows {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_str().unwrap().to_string();
        fs::write(tmp.path().join("empty.txt"), "").unwrap();
        let out_dir = tmp.path().join("new/run");
        let args: Vec<String> = r
            .args
            .iter()
            .map(|a| {
                a.replace("{out}", out_dir.to_str().unwrap())
                    .replace("{dir}", &dir)
            })
            .collect();
        let before = snapshot(tmp.path());
        let out = run(&args);
        let what = args.join(" ");
        tally.check(&what, &out, r.code, r.phrase);
        assert!(
            !tmp.path().join("new").exists(),
            "{what}: a failed start left {} behind",
            out_dir.display()
        );
        assert_eq!(snapshot(tmp.path()), before, "{what}: changed files");
    }
    tally.report("arguments and settings");
}

/// Runs `args` (with `{run}` replaced) on a copy of the good run after `damage`, checks the
/// outcome and that the copy is unchanged.
fn on_copy(tally: &mut Tally, label: &str, damage: Damage, args: &[&str], code: i32, phrase: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path().join("run");
    copy_dir(good_run(), &r);
    damage(&r);
    let before = snapshot(&r);
    let args: Vec<String> = args
        .iter()
        .map(|a| a.replace("{run}", r.to_str().unwrap()))
        .collect();
    let out = run(&args);
    tally.check(&format!("{label}: {}", args.join(" ")), &out, code, phrase);
    assert_eq!(snapshot(&r), before, "{label}: {args:?} changed the run");
}

#[test]
fn damaged_checkpoints_are_named_and_never_load() {
    let mut tally = Tally::new();
    let resume = ["train", "--resume", "{run}", "--quiet", "train.steps=6"];
    let eval = ["eval", "--run", "{run}"];
    let generate = ["generate", "--run", "{run}", "--tokens", "5"];
    let verify = ["verify", "{run}"];
    for (label, damage, phrase) in damages() {
        for cmd in [&resume[..], &eval, &generate, &verify] {
            on_copy(&mut tally, label, damage, cmd, 4, phrase);
        }
        // The error lists what verifies, and --checkpoint selects it.
        on_copy(&mut tally, label, damage, &eval, 4, "that verify: ");
        on_copy(
            &mut tally,
            label,
            damage,
            &["eval", "--run", "{run}", "--checkpoint", "step_2"],
            0,
            "(step 2)",
        );
        on_copy(
            &mut tally,
            label,
            damage,
            &[
                "generate",
                "--run",
                "{run}",
                "--tokens",
                "5",
                "--checkpoint",
                "2",
            ],
            0,
            "ROMEO:",
        );
    }
    for (label, damage) in optimizer_damages() {
        on_copy(
            &mut tally,
            label,
            damage,
            &resume,
            4,
            "optimizer.safetensors",
        );
        on_copy(
            &mut tally,
            label,
            damage,
            &verify,
            4,
            "optimizer.safetensors",
        );
        on_copy(&mut tally, label, damage, &eval, 0, "(step 4)");
    }
    let both: Damage = |r| {
        for step in [2, 4] {
            flip(&ckpt(r, step).join("model.safetensors"), 40, 0x01);
        }
    };
    on_copy(
        &mut tally,
        "every checkpoint damaged",
        both,
        &eval,
        4,
        "no other checkpoint of this run verifies",
    );
    on_copy(
        &mut tally,
        "every checkpoint damaged",
        both,
        &verify,
        4,
        "no checkpoint verifies",
    );
    // A process stopped between its first checkpoint's rename and its pointer leaves no
    // `latest`: readers take the newest, and verify agrees when that one verifies.
    let no_pointer: Damage = |r| fs::remove_file(r.join("checkpoints").join("latest")).unwrap();
    on_copy(
        &mut tally,
        "latest pointer missing",
        no_pointer,
        &verify,
        0,
        "step_0000004 (no pointer",
    );
    on_copy(
        &mut tally,
        "latest pointer missing",
        no_pointer,
        &eval,
        0,
        "(step 4)",
    );
    let no_pointer_newest_damaged: Damage = |r| {
        fs::remove_file(r.join("checkpoints").join("latest")).unwrap();
        flip(&ckpt(r, 4).join("model.safetensors"), 40, 0x01);
    };
    on_copy(
        &mut tally,
        "latest pointer missing, newest damaged",
        no_pointer_newest_damaged,
        &verify,
        4,
        "the newest checkpoint, step_0000004, does not verify",
    );
    let none: Damage = |_| {};
    on_copy(
        &mut tally,
        "good run",
        none,
        &verify,
        0,
        "verified    2 checkpoint(s)",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["eval", "--run", "{run}", "--checkpoint", "step_9"],
        4,
        "the run has step_0000004, step_0000002",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["eval", "--run", "{run}", "--checkpoint", "latest"],
        2,
        "expected step_N",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["train", "--resume", "{run}", "train.steps=4"],
        2,
        "has done 4 steps",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["train", "--resume", "{run}", "train.steps=2"],
        2,
        "train.steps=8",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &[
            "train",
            "--resume",
            "{run}",
            "--stop-after",
            "3",
            "train.steps=8",
        ],
        2,
        "--stop-after 3",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["train", "--resume", "{run}", "model.d_model=64"],
        4,
        "another shape",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["train", "--out", "{run}"],
        2,
        "already holds a run",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["eval", "--run", "{run}", "--batches", "0"],
        2,
        "--batches 0",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["eval", "--run", "{run}", "--seq-len", "0"],
        2,
        "--seq-len 0",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["eval", "--run", "{run}", "--seq-len", "64"],
        2,
        "context of 32",
    );
    for t in ["nan", "inf", "-1", "-inf"] {
        let temp = format!("--temperature={t}");
        let args = ["generate", "--run", "{run}", temp.as_str()];
        on_copy(&mut tally, "good run", none, &args, 2, "--temperature");
    }
    on_copy(
        &mut tally,
        "good run",
        none,
        &["generate", "--run", "{run}", "--tokens", "0"],
        2,
        "--tokens 0",
    );
    on_copy(
        &mut tally,
        "good run",
        none,
        &["generate", "--run", "{run}", "--prompt", ""],
        2,
        "--prompt",
    );
    // Resuming from an earlier checkpoint past a damaged latest, in a copy that may change.
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path().join("run");
    copy_dir(good_run(), &r);
    flip(&ckpt(&r, 4).join("model.safetensors"), 40, 0x01);
    let out = run(&[
        s(&[
            "train",
            "--quiet",
            "--resume",
            r.to_str().unwrap(),
            "--checkpoint",
            "step_2",
        ]),
        s(&["train.steps=4"]),
    ]
    .concat());
    tally.check(
        "resume --checkpoint step_2 past a damaged latest",
        &out,
        0,
        "done: 4 steps",
    );
    let fixed = fs::read(ckpt(&r, 4).join("model.safetensors")).unwrap();
    assert_eq!(
        fixed,
        fs::read(ckpt(good_run(), 4).join("model.safetensors")).unwrap(),
        "redoing steps 3 and 4 from step 2 gives the same weights"
    );
    tally.report("checkpoints");
}

/// Turns a checkpoint into one as kiln wrote them before checkpoints carried manifests: no
/// manifest.json, and format version 1 in the trainer state (the same JSON otherwise).
fn make_legacy(ckpt: &Path) {
    fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let p = ckpt.join("trainer.json");
    let t = fs::read_to_string(&p).unwrap();
    assert!(t.contains("\"format_version\": 2,"), "{t}");
    fs::write(
        &p,
        t.replacen("\"format_version\": 2,", "\"format_version\": 1,", 1),
    )
    .unwrap();
}

/// Rewrites the format version in the trainer state and records the new file in the
/// manifest, as a kiln writing that version would have.
fn set_version_with_manifest(ckpt: &Path, version: u32) {
    let p = ckpt.join("trainer.json");
    let t = fs::read_to_string(&p).unwrap().replacen(
        "\"format_version\": 2,",
        &format!("\"format_version\": {version},"),
        1,
    );
    fs::write(&p, &t).unwrap();
    let mp = ckpt.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&mp).unwrap()).unwrap();
    m["format_version"] = version.into();
    for f in m["files"].as_array_mut().unwrap() {
        if f["name"] == "trainer.json" {
            f["bytes"] = t.len().into();
            f["crc32"] = format!("{:08x}", crc32fast::hash(t.as_bytes())).into();
        }
    }
    fs::write(&mp, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

#[test]
fn legacy_checkpoints_load_with_a_warning_and_verify_once_adopted() {
    let mut tally = Tally::new();
    let warning = "cannot be checked";
    let legacy: Damage = |r| make_legacy(&ckpt(r, 4));
    for (args, phrase) in [
        (&["eval", "--run", "{run}"][..], warning),
        (&["generate", "--run", "{run}", "--tokens", "5"], warning),
        (&["export", "--run", "{run}", "--to", "{run}-hf"], warning),
        (&["eval", "--run", "{run}"], "(step 4)"),
    ] {
        on_copy(&mut tally, "legacy latest", legacy, args, 0, phrase);
    }
    let verify = ["verify", "{run}"];
    on_copy(
        &mut tally,
        "legacy latest",
        legacy,
        &verify,
        10,
        "step_0000004: legacy (no manifest): unverified",
    );
    on_copy(&mut tally, "legacy latest", legacy, &verify, 10, "--adopt");
    let all: Damage = |r| {
        make_legacy(&ckpt(r, 2));
        make_legacy(&ckpt(r, 4));
    };
    on_copy(
        &mut tally,
        "every checkpoint legacy",
        all,
        &verify,
        10,
        "unverified: step_0000004, step_0000002 (written before",
    );
    // A legacy checkpoint is still checked for what can be checked without a manifest.
    let truncated: Damage = |r| {
        make_legacy(&ckpt(r, 4));
        let p = ckpt(r, 4).join("model.safetensors");
        let b = fs::read(&p).unwrap();
        fs::write(&p, &b[..b.len() - 9]).unwrap();
    };
    for cmd in [&["eval", "--run", "{run}"][..], &verify] {
        on_copy(
            &mut tally,
            "legacy and truncated",
            truncated,
            cmd,
            4,
            "model.safetensors",
        );
    }
    on_copy(
        &mut tally,
        "legacy and truncated",
        truncated,
        &["verify", "{run}", "--adopt"],
        4,
        "adopted     none",
    );
    // When the latest is damaged, the legacy one is offered as what it is.
    let damaged_beside_legacy: Damage = |r| {
        make_legacy(&ckpt(r, 2));
        flip(&ckpt(r, 4).join("model.safetensors"), 40, 0x01);
    };
    on_copy(
        &mut tally,
        "latest damaged, earlier legacy",
        damaged_beside_legacy,
        &["eval", "--run", "{run}"],
        4,
        "step_0000002 (legacy, unverified)",
    );
    // A version 1 checkpoint that has a manifest (written by kilns between manifests and
    // the version bump) verifies like a version 2 one.
    let v1_manifest: Damage = |r| set_version_with_manifest(&ckpt(r, 4), 1);
    on_copy(
        &mut tally,
        "version 1 with a manifest",
        v1_manifest,
        &verify,
        0,
        "verified    2 checkpoint(s)",
    );
    on_copy(
        &mut tally,
        "version 1 with a manifest",
        v1_manifest,
        &["eval", "--run", "{run}"],
        0,
        "(step 4)",
    );
    let v3: Damage = |r| set_version_with_manifest(&ckpt(r, 4), 3);
    on_copy(
        &mut tally,
        "version 3",
        v3,
        &["eval", "--run", "{run}"],
        4,
        "format version 3 is newer",
    );

    // Adoption writes one file per legacy checkpoint, manifest.json, and nothing else.
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path().join("run");
    copy_dir(good_run(), &r);
    make_legacy(&ckpt(&r, 4));
    let before = snapshot(&r);
    let run_s = r.to_str().unwrap();
    let out = run(&s(&["verify", run_s, "--adopt"]));
    tally.check("--adopt", &out, 0, "adopted     step_0000004");
    let after: Vec<_> = snapshot(&r)
        .into_iter()
        .filter(|(p, _)| *p != ckpt(&r, 4).join("manifest.json"))
        .collect();
    assert_eq!(after, before, "--adopt changed more than the manifest");
    let out = run(&s(&["verify", run_s]));
    tally.check(
        "verify after --adopt",
        &out,
        0,
        "(against a manifest adopted from its files)",
    );
    let out = run(&s(&["verify", run_s, "--adopt"]));
    tally.check("--adopt again", &out, 0, "adopted     none");

    // Resuming from a legacy checkpoint warns and stays bit-exact.
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path().join("run");
    copy_dir(good_run(), &r);
    make_legacy(&ckpt(&r, 2));
    let run_s = r.to_str().unwrap();
    let out = run(&s(&[
        "train",
        "--resume",
        run_s,
        "--checkpoint",
        "step_2",
        "train.steps=4",
    ]));
    tally.check("resume from a legacy checkpoint", &out, 0, warning);
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            fs::read(ckpt(&r, 4).join(f)).unwrap()
                == fs::read(ckpt(good_run(), 4).join(f)).unwrap(),
            "{f} differs after resuming from a legacy checkpoint"
        );
    }
    tally.report("legacy checkpoints");
}

/// Starts a long tiny run in the background and waits until it has logged a step.
fn start_long(dir: &Path, extra: &[&str]) -> Child {
    let mut args = s(&["train", "--out", dir.to_str().unwrap()]);
    args.extend(tiny(
        &[
            &["train.steps=1000000", "train.checkpoint_every=1000000"],
            extra,
        ]
        .concat(),
    ));
    let child = kiln_cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("metrics.jsonl");
    let start = Instant::now();
    while fs::metadata(&metrics).map_or(true, |m| m.len() == 0) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the run never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn signal(child: &Child, sig: i32) {
    let rc = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(rc.success());
}

#[test]
fn a_run_directory_has_one_writer() {
    let mut tally = Tally::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let live = start_long(&dir, &[]);
    let before_config = fs::read(dir.join("config.toml")).unwrap();
    let mut second = s(&["train", "--out", dir.to_str().unwrap()]);
    second.extend(tiny(&["train.seed=7"]));
    let out = run(&second);
    tally.check(
        "second writer",
        &out,
        9,
        &format!("in use by pid {}", live.id()),
    );
    let resume = s(&["train", "--resume", dir.to_str().unwrap()]);
    let out = run(&resume);
    tally.check("resume of a live run", &out, 9, "run.lock");
    assert_eq!(fs::read(dir.join("config.toml")).unwrap(), before_config);
    let out = run(&s(&["verify", dir.to_str().unwrap()]));
    tally.check("verify a live run", &out, 0, "in use");
    let out = run(&s(&["verify", dir.to_str().unwrap(), "--adopt"]));
    tally.check("--adopt on a live run", &out, 9, "run.lock");
    // SIGKILL leaves the holder's record; the next run takes the lock over and says so.
    signal(&live, 9);
    let out = live.wait_with_output().unwrap();
    assert_eq!(out.status.code(), None, "killed");
    let mut again = s(&["train", "--out", dir.to_str().unwrap()]);
    again.extend(tiny(&["train.steps=2"]));
    let out = run(&again);
    tally.check("stale lock", &out, 0, "no longer running; taking it over");
    tally.report("concurrency");
}

#[test]
fn signals_stop_at_a_step_boundary_with_a_checkpoint() {
    let mut tally = Tally::new();
    for (name, sig, code, phrase, extra) in [
        ("SIGTERM", 15, 75, "stopped by SIGTERM", None),
        ("SIGINT", 2, 75, "stopped by SIGINT", None),
        (
            "SIGTERM, saving in line",
            15,
            75,
            "stopped by SIGTERM",
            Some("train.checkpoint_async=false"),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let child = start_long(&dir, extra.as_slice());
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        tally.check(name, &out, code, phrase);
        let v = run(&s(&["verify", dir.to_str().unwrap()]));
        tally.check(
            &format!("verify after {name}"),
            &v,
            0,
            "verified    1 checkpoint(s)",
        );
        let metrics = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        assert!(metrics.contains("\"kind\":\"checkpoint\""), "{metrics}");
    }
    // A second SIGINT stops at once, without waiting for the step boundary's save.
    let tmp = tempfile::tempdir().unwrap();
    let child = start_long(&tmp.path().join("run"), &[]);
    signal(&child, 2);
    signal(&child, 2);
    let out = child.wait_with_output().unwrap();
    let c = out.status.code();
    assert!(c == Some(130) || c == Some(75), "{c:?}: {}", text(&out));
    *tally.by_code.entry(c.unwrap_or(-1)).or_default() += 1;
    tally.cases += 1;
    // SIGUSR1 saves and goes on.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let child = start_long(&dir, &[]);
    signal(&child, 10);
    let start = Instant::now();
    while checkpoint_count(&dir) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "SIGUSR1 saved nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(child_alive(&child), "SIGUSR1 must not stop the run");
    signal(&child, 15);
    let out = child.wait_with_output().unwrap();
    tally.check("SIGTERM after SIGUSR1", &out, 75, "checkpoint saved");
    tally.report("signals");
}

fn checkpoint_count(dir: &Path) -> usize {
    fs::read_dir(dir.join("checkpoints")).map_or(0, |e| {
        e.filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("step_"))
        })
        .count()
    })
}

fn child_alive(child: &Child) -> bool {
    Path::new(&format!("/proc/{}", child.id())).exists()
}

#[test]
fn a_full_disk_is_exit_7_and_leaves_no_temporary_files() {
    // A private mount namespace (root or unprivileged user namespaces) holds a small tmpfs.
    let probe = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "true"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("skipped: this machine does not allow a private tmpfs (unshare failed)");
        return;
    }
    let mut tally = Tally::new();
    // 300 KiB: the config and metrics fit, a checkpoint (about 420 KiB) does not.
    for (size, checkpoint_every) in [("300k", "2"), ("8k", "1")] {
        let tmp = tempfile::tempdir().unwrap();
        let mnt = tmp.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let run_dir = mnt.join("run");
        let kiln = env!("CARGO_BIN_EXE_kiln");
        let overrides = tiny(&[
            "train.steps=4",
            &format!("train.checkpoint_every={checkpoint_every}"),
        ])
        .join(" ");
        let script = format!(
            "mount -t tmpfs -o size={size} tmpfs {m} && RUST_BACKTRACE=0 {kiln} train --quiet --out {r} {overrides}; rc=$?; find {m} -name '*.tmp*' | sed 's/^/LEFT /'; ls -A {r} 2>/dev/null | sed 's/^/HAS /'; exit $rc",
            m = mnt.display(),
            r = run_dir.display()
        );
        let out = Command::new("unshare")
            .args(["--user", "--map-root-user", "--mount", "sh", "-c", &script])
            .output()
            .unwrap();
        let t = text(&out);
        tally.check(&format!("disk of {size}"), &out, 7, "cannot write");
        assert!(
            !t.contains("LEFT "),
            "temporary files left on a full disk:\n{t}"
        );
        if t.contains("HAS ") {
            assert!(t.contains("HAS metrics.jsonl"), "only data is kept:\n{t}");
        }
    }
    tally.report("disk full");
}

/// `train.checkpoint_async=false` saves in line (training waits for the write) and writes the
/// same bytes as the background writer.
#[test]
fn an_inline_save_writes_what_the_background_writer_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("inline");
    let mut args = s(&["train", "--quiet", "--out", dir.to_str().unwrap()]);
    args.extend(tiny(&[
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.checkpoint_async=false",
    ]));
    let out = run(&args);
    assert!(out.status.success(), "{}", text(&out));
    for step in [2, 4] {
        for f in ["model.safetensors", "optimizer.safetensors", "trainer.json"] {
            assert!(
                fs::read(ckpt(&dir, step).join(f)).unwrap()
                    == fs::read(ckpt(good_run(), step).join(f)).unwrap(),
                "step {step}: {f} differs between in-line and background saves"
            );
        }
    }
    let metrics = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let saves: Vec<&str> = metrics
        .lines()
        .filter(|l| l.contains("\"kind\":\"checkpoint\""))
        .collect();
    assert_eq!(saves.len(), 2, "{metrics}");
    for line in saves {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(r["mode"], "inline", "{line}");
        assert_eq!(r["staging"], "pageable", "{line}");
        // In line, training waits for the write as well as the copy.
        let (stall, write) = (
            r["stall_s"].as_f64().unwrap(),
            r["write_s"].as_f64().unwrap(),
        );
        assert!(stall >= write, "{line}");
    }
    let background = fs::read_to_string(good_run().join("metrics.jsonl")).unwrap();
    assert!(
        background.contains("\"mode\":\"background\""),
        "{background}"
    );
}

/// SIGKILL at random points, resuming after each, ends bit-identical to a run never stopped.
#[test]
fn killed_at_random_points_and_resumed_the_run_is_bit_exact() {
    const KILLS: usize = 10;
    let steps = ["train.steps=40", "train.checkpoint_every=1"];
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    let mut args = s(&["train", "--quiet", "--out", reference.to_str().unwrap()]);
    args.extend(tiny(&steps));
    let started = Instant::now();
    assert!(run(&args).status.success());
    let full_ms = started.elapsed().as_millis() as u64;

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    println!("kill test seed {seed}; an uninterrupted run takes {full_ms} ms");
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let dir = tmp.path().join("killed");
    let mut kills = 0;
    let mut attempts = 0;
    loop {
        attempts += 1;
        assert!(attempts < 100, "the killed run never finished");
        let resume = checkpoint_count(&dir) > 0;
        let mut args = if resume {
            s(&["train", "--quiet", "--resume", dir.to_str().unwrap()])
        } else {
            s(&["train", "--quiet", "--out", dir.to_str().unwrap()])
        };
        args.extend(tiny(&steps));
        let mut child = kiln_cmd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if kills < KILLS {
            // Up to a quarter of a whole run: most starts die somewhere in the middle, a few
            // while starting or while resuming.
            std::thread::sleep(Duration::from_millis(next() % (full_ms / 4).max(20)));
            if child.try_wait().unwrap().is_none() {
                signal(&child, 9);
                kills += 1;
            }
        }
        let out = child.wait_with_output().unwrap();
        match out.status.code() {
            Some(0) => break,
            None => continue,
            Some(c) => panic!("exit {c} after {kills} kills:\n{}", text(&out)),
        }
    }
    let v = run(&s(&["verify", dir.to_str().unwrap()]));
    assert!(v.status.success(), "{}", text(&v));
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert!(
            fs::read(ckpt(&dir, 40).join(f)).unwrap()
                == fs::read(ckpt(&reference, 40).join(f)).unwrap(),
            "{f} differs after {kills} kills (seed {seed})"
        );
    }
    println!("kill test: {kills} kills over {attempts} starts, final checkpoint bit-identical");
}

#[test]
fn save_final_false_ends_a_run_without_its_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut args = s(&["train", "--quiet", "--out", dir.to_str().unwrap()]);
    args.extend(tiny(&[
        "train.steps=4",
        "train.checkpoint_every=3",
        "train.save_final=false",
    ]));
    let out = run(&args);
    assert!(out.status.success(), "{}", text(&out));
    // The periodic save at step 3 stays; step 4, the last, is not saved.
    assert!(ckpt(&dir, 3).is_dir(), "{}", text(&out));
    assert_eq!(checkpoint_count(&dir), 1, "{}", text(&out));
    let summary: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert!(
        summary["checkpoint"]
            .as_str()
            .unwrap()
            .ends_with("step_0000003"),
        "{summary}"
    );
}

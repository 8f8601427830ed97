//! Data parallelism end to end on the CPU: ranks are real `kiln train` processes started with
//! the environment torchrun gives (RANK, WORLD_SIZE, ...), meeting at a loopback rendezvous,
//! reducing gradients over the control plane. Two ranks must train like one process reading
//! the same global batch, under every ZeRO stage; a ZeRO checkpoint of two ranks must resume
//! on one; a rank that never arrives or dies must stop the job with a message naming it.

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn train_args(out: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--profile",
        "none",
        "--device",
        "cpu",
        "-q",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(out.display().to_string());
    a.extend(common::with(&[
        "data.tokenizer=byte",
        "train.steps=6",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "optim.lr=3e-3",
    ]));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn rank(r: usize, world: usize, port: u16, args: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("RANK", r.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", r.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn single(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap()
}

/// One process trains `train_args(dir, extra)` to the end.
fn train_alone(dir: &Path, extra: &[&str]) {
    let o = single(&train_args(dir, extra));
    assert!(o.status.success(), "{}", text(&o));
}

fn run_world(world: usize, args: &[String]) -> Vec<Output> {
    let port = free_port();
    let children: Vec<Child> = (0..world).map(|r| rank(r, world, port, args)).collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every train record in a run's metrics.
fn train_records(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .collect()
}

/// `(step, loss)` of every train record in a run's metrics.
fn losses(dir: &Path) -> Vec<(u64, f64)> {
    train_records(dir)
        .iter()
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

fn assert_close(a: &[(u64, f64)], b: &[(u64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for ((sa, la), (sb, lb)) in a.iter().zip(b) {
        assert_eq!(sa, sb);
        // Only the order of the gradient additions differs.
        assert!(
            (la - lb).abs() <= 2e-5 * la.abs(),
            "{what}: step {sa}: {la} vs {lb}"
        );
    }
}

#[test]
fn two_ranks_train_like_one_process_reading_the_same_global_batch_under_every_zero_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    train_alone(&one, &["train.grad_accum=2"]);
    let reference = losses(&one);
    assert_eq!(reference.len(), 6);
    // The losses fall, so the comparison is of training, not of six initial losses.
    assert!(reference[5].1 < reference[0].1, "{reference:?}");
    for zero in 0..=2 {
        let dir = tmp.path().join(format!("zero{zero}"));
        let zero_setting = format!("dist.zero={zero}");
        let outs = run_world(2, &train_args(&dir, &["train.grad_accum=1", &zero_setting]));
        for o in &outs {
            assert!(o.status.success(), "ZeRO-{zero}: {}", text(o));
        }
        assert_close(&losses(&dir), &reference, &format!("ZeRO-{zero}"));
        // Rank 0 alone writes the run; its metrics carry every rank's memory peak.
        let m = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        assert!(m.contains("\"mem_peak_ranks\":["), "{m}");
        assert!(dir.join("summary.json").is_file());
    }
}

#[test]
fn a_zero1_checkpoint_of_two_ranks_resumes_on_one_as_if_never_interrupted() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    train_alone(&whole, &["train.grad_accum=2"]);
    let split = tmp.path().join("split");
    let mut first = train_args(&split, &["train.grad_accum=1", "dist.zero=1"]);
    first.extend(["--stop-after".to_string(), "3".to_string()]);
    for o in run_world(2, &first) {
        assert!(o.status.success(), "{}", text(&o));
    }
    assert!(split.join("checkpoints").join("step_0000003").is_dir());
    // Resume the run on one process: the checkpoint holds every rank's moments.
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--profile",
            "none",
            "--device",
            "cpu",
            "-q",
            "--resume",
            &split.display().to_string(),
            "train.grad_accum=2",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_close(&losses(&split), &losses(&whole), "2 ranks then 1");
}

#[test]
fn a_rank_that_never_arrives_is_named_after_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let args = train_args(&tmp.path().join("r"), &["dist.timeout_s=2"]);
    let start = Instant::now();
    let o = rank(0, 2, port, &args).wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rank(s) 1 never arrived"), "{err}");
    assert!(err.contains(&port.to_string()), "{err}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_rank_that_dies_stops_the_other_with_its_name_and_keeps_the_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let port = free_port();
    let args = train_args(
        &dir,
        &[
            "train.steps=100000",
            "train.checkpoint_every=2",
            "dist.timeout_s=30",
        ],
    );
    let r0 = rank(0, 2, port, &args);
    let mut r1 = rank(1, 2, port, &args);
    // Wait until a checkpoint exists, then kill rank 1 as a crash would. Any step counts:
    // under load the first one can be pruned before a poll sees it.
    let start = Instant::now();
    let any_checkpoint = || {
        std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("step_"))
        })
    };
    while !any_checkpoint() {
        assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint");
        std::thread::sleep(Duration::from_millis(50));
    }
    r1.kill().unwrap();
    let killed = Instant::now();
    let o = r0.wait_with_output().unwrap();
    assert!(
        killed.elapsed() < Duration::from_secs(20),
        "rank 0 took {:?}",
        killed.elapsed()
    );
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rank 1 on"), "{err}");
    let _ = r1.wait();
    // The checkpoints on disk verify.
    let v = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["verify", &dir.display().to_string()])
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", text(&v));
}

#[test]
fn a_port_in_use_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let holder = TcpListener::bind(("0.0.0.0", 0)).unwrap();
    let port = holder.local_addr().unwrap().port();
    let o = rank(0, 2, port, &train_args(&tmp.path().join("r"), &[]))
        .wait_with_output()
        .unwrap();
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("port {port}")) && err.contains("in use"),
        "{err}"
    );
}

#[test]
fn bad_launch_settings_are_refused_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let args = train_args(&tmp.path().join("r"), &[]);
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
        c.args(&args).args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let o = run(&["--gpus", "0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--gpus 0"));
    let o = run(&[], &[("RANK", "1")]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("WORLD_SIZE is not"));
    let o = run(
        &[],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("LOCAL_RANK=1 disagrees"));
    let o = run(&["dist.zero=3"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(!tmp.path().join("r").join("checkpoints").exists());
}

/// `kiln plan --json --gpus 2` of the tiny model with `extra`: the plan and its three ZeRO
/// stages.
fn plan_over_two(extra: &[&str]) -> (serde_json::Value, Vec<serde_json::Value>) {
    let mut plan_args: Vec<String> = ["plan", "--profile", "none", "--json", "--gpus", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    plan_args.extend(common::with(extra));
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&plan_args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let stages = plan["data_parallel"]["stages"].as_array().unwrap().clone();
    assert_eq!(stages.len(), 3);
    (plan, stages)
}

#[test]
fn the_plan_of_each_zero_stage_is_the_pool_peak_each_rank_measures() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, stages) = plan_over_two(&["data.tokenizer=byte", "train.device=cpu"]);
    for (zero, stage) in [(0usize, &stages[0]), (1, &stages[1])] {
        let dir = tmp.path().join(format!("z{zero}"));
        let z = format!("dist.zero={zero}");
        for o in run_world(2, &train_args(&dir, &["train.grad_accum=1", &z])) {
            assert!(o.status.success(), "{}", text(&o));
        }
        let last = train_records(&dir).pop().unwrap();
        let peaks: Vec<u64> = last["mem_peak_ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let fullest = *peaks.iter().max().unwrap();
        assert_eq!(
            fullest,
            stage["pool_peak"].as_u64().unwrap(),
            "ZeRO-{zero}: measured {peaks:?}, planned {stage}"
        );
    }
    // Sharding the moments saves memory on every rank.
    assert!(stages[1]["pool_peak"].as_u64() < stages[0]["pool_peak"].as_u64());
}

#[test]
fn a_llama_plan_over_two_gpus_is_the_pool_peak_each_rank_measures() {
    // The meta-step planner (every family but GPT and ResNet-BK's walks) reports the same
    // per-rank stages; the fullest ZeRO-1 rank must book exactly what the plan says.
    let tmp = tempfile::tempdir().unwrap();
    let llama = [
        "model.kind=llama",
        "model.n_kv_heads=1",
        "model.ffn_hidden=64",
        "data.tokenizer=byte",
        "train.device=cpu",
    ];
    let (plan, stages) = plan_over_two(&llama);
    assert_eq!(stages[0]["pool_peak"], plan["pool_peak"]);
    let dir = tmp.path().join("z1");
    let mut extra = vec!["train.grad_accum=1", "dist.zero=1"];
    extra.extend(&llama[..3]);
    for o in run_world(2, &train_args(&dir, &extra)) {
        assert!(o.status.success(), "{}", text(&o));
    }
    let last = train_records(&dir).pop().unwrap();
    let fullest = last["mem_peak_ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .max()
        .unwrap();
    assert_eq!(fullest, stages[1]["pool_peak"].as_u64().unwrap(), "{plan}");
    assert!(stages[1]["pool_peak"].as_u64() < stages[0]["pool_peak"].as_u64());
}

#[test]
fn a_global_batch_is_split_across_ranks_or_refused_with_the_sizes_that_would_split_it() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    train_alone(&one, &["train.global_batch=8"]);
    // 8 sequences of micro-batch 4 on two ranks: one micro-batch each, the same run.
    let two = tmp.path().join("two");
    for o in run_world(2, &train_args(&two, &["train.global_batch=8"])) {
        assert!(o.status.success(), "{}", text(&o));
    }
    assert_close(&losses(&two), &losses(&one), "global batch 8 on 2 ranks");
    // 12 sequences are 3 micro-batches: two ranks cannot share them.
    let outs = run_world(
        2,
        &train_args(&tmp.path().join("bad"), &["train.global_batch=12"]),
    );
    for o in &outs {
        assert_eq!(o.status.code(), Some(2), "{}", text(o));
    }
    let err = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        err.contains("train.global_batch = 12") && err.contains("run on 1, 3 GPUs"),
        "{err}"
    );
}

#[test]
fn a_rank_that_runs_out_of_memory_makes_every_rank_split_the_same_way() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    train_alone(&one, &["train.grad_accum=2"]);
    // Rank 1 alone gets a cap between the peaks of 2 and 4 sequences per pass.
    let (two_rows, four_rows) = (
        common::step_peak(&["train.micro_batch=2"]),
        common::step_peak(&["train.micro_batch=4"]),
    );
    assert!(two_rows < four_rows);
    let cap = format!("train.memory_limit={}", (two_rows + four_rows) / 2);
    let dir = tmp.path().join("split");
    let port = free_port();
    let base = train_args(&dir, &["train.grad_accum=1"]);
    let mut capped = base.clone();
    capped.push(cap);
    let r0 = rank(0, 2, port, &base);
    let r1 = rank(1, 2, port, &capped);
    for o in [
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    ] {
        assert!(o.status.success(), "{}", text(&o));
    }
    // Rank 0 split too (it records the split), and the run is still the same run.
    let m = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(m.contains("\"kind\":\"oom\""), "{m}");
    assert_close(&losses(&dir), &losses(&one), "a split on one rank");
}

fn launcher(args: &[String], port: u16) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .args(["--gpus", "2", "--master-port", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn the_gpus_launcher_runs_its_ranks_and_passes_sigterm_on_to_them() {
    let tmp = tempfile::tempdir().unwrap();
    // On the CPU `--gpus 2` starts two processes; the run is the one-process run of the same
    // global batch.
    let one = tmp.path().join("one");
    train_alone(&one, &["train.grad_accum=2", "train.steps=40"]);
    let dir = tmp.path().join("launched");
    let args = train_args(
        &dir,
        &[
            "train.grad_accum=1",
            "train.steps=40",
            "train.checkpoint_every=2",
        ],
    );
    let child = launcher(&args, free_port());
    let start = Instant::now();
    while !dir.join("checkpoints").join("step_0000004").is_dir() {
        assert!(start.elapsed() < Duration::from_secs(60), "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGTERM to the launcher only: every rank saves at the same step and stops with 75.
    // SAFETY: kill(2) on our child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(75), "{}", text(&o));
    let stopped = losses(&dir).len();
    assert!(stopped < 40, "the run stopped early ({stopped} steps)");
    let v = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["verify", &dir.display().to_string()])
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", text(&v));
    // Resumed by the launcher on two processes, it finishes as the one-process run.
    let resumed = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--profile",
            "none",
            "--device",
            "cpu",
            "-q",
            "--gpus",
            "2",
            "--master-port",
            &free_port().to_string(),
            "--resume",
            &dir.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert_close(
        &losses(&dir),
        &losses(&one),
        "stopped and resumed by the launcher",
    );
}

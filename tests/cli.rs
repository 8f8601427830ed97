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
    assert_fails(&out, 2, &["longer than the model's context of 32"]);
    // A streamed reply echoes its prompt with the first token: a refused prompt prints only
    // its error.
    let long = "a".repeat(40);
    let out = kiln(
        &[
            "generate",
            "--run",
            run.to_str().unwrap(),
            "--prompt",
            &long,
        ],
        &[],
    );
    assert_fails(
        &out,
        2,
        &[
            "prompt 1 has 40 tokens",
            "more than the model's context of 32",
        ],
    );
    assert!(out.stdout.is_empty(), "{}", text(&out));
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

#[test]
fn hw_reports_the_machine_and_why_there_is_no_gpu() {
    let out = kiln(&["hw"], &[]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for needle in ["CPU ", "RAM ", "recommended settings:", "train.precision="] {
        assert!(t.contains(needle), "expected {needle:?} in:\n{t}");
    }
    // With no GPU the report says why in one line, and recommends the CPU.
    if t.contains("no GPU ") {
        assert!(t.contains("train.device=cpu train.precision=fp32"), "{t}");
    }
    let alias = kiln(&["check-hardware"], &[]);
    assert!(alias.status.success(), "{}", text(&alias));
}

#[test]
fn hw_json_parses_and_keeps_its_field_names() {
    let out = kiln(&["hw", "--json"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert!(v["cpu"]["threads"].as_u64().unwrap() >= 1);
    assert!(v["ram"].get("total_bytes").is_some());
    assert!(v["driver"].get("version").is_some());
    assert!(v["probe"].is_null());
    let gpus = v["gpus"].as_array().unwrap();
    let recs = v["recommendations"].as_array().unwrap();
    match v["no_gpu"].as_object() {
        Some(why) => {
            let reason = why["reason"].as_str().unwrap();
            assert!(
                ["no-driver", "no-device", "library-missing", "driver-error"].contains(&reason),
                "{reason}"
            );
            assert!(!why["detail"].as_str().unwrap().is_empty());
            assert_eq!(recs[0]["device"], "cpu");
            assert_eq!(recs[0]["precision"], "fp32");
        }
        None => {
            assert!(!gpus.is_empty());
            for g in gpus {
                for key in ["name", "memory_total", "memory_free", "compute_capability"] {
                    assert!(g.get(key).is_some(), "{key} missing in {g}");
                }
            }
        }
    }
}

#[test]
fn hw_probe_measures_in_the_json() {
    let out = kiln(&["hw", "--probe", "--json", "--device", "cpu"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let p = &v["probe"];
    assert_eq!(p["device"], "cpu");
    assert!(p["gemm"][0]["tflops"].as_f64().unwrap() > 0.0);
    assert!(p["copy"]["gbs"].as_f64().unwrap() > 0.0);
}

/// `kiln plan` for a named GPU: the breakdown, the per-layer table, the largest micro-batch
/// of each variant, and GPT-2's vocabulary padded for the tensor cores.
#[test]
fn plan_for_a_named_gpu() {
    let out = kiln(
        &["plan", "--gpu", "a100-40gb"],
        &common::with(&["data.tokenizer=gpt2", "train.precision=bf16-mixed"]),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for needle in [
        "NVIDIA A100 40GB",
        "master weights (fp32)",
        "compute copies (bf16)",
        "optimizer state",
        "saved activations",
        "CUDA context and other processes (estimate)",
        "| block.attn | 2 |",
        "FLOPs per token",
        "| recompute+offload |",
        "vocabulary 50257 padded to 50304",
    ] {
        assert!(t.contains(needle), "expected {needle:?} in:\n{t}");
    }
}

/// `--json` for scripts: the largest micro-batch grows with memory, and the plan at that
/// size fits while one more does not.
#[test]
fn plan_json_is_consistent_across_gpus() {
    let json = |gpu: &str| -> serde_json::Value {
        let out = kiln(&["plan", "--json", "--gpu", gpu], &common::with(&[]));
        assert!(out.status.success(), "{}", text(&out));
        serde_json::from_slice(&out.stdout).expect("plan --json prints one JSON object")
    };
    let plain =
        |v: &serde_json::Value| v["largest_micro_batch"][0]["micro_batch"].as_u64().unwrap();
    let small = json("rtx3060-12gb");
    let large = json("h200-141gb");
    assert!(
        plain(&small) < plain(&large),
        "{} vs {}",
        plain(&small),
        plain(&large)
    );
    assert_eq!(small["fits"], true);
    assert!(small["plan"]["pool_peak"].as_u64().unwrap() > 0);
    assert_eq!(small["largest_micro_batch"].as_array().unwrap().len(), 4);
}

#[test]
fn plan_refuses_an_unknown_gpu_and_lists_the_known_ones() {
    let out = kiln(&["plan", "--gpu", "gtx480"], &[]);
    assert_fails(
        &out,
        2,
        &["unknown GPU 'gtx480'", "h100-80gb", "rtx4090", "t4-16gb"],
    );
}

/// A model that cannot fit one sequence says what it needs and what would help.
#[test]
fn plan_says_what_one_sequence_needs_and_how_to_shrink_it() {
    let out = kiln(
        &["plan", "--gpu", "rtx3080-10gb"],
        &common::with(&[
            "model.d_model=4096",
            "model.n_layers=32",
            "model.n_heads=32",
            "model.context=2048",
            "train.seq_len=2048",
        ]),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for needle in [
        "for one sequence of 2048 tokens",
        "NVIDIA GeForce RTX 3080 10GB",
        "train.recompute=blocks (saves",
        "train.offload_optimizer=true (saves",
        "train.precision=bf16-mixed (saves",
        "a shorter train.seq_len",
        "| plain | none |",
    ] {
        assert!(t.contains(needle), "expected {needle:?} in:\n{t}");
    }
}

/// On the CPU under a memory cap, `--find-batch` runs real steps: the predicted largest
/// micro-batch fits with the planned peak measured exactly, and the next one runs out.
#[test]
fn find_batch_on_the_cpu_confirms_the_predicted_boundary() {
    let out = kiln(
        &["plan", "--json", "--find-batch"],
        &common::with(&["train.device=cpu", "train.memory_limit=6MiB"]),
    );
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let predicted = v["largest_micro_batch"][0]["micro_batch"].as_u64().unwrap();
    let trials = v["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 2);
    assert_eq!(trials[0]["micro_batch"].as_u64(), Some(predicted));
    assert_eq!(trials[0]["fits"], true);
    assert_eq!(
        trials[0]["measured_pool_peak"],
        trials[0]["planned_pool_peak"]
    );
    assert_eq!(trials[1]["micro_batch"].as_u64(), Some(predicted + 1));
    assert_eq!(trials[1]["fits"], false);
    // Without a cap the CPU trials would fill the machine: refused with the fix.
    let out = kiln(
        &["plan", "--find-batch"],
        &common::with(&["train.device=cpu"]),
    );
    assert_fails(&out, 2, &["train.memory_limit"]);
}

/// A `train.memory_limit` between the peaks of micro-batch 4 and 8: the run says it split,
/// finishes (exit 0) and reports the micro-batch it ended with.
#[test]
fn a_memory_limit_splits_the_micro_batch_and_the_run_finishes() {
    let peak8 = common::step_peak(&["train.micro_batch=8"]);
    let peak4 = common::step_peak(&["train.micro_batch=4"]);
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let out = kiln(
        &["train", "--out", run.to_str().unwrap()],
        &common::with(&[
            "train.device=cpu",
            "train.steps=3",
            "train.micro_batch=8",
            &format!("train.memory_limit={}", (peak4 + peak8) / 2),
        ]),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("step 1: out of memory with 8 sequences per forward/backward pass; continuing with 4 per pass"),
        "{t}"
    );
    assert!(
        t.contains("micro-batch: 4 sequences per forward/backward pass"),
        "{t}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["effective_micro_batch"], 4);
}

/// Room for the weights but not for one sequence's activations: exit 6 with the numbers and
/// the settings that use less memory.
#[test]
fn a_sequence_that_does_not_fit_exits_with_what_to_change() {
    let limit = common::resident_bytes(&[]) + 16 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let out = kiln(
        &["train", "--out", tmp.path().join("run").to_str().unwrap()],
        &common::with(&[
            "train.device=cpu",
            "train.recompute=blocks",
            &format!("train.memory_limit={limit}"),
        ]),
    );
    assert_fails(
        &out,
        6,
        &[
            "one sequence of 32 tokens does not fit on cpu",
            "asked for",
            "train.offload_optimizer=true",
            "train.seq_len",
        ],
    );
    assert!(
        !text(&out).contains("train.recompute=blocks,"),
        "already set"
    );

    // A cap below the weights: the model itself does not fit, and recomputation would not help.
    let out = kiln(
        &["train", "--out", tmp.path().join("run2").to_str().unwrap()],
        &common::with(&["train.device=cpu", "train.memory_limit=1KiB"]),
    );
    assert_fails(
        &out,
        6,
        &[
            "the model's weights, gradients and optimizer state do not fit on cpu",
            "train.offload_optimizer=true",
            "a smaller model",
            "a larger train.memory_limit",
        ],
    );
    assert!(
        !text(&out).contains("train.recompute=blocks"),
        "{}",
        text(&out)
    );
}

#[test]
fn train_and_bench_run_with_block_recomputation() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &["train.recompute=blocks"]);
    let config = fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(config.contains("recompute = \"blocks\""), "{config}");

    let bench_out = tmp.path().join("bench");
    let bench = |extra: &[&str]| {
        let out = kiln(
            &[
                "bench",
                "train",
                "--device",
                "cpu",
                "--steps",
                "2",
                "--out",
                bench_out.to_str().unwrap(),
            ],
            &common::with(extra),
        );
        assert!(out.status.success(), "{}", text(&out));
        text(&out)
    };
    let t = bench(&["train.recompute=blocks"]);
    assert!(t.contains("recompute blocks on cpu"), "{t}");
    assert!(t.contains("| peak memory |"), "{t}");

    // The bench takes train.memory_limit too, and splits like a run.
    let peak8 = common::step_peak(&["train.micro_batch=8"]);
    let peak4 = common::step_peak(&["train.micro_batch=4"]);
    let t = bench(&[
        "train.micro_batch=8",
        &format!("train.memory_limit={}", (peak4 + peak8) / 2),
    ]);
    assert!(
        t.contains("out of memory with 8 sequences per pass in step 1; ran 4 per pass"),
        "{t}"
    );
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
            // transformers' name for --tokens
            "--max-new-tokens",
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

#[test]
fn bench_suites_without_a_gpu_write_reports_and_say_what_they_skipped() {
    // On the GPU machine these suites are run by hand (see the README).
    if text(&kiln(&["hw"], &[])).contains("no GPU") {
        let dir = tempfile::tempdir().unwrap();
        let amp_dir = dir.path().join("amp");
        let amp = kiln(
            &[
                "bench",
                "amp",
                "--device",
                "cpu",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--out",
                amp_dir.to_str().unwrap(),
            ],
            &common::tiny_overrides(),
        );
        let t = text(&amp);
        assert!(amp.status.success(), "{t}");
        assert!(t.contains("skipped: tf32: "), "{t}");
        assert!(t.contains("wrote "), "{t}");
        let md = fs::read_to_string(amp_dir.join("report.md")).unwrap();
        assert!(md.contains("Reproduce: `"), "{md}");
        assert!(md.contains("bench amp --device cpu"), "{md}");
        assert!(md.contains("- no GPU: "), "{md}");
        for f in [
            "results.json",
            "tokens_per_s.png",
            "peak_memory.png",
            "loss.png",
        ] {
            assert!(amp_dir.join(f).is_file(), "{f} missing");
        }

        let bk_dir = dir.path().join("bk");
        let bk = kiln(
            &[
                "bench",
                "bk",
                "--batches",
                "1,4",
                "--ns",
                "64,256",
                "--reps",
                "2",
                "--no-python",
                "--out",
                bk_dir.to_str().unwrap(),
            ],
            &[],
        );
        let t = text(&bk);
        assert!(bk.status.success(), "{t}");
        assert!(t.contains("no usable GPU"), "{t}");
        let md = fs::read_to_string(bk_dir.join("report.md")).unwrap();
        assert!(md.contains("![BK-Core time against N, batch 4"), "{md}");
        assert!(bk_dir.join("time_b1.png").is_file());

        let dl_dir = dir.path().join("dataloader");
        let dl = kiln(
            &[
                "bench",
                "dataloader",
                "--device",
                "cpu",
                "--reps",
                "1",
                "--steps",
                "1",
                "--out",
                dl_dir.to_str().unwrap(),
            ],
            &common::tiny_overrides(),
        );
        let t = text(&dl);
        assert!(dl.status.success(), "{t}");
        assert!(t.contains("skipped: copy to the device"), "{t}");
        let md = fs::read_to_string(dl_dir.join("report.md")).unwrap();
        assert!(md.contains("| training step | every step |"), "{md}");

        let mem_dir = dir.path().join("memory");
        let mem = kiln(
            &[
                "bench",
                "memory",
                "--device",
                "cpu",
                "--batches",
                "1,2,4",
                "--out",
                mem_dir.to_str().unwrap(),
            ],
            &common::tiny_overrides(),
        );
        let t = text(&mem);
        assert!(mem.status.success(), "{t}");
        let md = fs::read_to_string(mem_dir.join("report.md")).unwrap();
        assert!(md.contains("## Out-of-memory boundary"), "{md}");
        assert!(mem_dir.join("peak_by_micro_batch.png").is_file());
    }
}

#[test]
fn bench_train_writes_a_report_with_phases_and_says_when_pytorch_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("train");
    let o = kiln(
        &[
            "bench",
            "train",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            out_dir.to_str().unwrap(),
        ],
        &common::tiny_overrides(),
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("| tokens/s |"), "the printed table stays: {t}");
    for f in ["report.md", "results.json", "phases.png", "loss.png"] {
        assert!(out_dir.join(f).is_file(), "{f} missing: {t}");
    }
    assert!(!out_dir.join("pytorch_batches.i32").exists());
    let md = fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(md.contains("bench train --device cpu"), "{md}");
    assert!(md.contains("| forward + backward |"), "{md}");
    assert!(md.contains("| optimizer |"), "{md}");
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out_dir.join("results.json")).unwrap()).unwrap();
    let p = &json["phases"];
    let (fb, opt, step) = (
        p["fwd_bwd_ms"].as_f64().unwrap(),
        p["optimizer_ms"].as_f64().unwrap(),
        p["step_ms"].as_f64().unwrap(),
    );
    assert!(fb > 0.0 && opt > 0.0 && step > 0.0, "{p}");
    let kiln_row = &json["engines"][0];
    assert_eq!(kiln_row["losses"].as_array().unwrap().len(), 3);
    assert!(kiln_row["tokens_per_s"].as_f64().unwrap() > 0.0);
    // Without torch and a GPU beside kiln, the reference is listed as skipped with the reason.
    let torch_and_gpu = std::process::Command::new("python3")
        .args(["-c", "import torch; assert torch.cuda.is_available()"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !torch_and_gpu {
        let skipped = json["skipped"].as_array().unwrap();
        assert!(
            skipped
                .iter()
                .any(|s| s.as_str().unwrap().starts_with("PyTorch reference")),
            "{skipped:?}"
        );
        assert!(md.contains("## Skipped\n\n- PyTorch reference"), "{md}");
        assert_eq!(json["engines"].as_array().unwrap().len(), 1);
    }
}

#[test]
fn bench_amp_refuses_an_unknown_mode_and_zero_steps_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("amp");
    let o = kiln(
        &[
            "bench",
            "amp",
            "--device",
            "cpu",
            "--modes",
            "fp8",
            "--out",
            out.to_str().unwrap(),
        ],
        &common::tiny_overrides(),
    );
    assert_fails(&o, 2, &["fp8", "use fp32, tf32, bf16-mixed or fp16-mixed"]);
    assert!(!out.exists(), "nothing is written for a refused command");
    let o = kiln(
        &[
            "bench",
            "amp",
            "--device",
            "cpu",
            "--steps",
            "0",
            "--out",
            out.to_str().unwrap(),
        ],
        &common::tiny_overrides(),
    );
    assert_fails(&o, 2, &["--steps must be at least 1"]);
}

#[test]
fn train_trace_records_the_phases_of_the_chosen_steps() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let out = kiln(
        &[
            "train",
            "--quiet",
            "--out",
            dir.path().join("run").to_str().unwrap(),
            "--trace",
            trace.to_str().unwrap(),
            "--trace-steps",
            "2..=3",
        ],
        &common::with(&["train.steps=4", "train.eval_every=3"]),
    );
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_str(&fs::read_to_string(&trace).unwrap()).unwrap();
    let all = v["traceEvents"].as_array().unwrap();
    let (events, ops): (Vec<&serde_json::Value>, Vec<&serde_json::Value>) = all
        .iter()
        .filter(|e| e["ph"] == "X")
        .partition(|e| e["cat"] == "step");
    let of = |step: u64| -> Vec<&str> {
        events
            .iter()
            .filter(|e| e["args"]["step"] == step)
            .map(|e| e["name"].as_str().unwrap())
            .collect()
    };
    assert_eq!(of(2), ["data wait", "forward+backward", "optimizer"]);
    assert_eq!(
        of(3),
        ["data wait", "forward+backward", "optimizer", "eval"]
    );
    assert!(of(1).is_empty() && of(4).is_empty());
    // Phases of a step follow one another on the clock.
    let step2: Vec<&&serde_json::Value> =
        events.iter().filter(|e| e["args"]["step"] == 2).collect();
    for w in step2.windows(2) {
        let end = w[0]["ts"].as_f64().unwrap() + w[0]["dur"].as_f64().unwrap();
        assert!(w[1]["ts"].as_f64().unwrap() >= end - 1e-3, "{w:?}");
    }
    // Every op of a traced step is on its own track, inside the step's forward+backward and
    // optimizer phases; the step's GEMMs, attention, loss and update are all there.
    let at = |e: &serde_json::Value| {
        let ts = e["ts"].as_f64().unwrap();
        (ts, ts + e["dur"].as_f64().unwrap())
    };
    let (step_start, _) = at(step2[1]);
    let (_, step_end) = at(step2[2]);
    let ops2: Vec<&&serde_json::Value> = ops.iter().filter(|e| e["args"]["step"] == 2).collect();
    for name in [
        "linear_forward",
        "linear_backward",
        "attention_forward",
        "attention_backward",
        "cross_entropy_fused",
        "adamw_update",
    ] {
        assert!(
            ops2.iter().any(|e| e["name"] == name),
            "no {name} in {ops2:?}"
        );
    }
    for op in &ops2 {
        let (a, b) = at(op);
        assert!(a >= step_start - 1e-3 && b <= step_end + 1e-3, "{op:?}");
        assert_ne!(op["tid"], step2[0]["tid"]);
    }
    assert!(
        ops.iter()
            .all(|e| e["args"]["step"] == 2 || e["args"]["step"] == 3)
    );

    let bad = kiln(
        &[
            "train",
            "--quiet",
            "--trace",
            trace.to_str().unwrap(),
            "--trace-steps",
            "5..5",
        ],
        &common::with(&["train.steps=1"]),
    );
    assert_fails(&bad, 2, &["--trace-steps", "at least one step"]);

    // The profiler's range takes the same form and names its own option.
    let bad = kiln(
        &["train", "--quiet", "--profile-steps", "0..3"],
        &common::with(&["train.steps=1"]),
    );
    assert_fails(&bad, 2, &["--profile-steps", "at least one step"]);
    // On the CPU there is no profiler to start: the run trains as without the option.
    let run = dir.path().join("profiled");
    let ok = kiln(
        &[
            "train",
            "--quiet",
            "--out",
            run.to_str().unwrap(),
            "--profile-steps",
            "1..=2",
        ],
        &common::with(&["train.steps=2"]),
    );
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[test]
fn plan_generate_books_the_cache_and_finds_the_most_sequences_that_fit() {
    // Long enough that the cache, not loading the weights, makes the peak.
    let llama = common::with(&[
        "model.kind=llama",
        "model.n_kv_heads=1",
        "model.ffn_hidden=64",
        "model.context=64",
        "train.seq_len=64",
        "train.device=cpu",
    ]);
    let shape = [
        "plan",
        "--generate",
        "--prompts",
        "16",
        "--num-samples",
        "2",
        "--prompt-tokens",
        "16",
        "--tokens",
        "48",
    ];
    let json = |extra: &[String]| -> serde_json::Value {
        let o = kiln(&[&shape[..], &["--json"]].concat(), extra);
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let p = json(&llama);
    let plan = &p["plan"];
    assert_eq!(plan["slots"], 32, "{p}");
    assert_eq!(plan["max_len"], 64, "{p}");
    let (peak, weights, cache) = (
        plan["pool_peak"].as_u64().unwrap(),
        plan["weights"].as_u64().unwrap(),
        plan["cache_bytes"].as_u64().unwrap(),
    );
    assert!(cache > 0 && peak > weights + cache, "{p}");
    assert_eq!(p["fits"], true);
    assert_eq!(p["largest_at_once"], 32);

    // A pool limit one byte short of the whole call: fewer sequences at once, named.
    let mut capped = llama.clone();
    capped.push(format!("train.memory_limit={}", peak - 1));
    let q = json(&capped);
    assert_eq!(q["fits"], false, "{q}");
    let n = q["largest_at_once"].as_u64().unwrap();
    assert!((1..32).contains(&n), "{q}");
    let o = kiln(&shape, &capped);
    let t = text(&o);
    assert!(
        t.contains("does NOT fit") && t.contains(&format!("--max-batch {n}")),
        "{t}"
    );

    assert_fails(
        &kiln(&["plan", "--generate", "--tokens", "0"], &llama),
        2,
        &["--tokens 0"],
    );
    assert_fails(
        &kiln(&["plan", "--generate", "--num-samples", "0"], &llama),
        2,
        &["--num-samples"],
    );
    // The generation flags belong to --generate.
    assert_fails(
        &kiln(&["plan", "--prompts", "3"], &llama),
        2,
        &["--generate"],
    );
}

#[test]
fn a_key_of_another_family_is_refused_and_an_older_run_directory_still_loads() {
    let out = kiln(&["train", "model.moe_experts=4"], &[]);
    assert_fails(
        &out,
        2,
        &[
            "model.moe_experts (from override) is a setting of model.kind = \"resnet_bk\"",
            "model.kind is \"gpt\"",
            "set model.kind=resnet_bk",
        ],
    );
    // A run directory whose config.toml lists every family's keys, as kiln wrote it before
    // the model section was per family, still evaluates, resumes and exports.
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run, &[]);
    let toml = run.join("config.toml");
    let cfg = fs::read_to_string(&toml).unwrap();
    let (_, body) = cfg.split_once('\n').unwrap();
    let other_families = "moe_experts = 4\nmoe_top_k = 2\nmoe_hidden = 0\n\
        moe_capacity_factor = 1.25\nmoe_aux_coef = 0.01\nn_kv_heads = 0\nhead_dim = 0\n\
        ffn_hidden = 0\nrope_theta = 10000.0\nrot_dim = 0\nrope_scaling_factor = 0.0\n\
        rope_low_freq_factor = 1.0\nrope_high_freq_factor = 4.0\nrope_original_context = 8192\n\
        norm_eps = 1e-5\nqkv_bias = false\nqk_norm = false\nsliding_window = 0\n\
        full_attention_layers = 0\n";
    let old = format!(
        "# kiln run configuration\n{}",
        body.replacen("[model]\n", &format!("[model]\n{other_families}"), 1)
    );
    fs::write(&toml, &old).unwrap();
    let ev = kiln(&["eval", "--run", run.to_str().unwrap()], &[]);
    assert!(ev.status.success(), "{}", text(&ev));
    let resumed = kiln(
        &["train", "--quiet", "--resume", run.to_str().unwrap()],
        &["train.steps=6".into()],
    );
    assert!(resumed.status.success(), "{}", text(&resumed));
    let exported = tmp.path().join("hf");
    let ex = kiln(
        &[
            "export",
            "--run",
            run.to_str().unwrap(),
            "--to",
            exported.to_str().unwrap(),
        ],
        &[],
    );
    assert!(ex.status.success(), "{}", text(&ex));
}

/// `data.val_corpus`: a text run validates on its own file and `kiln eval` evaluates the same
/// file (the run's last validation loss, to the digits both print).
#[test]
fn a_validation_file_is_what_train_and_eval_validate_on() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus_text = kiln::data::Corpus::load(None).unwrap().text;
    let (train, val) = (tmp.path().join("train.txt"), tmp.path().join("val.txt"));
    fs::write(&train, &corpus_text[..200_000]).unwrap();
    fs::write(&val, &corpus_text[corpus_text.len() - 20_000..]).unwrap();
    let run = tmp.path().join("run");
    let corpus = format!("data.corpus={}", train.display());
    let val_corpus = format!("data.val_corpus={}", val.display());
    train_tiny(&run, &[&corpus, &val_corpus]);
    let summary: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let want = format!("val loss {:.4}", summary["val_loss"].as_f64().unwrap());
    let ev = kiln(&["eval", "--run", run.to_str().unwrap()], &[]);
    assert!(ev.status.success(), "{}", text(&ev));
    assert!(text(&ev).contains(&want), "{want} in {}", text(&ev));
    // Without the file, the tail of the corpus validates: another loss.
    let tail = tmp.path().join("tail");
    train_tiny(&tail, &[&corpus]);
    let other: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(tail.join("summary.json")).unwrap()).unwrap();
    assert_ne!(other["val_loss"], summary["val_loss"]);
}

//! Encoders end to end on the CPU: the real all-MiniLM-L6-v2 (and SmolLM2 as a decoder
//! encoder) through `kiln embed`, grouped cross-validation through `kiln classify` on the
//! play-pairs dataset, and bad input with its exit codes.

mod common;

use common::fixtures::{minilm_dir, smollm2_gguf};
use kiln::nn::Params;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", "")
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

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Embeddings of the lines of `texts`, through `kiln embed` with `extra` arguments.
fn embed(model: &Path, texts: &[&str], extra: &[&str]) -> (Vec<Vec<f32>>, String) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.txt");
    std::fs::write(&input, texts.join("\n")).unwrap();
    let out = dir.path().join("out.jsonl");
    let mut args = vec![
        "embed",
        "--init-from",
        s(model),
        "--input",
        s(&input),
        "--out",
        s(&out),
        "--device",
        "cpu",
    ];
    args.extend(extra);
    let o = kiln(&args);
    assert!(o.status.success(), "{}", text(&o));
    let rows = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    (rows, text(&o))
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The similarities the sentence-transformers documentation prints for all-MiniLM-L6-v2
/// (its semantic-textual-similarity example, four decimals), and what the padding mask and
/// normalisation must guarantee.
#[test]
fn minilm_embeddings_match_the_published_similarities() {
    let texts = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "A man is riding a horse.",
        "A man is riding a white horse on an enclosed ground.",
        "A woman is playing violin.",
    ];
    let (e, log) = embed(&minilm_dir(), &texts, &["--batch-size", "5"]);
    assert!(log.contains("0 truncated"), "{log}");
    assert_eq!(e.len(), 5);
    assert_eq!(e[0].len(), 384);
    for row in &e {
        assert!((dot(row, row).sqrt() - 1.0).abs() < 1e-5, "not normalised");
    }
    assert!(
        (dot(&e[0], &e[1]) - 0.7553).abs() < 1e-3,
        "{}",
        dot(&e[0], &e[1])
    );
    assert!(
        (dot(&e[2], &e[3]) - 0.7369).abs() < 1e-3,
        "{}",
        dot(&e[2], &e[3])
    );
    assert!(dot(&e[0], &e[4]) < 0.2);
    // One at a time (no padding at all) gives the same vectors as the padded batch.
    let (alone, _) = embed(&minilm_dir(), &texts, &["--batch-size", "1"]);
    for (a, b) in alone.iter().zip(&e) {
        assert!(
            dot(a, b) > 0.99999,
            "padding changed an embedding: {}",
            dot(a, b)
        );
    }
}

#[test]
fn long_texts_are_truncated_and_counted_and_safetensors_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let long = "word ".repeat(50);
    std::fs::write(
        &input,
        format!("{{\"text\": \"short one\"}}\n{{\"text\": \"{long}\"}}\n"),
    )
    .unwrap();
    let out = dir.path().join("e.safetensors");
    let o = kiln(&[
        "embed",
        "--init-from",
        s(&minilm_dir()),
        "--input",
        s(&input),
        "--out",
        s(&out),
        "--max-length",
        "16",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("1 truncated to 16 tokens"),
        "{}",
        text(&o)
    );
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("embeddings").unwrap().shape(), &[2, 384]);
}

#[test]
fn a_decoder_embeds_by_mean_pooling_its_final_states() {
    let (e, log) = embed(
        &smollm2_gguf(),
        &[
            "The king is dead.",
            "Long live the king!",
            "A recipe for bread.",
        ],
        &["--max-length", "32"],
    );
    assert!(log.contains("Llama decoder"), "{log}");
    assert_eq!(e[0].len(), 576);
    assert!(e.iter().flatten().all(|v| v.is_finite()));
    let cos = |a: &[f32], b: &[f32]| dot(a, b) / (dot(a, a) * dot(b, b)).sqrt();
    assert!(
        cos(&e[0], &e[1]) < 0.9999,
        "distinct texts gave the same vector"
    );
}

fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

/// Frozen MiniLM with a linear head on play-pairs (three plays): well above chance, with
/// folds free of group leakage where a plain stratified split leaks, and a rerun served from
/// the feature cache.
#[test]
fn classify_learns_play_pairs_without_leaking_groups() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("pairs.jsonl");
    let o = kiln(&[
        "make-dataset",
        "play-pairs",
        "--plays",
        "3",
        "--per-scene",
        "4",
        "--seed",
        "1",
        "--out",
        s(&data),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let cache = dir.path().join("cache");
    let run = |out: &str| {
        let out = dir.path().join(out);
        let o = kiln(&[
            "classify",
            "--init-from",
            s(&minilm_dir()),
            "--data",
            s(&data),
            "--folds",
            "5",
            "--out",
            s(&out),
            "--cache-dir",
            s(&cache),
            "--pair-encoding",
            "bi",
            "--device",
            "cpu",
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("metrics.json")).unwrap())
                .unwrap();
        assert!(out.join("report.md").exists() && out.join("folds.png").exists());
        m
    };
    let first = run("first");
    assert_eq!(first["cache"]["hit"], false);
    let f1 = first["summary"]["F1"]["mean"].as_f64().unwrap();
    let auc = first["summary"]["ROC-AUC"]["mean"].as_f64().unwrap();
    assert!(f1 > 0.58 && auc > 0.6, "F1 {f1}, ROC-AUC {auc}");
    let leaks = |key: &str| -> u64 {
        first[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum()
    };
    assert_eq!(leaks("leaking_groups"), 0);
    assert!(
        leaks("stratified_leaking_groups") > 20,
        "a plain stratified split should leak scenes"
    );
    let second = run("second");
    assert_eq!(second["cache"]["hit"], true);
    assert_eq!(second["summary"], first["summary"]);
}

/// Bad input: each case with its exit code and a phrase the message must hold.
#[test]
fn bad_input_is_refused_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rec = |text: &str, label: &str, group: &str| {
        format!("{{\"text\": \"{text}\", \"label\": {label}, \"group\": \"{group}\"}}\n")
    };
    let two_groups = write(d, "two.jsonl", &(rec("a", "0", "x") + &rec("b", "1", "y")));
    let no_label = write(
        d,
        "nolabel.jsonl",
        &(rec("a", "0", "x") + "{\"text\": \"b\", \"group\": \"y\"}\n"),
    );
    let one_class = write(d, "one.jsonl", &(rec("a", "1", "x") + &rec("b", "1", "y")));
    let not_json = write(d, "bad.jsonl", &(rec("a", "0", "x") + "{\"text\": \n"));
    // A tokenizer-less copy of MiniLM (the weights linked, not copied).
    let no_tok = d.join("no-tokenizer");
    std::fs::create_dir(&no_tok).unwrap();
    for f in ["config.json", "modules.json"] {
        std::fs::copy(minilm_dir().join(f), no_tok.join(f)).unwrap();
    }
    std::os::unix::fs::symlink(
        minilm_dir().join("model.safetensors"),
        no_tok.join("model.safetensors"),
    )
    .unwrap();
    let minilm = minilm_dir();
    let out = d.join("out");
    let classify = |data: &Path, extra: &[&str]| {
        let mut a = vec![
            "classify",
            "--init-from",
            s(&minilm),
            "--data",
            s(data),
            "--out",
            s(&out),
            "--device",
            "cpu",
            "--no-cache",
        ];
        a.extend(extra);
        kiln(&a)
    };
    let cases: Vec<(&str, Output, i32, &str)> = vec![
        (
            "unknown fine-tune mode",
            classify(&two_groups, &["--folds", "2", "--finetune", "partial"]),
            2,
            "use lora or full",
        ),
        (
            "encoder lr without fine-tuning",
            classify(&two_groups, &["--folds", "2", "--encoder-lr", "1e-4"]),
            2,
            "only with --finetune",
        ),
        (
            "fine-tuning a decoder",
            kiln(&[
                "classify",
                "--init-from",
                s(&smollm2_gguf()),
                "--data",
                s(&two_groups),
                "--out",
                s(&out),
                "--device",
                "cpu",
                "--folds",
                "2",
                "--finetune",
                "full",
            ]),
            2,
            "needs a BERT-family encoder",
        ),
        (
            "missing label",
            classify(&no_label, &["--folds", "2"]),
            3,
            "line 2 has no \"label\"",
        ),
        (
            "single class",
            classify(&one_class, &["--folds", "2"]),
            3,
            "at least two classes",
        ),
        (
            "fewer groups than folds",
            classify(&two_groups, &["--folds", "5"]),
            3,
            "2 groups, fewer than the 5 folds",
        ),
        (
            "not JSON",
            classify(&not_json, &["--folds", "2"]),
            3,
            "line 2 is not valid JSON",
        ),
        (
            "one fold",
            classify(&two_groups, &["--folds", "1"]),
            2,
            "--folds 1",
        ),
        (
            "bf16 on the CPU",
            classify(&two_groups, &["--folds", "2", "--precision", "bf16"]),
            2,
            "needs a GPU",
        ),
        (
            "no tokenizer",
            kiln(&[
                "embed",
                "--init-from",
                s(&no_tok),
                "--input",
                s(&two_groups),
                "--out",
                s(&d.join("e.jsonl")),
                "--device",
                "cpu",
            ]),
            4,
            "tokenizer.json",
        ),
    ];
    for (what, o, code, phrase) in cases {
        let msg = text(&o);
        assert_eq!(o.status.code(), Some(code), "{what}: {msg}");
        assert!(msg.contains(phrase), "{what}: expected {phrase:?} in {msg}");
        assert!(!msg.contains("panicked"), "{what}: {msg}");
    }
}

/// A class present in a single group cannot be on both sides of every fold: the run goes on
/// and the report names the class and the folds whose label sets differ.
#[test]
fn a_class_too_small_to_stratify_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut body = String::new();
    for g in 0..6 {
        for i in 0..3 {
            body += &format!(
                "{{\"text\": \"common text {g} {i}\", \"label\": \"common\", \"group\": \"g{g}\"}}\n"
            );
        }
    }
    body += "{\"text\": \"rare text\", \"label\": \"rare\", \"group\": \"g0\"}\n";
    let data = write(dir.path(), "d.jsonl", &body);
    let out = dir.path().join("out");
    let o = kiln(&[
        "classify",
        "--init-from",
        s(&minilm_dir()),
        "--data",
        s(&data),
        "--folds",
        "3",
        "--out",
        s(&out),
        "--device",
        "cpu",
        "--no-cache",
        "--epochs",
        "5",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("class \"rare\" is in 1 group(s), fewer than the 3 folds"),
        "{report}"
    );
    assert!(
        report.contains("the validation side has no \"rare\" records"),
        "{report}"
    );
}

/// A small slice of play-pairs: the first `n` records of three plays, scenes as groups.
fn play_pairs_slice(dir: &Path, n: usize) -> PathBuf {
    let full = dir.join("full.jsonl");
    let o = kiln(&[
        "make-dataset",
        "play-pairs",
        "--plays",
        "3",
        "--per-scene",
        "2",
        "--seed",
        "1",
        "--out",
        s(&full),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let body = std::fs::read_to_string(&full).unwrap();
    let lines: Vec<&str> = body.lines().take(n).collect();
    write(dir, "slice.jsonl", &(lines.join("\n") + "\n"))
}

/// `kiln classify --finetune lora` runs end to end on the CPU on a slice of play-pairs and
/// says in its report that the encoder was fine-tuned, with no feature cache.
#[test]
fn classify_fine_tunes_minilm_with_lora() {
    let dir = tempfile::tempdir().unwrap();
    let data = play_pairs_slice(dir.path(), 24);
    let out = dir.path().join("out");
    let o = kiln(&[
        "classify",
        "--init-from",
        s(&minilm_dir()),
        "--data",
        s(&data),
        "--folds",
        "2",
        "--out",
        s(&out),
        "--device",
        "cpu",
        "--finetune",
        "lora",
        "--epochs",
        "1",
        "--max-length",
        "24",
        "--batch-size",
        "8",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("LoRA rank 8"), "{report}");
    assert!(report.contains("feature cache: none"), "{report}");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("metrics.json")).unwrap()).unwrap();
    let f1 = m["summary"]["F1"]["mean"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&f1), "macro-F1 {f1}");
}

/// One fold's LoRA fine-tune moves the adapters and leaves every base weight bit-identical.
#[test]
fn lora_fine_tune_changes_adapters_only() {
    use kiln::classify::finetune::{Finetune, FinetuneSetup, train_fold};
    use kiln::classify::head::{HeadKind, HeadOptions};
    use kiln::embed::{EncoderOptions, TextEncoder};
    let enc_opts = EncoderOptions {
        device: "cpu".into(),
        precision: None,
        max_length: Some(16),
    };
    let head = HeadOptions {
        kind: HeadKind::Linear,
        lr: 1e-3,
        weight_decay: 0.0,
        max_epochs: 1,
        patience: 1,
        batch_size: 8,
        seed: 3,
    };
    let minilm = minilm_dir();
    let setup = FinetuneSetup {
        init_from: &minilm,
        encoder: &enc_opts,
        mode: Finetune::Lora,
        encoder_lr: 1e-3,
        batch_size: 4,
        head: &head,
    };
    let base = TextEncoder::open(&minilm, &enc_opts).unwrap();
    let texts = [
        "To be, or not to be",
        "Friends, Romans, countrymen",
        "Now is the winter of our discontent",
        "O Romeo, Romeo",
        "All the world's a stage",
        "The quality of mercy is not strained",
        "Out, damned spot",
        "If music be the food of love",
    ];
    let inputs: Vec<_> = texts
        .iter()
        .map(|t| base.encode(t, None).unwrap())
        .collect();
    let labels = [0, 1, 0, 1, 0, 1, 0, 1];
    let train: Vec<usize> = (0..8).collect();
    let tuned = train_fold(&setup, &inputs, &labels, 2, &train, &[]).unwrap();
    let (b0, b1) = (base.bert().unwrap(), tuned.encoder.bert().unwrap());
    let (base_params, tuned_params) = (b0.params(), b1.params());
    let (frozen, adapters): (Vec<&kiln::nn::Param>, Vec<&kiln::nn::Param>) =
        tuned_params.iter().copied().partition(|p| p.frozen);
    assert_eq!(frozen.len(), base_params.len());
    for (a, b) in base_params.iter().zip(&frozen) {
        assert_eq!(a.name, b.name);
        assert_eq!(
            a.value.to_vec().unwrap(),
            b.value.to_vec().unwrap(),
            "{}",
            a.name
        );
    }
    assert_eq!(
        adapters.len(),
        6 * 6 * 2,
        "query, key, value and three dense per layer"
    );
    let moved = adapters
        .iter()
        .filter(|p| p.name.ends_with(".B"))
        .filter(|p| p.value.to_vec().unwrap().iter().any(|&v| v != 0.0))
        .count();
    assert_eq!(moved, 6 * 6, "every B left zero");
}

//! Diversity end to end on the CPU: the cue-reply dataset, `kiln diversity` on samples in
//! `kiln generate`'s format (n-gram metrics, a checker's pass@k, the real all-MiniLM-L6-v2
//! for semantic diversity), and bad input with its exit codes.

mod common;

use common::fixtures::minilm_dir;
use std::path::Path;
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

#[test]
fn cue_reply_writes_grouped_prompt_completion_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cues.jsonl");
    let o = kiln(&[
        "make-dataset",
        "cue-reply",
        "--plays",
        "2",
        "--per-scene",
        "2",
        "--out",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.len() > 30, "{}", lines.len());
    let mut per_group = std::collections::BTreeMap::new();
    for l in &lines {
        let (p, c, g) = (
            l["prompt"].as_str().unwrap(),
            l["completion"].as_str().unwrap(),
            l["group"].as_str().unwrap(),
        );
        // "CUE: words\nREPLIER:" with two different speakers.
        let (cue, replier) = p.split_once('\n').unwrap();
        let cue_speaker = cue.split(':').next().unwrap();
        assert!(replier.ends_with(':') && cue_speaker != replier.trim_end_matches(':'));
        assert!(c.starts_with(' ') && c.split_whitespace().count() >= 6);
        assert!(g.contains(" / scene "));
        *per_group.entry(g.to_string()).or_insert(0) += 1;
    }
    assert!(per_group.values().all(|&n| n <= 2));
    assert!(text(&o).contains("2 plays"), "{}", text(&o));
    let bad = kiln(&[
        "make-dataset",
        "cue-reply",
        "--min-words",
        "50",
        "--max-words",
        "10",
        "--out",
        s(&out),
    ]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
}

/// Two prompts in `kiln generate`'s output format: one whose samples repeat each other,
/// one whose samples share nothing.
fn samples_file(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("samples.jsonl");
    let line = |prompt: &str, texts: &[&str]| {
        let samples: Vec<_> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| serde_json::json!({"prompt": 0, "sample": i, "tokens": [1, 2], "logprobs": [-0.5, -0.1], "text": t, "finish": "length"}))
            .collect();
        serde_json::json!({"prompt": prompt, "prompt_tokens": [5], "samples": samples}).to_string()
    };
    let body = [
        line(
            "Speak of love.",
            &[
                "I love thee, I love thee well",
                "I love thee, I love thee well",
                "I love thee, I love thee well",
            ],
        ),
        line(
            "Speak of war.",
            &[
                "Cry havoc and let slip the dogs",
                "The winter of our discontent is here",
                "Once more unto the breach, dear friends",
            ],
        ),
    ]
    .join("\n");
    std::fs::write(&p, body + "\n").unwrap();
    p
}

#[test]
fn diversity_reports_ngram_metrics_and_pass_at_k() {
    let dir = tempfile::tempdir().unwrap();
    let file = samples_file(dir.path());
    let json = dir.path().join("m.json");
    let o = kiln(&[
        "diversity",
        s(&file),
        "--checker",
        "grep -qi love",
        "--out",
        s(&json),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(m["prompts"], 2);
    assert_eq!(m["samples"], 6);
    // Copies: 5 distinct words of 24 ("i love thee , i love thee well" x3); the second
    // prompt's 22 words (with the comma) are all distinct but "the", which appears thrice.
    let d1 = m["distinct_1"].as_f64().unwrap();
    assert!((d1 - (5.0 / 24.0 + 20.0 / 22.0) / 2.0).abs() < 1e-9, "{d1}");
    // Copies score BLEU 1; the other prompt's samples share only "the": far below.
    let sb = m["self_bleu"].as_f64().unwrap();
    assert!(sb > 0.5 && sb < 0.6, "{sb}");
    // All of prompt 1 passes, none of prompt 2: pass@k = 0.5 for every k, so
    // DER(k) = 1/k (the samples add nothing to one another).
    let pass = m["pass"].as_array().unwrap();
    let ks: Vec<u64> = pass.iter().map(|p| p["k"].as_u64().unwrap()).collect();
    assert_eq!(ks, vec![1, 2, 3]);
    for p in pass {
        let k = p["k"].as_f64().unwrap();
        assert!((p["pass_at_k"].as_f64().unwrap() - 0.5).abs() < 1e-12);
        assert!((p["der"].as_f64().unwrap() - 1.0 / k).abs() < 1e-12);
    }
    assert!(m["semantic_diversity"].is_null());
    assert!(text(&o).contains("pass@2 0.5000"), "{}", text(&o));
}

#[test]
fn semantic_diversity_with_minilm_separates_copies_from_variety() {
    let dir = tempfile::tempdir().unwrap();
    let file = samples_file(dir.path());
    let json = dir.path().join("m.json");
    let o = kiln(&[
        "diversity",
        s(&file),
        "--embedder",
        s(&minilm_dir()),
        "--device",
        "cpu",
        "--out",
        s(&json),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let per: Vec<f64> = m["semantic_diversity_per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert!(per[0].abs() < 1e-5, "identical samples: {per:?}");
    assert!(
        per[1] > 0.3 && per[1] < 1.2,
        "three unrelated lines: {per:?}"
    );
    let mean = m["semantic_diversity"].as_f64().unwrap();
    assert!((mean - (per[0] + per[1]) / 2.0).abs() < 1e-6);
}

#[test]
fn diversity_refuses_single_samples_bad_lines_and_k_beyond_the_samples() {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one.jsonl");
    std::fs::write(&one, "{\"prompt\": \"p\", \"samples\": [\"only one\"]}\n").unwrap();
    let o = kiln(&["diversity", s(&one)]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("at least 2"), "{}", text(&o));
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "{\"prompt\": \"p\"}\n").unwrap();
    let o = kiln(&["diversity", s(&junk)]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("line 1"), "{}", text(&o));
    let file = samples_file(dir.path());
    let o = kiln(&["diversity", s(&file), "--checker", "true", "--k", "4"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("fewest is 3"), "{}", text(&o));
}

//! kiln's GGUF vocabularies against llama.cpp's tokenizer tests: the vocabulary-only GGUF
//! files of published models that llama.cpp ships (`models/ggml-vocab-*.gguf`), each with its
//! test texts (`.inp`, separated by `__ggml_vocab_test__` lines) and the ids its tests expect
//! without special tokens (`.out`, one line a text; written by llama.cpp's
//! convert_hf_to_gguf_update.py with each model's Hugging Face tokenizer).
//!
//! The committed subset (tests/data/llama-cpp-vocab/, MIT-licensed, from llama.cpp as the PyPI
//! sdist llama-cpp-python 0.3.36 vendors it) is Llama 2's and Phi-3's SentencePiece
//! vocabularies and GPT-2's and DeepSeek Coder's byte-level ones. `KILN_LLAMA_CPP_VOCABS=DIR`
//! runs the same check over every file in DIR (a llama.cpp checkout's models/), for
//! vocabularies too large to commit.

use std::path::{Path, PathBuf};

/// The texts and llama.cpp's ids of `vocab`'s test files.
fn cases(vocab: &Path) -> Vec<(String, Vec<u32>)> {
    let with = |ext: &str| PathBuf::from(format!("{}.{ext}", vocab.display()));
    let raw = std::fs::read_to_string(with("inp")).unwrap();
    let out = std::fs::read_to_string(with("out")).unwrap();
    // llama.cpp's reader: texts end at each separator; whatever follows the last one is a
    // final text only when it is not empty.
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts: Vec<String> = raw.split(sep).map(str::to_string).collect();
    if texts.last().is_some_and(String::is_empty) {
        texts.pop();
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(texts.len(), ids.len(), "{}", vocab.display());
    texts.into_iter().zip(ids).collect()
}

/// How one vocabulary fared: refused (kiln's message), or how many texts gave the expected
/// ids and the first that did not.
enum Outcome {
    Refused(String),
    Read {
        same: usize,
        total: usize,
        first_difference: Option<String>,
    },
}

/// Every vocabulary in `dir` with test files, by file name.
fn check_dir(dir: &Path) -> Vec<(String, Outcome)> {
    let mut vocabs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .filter(|p| PathBuf::from(format!("{}.inp", p.display())).exists())
        .collect();
    vocabs.sort();
    assert!(!vocabs.is_empty(), "no vocabularies in {}", dir.display());
    vocabs
        .iter()
        .map(|v| {
            let name = v.file_name().unwrap().to_string_lossy().to_string();
            let tok = match kiln::data::tokenizer_from_path(v) {
                Ok(t) => t,
                Err(e) => return (name, Outcome::Refused(e.to_string())),
            };
            let cases = cases(v);
            let mut first_difference = None;
            let mut same = 0;
            for (text, want) in &cases {
                let got = tok.encode(text);
                if &got == want {
                    same += 1;
                } else if first_difference.is_none() {
                    first_difference = Some(format!("{text:?}: llama.cpp {want:?}, kiln {got:?}"));
                }
            }
            let total = cases.len();
            (
                name,
                Outcome::Read {
                    same,
                    total,
                    first_difference,
                },
            )
        })
        .collect()
}

/// Every vocabulary kiln reads gives llama.cpp's ids for every test text. Over a whole
/// models/ folder (`KILN_LLAMA_CPP_VOCABS`) kiln may refuse some (a WordPiece or Gemma
/// vocabulary, a pre-tokenizer it does not know), with a message; in the committed subset it
/// must read them all.
#[test]
fn published_vocabularies_give_llama_cpps_ids() {
    let given = std::env::var_os("KILN_LLAMA_CPP_VOCABS").map(PathBuf::from);
    let dir = given.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/llama-cpp-vocab")
    });
    let results = check_dir(&dir);
    let refused = |o: &Outcome| matches!(o, Outcome::Refused(_));
    if given.is_none() {
        assert!(
            !results.iter().any(|r| refused(&r.1)),
            "a committed vocabulary was not read"
        );
    }
    assert!(
        results.iter().any(|r| !refused(&r.1)),
        "kiln read none of them"
    );
    let mut failed = vec![];
    for (name, outcome) in &results {
        match outcome {
            Outcome::Refused(why) => eprintln!("{name}: not read: {why}"),
            Outcome::Read {
                same,
                total,
                first_difference,
            } => {
                eprintln!(
                    "{name}: {same}/{total} texts{}",
                    first_difference
                        .as_ref()
                        .map_or(String::new(), |f| format!("; first that differs: {f}"))
                );
                if same != total {
                    failed.push(name);
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "ids differ from llama.cpp's for {failed:?}"
    );
}

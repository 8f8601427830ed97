//! `kiln verify`: checks a whole run directory without loading a model.
//!
//! Every checkpoint's files are read and checked against its manifest (sizes and CRC-32),
//! safetensors headers and the trainer state are parsed, the `latest` pointer must name a
//! checkpoint that verifies, and leftovers of interrupted writes and a live lock holder are
//! reported. Exit 0 when everything the run needs verifies, 4 when something is damaged, and
//! 10 when nothing is damaged but legacy checkpoints (format version 1, written before
//! checkpoints carried manifests) could be checked only for their structure.
//!
//! `--adopt` writes a manifest for each legacy checkpoint from its files as they are, under
//! the run's lock. It trusts them: a file damaged before adoption is recorded as it is.

use crate::error::{KilnError, Result};
use crate::train::checkpoint::{self, Checked};
use crate::train::{self, lock};
use clap::Args;
use std::fs;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln verify runs/big          check every checkpoint of a run against its manifest
  kiln verify runs/old --adopt  write manifests for checkpoints made before kiln wrote them

A damaged checkpoint is named with the file that does not match; resume, eval or generate
from one that verifies with --checkpoint step_N.

Checkpoints written before checkpoints carried manifests (format version 1) are reported as
\"legacy (no manifest): unverified\": their structure is checked, their values cannot be.
They still load, with a warning. --adopt records the size and CRC-32 of their files as they
are now, so later reads are verified against that; it trusts the files, so adopt only
checkpoints you have no reason to doubt.

EXIT CODES:
  0 everything verifies   4 something is damaged or missing, or not a run directory
  9 --adopt on a run another process is training   10 only legacy checkpoints are unverified")]
pub struct VerifyArgs {
    /// Run directory written by `kiln train` (default: the most recent run).
    #[arg(value_name = "RUN")]
    pub run: Option<PathBuf>,
    /// Write a manifest for each legacy checkpoint (format version 1, none of its own) from
    /// its files as they are now, trusting them; then verify the run as usual.
    #[arg(long)]
    pub adopt: bool,
}

fn name_of(ckpt: &std::path::Path) -> String {
    ckpt.file_name().map_or_else(
        || ckpt.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
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
    // Adoption writes into the run, so it takes the run's lock like a writer (a live run
    // is refused, exit 9); plain verification only reads and reports a live holder.
    let _lock = if a.adopt {
        Some(lock::RunLock::acquire(&run_dir)?)
    } else {
        if let Some(holder) = lock::holder(&run_dir) {
            println!("in use      by {holder} (checkpoints may appear while this runs)");
        }
        None
    };
    let checkpoints = checkpoint::list(&run_dir);
    if a.adopt {
        let mut adopted = 0;
        for ckpt in &checkpoints {
            // A legacy checkpoint that fails its structural checks is not adopted; the
            // verification below reports it as damaged.
            if let Ok(true) = checkpoint::adopt(ckpt) {
                println!(
                    "adopted     {}: manifest written from its files as they are (trusted, not verified)",
                    name_of(ckpt)
                );
                adopted += 1;
            }
        }
        if adopted == 0 {
            println!("adopted     none (no legacy checkpoint without a manifest)");
        }
    }
    let mut good = Vec::new();
    let mut legacy = Vec::new();
    for ckpt in &checkpoints {
        let name = name_of(ckpt);
        match checkpoint::verify(ckpt) {
            Ok(v) => {
                let size = train::metrics::format_bytes(v.bytes as usize);
                match v.checked {
                    Checked::Manifest => println!("ok          {name}: step {}, {size}", v.step),
                    Checked::Adopted => println!(
                        "ok          {name}: step {}, {size} (against a manifest adopted from its files)",
                        v.step
                    ),
                    Checked::Legacy => {
                        println!(
                            "legacy      {name}: legacy (no manifest): unverified; step {}, {size}, structure intact",
                            v.step
                        );
                        legacy.push(name);
                        continue;
                    }
                }
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
            } else if legacy.contains(&name) {
                println!("latest      {name} (legacy, unverified)");
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
        // A process stopped between renaming its first checkpoint into place and writing the
        // pointer: every reader takes the newest checkpoint then, so it is fine if that verifies.
        Ok(None) => {
            let newest = name_of(&checkpoints[0]);
            if good.contains(&newest) || legacy.contains(&newest) {
                println!(
                    "latest      {newest} (no pointer: a write stopped before it; readers take the newest)"
                );
            } else {
                println!(
                    "DANGLING    checkpoints/latest is missing and the newest, {newest}, does not verify"
                );
                problems.push(format!(
                    "checkpoints/latest is missing and the newest checkpoint, {newest}, does not verify"
                ));
            }
        }
        Err(e) => problems.push(e.to_string()),
    }
    if let Ok(entries) = fs::read_dir(checkpoint::checkpoints_dir(&run_dir)) {
        for e in entries.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with('.') && n.ends_with(".tmp") {
                println!("leftover    {n} (an interrupted write; ignored by every reader)");
            }
            if n.starts_with('.') && n.ends_with(checkpoint::DELETING_SUFFIX) {
                println!(
                    "leftover    {n} (an interrupted deletion of an old checkpoint; ignored by \
                     every reader, removed by the next checkpoint)"
                );
            }
        }
    }
    if problems.is_empty() {
        if !legacy.is_empty() {
            return Err(KilnError::Unverified {
                path: run_dir,
                names: legacy,
            });
        }
        println!(
            "verified    {} checkpoint(s) of {}",
            good.len(),
            run_dir.display()
        );
        return Ok(());
    }
    let mut advice = Vec::new();
    if let Some(g) = good.first() {
        advice.push(format!(
            "checkpoints that verify: {}; use --checkpoint {g} with kiln train --resume, eval or generate",
            good.join(", ")
        ));
    }
    if !legacy.is_empty() {
        advice.push(format!(
            "legacy checkpoints (no manifest, unverified) that load: {}",
            legacy.join(", ")
        ));
    }
    if advice.is_empty() {
        advice.push("no checkpoint verifies; start a new run".into());
    }
    Err(KilnError::run_dir(
        &run_dir,
        format!(
            "{} problem(s): {}; {}",
            problems.len(),
            problems.join("; "),
            advice.join("; ")
        ),
    ))
}

//! Observers of a run: the metrics file (JSON lines) and the progress line.

use crate::error::{KilnError, Result};
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Appends one JSON object per line to `metrics.jsonl`; appending keeps a resumed run's
/// history in one file.
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| KilnError::output(path, e))?;
        Ok(MetricsWriter {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn write(&mut self, record: &impl Serialize) -> Result<()> {
        let mut line =
            serde_json::to_string(record).map_err(|e| KilnError::output(&self.path, e))?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|e| KilnError::output(&self.path, e))
    }
}

/// Human-friendly durations: `42s`, `3m05s`, `1h02m`.
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

pub fn format_bytes(b: usize) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    }
}

/// The progress line: rewritten in place on a terminal, one plain line per report otherwise
/// (so logs and CI output stay readable).
pub struct Progress {
    tty: bool,
    quiet: bool,
    live: bool,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        Progress {
            tty: std::io::stdout().is_terminal(),
            quiet,
            live: false,
        }
    }

    pub fn update(&mut self, line: &str) {
        if self.quiet {
            return;
        }
        if self.tty {
            print!("\r\x1b[2K{line}");
            let _ = std::io::stdout().flush();
            self.live = true;
        } else {
            println!("{line}");
        }
    }

    /// Prints a message on its own line without losing the progress line.
    pub fn message(&mut self, msg: &str) {
        if self.quiet {
            return;
        }
        if self.live {
            println!();
            self.live = false;
        }
        println!("{msg}");
    }

    pub fn finish(&mut self) {
        if self.live && !self.quiet {
            println!();
        }
        self.live = false;
    }
}

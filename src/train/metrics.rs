//! Observers of a run: the metrics file (JSON lines: `train`, `eval` and, on a GPU, `device`
//! records) and the progress line.

use crate::error::{KilnError, Result};
use crate::hw::nvml::DeviceSample;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Appends one JSON object per line to `metrics.jsonl`; appending keeps a resumed run's
/// history in one file.
pub struct MetricsWriter {
    /// `None` for a rank other than 0 of a data-parallel run, which records nothing.
    file: Option<File>,
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
            file: Some(file),
            path: path.to_path_buf(),
        })
    }

    /// A writer that records nothing (the ranks besides 0 of a data-parallel run).
    pub fn discard() -> Self {
        MetricsWriter {
            file: None,
            path: PathBuf::new(),
        }
    }

    /// Appends GPU readings, one `{"kind": "device", ...}` line each.
    pub fn write_device_samples(&mut self, samples: &[DeviceSample]) -> Result<()> {
        #[derive(Serialize)]
        struct DeviceRecord<'a> {
            kind: &'static str,
            #[serde(flatten)]
            sample: &'a DeviceSample,
        }
        for sample in samples {
            self.write(&DeviceRecord {
                kind: "device",
                sample,
            })?;
        }
        Ok(())
    }

    pub fn write(&mut self, record: &impl Serialize) -> Result<()> {
        let Some(file) = &mut self.file else {
            return Ok(());
        };
        let mut line =
            serde_json::to_string(record).map_err(|e| KilnError::output(&self.path, e))?;
        line.push('\n');
        file.write_all(line.as_bytes())
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

/// The progress line: redrawn in place on a terminal (by indicatif, which limits redraws and
/// cuts the line to the terminal's width instead of wrapping it), one plain line per report
/// otherwise (so logs, CI output and the tests that read it stay as they are).
pub struct Progress {
    /// The live line; `None` when standard output is not a terminal that indicatif draws on,
    /// and then every update and message is printed as a line of its own.
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        let bar = (!quiet && std::io::stdout().is_terminal())
            .then(|| {
                let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
                bar.set_style(
                    ProgressStyle::with_template("{wide_msg}").expect("a valid template"),
                );
                bar
            })
            // indicatif hides a bar whose target it judges not to be a terminal, and drops
            // what it is given to print then: such a run prints plain lines instead.
            .filter(|bar| !bar.is_hidden());
        Progress { bar, quiet }
    }

    pub fn update(&mut self, line: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(bar) => bar.set_message(line.to_string()),
            None => println!("{line}"),
        }
    }

    /// Prints a message on its own line without losing the progress line.
    pub fn message(&mut self, msg: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => println!("{msg}"),
        }
    }

    /// Leaves the last progress line on the screen as a plain line (none when no step was
    /// reported); later messages print as plain lines.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            let last = bar.message();
            bar.finish_and_clear();
            if !last.is_empty() {
                println!("{last}");
            }
        }
    }
}

/// A run that stops on an error still ends the live line, so the error starts a line of its own.
impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_samples_are_written_as_device_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut w = MetricsWriter::open(&path).unwrap();
        let sample = DeviceSample {
            elapsed_s: 1.5,
            gpu: 0,
            gpu_util_pct: Some(97),
            mem_util_pct: Some(41),
            power_w: Some(612.5),
            sm_clock_mhz: Some(1980),
            mem_clock_mhz: Some(2619),
            temperature_c: Some(61),
            mem_used_bytes: None,
        };
        w.write_device_samples(&[sample.clone(), sample]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2);
        let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(v["kind"], "device");
        assert_eq!(v["elapsed_s"], 1.5);
        assert_eq!(v["gpu_util_pct"], 97);
        assert_eq!(v["mem_util_pct"], 41);
        assert_eq!(v["power_w"], 612.5);
        assert_eq!(v["sm_clock_mhz"], 1980);
        assert_eq!(v["mem_clock_mhz"], 2619);
        assert_eq!(v["temperature_c"], 61);
        // An unknown reading is null, not missing, so every record has the same keys.
        assert!(v["mem_used_bytes"].is_null() && v.get("mem_used_bytes").is_some());
    }
}

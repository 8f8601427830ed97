//! Benchmark reports: what every `kiln bench <suite>` writes into its output directory.
//!
//! A [`Report`] collects markdown (text, tables, plots), machine-readable results and notes,
//! and on [`Report::finish`] writes `report.md`, `results.json` and the PNG plots, then prints
//! a short table. Every report opens with the machine as `kiln hw` sees it and the exact command
//! line that reproduces it; while a suite runs on a GPU, [`Report::watch_gpu`] samples NVML
//! (utilisation, power, clocks) and the readings go into the report.

pub mod plot;
pub mod table;

pub use plot::{BarChart, LinePlot, Plot, PlotError, Series};
pub use table::Table;

use crate::error::{KilnError, Result};
use crate::hw::nvml::{DeviceSample, Sampler};
use crate::hw::{self, HwReport};
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A benchmark report being assembled; nothing is written until [`Report::finish`] except the
/// plots, which are rendered as they are added.
pub struct Report {
    suite: String,
    title: String,
    dir: PathBuf,
    machine: HwReport,
    command: String,
    body: String,
    results: Map<String, Value>,
    plots: Vec<String>,
    notes: Vec<String>,
    skipped: Vec<String>,
    sampler: Option<Sampler>,
    started: Instant,
}

/// One quantity read out of an NVML sample.
type Reading = dyn Fn(&DeviceSample) -> Option<f64>;

/// The command line as a shell would need it typed again.
fn command_line() -> String {
    shell_words(std::env::args())
}

fn shell_words(args: impl Iterator<Item = String>) -> String {
    args.map(|a| {
        let plain = !a.is_empty()
            && a.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c));
        if plain {
            a
        } else {
            format!("'{}'", a.replace('\'', r"'\''"))
        }
    })
    .collect::<Vec<_>>()
    .join(" ")
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The machine in a few lines of markdown.
pub fn machine_summary(m: &HwReport) -> String {
    let mut s = String::new();
    for g in &m.gpus {
        let mut parts = vec![g.name.clone()];
        if let Some(b) = g.memory_total {
            parts.push(gib(b));
        }
        if let Some((a, b)) = g.compute_capability {
            parts.push(format!("compute capability {a}.{b}"));
        }
        if let Some(n) = g.sm_count {
            parts.push(format!("{n} SMs"));
        }
        if let Some(w) = g.power_limit_w {
            parts.push(format!("power limit {w:.0} W"));
        }
        let at = g.ordinal.map_or("GPU".into(), |o| format!("cuda:{o}"));
        s += &format!("- {at}: {}\n", parts.join(", "));
    }
    if !m.gpus.is_empty() {
        s += &format!(
            "- driver {}, CUDA {}\n",
            m.driver.version.as_deref().unwrap_or("unknown"),
            m.driver.cuda_version.as_deref().unwrap_or("unknown")
        );
    }
    if let Some(why) = &m.no_gpu {
        s += &format!("- no GPU: {}\n", why.detail);
    }
    s += &format!(
        "- CPU: {}, {} cores, {} threads (kiln uses {})\n",
        m.cpu.model.as_deref().unwrap_or("unknown model"),
        m.cpu
            .physical_cores
            .map_or("unknown".into(), |c| c.to_string()),
        m.cpu.threads,
        m.cpu.compute_threads
    );
    s += &format!(
        "- RAM: {}\n",
        m.ram.total_bytes.map_or("unknown".into(), gib)
    );
    s
}

impl Report {
    /// Starts a report for `suite` into `dir` (created if missing), detecting the machine now.
    pub fn new(suite: &str, title: &str, dir: &Path) -> Result<Report> {
        std::fs::create_dir_all(dir).map_err(|e| KilnError::output(dir, e))?;
        Ok(Report {
            suite: suite.into(),
            title: title.into(),
            dir: dir.to_path_buf(),
            machine: hw::detect(),
            command: command_line(),
            body: String::new(),
            results: Map::new(),
            plots: Vec::new(),
            notes: Vec::new(),
            skipped: Vec::new(),
            sampler: None,
            started: Instant::now(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn machine(&self) -> &HwReport {
        &self.machine
    }

    /// Markdown text, as a paragraph.
    pub fn text(&mut self, md: &str) {
        self.body += md.trim_end();
        self.body += "\n\n";
    }

    pub fn heading(&mut self, title: &str) {
        self.body += &format!("## {title}\n\n");
    }

    pub fn table(&mut self, t: &Table) {
        self.body += &t.markdown();
        self.body += "\n";
    }

    /// Something worth knowing about how the numbers were taken.
    pub fn note(&mut self, s: impl Into<String>) {
        let s = s.into();
        println!("note: {s}");
        self.notes.push(s);
    }

    /// Something the suite did not measure, and why.
    pub fn skip(&mut self, s: impl Into<String>) {
        let s = s.into();
        println!("skipped: {s}");
        self.skipped.push(s);
    }

    /// Stores `value` under `key` in `results.json`.
    pub fn result(&mut self, key: &str, value: impl Serialize) -> Result<()> {
        let v = serde_json::to_value(value).map_err(|e| KilnError::output(&self.dir, e))?;
        self.results.insert(key.into(), v);
        Ok(())
    }

    /// Renders `plot` to `<name>.png` and shows it in the report. A plot with no data becomes
    /// a note rather than an empty picture; a file that cannot be written is an error.
    pub fn plot(&mut self, name: &str, plot: &Plot) -> Result<()> {
        let file = format!("{name}.png");
        let path = self.dir.join(&file);
        match plot.render(&path) {
            Ok(()) => {
                self.body += &format!("![{}]({file})\n\n", plot.title());
                self.plots.push(file);
                Ok(())
            }
            Err(PlotError::Empty) => {
                self.note(format!("plot {file} not drawn: no data"));
                Ok(())
            }
            Err(e) => Err(KilnError::output(&path, e)),
        }
    }

    /// Samples GPU `ordinal` through NVML until the report finishes; without NVML, says so.
    pub fn watch_gpu(&mut self, ordinal: usize) {
        match Sampler::spawn(ordinal, Duration::from_millis(500), self.started) {
            Ok(s) => self.sampler = Some(s),
            Err(e) => self.note(format!("no NVML readings during the run: {e}")),
        }
    }

    /// Adds the NVML readings (a table of mean and peak, a plot over time) when there are any.
    fn add_gpu_readings(&mut self) -> Result<()> {
        let Some(sampler) = self.sampler.take() else {
            return Ok(());
        };
        let samples = sampler.drain();
        drop(sampler);
        if samples.is_empty() {
            return Ok(());
        }
        self.heading("GPU during the run (NVML, every 0.5 s)");
        let mut t = Table::new(&["reading", "mean", "peak"]);
        let metric = |f: &Reading| {
            let v: Vec<f64> = samples.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| {
                (
                    v.iter().sum::<f64>() / v.len() as f64,
                    v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                )
            })
        };
        let rows: [(&str, &Reading, usize); 7] = [
            ("GPU utilisation %", &|s| s.gpu_util_pct.map(f64::from), 0),
            (
                "memory utilisation %",
                &|s| s.mem_util_pct.map(f64::from),
                0,
            ),
            ("power W", &|s| s.power_w, 0),
            ("SM clock MHz", &|s| s.sm_clock_mhz.map(f64::from), 0),
            ("memory clock MHz", &|s| s.mem_clock_mhz.map(f64::from), 0),
            ("temperature C", &|s| s.temperature_c.map(f64::from), 0),
            (
                "memory used GiB",
                &|s| s.mem_used_bytes.map(|b| b as f64 / (1u64 << 30) as f64),
                1,
            ),
        ];
        for (name, f, prec) in rows {
            if let Some((mean, peak)) = metric(f) {
                t.row(vec![
                    name.into(),
                    format!("{mean:.prec$}"),
                    format!("{peak:.prec$}"),
                ]);
            }
        }
        self.table(&t);
        let series = |name: &str, f: &Reading| {
            Series::new(
                name,
                samples
                    .iter()
                    .filter_map(|s| f(s).map(|v| (s.elapsed_s, v)))
                    .collect(),
            )
        };
        self.plot(
            "gpu_readings",
            &Plot::Line(LinePlot {
                title: "GPU utilisation and power during the run".into(),
                x_label: "seconds".into(),
                y_label: "% or W".into(),
                series: vec![
                    series("GPU utilisation %", &|s| s.gpu_util_pct.map(f64::from)),
                    series("memory utilisation %", &|s| s.mem_util_pct.map(f64::from)),
                    series("power W", &|s| s.power_w),
                ],
                ..LinePlot::default()
            }),
        )?;
        self.result("gpu_samples", &samples)
    }

    /// Writes `report.md` and `results.json`, prints `summary` and where the files are.
    pub fn finish(mut self, summary: &Table) -> Result<()> {
        self.add_gpu_readings()?;
        let mut md = format!(
            "# {}\n\nReproduce: `{}`\n\nMachine:\n\n{}\n",
            self.title,
            self.command,
            machine_summary(&self.machine)
        );
        md += &self.body;
        for (title, items) in [("Notes", &self.notes), ("Skipped", &self.skipped)] {
            if !items.is_empty() {
                md += &format!("## {title}\n\n");
                for i in items {
                    md += &format!("- {i}\n");
                }
                md += "\n";
            }
        }
        let mut json = Map::new();
        json.insert("suite".into(), Value::from(self.suite.clone()));
        json.insert("title".into(), Value::from(self.title.clone()));
        json.insert("command".into(), Value::from(self.command.clone()));
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        json.insert("unix_time".into(), Value::from(secs));
        json.insert(
            "machine".into(),
            serde_json::to_value(&self.machine).map_err(|e| KilnError::output(&self.dir, e))?,
        );
        json.insert("notes".into(), Value::from(self.notes.clone()));
        json.insert("skipped".into(), Value::from(self.skipped.clone()));
        json.insert("plots".into(), Value::from(self.plots.clone()));
        json.extend(std::mem::take(&mut self.results));
        let json =
            serde_json::to_string_pretty(&json).map_err(|e| KilnError::output(&self.dir, e))?;
        for (name, text) in [("report.md", md), ("results.json", json)] {
            let path = self.dir.join(name);
            std::fs::write(&path, text).map_err(|e| KilnError::output(&path, e))?;
        }
        println!("\n{}", self.title);
        print!("{}", summary.terminal());
        println!(
            "wrote {} ({} plot{})",
            self.dir.join("report.md").display(),
            self.plots.len(),
            if self.plots.len() == 1 { "" } else { "s" }
        );
        Ok(())
    }
}

/// A suite's `results.json` in `dir`, parsed (for tests of the suites).
#[cfg(test)]
pub(crate) fn read_results(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("results.json")).expect("results.json written");
    serde_json::from_str(&text).expect("results.json is JSON")
}

/// Overrides that shrink the default GPT to a model a suite's CPU test trains in moments,
/// plus `extra` (for tests of the suites).
#[cfg(test)]
pub(crate) fn tiny_model_overrides(extra: &[&str]) -> Vec<String> {
    [
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.context=16",
        "train.seq_len=16",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_writes_markdown_json_and_plots() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("nested/suite");
        let mut r = Report::new("demo", "Demo benchmark", &out).unwrap();
        r.text("Some words.");
        let mut t = Table::new(&["size", "ms"]);
        t.row(vec!["1".into(), "0.5".into()]);
        r.table(&t);
        r.plot(
            "times",
            &Plot::Line(LinePlot {
                title: "time".into(),
                series: vec![Series::new("a", vec![(1.0, 1.0), (2.0, 3.0)])],
                ..LinePlot::default()
            }),
        )
        .unwrap();
        r.plot("empty", &Plot::Bar(BarChart::default())).unwrap();
        r.skip("the GPU part (no GPU)");
        r.result("rows", vec![1, 2, 3]).unwrap();
        r.finish(&t).unwrap();

        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.starts_with("# Demo benchmark\n"), "{md}");
        assert!(md.contains("Reproduce: `"), "{md}");
        assert!(md.contains("- CPU: "), "{md}");
        assert!(md.contains("| 1 | 0.5 |"), "{md}");
        assert!(md.contains("![time](times.png)"), "{md}");
        assert!(md.contains("## Skipped\n\n- the GPU part (no GPU)"), "{md}");
        assert!(md.contains("plot empty.png not drawn: no data"), "{md}");
        plot::tests::assert_png(&out.join("times.png"));
        assert!(!out.join("empty.png").exists());

        let json = super::read_results(&out);
        assert_eq!(json["suite"], "demo");
        assert_eq!(json["rows"], serde_json::json!([1, 2, 3]));
        assert_eq!(json["plots"], serde_json::json!(["times.png"]));
        assert!(json["machine"]["cpu"]["threads"].as_u64().unwrap() >= 1);
    }

    #[test]
    fn an_unwritable_directory_is_an_output_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").unwrap();
        let e = Report::new("demo", "Demo", &file.join("sub"))
            .err()
            .unwrap();
        assert_eq!(e.exit_code(), 7);
    }

    #[test]
    fn command_lines_are_quoted_for_the_shell() {
        let args = [
            "kiln",
            "bench",
            "amp",
            "--out",
            "a b",
            "it's",
            "train.steps=3",
        ];
        assert_eq!(
            shell_words(args.iter().map(|a| a.to_string())),
            r"kiln bench amp --out 'a b' 'it'\''s' train.steps=3"
        );
    }
}

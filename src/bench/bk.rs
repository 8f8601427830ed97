//! `kiln bench bk`: BK-Core forward and forward+backward time over a grid of batch sizes and
//! sequence lengths, against three references measured in the same run:
//!
//! - the DRAM roofline: the bytes the kernels must move (forward: read v, write G = 12 bytes
//!   per position; backward adds read v and dL/dG, write dv = 16 more) over the bandwidth of a
//!   device-to-device copy, so `fraction` = floor time / measured time;
//! - a device-to-device copy that moves those same bytes, timed the same way: the fraction of
//!   the roofline that the plainest possible kernel reaches at that size (a small call pays
//!   the launch and the ramp of DRAM traffic as well);
//! - cuSPARSE `cusparseCgtsv2StridedBatch`, one complex tridiagonal solve per sequence (one
//!   right-hand side; the buffer-size query and allocation stay outside the timing);
//! - the determinant recurrence written plainly in PyTorch (`bench/pytorch_bk.py`), when
//!   `python3` with torch is there.
//!
//! Every GPU time is device time per call: a batch of back-to-back calls is captured once
//! into a CUDA graph and replayed between two events
//! ([`CudaBackend::time_graph_median_ms`]), so the host's launch cost (a few microseconds per
//! call, more than the whole of a small call) stays out, as it does inside a training step.
//!
//! Writes `results.json` (one flat row per size), `report.md` and, per batch size, plots of time
//! and of speedup against N, and prints a short table. With no GPU it times the CPU kernel on
//! the sizes that finish quickly and lists what it skipped.

use crate::engine::cpu::bk_core::{self as cpu_bk, BkCoeffs, BkShape, Cx};
use crate::engine::cuda::{BkWork, CudaBackend, CudaError, loader};
use crate::engine::rng::{Rng, stream};
use crate::error::{KilnError, Result};
use crate::report::{LinePlot, Plot, Report, Series, Table};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench bk
  kiln bench bk --out bench-out/bk --batches 1,64 --ns 2048,8192
  kiln bench bk --no-python")]
pub struct BenchBkArgs {
    /// Which GPU (CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out/bk")]
    pub out: PathBuf,
    /// Batch sizes (sequences per call).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,512")]
    pub batches: Vec<usize>,
    /// Sequence lengths.
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048,8192")]
    pub ns: Vec<usize>,
    /// Timed runs per measurement (the median is reported), after warm-up runs.
    #[arg(long, default_value_t = 50)]
    pub reps: usize,
    /// Full mode (G from both sides) or causal (`--causal`).
    #[arg(long)]
    pub causal: bool,
    /// Skip the PyTorch baseline.
    #[arg(long)]
    pub no_python: bool,
}

/// One size. Times in milliseconds; `None` where that measurement was not taken.
#[derive(Debug, Serialize, Default, Clone)]
struct Row {
    batch: usize,
    n: usize,
    fwd_ms: f64,
    fwdbwd_ms: f64,
    fwd_bytes: f64,
    fwdbwd_bytes: f64,
    fwd_gbs: f64,
    fwdbwd_gbs: f64,
    fwd_roofline_fraction: Option<f64>,
    fwdbwd_roofline_fraction: Option<f64>,
    /// A copy moving the forward's (forward+backward's) bytes, and its roofline fraction.
    fwd_copy_ms: Option<f64>,
    fwd_copy_roofline_fraction: Option<f64>,
    fwdbwd_copy_ms: Option<f64>,
    fwdbwd_copy_roofline_fraction: Option<f64>,
    cusparse_ms: Option<f64>,
    fwd_speedup_vs_cusparse: Option<f64>,
    pytorch_fwd_ms: Option<f64>,
    pytorch_fwdbwd_ms: Option<f64>,
    fwd_speedup_vs_pytorch: Option<f64>,
    fwdbwd_speedup_vs_pytorch: Option<f64>,
    pytorch_nonfinite_fraction: Option<f64>,
}

#[derive(Debug)]
struct Results {
    device: String,
    mode: &'static str,
    /// Device-to-device copy rate (read + write), GB/s; the roofline's bandwidth.
    copy_gbs: Option<f64>,
    notes: Vec<String>,
    skipped: Vec<String>,
    rows: Vec<Row>,
}

/// Bytes a kernel must move per position: forward reads v, writes G (complex f32).
const FWD_BYTES: f64 = 12.0;
/// Forward plus backward: the backward reads v and dL/dG and writes dv.
const FWDBWD_BYTES: f64 = 12.0 + 16.0;
/// The most device memory the rotated input copies of one size may take.
const ROTATION_BYTES: usize = 4 << 30;

pub fn run(a: BenchBkArgs) -> Result<()> {
    let mut report = Report::new("bk", "BK-Core benchmark", &a.out)?;
    let results = match CudaBackend::new(a.gpu) {
        Ok(gpu) => {
            report.watch_gpu(a.gpu);
            run_gpu(&gpu, &a)?
        }
        Err(e) => run_cpu(&a, &e.to_string()),
    };
    write_report(report, results)
}

fn random(n: usize, rng: &mut Rng, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
        .collect()
}

fn timing_err(e: CudaError) -> KilnError {
    KilnError::Setting(format!("BK-Core timing failed: {e}"))
}

fn run_gpu(gpu: &CudaBackend, a: &BenchBkArgs) -> Result<Results> {
    println!("device: {}", gpu.info());
    let copy_gbs = copy_bandwidth(gpu).map_err(timing_err)?;
    println!("device copy: {copy_gbs:.0} GB/s (read + write)");
    let mut notes = Vec::new();
    let sparse = match sparse::Cusparse::new(gpu) {
        Ok(s) => Some(s),
        Err(e) => {
            notes.push(format!("cuSPARSE baseline skipped: {e}"));
            None
        }
    };
    let mut rng = Rng::new(1, stream::INIT);
    let mut rows = Vec::new();
    for &n in &a.ns {
        for &batch in &a.batches {
            let s = BkShape {
                batch,
                n,
                causal: a.causal,
            };
            let mut row = time_kiln_gpu(gpu, s, a.reps, &mut rng).map_err(timing_err)?;
            row.fwd_roofline_fraction =
                Some(row.fwd_bytes / (copy_gbs * 1e9) / (row.fwd_ms * 1e-3));
            row.fwdbwd_roofline_fraction =
                Some(row.fwdbwd_bytes / (copy_gbs * 1e9) / (row.fwdbwd_ms * 1e-3));
            let fraction = |bytes: f64, ms: f64| bytes / (copy_gbs * 1e9) / (ms * 1e-3);
            let fwd_copy = time_copy_of(gpu, row.fwd_bytes, a.reps).map_err(timing_err)?;
            row.fwd_copy_ms = Some(fwd_copy);
            row.fwd_copy_roofline_fraction = Some(fraction(row.fwd_bytes, fwd_copy));
            let fwdbwd_copy = time_copy_of(gpu, row.fwdbwd_bytes, a.reps).map_err(timing_err)?;
            row.fwdbwd_copy_ms = Some(fwdbwd_copy);
            row.fwdbwd_copy_roofline_fraction = Some(fraction(row.fwdbwd_bytes, fwdbwd_copy));
            if let Some(sp) = &sparse {
                match sp.time_solve(gpu, batch, n, a.reps, &mut rng) {
                    Ok(ms) => {
                        row.cusparse_ms = Some(ms);
                        row.fwd_speedup_vs_cusparse = Some(ms / row.fwd_ms);
                    }
                    Err(e) => notes.push(format!("cuSPARSE at B{batch} N{n}: {e}")),
                }
            }
            println!(
                "B{batch:<4} N{n:<5} fwd {:.4} ms  fwd+bwd {:.4} ms",
                row.fwd_ms, row.fwdbwd_ms
            );
            rows.push(row);
        }
    }
    if a.no_python {
        notes.push("PyTorch baseline skipped (--no-python)".into());
    } else {
        match pytorch_baseline(a) {
            Ok((note, py)) => {
                notes.push(note);
                merge_pytorch(&mut rows, &py);
            }
            Err(why) => notes.push(format!("PyTorch baseline not run: {why}")),
        }
    }
    Ok(Results {
        device: gpu.info().to_string(),
        mode: mode(a.causal),
        copy_gbs: Some(copy_gbs),
        notes,
        skipped: Vec::new(),
        rows,
    })
}

fn mode(causal: bool) -> &'static str {
    if causal { "causal" } else { "full" }
}

/// Device-to-device copy of 512 MiB: the bandwidth the roofline divides by.
fn copy_bandwidth(gpu: &CudaBackend) -> std::result::Result<f64, CudaError> {
    let n = 128 << 20;
    let src = gpu.alloc::<f32>(n)?;
    let mut dst = gpu.alloc::<f32>(n)?;
    let stream = gpu.stream().clone();
    let ms = gpu.time_median_ms(2, 10, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9)
}

/// A device-to-device copy moving `bytes` through DRAM in all (half read, half written),
/// cycled through enough buffers that each call misses the L2, timed as the kernels are.
fn time_copy_of(gpu: &CudaBackend, bytes: f64, reps: usize) -> std::result::Result<f64, CudaError> {
    let elems = (bytes / 8.0).ceil() as usize; // f32 per side
    let copies = gpu.rotation_copies(8 * elems, ROTATION_BYTES);
    let mut bufs = Vec::with_capacity(copies);
    for _ in 0..copies {
        bufs.push((gpu.alloc::<f32>(elems)?, gpu.alloc::<f32>(elems)?));
    }
    let stream = gpu.stream().clone();
    let mut next = 0;
    gpu.time_graph_median_ms(5, reps, || {
        let (src, dst) = &mut bufs[next % copies];
        next += 1;
        Ok(stream.memcpy_dtod(src, dst)?)
    })
}

fn time_kiln_gpu(
    gpu: &CudaBackend,
    s: BkShape,
    reps: usize,
    rng: &mut Rng,
) -> std::result::Result<Row, CudaError> {
    let elems = s.batch * s.n;
    // v, G, dL/dG and dv: cycled through enough copies that each call reads DRAM.
    let copies = gpu.rotation_copies(24 * elems, ROTATION_BYTES);
    let mut sets = Vec::with_capacity(copies);
    for _ in 0..copies {
        sets.push((
            gpu.upload(&random(elems, rng, 1.0))?,
            gpu.alloc::<f32>(2 * elems)?,
            gpu.upload(&random(2 * elems, rng, 1.0))?,
            gpu.alloc::<f32>(elems)?,
        ));
    }
    let z = gpu.upload(&[0.0f32, 1.0])?;
    let mut w: BkWork = gpu.bk_work(s)?;
    let mut next = 0;
    let fwd_ms = gpu.time_graph_median_ms(5, reps, || {
        let (v, out, _, _) = &mut sets[next % copies];
        next += 1;
        gpu.bk_core_forward_with(&mut w, out, v, &z, None)
    })?;
    let fwdbwd_ms = gpu.time_graph_median_ms(5, reps, || {
        let (v, out, d_out, dv) = &mut sets[next % copies];
        next += 1;
        gpu.bk_core_forward_with(&mut w, out, v, &z, None)?;
        gpu.bk_core_backward_with(&mut w, dv, d_out, v, &z, None, None, None)
    })?;
    if gpu.bk_nonfinite(&mut w)? {
        return Err(CudaError::Driver(
            "the BK-Core forward produced non-finite values on random potentials".into(),
        ));
    }
    Ok(row_for(s, fwd_ms, fwdbwd_ms))
}

fn row_for(s: BkShape, fwd_ms: f64, fwdbwd_ms: f64) -> Row {
    let elems = (s.batch * s.n) as f64;
    let (fb, bb) = (FWD_BYTES * elems, FWDBWD_BYTES * elems);
    Row {
        batch: s.batch,
        n: s.n,
        fwd_ms,
        fwdbwd_ms,
        fwd_bytes: fb,
        fwdbwd_bytes: bb,
        fwd_gbs: fb / (fwd_ms * 1e-3) / 1e9,
        fwdbwd_gbs: bb / (fwdbwd_ms * 1e-3) / 1e9,
        ..Row::default()
    }
}

/// Largest `batch * n` timed on the CPU (a few milliseconds per call on a laptop).
const CPU_MAX_ELEMS: usize = 1 << 19;

fn run_cpu(a: &BenchBkArgs, why: &str) -> Results {
    println!("no usable GPU ({why}); timing the CPU kernel instead");
    let mut rng = Rng::new(1, stream::INIT);
    let (mut rows, mut skipped) = (Vec::new(), Vec::new());
    for &n in &a.ns {
        for &batch in &a.batches {
            if batch * n > CPU_MAX_ELEMS || n == 0 || batch == 0 {
                skipped.push(format!(
                    "B{batch} N{n} (over {CPU_MAX_ELEMS} positions on the CPU)"
                ));
                continue;
            }
            let s = BkShape {
                batch,
                n,
                causal: a.causal,
            };
            let v = random(batch * n, &mut rng, 1.0);
            let d_out = random(2 * batch * n, &mut rng, 1.0);
            let (mut out, mut dv) = (vec![0.0f32; 2 * batch * n], vec![0.0f32; batch * n]);
            let k = BkCoeffs {
                z: Cx::new(0.0f32, 1.0),
                offdiag: None,
            };
            let reps = a.reps.clamp(1, 10);
            let fwd_ms = median_ms(reps, || cpu_bk::forward(&mut out, &v, k, s));
            let fwdbwd_ms = median_ms(reps, || {
                cpu_bk::forward(&mut out, &v, k, s);
                cpu_bk::backward(&mut dv, &d_out, &v, k, s);
            });
            println!("B{batch:<4} N{n:<5} fwd {fwd_ms:.3} ms  fwd+bwd {fwdbwd_ms:.3} ms (CPU)");
            rows.push(row_for(s, fwd_ms, fwdbwd_ms));
        }
    }
    Results {
        device: "cpu".into(),
        mode: mode(a.causal),
        copy_gbs: None,
        notes: vec![
            "no usable GPU: CPU times only; no roofline, cuSPARSE or PyTorch comparison".into(),
        ],
        skipped,
        rows,
    }
}

fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

#[derive(serde::Deserialize)]
struct PyRow {
    batch: usize,
    n: usize,
    fwd_ms: f64,
    fwdbwd_ms: f64,
    nonfinite_fraction: f64,
}

#[derive(serde::Deserialize)]
struct PyOut {
    torch: String,
    device: String,
    rows: Vec<PyRow>,
}

/// Runs `bench/pytorch_bk.py` (found next to the working directory or the executable).
fn pytorch_baseline(a: &BenchBkArgs) -> std::result::Result<(String, Vec<PyRow>), String> {
    let script = super::find_script("pytorch_bk.py")?;
    let list = |xs: &[usize]| {
        xs.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let reps = a.reps.clamp(2, 10).to_string();
    let out = std::process::Command::new("python3")
        .arg(&script)
        .args([
            "--batches",
            &list(&a.batches),
            "--ns",
            &list(&a.ns),
            "--reps",
            &reps,
        ])
        .output()
        .map_err(|e| format!("python3 could not start ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no output");
        return Err(format!("python3 {} failed: {last}", script.display()));
    }
    let py: PyOut = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("unreadable output from {}: {e}", script.display()))?;
    Ok((
        format!(
            "PyTorch {} on {}: determinant recurrence, one step per position, autograd backward",
            py.torch, py.device
        ),
        py.rows,
    ))
}

fn merge_pytorch(rows: &mut [Row], py: &[PyRow]) {
    for r in rows {
        if let Some(p) = py.iter().find(|p| p.batch == r.batch && p.n == r.n) {
            r.pytorch_fwd_ms = Some(p.fwd_ms);
            r.pytorch_fwdbwd_ms = Some(p.fwdbwd_ms);
            r.fwd_speedup_vs_pytorch = Some(p.fwd_ms / r.fwd_ms);
            r.fwdbwd_speedup_vs_pytorch = Some(p.fwdbwd_ms / r.fwdbwd_ms);
            r.pytorch_nonfinite_fraction = Some(p.nonfinite_fraction);
        }
    }
}

fn opt(x: Option<f64>, prec: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.prec$}"))
}

/// A speedup as `12.3x`.
fn times(x: Option<f64>, prec: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.prec$}x"))
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{:.0}%", 100.0 * v))
}

fn detail_table(r: &Results) -> Table {
    let mut t = Table::new(&[
        "batch",
        "N",
        "fwd ms",
        "fwd GB/s",
        "fwd roofline",
        "fwd+bwd ms",
        "fwd+bwd GB/s",
        "fwd+bwd roofline",
        "cuSPARSE ms",
        "vs cuSPARSE",
        "PyTorch fwd ms",
        "vs PyTorch fwd",
        "PyTorch fwd+bwd ms",
        "vs PyTorch fwd+bwd",
        "PyTorch non-finite",
    ]);
    for x in &r.rows {
        t.row(vec![
            x.batch.to_string(),
            x.n.to_string(),
            format!("{:.4}", x.fwd_ms),
            format!("{:.0}", x.fwd_gbs),
            pct(x.fwd_roofline_fraction),
            format!("{:.4}", x.fwdbwd_ms),
            format!("{:.0}", x.fwdbwd_gbs),
            pct(x.fwdbwd_roofline_fraction),
            opt(x.cusparse_ms, 4),
            times(x.fwd_speedup_vs_cusparse, 1),
            opt(x.pytorch_fwd_ms, 2),
            times(x.fwd_speedup_vs_pytorch, 0),
            opt(x.pytorch_fwdbwd_ms, 2),
            times(x.fwdbwd_speedup_vs_pytorch, 0),
            pct(x.pytorch_nonfinite_fraction),
        ]);
    }
    t
}

/// The roofline fraction that a plain copy of the same bytes reaches at each size, beside
/// kiln's: an upper bound for any kernel that must move those bytes in one call.
fn copy_table(r: &Results) -> Option<Table> {
    if r.rows.iter().all(|x| x.fwd_copy_ms.is_none()) {
        return None;
    }
    let mut t = Table::new(&[
        "batch",
        "N",
        "copy of fwd bytes ms",
        "copy roofline",
        "kiln fwd roofline",
        "copy of fwd+bwd bytes ms",
        "copy roofline",
        "kiln fwd+bwd roofline",
    ]);
    for x in &r.rows {
        t.row(vec![
            x.batch.to_string(),
            x.n.to_string(),
            opt(x.fwd_copy_ms, 4),
            pct(x.fwd_copy_roofline_fraction),
            pct(x.fwd_roofline_fraction),
            opt(x.fwdbwd_copy_ms, 4),
            pct(x.fwdbwd_copy_roofline_fraction),
            pct(x.fwdbwd_roofline_fraction),
        ]);
    }
    Some(t)
}

fn summary_table(r: &Results) -> Table {
    let mut t = Table::new(&[
        "batch",
        "N",
        "fwd ms",
        "roof",
        "copy roof",
        "f+b ms",
        "roof",
        "vs cuSP",
        "vs torch",
    ]);
    for x in &r.rows {
        t.row(vec![
            x.batch.to_string(),
            x.n.to_string(),
            format!("{:.4}", x.fwd_ms),
            pct(x.fwd_roofline_fraction),
            pct(x.fwd_copy_roofline_fraction),
            format!("{:.4}", x.fwdbwd_ms),
            pct(x.fwdbwd_roofline_fraction),
            times(x.fwd_speedup_vs_cusparse, 1),
            times(x.fwdbwd_speedup_vs_pytorch, 0),
        ]);
    }
    t
}

type Field = fn(&Row) -> Option<f64>;

/// One series per field over the rows of one batch size, against N; fields a row lacks are
/// left out, and a series with no points at all is dropped.
fn series_by_n(rows: &[&Row], fields: &[(&str, Field)]) -> Vec<Series> {
    fields
        .iter()
        .map(|(name, f)| {
            Series::new(
                *name,
                rows.iter()
                    .filter_map(|r| f(r).map(|v| (r.n as f64, v)))
                    .collect(),
            )
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

/// Time and speedup against N, one pair of plots per batch size.
fn add_plots(report: &mut Report, r: &Results) -> Result<()> {
    let mut batches: Vec<usize> = r.rows.iter().map(|x| x.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let time_fields: [(&str, Field); 5] = [
        ("kiln fwd", |x| Some(x.fwd_ms)),
        ("kiln fwd+bwd", |x| Some(x.fwdbwd_ms)),
        ("cuSPARSE solve", |x| x.cusparse_ms),
        ("PyTorch fwd", |x| x.pytorch_fwd_ms),
        ("PyTorch fwd+bwd", |x| x.pytorch_fwdbwd_ms),
    ];
    let speedup_fields: [(&str, Field); 3] = [
        ("fwd vs cuSPARSE", |x| x.fwd_speedup_vs_cusparse),
        ("fwd vs PyTorch", |x| x.fwd_speedup_vs_pytorch),
        ("fwd+bwd vs PyTorch", |x| x.fwdbwd_speedup_vs_pytorch),
    ];
    for b in batches {
        let rows: Vec<&Row> = r.rows.iter().filter(|x| x.batch == b).collect();
        report.plot(
            &format!("time_b{b}"),
            &Plot::Line(LinePlot {
                title: format!("BK-Core time against N, batch {b} ({})", r.device),
                x_label: "sequence length N".into(),
                y_label: "milliseconds".into(),
                log_x: true,
                log_y: true,
                series: series_by_n(&rows, &time_fields),
            }),
        )?;
        let speedups = series_by_n(&rows, &speedup_fields);
        if !speedups.is_empty() {
            report.plot(
                &format!("speedup_b{b}"),
                &Plot::Line(LinePlot {
                    title: format!("kiln speedup against N, batch {b}"),
                    x_label: "sequence length N".into(),
                    y_label: "reference time / kiln time".into(),
                    log_x: true,
                    log_y: true,
                    series: speedups,
                }),
            )?;
        }
    }
    Ok(())
}

fn write_report(mut report: Report, r: Results) -> Result<()> {
    report.text(&format!(
        "device: {}  \nmode: {}  \ncopy bandwidth: {}\n\n\
         Floor bytes per position: forward 12 (read v, write G), forward+backward 28. \
         Roofline fraction = (bytes / copy bandwidth) / time. Speedups are reference time / \
         kiln time. kiln, cuSPARSE and the copies are timed as device time per call: a batch \
         of back-to-back calls captured into a CUDA graph and replayed, inputs cycled past \
         the L2.",
        r.device,
        r.mode,
        r.copy_gbs
            .map_or("not measured".into(), |g| format!("{g:.0} GB/s"))
    ));
    report.table(&detail_table(&r));
    if let Some(t) = copy_table(&r) {
        report.text(
            "A device-to-device copy that moves the same bytes as the kernels, timed the same \
             way, reaches this much of the roofline at each size; the gap at small sizes is \
             the launch, ramp and tail time that no kernel moving those bytes in one call \
             avoids.",
        );
        report.table(&t);
    }
    add_plots(&mut report, &r)?;
    for n in &r.notes {
        report.note(n.clone());
    }
    for s in &r.skipped {
        report.skip(s.clone());
    }
    report.result("device", &r.device)?;
    report.result("mode", r.mode)?;
    report.result("copy_gbs", r.copy_gbs)?;
    report.result("rows", &r.rows)?;
    report.finish(&summary_table(&r))
}

/// cuSPARSE's batched complex tridiagonal solve, loaded only for this benchmark.
mod sparse {
    use super::*;
    use cudarc::cusparse::sys;
    use cudarc::driver::DevicePtr;

    pub struct Cusparse {
        handle: sys::cusparseHandle_t,
    }

    fn check(what: &str, st: sys::cusparseStatus_t) -> std::result::Result<(), CudaError> {
        if st == sys::cusparseStatus_t::CUSPARSE_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(CudaError::Driver(format!("cuSPARSE {what}: {st:?}")))
        }
    }

    impl Cusparse {
        pub fn new(gpu: &CudaBackend) -> std::result::Result<Cusparse, CudaError> {
            loader::ensure_loaded(loader::CudaLibrary::Cusparse)?;
            loader::guarded("cuSPARSE start", || {
                let mut handle = std::ptr::null_mut();
                // SAFETY: creates a handle and binds it to kiln's stream (the context is current).
                unsafe {
                    gpu.context().bind_to_thread()?;
                    check("create", sys::cusparseCreate(&mut handle))?;
                    check(
                        "set stream",
                        sys::cusparseSetStream(handle, gpu.stream().cu_stream() as _),
                    )?;
                }
                Ok(Cusparse { handle })
            })
        }

        /// Median time of solving `batch` systems `(H - iI) x = rhs` of size `n`.
        pub fn time_solve(
            &self,
            gpu: &CudaBackend,
            batch: usize,
            n: usize,
            reps: usize,
            rng: &mut Rng,
        ) -> std::result::Result<f64, CudaError> {
            let elems = batch * n;
            let (m, count) = (n as i32, batch as i32);
            // Interleaved complex: sub-diagonal (first of each system zero), diagonal
            // -2 + v - i, super-diagonal (last zero), right-hand side.
            let v = random(elems, rng, 1.0);
            let mut dl = vec![0.0f32; 2 * elems];
            let mut d = vec![0.0f32; 2 * elems];
            let mut du = vec![0.0f32; 2 * elems];
            for i in 0..elems {
                let pos = i % n;
                d[2 * i] = -2.0 + v[i];
                d[2 * i + 1] = -1.0;
                if pos > 0 {
                    dl[2 * i] = 1.0;
                }
                if pos + 1 < n {
                    du[2 * i] = 1.0;
                }
            }
            let (dl, d, du) = (gpu.upload(&dl)?, gpu.upload(&d)?, gpu.upload(&du)?);
            // Three diagonals and the right-hand side, 32 bytes per position: cycled like
            // kiln's inputs so that each solve reads DRAM.
            let copies = gpu.rotation_copies(32 * elems, super::ROTATION_BYTES);
            let mut sets = Vec::with_capacity(copies);
            for _ in 0..copies {
                sets.push((
                    dl.clone(),
                    d.clone(),
                    du.clone(),
                    gpu.upload(&random(2 * elems, rng, 1.0))?,
                ));
            }
            let s = gpu.stream();
            let ptr =
                |b: &cudarc::driver::CudaSlice<f32>| b.device_ptr(s).0 as *const sys::cuComplex;
            let mut bytes = 0usize;
            let (dl, d, du, x) = &sets[0];
            // SAFETY: all arrays hold `batch * n` complex values, stride n; the query only reads sizes.
            unsafe {
                check(
                    "buffer size",
                    sys::cusparseCgtsv2StridedBatch_bufferSizeExt(
                        self.handle,
                        m,
                        ptr(dl),
                        ptr(d),
                        ptr(du),
                        ptr(x),
                        count,
                        m,
                        &mut bytes,
                    ),
                )?;
            }
            let buffer = gpu.alloc::<u8>(bytes.max(1))?;
            let buf = buffer.device_ptr(s).0 as *mut std::ffi::c_void;
            let mut next = 0;
            let ms = gpu.time_graph_median_ms(5, reps, || {
                let (dl, d, du, x) = &sets[next % copies];
                next += 1;
                let xp = x.device_ptr(s).0 as *mut sys::cuComplex;
                // SAFETY: as above; `buffer` has the size cuSPARSE asked for. The solve
                // overwrites x in place; later solves start from the previous solution, which
                // costs the same.
                unsafe {
                    check(
                        "gtsv2StridedBatch",
                        sys::cusparseCgtsv2StridedBatch(
                            self.handle,
                            m,
                            ptr(dl),
                            ptr(d),
                            ptr(du),
                            xp,
                            count,
                            m,
                            buf,
                        ),
                    )
                }
            })?;
            Ok(ms)
        }
    }

    impl Drop for Cusparse {
        fn drop(&mut self) {
            // SAFETY: the handle was created in `new` and is destroyed once.
            unsafe {
                sys::cusparseDestroy(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_gpu_it_times_the_cpu_and_writes_both_files() {
        if crate::engine::cuda::probe().is_ok() {
            return; // the GPU path needs the device; `kiln bench bk` on the GPU machine covers it
        }
        let dir = tempfile::tempdir().unwrap();
        let a = BenchBkArgs {
            gpu: 0,
            out: dir.path().join("bk"),
            batches: vec![1, 8, 4096],
            ns: vec![128, 512],
            reps: 2,
            causal: false,
            no_python: true,
        };
        run(a).unwrap();
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("bk/results.json")).unwrap(),
        )
        .unwrap();
        let rows = json["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 5);
        assert!(rows.iter().all(|r| r["fwd_ms"].as_f64().unwrap() > 0.0));
        // 4096 x 512 is over the CPU limit and listed; 4096 x 128 is exactly at it and timed.
        let skipped = json["skipped"].as_array().unwrap();
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(skipped[0].as_str().unwrap().starts_with("B4096 N512"));
        let md = std::fs::read_to_string(dir.path().join("bk/report.md")).unwrap();
        assert!(md.contains("| 8 | 512 |"), "{md}");
        // One time plot per batch size; no speedup plots without a reference to divide by.
        for b in [1, 8, 4096] {
            crate::report::plot::tests::assert_png(&dir.path().join(format!("bk/time_b{b}.png")));
            assert!(md.contains(&format!("(time_b{b}.png)")), "{md}");
        }
        assert!(!dir.path().join("bk/speedup_b1.png").exists());
    }

    #[test]
    fn rows_with_references_get_speedup_plots_per_batch() {
        let dir = tempfile::tempdir().unwrap();
        let mut rows = Vec::new();
        for batch in [1, 64] {
            for n in [128, 512, 2048, 8192] {
                let s = BkShape {
                    batch,
                    n,
                    causal: false,
                };
                let scale = (batch * n) as f64 * 1e-6;
                let mut r = row_for(s, 0.01 + scale, 0.03 + 3.0 * scale);
                r.cusparse_ms = Some(0.05 + 4.0 * scale);
                r.fwd_speedup_vs_cusparse = Some(r.cusparse_ms.unwrap() / r.fwd_ms);
                merge_pytorch(
                    std::slice::from_mut(&mut r),
                    &[PyRow {
                        batch,
                        n,
                        fwd_ms: 0.02 * n as f64,
                        fwdbwd_ms: 0.05 * n as f64,
                        nonfinite_fraction: 0.0,
                    }],
                );
                rows.push(r);
            }
        }
        let results = Results {
            device: "test GPU".into(),
            mode: "full",
            copy_gbs: Some(3000.0),
            notes: vec![],
            skipped: vec![],
            rows,
        };
        let out = dir.path().join("bk");
        write_report(
            Report::new("bk", "BK-Core benchmark", &out).unwrap(),
            results,
        )
        .unwrap();
        for name in ["time_b1", "time_b64", "speedup_b1", "speedup_b64"] {
            crate::report::plot::tests::assert_png(&out.join(format!("{name}.png")));
        }
        let json = crate::report::read_results(&out);
        assert_eq!(json["rows"].as_array().unwrap().len(), 8);
        assert!(json["rows"][0]["fwd_speedup_vs_pytorch"].as_f64().unwrap() > 1.0);
    }
}

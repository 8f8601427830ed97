//! `kiln hw` (alias `check-hardware`): what the machine has and what kiln recommends for it,
//! as text or as JSON, optionally with measured GEMM and copy rates.

use crate::engine::{self, device::DeviceRequest};
use crate::error::{KilnError, Result};
use crate::hw::{self, GpuReport, HwReport, ProbeResult};
use crate::train::metrics::format_bytes;
use clap::Args;
use std::fmt::Display;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln hw
  kiln hw --json | jq '.gpus[0].memory_free'
  kiln hw --probe              # measure GEMM TFLOP/s and copy GB/s (a few seconds)")]
pub struct HwArgs {
    /// Print the whole report as JSON (stable field names, for scripts).
    #[arg(long)]
    pub json: bool,
    /// Also measure bf16/TF32/fp32 GEMM rates and copy bandwidth on --device.
    #[arg(long)]
    pub probe: bool,
    /// Device --probe measures: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
}

pub fn run(a: HwArgs) -> Result<()> {
    let mut report = hw::detect();
    if a.probe {
        let request: DeviceRequest = a.device.parse().map_err(KilnError::Setting)?;
        let (pool, _) = engine::open(request)?;
        report.probe = Some(hw::probe::run(&pool)?);
    }
    if a.json {
        let json = serde_json::to_string_pretty(&report)
            .map_err(|e| KilnError::Setting(format!("cannot encode the report: {e}")))?;
        println!("{json}");
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// A value, or `unknown` where the query failed.
fn or_unknown<T: Display>(v: Option<T>) -> String {
    v.map_or_else(|| "unknown".into(), |v| v.to_string())
}

fn bytes(v: Option<u64>) -> String {
    or_unknown(v.map(|b| format_bytes(b as usize)))
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn render_gpu(g: &GpuReport, out: &mut String) {
    let id = g
        .ordinal
        .map_or_else(|| "(not usable)".into(), |i| format!("cuda:{i}"));
    out.push_str(&format!("GPU {id}  {}\n", g.name));
    let row = |out: &mut String, k: &str, v: String| out.push_str(&format!("  {k:<12}{v}\n"));
    row(out, "uuid", or_unknown(g.uuid.as_ref()));
    row(out, "PCI bus", or_unknown(g.pci_bus_id.as_ref()));
    row(
        out,
        "memory",
        format!(
            "{} total, {} free",
            bytes(g.memory_total),
            bytes(g.memory_free)
        ),
    );
    let compute = match (g.compute_capability, g.supports) {
        (Some((major, minor)), Some(s)) => format!(
            "compute capability {major}.{minor}, {} SMs; bf16 {}, TF32 {}, FP8 {}",
            or_unknown(g.sm_count),
            yes_no(s.bf16),
            yes_no(s.tf32),
            yes_no(s.fp8)
        ),
        _ => "unknown (CUDA cannot open this GPU)".into(),
    };
    row(out, "compute", compute);
    let c = &g.clocks;
    row(
        out,
        "clocks",
        format!(
            "SM {} / {} MHz, memory {} / {} MHz (now / max)",
            or_unknown(c.sm_mhz),
            or_unknown(c.sm_max_mhz),
            or_unknown(c.memory_mhz),
            or_unknown(c.memory_max_mhz)
        ),
    );
    row(
        out,
        "power",
        format!(
            "limit {} W, drawing {} W, {} C",
            or_unknown(g.power_limit_w.map(|w| format!("{w:.0}"))),
            or_unknown(g.power_draw_w.map(|w| format!("{w:.0}"))),
            or_unknown(g.temperature_c)
        ),
    );
    let p = &g.pcie;
    row(
        out,
        "PCIe",
        format!(
            "gen {} x{} (max gen {} x{})",
            or_unknown(p.generation),
            or_unknown(p.width),
            or_unknown(p.max_generation),
            or_unknown(p.max_width)
        ),
    );
    let nvlink = match &g.nvlink {
        None => "unknown".into(),
        Some(l) if l.active_links == 0 => "none active".into(),
        Some(l) => format!(
            "{} active links to {} peer(s): {}",
            l.active_links,
            l.peers.len(),
            l.peers
                .iter()
                .map(|p| format!("{} x{}", p.bus_id, p.links))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    row(out, "NVLink", nvlink);
}

fn render_probe(p: &ProbeResult, out: &mut String) {
    out.push_str(&format!(
        "measured on {} in {:.1} s:\n",
        p.device, p.elapsed_s
    ));
    for g in &p.gemm {
        // A CPU's rate reads better in GFLOP/s.
        let rate = if g.tflops < 1.0 {
            format!("{:.1} GFLOP/s", g.tflops * 1e3)
        } else {
            format!("{:.1} TFLOP/s", g.tflops)
        };
        out.push_str(&format!(
            "  {:<5} GEMM {n}x{n}x{n}  {rate}\n",
            g.math,
            n = g.n
        ));
    }
    out.push_str(&format!(
        "  copy {}     {:.1} GB/s (read + write)\n",
        format_bytes(p.copy.bytes),
        p.copy.gbs
    ));
}

/// The report as the terminal shows it.
pub fn render(r: &HwReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "driver      {}, CUDA {}\n",
        or_unknown(r.driver.version.as_ref()),
        or_unknown(r.driver.cuda_version.as_ref())
    ));
    for g in &r.gpus {
        render_gpu(g, &mut out);
    }
    if let Some(why) = &r.no_gpu {
        out.push_str(&format!("no GPU      {}\n", why.detail));
    }
    out.push_str(&format!(
        "CPU         {}, {} cores, {} threads (kiln uses {})\n",
        or_unknown(r.cpu.model.as_ref()),
        or_unknown(r.cpu.physical_cores),
        r.cpu.threads,
        r.cpu.compute_threads
    ));
    out.push_str(&format!(
        "RAM         {} total, {} available\n",
        bytes(r.ram.total_bytes),
        bytes(r.ram.available_bytes)
    ));
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out.push_str("recommended settings:\n");
    for rec in &r.recommendations {
        let extras = if rec.device == "cpu" {
            String::new()
        } else {
            format!(
                "; tf32 {}, FP8 tensor cores {}",
                if rec.tf32_available {
                    "available (train.precision=tf32 for f32 models)"
                } else {
                    "not available"
                },
                if rec.fp8_available {
                    "present (kiln does not train in FP8)"
                } else {
                    "absent"
                }
            )
        };
        out.push_str(&format!(
            "  {:<7} train.device={} train.precision={}\n          {}{extras}\n",
            rec.device, rec.device, rec.precision, rec.why
        ));
    }
    if let Some(p) = &r.probe {
        render_probe(p, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::nvml::{Clocks, NvLink, NvLinkPeer, Pcie};
    use crate::hw::{Capabilities, CpuInfo, DriverInfo, RamInfo, recommend_gpu};

    fn hopper(nvml_answers: bool) -> GpuReport {
        let known = |v: u32| nvml_answers.then_some(v);
        GpuReport {
            ordinal: Some(0),
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: nvml_answers.then(|| "GPU-0f1e2d3c".into()),
            pci_bus_id: nvml_answers.then(|| "00000000:1B:00.0".into()),
            memory_total: Some(80 << 30),
            memory_free: nvml_answers.then_some(79 << 30),
            compute_capability: Some((9, 0)),
            sm_count: Some(132),
            supports: Some(Capabilities::of((9, 0))),
            clocks: Clocks {
                sm_mhz: known(1980),
                sm_max_mhz: known(1980),
                memory_mhz: known(2619),
                memory_max_mhz: known(2619),
            },
            power_limit_w: nvml_answers.then_some(700.0),
            power_draw_w: nvml_answers.then_some(71.6),
            temperature_c: known(33),
            pcie: Pcie {
                generation: known(5),
                width: known(16),
                max_generation: known(5),
                max_width: known(16),
            },
            nvlink: nvml_answers.then(|| NvLink {
                active_links: 18,
                peers: vec![NvLinkPeer {
                    bus_id: "00000000:05:00.0".into(),
                    links: 18,
                }],
            }),
        }
    }

    fn report(gpu: GpuReport) -> HwReport {
        HwReport {
            driver: DriverInfo {
                version: Some("580.95.05".into()),
                cuda_version: Some("13.0".into()),
            },
            recommendations: vec![recommend_gpu(0, (9, 0))],
            gpus: vec![gpu],
            no_gpu: None,
            cpu: CpuInfo {
                model: None,
                physical_cores: None,
                threads: 8,
                compute_threads: 8,
            },
            ram: RamInfo {
                total_bytes: None,
                available_bytes: None,
            },
            notes: vec![],
            probe: None,
        }
    }

    #[test]
    fn a_gpu_report_shows_every_field() {
        let text = render(&report(hopper(true)));
        for needle in [
            "GPU cuda:0  NVIDIA H100 80GB HBM3",
            "driver      580.95.05, CUDA 13.0",
            "compute capability 9.0, 132 SMs; bf16 yes, TF32 yes, FP8 yes",
            "SM 1980 / 1980 MHz, memory 2619 / 2619 MHz",
            "limit 700 W, drawing 72 W, 33 C",
            "gen 5 x16 (max gen 5 x16)",
            "18 active links to 1 peer(s): 00000000:05:00.0 x18",
            "train.device=cuda:0 train.precision=bf16-mixed",
        ] {
            assert!(text.contains(needle), "expected {needle:?} in:\n{text}");
        }
    }

    #[test]
    fn fields_nvml_cannot_give_read_unknown() {
        let text = render(&report(hopper(false)));
        assert!(text.contains("SM unknown / unknown MHz"), "{text}");
        assert!(text.contains("NVLink      unknown"), "{text}");
        assert!(text.contains("80.00 GiB total, unknown free"), "{text}");
        assert!(
            text.contains("CPU         unknown, unknown cores, 8 threads"),
            "{text}"
        );
    }
}

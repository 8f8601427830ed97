//! `kiln bench kernels`: the device time of every CUDA kernel kiln launches over a grid of
//! token-row counts, against the roofline measured in the same run and against the same
//! operation in PyTorch on the same GPU (`bench/pytorch_kernels.py`, run by this command).
//!
//! - Time: device events, the median of `--reps` samples after `--warmup` calls
//!   ([`CudaBackend::time_median_ms`]).
//! - Settling: each kernel is timed after [`SETTLE`] of idle GPU, so that it starts at the
//!   clock the previous kernel left (under the power limit a long GEMM lowers the SM clock,
//!   which takes time to come back: on an H100 without the pause, attention timed right after
//!   the previous type's large GEMMs read 15-35% slower than in a run that timed it first).
//!   `bench/pytorch_kernels.py` pauses the same way.
//! - Rotation: a kernel whose working set is under twice the L2 cache gets enough copies of
//!   its buffers that successive calls touch different copies, so a timed call never finds
//!   its inputs left in L2 by the previous one (as in training, where other layers run in
//!   between). The copies are bounded: at most `2 x L2 + one working set` in all.
//! - Kernels: the fused ones kiln trains with, and those `train.fused_kernels=false` runs
//!   instead (group `unfused`: residual adds, the three-kernel cross-entropy, unfused
//!   attention's head moves, batched GEMMs and causal softmax, the five-pass AdamW).
//! - Roofline: a memory-bound kernel's floor is the bytes it must move (each input read once,
//!   each output written once) over the bandwidth of a device-to-device copy; a GEMM's or an
//!   attention kernel's is its floating-point work over the measured GEMM rate of its math
//!   mode. `roofline` = floor time / measured time.
//!
//! Writes `report.md`, `results.json` and bar charts into `--out`. Without a GPU there is
//! nothing to time: the report says so and lists every kernel as skipped.

use crate::engine::AttnShape;
use crate::engine::DType;
use crate::engine::GemmShape;
use crate::engine::cpu::bk_core::BkShape;
use crate::engine::cuda::{
    AdamWStep, Bf16, CudaBackend, CudaError, Elem, F16, GemmMath, LogitRows,
};
use crate::engine::rng::{Rng, stream};
use crate::error::{KilnError, Result};
use crate::hw::probe;
use crate::report::{BarChart, LinePlot, Plot, Report, Series, Table};
use clap::Args;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

type CResult<T> = std::result::Result<T, CudaError>;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench kernels
  kiln bench kernels --rows 8192 --dtypes bf16 --no-python
  kiln bench kernels --out bench-out/kernels --rows 2048,8192,32768,65536")]
pub struct BenchKernelsArgs {
    /// Which GPU (CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Directory for report.md, results.json and the plots.
    #[arg(long, default_value = "bench-out/kernels")]
    pub out: PathBuf,
    /// Token rows (batch x sequence) of the grid. Attention and BK-Core take them as
    /// rows / --seq sequences of length --seq.
    #[arg(long, value_delimiter = ',', default_value = "2048,8192,32768")]
    pub rows: Vec<usize>,
    /// Model width.
    #[arg(long, default_value_t = 768)]
    pub channels: usize,
    /// Attention heads (head size = channels / heads; the GPU kernels take 16, 32 and 64, and
    /// 128 on sm_80+).
    #[arg(long, default_value_t = 12)]
    pub heads: usize,
    /// Vocabulary size (padded, as GPT-2 trains it).
    #[arg(long, default_value_t = 50304)]
    pub vocab: usize,
    /// Sequence length (attention, BK-Core, rows of the position table).
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Parameters updated by the AdamW and gradient-norm timings.
    #[arg(long, default_value_t = 124_475_904)]
    pub params: usize,
    /// Activation types: f32 (its GEMMs also in tf32), bf16, f16.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    pub dtypes: Vec<String>,
    /// Timed samples per kernel (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Untimed calls per kernel before timing (module load, cuBLASLt's algorithm choice).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Skip the PyTorch comparison.
    #[arg(long)]
    pub no_python: bool,
    /// Time only these groups (comma-separated): memory, compute, unfused, other, nf4 (NF4
    /// dequantisation of a 2048x8192 and an 8192x2048 weight beside the bf16 GEMM it feeds at
    /// 8192 tokens), diversity (pairwise cosine diversity of n embeddings of width d, forward
    /// and gradient, for n in 8..4096 and d in 64..1024). Default: all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

/// Most copies of one kernel's buffers; past this a kernel is so small that launch cost, not
/// L2, decides its time.
const MAX_COPIES: usize = 256;

/// How many copies of a kernel's buffers keep successive calls out of each other's L2
/// footprint (the rule of [`crate::engine::cuda::rotation_copies`]), at most `MAX_COPIES`.
pub(crate) fn copies_for(working_set: f64, l2_bytes: usize) -> usize {
    let bytes = working_set.max(1.0).ceil() as usize;
    crate::engine::cuda::rotation_copies(bytes, l2_bytes, bytes.saturating_mul(MAX_COPIES))
}

/// The copy the next call uses; counts calls in `i`.
fn cycle(i: &mut usize, copies: usize) -> usize {
    let j = *i % copies;
    *i += 1;
    j
}

/// An activation type of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dt {
    F32,
    Bf16,
    F16,
}

fn parse_dtypes(names: &[String]) -> Result<Vec<Dt>> {
    let mut out = Vec::new();
    for n in names {
        let d = match n.trim() {
            "f32" | "fp32" => Dt::F32,
            "bf16" => Dt::Bf16,
            "f16" | "fp16" => Dt::F16,
            other => {
                return Err(KilnError::Setting(format!(
                    "--dtypes: unknown type {other:?}; use f32, bf16 or f16 (comma-separated)"
                )));
            }
        };
        if !out.contains(&d) {
            out.push(d);
        }
    }
    if out.is_empty() {
        return Err(KilnError::Setting(
            "--dtypes is empty; name at least one of f32, bf16, f16".into(),
        ));
    }
    Ok(out)
}

fn validate(a: &BenchKernelsArgs) -> Result<Vec<Dt>> {
    let bad = |what: &str| Err(KilnError::Setting(what.to_string()));
    if a.rows.is_empty() || a.rows.contains(&0) {
        return bad("--rows must list token-row counts above 0, e.g. --rows 2048,8192");
    }
    for (flag, v) in [
        ("--channels", a.channels),
        ("--heads", a.heads),
        ("--vocab", a.vocab),
        ("--seq", a.seq),
        ("--params", a.params),
        ("--reps", a.reps),
    ] {
        if v == 0 {
            return bad(&format!("{flag} must be at least 1"));
        }
    }
    if !a.channels.is_multiple_of(a.heads) {
        return bad(&format!(
            "--channels {} is not a multiple of --heads {}; pick heads that divide the width",
            a.channels, a.heads
        ));
    }
    parse_dtypes(&a.dtypes)
}

/// The groups `--only` names, or all of them.
fn parse_groups(names: &[String]) -> Result<Vec<Group>> {
    if names.is_empty() {
        return Ok(Group::ALL.to_vec());
    }
    let mut out = Vec::new();
    for n in names {
        let g = Group::ALL
            .into_iter()
            .find(|g| g.name() == n.trim())
            .ok_or_else(|| {
                KilnError::Setting(format!(
                    "--only: unknown group {:?}; use one or more of {}, comma-separated",
                    n.trim(),
                    Group::ALL.map(Group::name).join(", ")
                ))
            })?;
        if !out.contains(&g) {
            out.push(g);
        }
    }
    Ok(out)
}

/// Which measured GEMM rate bounds a compute-bound kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Math {
    /// bf16 (and f16) operands on the tensor cores, fp32 accumulation.
    Bf16,
    Tf32,
    /// Plain fp32 arithmetic.
    Fp32,
}

impl Math {
    fn name(self) -> &'static str {
        match self {
            Math::Bf16 => "bf16",
            Math::Tf32 => "tf32",
            Math::Fp32 => "fp32",
        }
    }
}

/// What bounds a kernel: bytes through memory, or floating-point work at a GEMM rate.
#[derive(Debug, Clone, Copy)]
enum Work {
    Bytes(f64),
    Flops(f64, Math),
}

/// Which chart a kernel is drawn in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
enum Group {
    /// Row-wise and element-wise kernels of a transformer layer.
    Memory,
    /// GEMMs and attention.
    Compute,
    /// The kernels `train.fused_kernels=false` runs in place of the fused ones: residual adds,
    /// the three-kernel cross-entropy, unfused attention's pieces, the five-pass AdamW.
    Unfused,
    /// The optimizer, the gradient norm and BK-Core.
    Other,
    /// NF4 dequantisation into a bf16 workspace beside the GEMM that reads it.
    Nf4,
    /// Pairwise cosine diversity of a set of embeddings and its gradient.
    Diversity,
}

impl Group {
    const ALL: [Group; 6] = [
        Group::Memory,
        Group::Compute,
        Group::Unfused,
        Group::Other,
        Group::Nf4,
        Group::Diversity,
    ];

    fn name(self) -> &'static str {
        match self {
            Group::Memory => "memory",
            Group::Compute => "compute",
            Group::Unfused => "unfused",
            Group::Other => "other",
            Group::Nf4 => "nf4",
            Group::Diversity => "diversity",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Group::Memory => "memory-bound kernels",
            Group::Compute => "GEMMs and attention",
            Group::Unfused => "unfused path (train.fused_kernels=false)",
            Group::Other => "optimizer, gradient norm, BK-Core",
            Group::Nf4 => "NF4 dequantisation beside the bf16 GEMM it feeds",
            Group::Diversity => "pairwise cosine diversity (forward and gradient)",
        }
    }
}

/// The rates measured at the start of the run.
#[derive(Debug, Clone, Copy, Serialize)]
struct Ceilings {
    /// Device-to-device copy, (read + written bytes) / time, GB/s.
    copy_gbs: f64,
    bf16_tflops: f64,
    tf32_tflops: f64,
    fp32_tflops: f64,
}

impl Ceilings {
    fn measure(gpu: &CudaBackend) -> CResult<Ceilings> {
        // The sizes `kiln hw --probe` uses: full rate on a Hopper, well under a second each.
        Ok(Ceilings {
            copy_gbs: probe::gpu_copy_gbs(gpu, 1 << 30)?,
            bf16_tflops: probe::gpu_gemm_tflops::<Bf16>(gpu, 8192, GemmMath::Fp32)?,
            tf32_tflops: probe::gpu_gemm_tflops::<f32>(gpu, 8192, GemmMath::Tf32)?,
            fp32_tflops: probe::gpu_gemm_tflops::<f32>(gpu, 4096, GemmMath::Fp32)?,
        })
    }

    fn tflops(&self, m: Math) -> f64 {
        match m {
            Math::Bf16 => self.bf16_tflops,
            Math::Tf32 => self.tf32_tflops,
            Math::Fp32 => self.fp32_tflops,
        }
    }
}

/// One kernel at one size, before timing.
struct Entry {
    kernel: String,
    /// A few characters, for the charts.
    label: String,
    group: Group,
    dtype: String,
    /// Token rows of the grid point, or parameters for the optimizer kernels.
    size: usize,
    shape: String,
    work: Work,
}

impl Entry {
    fn mem(kernel: &str, label: &str, dtype: &str, size: usize, shape: String, bytes: f64) -> Self {
        Entry {
            kernel: kernel.into(),
            label: label.into(),
            group: Group::Memory,
            dtype: dtype.into(),
            size,
            shape,
            work: Work::Bytes(bytes),
        }
    }

    fn compute(
        kernel: &str,
        label: &str,
        dtype: &str,
        size: usize,
        shape: String,
        flops: f64,
        math: Math,
    ) -> Self {
        Entry {
            group: Group::Compute,
            work: Work::Flops(flops, math),
            ..Entry::mem(kernel, label, dtype, size, shape, 0.0)
        }
    }

    fn other(self) -> Self {
        Entry {
            group: Group::Other,
            ..self
        }
    }

    fn unfused(self) -> Self {
        Entry {
            group: Group::Unfused,
            ..self
        }
    }

    fn nf4(self) -> Self {
        Entry {
            group: Group::Nf4,
            ..self
        }
    }

    fn diversity(self) -> Self {
        Entry {
            group: Group::Diversity,
            ..self
        }
    }
}

/// One timed kernel: a row of the report and of `results.json`.
#[derive(Debug, Clone, Serialize)]
struct Row {
    kernel: String,
    label: String,
    group: Group,
    dtype: String,
    size: usize,
    shape: String,
    /// Copies of the buffers the timed calls cycle through.
    copies: usize,
    ms: f64,
    bytes: Option<f64>,
    flops: Option<f64>,
    /// `copy` or the GEMM math mode whose rate is the ceiling.
    ceiling: &'static str,
    /// GB/s for memory-bound kernels, TFLOP/s for compute-bound ones.
    achieved: f64,
    achieved_unit: &'static str,
    roofline_fraction: f64,
    pytorch_op: Option<String>,
    pytorch_ms: Option<f64>,
    /// PyTorch time / kiln time (above 1: kiln is faster).
    speedup_vs_pytorch: Option<f64>,
}

fn make_row(e: Entry, ms: f64, copies: usize, c: &Ceilings) -> Row {
    let secs = ms * 1e-3;
    let (bytes, flops, ceiling, achieved, unit, floor_secs) = match e.work {
        Work::Bytes(b) => (
            Some(b),
            None,
            "copy",
            b / secs / 1e9,
            "GB/s",
            b / (c.copy_gbs * 1e9),
        ),
        Work::Flops(f, m) => (
            None,
            Some(f),
            m.name(),
            f / secs / 1e12,
            "TFLOP/s",
            f / (c.tflops(m) * 1e12),
        ),
    };
    Row {
        kernel: e.kernel,
        label: e.label,
        group: e.group,
        dtype: e.dtype,
        size: e.size,
        shape: e.shape,
        copies,
        ms,
        bytes,
        flops,
        ceiling,
        achieved,
        achieved_unit: unit,
        roofline_fraction: floor_secs / secs,
        pytorch_op: None,
        pytorch_ms: None,
        speedup_vs_pytorch: None,
    }
}

/// The timing state: the device, the ceilings, the L2 size and the rows so far.
struct Bench<'a> {
    gpu: &'a CudaBackend,
    warmup: usize,
    reps: usize,
    l2_bytes: usize,
    ceilings: Ceilings,
    rng: Rng,
    rows: Vec<Row>,
}

/// Idle time before each kernel's timing (see the module's "Settling").
const SETTLE: std::time::Duration = std::time::Duration::from_millis(200);

/// Host values generated at most this many at a time; larger buffers repeat the block (the
/// values do not change a kernel's time, and generating gigabytes on the host would).
const HOST_BLOCK: usize = 1 << 20;

impl Bench<'_> {
    fn copies(&self, working_set: f64) -> usize {
        copies_for(working_set, self.l2_bytes)
    }

    /// A buffer of uniform values in `[-scale, scale)`.
    fn random<T: Elem>(&mut self, len: usize, scale: f32) -> CResult<CudaSlice<T>> {
        let block: Vec<T> = (0..len.min(HOST_BLOCK))
            .map(|_| T::from_f32((self.rng.next_f32() * 2.0 - 1.0) * scale))
            .collect();
        let mut buf = self.gpu.alloc::<T>(len)?;
        let mut at = 0;
        while at < len {
            let m = block.len().min(len - at);
            self.gpu
                .stream()
                .memcpy_htod(&block[..m], &mut buf.slice_mut(at..at + m))?;
            at += m;
        }
        Ok(buf)
    }

    /// `copies` buffers holding the same random values.
    fn ring<T: Elem>(
        &mut self,
        len: usize,
        scale: f32,
        copies: usize,
    ) -> CResult<Vec<CudaSlice<T>>> {
        let first = self.random::<T>(len, scale)?;
        let mut out = Vec::with_capacity(copies);
        for _ in 1..copies {
            out.push(self.gpu.stream().clone_dtod(&first)?);
        }
        out.push(first);
        Ok(out)
    }

    /// `copies` output buffers the kernel overwrites in full.
    fn outputs<T: DeviceRepr>(&self, len: usize, copies: usize) -> CResult<Vec<CudaSlice<T>>> {
        (0..copies).map(|_| self.gpu.alloc::<T>(len)).collect()
    }

    /// `copies` zeroed buffers, for outputs a kernel accumulates into.
    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        copies: usize,
    ) -> CResult<Vec<CudaSlice<T>>> {
        (0..copies)
            .map(|_| Ok(self.gpu.stream().alloc_zeros::<T>(len)?))
            .collect()
    }

    /// Row indices below `bound`, fresh for each copy: a permutation of `0..len` when
    /// `distinct` (scatter needs one writer per row), else uniform draws.
    fn indices(
        &mut self,
        len: usize,
        bound: usize,
        distinct: bool,
        copies: usize,
    ) -> CResult<(Vec<CudaSlice<u32>>, usize)> {
        let mut out = Vec::with_capacity(copies);
        let mut unique_first = 0;
        for c in 0..copies {
            let host: Vec<u32> = if distinct {
                let mut p: Vec<u32> = (0..len as u32).collect();
                for i in (1..len).rev() {
                    p.swap(i, self.rng.below(i as u64 + 1) as usize);
                }
                p
            } else {
                (0..len)
                    .map(|_| self.rng.below(bound as u64) as u32)
                    .collect()
            };
            if c == 0 {
                unique_first = host.iter().collect::<std::collections::HashSet<_>>().len();
            }
            out.push(self.gpu.upload(&host)?);
        }
        Ok((out, unique_first))
    }

    /// Times `work` (which cycles through its `copies` itself, however often it is called)
    /// and records the row.
    fn time(&mut self, e: Entry, copies: usize, work: impl FnMut() -> CResult<()>) -> CResult<()> {
        self.gpu.synchronize()?;
        std::thread::sleep(SETTLE);
        let ms = self.gpu.time_median_ms(self.warmup, self.reps, work)?;
        let row = make_row(e, ms, copies, &self.ceilings);
        println!(
            "{:<34} {:<5} {:<22} {:>10.1} us  {:>5.0}% of roofline",
            row.kernel,
            row.dtype,
            row.shape,
            row.ms * 1e3,
            100.0 * row.roofline_fraction
        );
        self.rows.push(row);
        Ok(())
    }
}

fn es<T>() -> f64 {
    std::mem::size_of::<T>() as f64
}

/// Layernorms, GELU, cross-entropy and embedding at `n` rows.
fn time_rowwise<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let (c, v, seq, gpu) = (a.channels, a.vocab, a.seq, b.gpu);
    let dt = T::SUFFIX;
    let nc = n * c;
    // One [n, c] activation, and the per-row f32 mean and 1/std.
    let act = es::<T>() * nc as f64;
    let stats = 8.0 * n as f64;
    let shape = format!("{n}x{c}");
    let gamma = b.random::<T>(c, 1.0)?;
    let beta = b.random::<T>(c, 1.0)?;

    // Reads x, writes out, mean, rstd.
    let bytes = 2.0 * act + stats;
    let k = b.copies(bytes);
    let x = b.ring::<T>(nc, 2.0, k)?;
    let mut out = b.outputs::<T>(nc, k)?;
    let mut mean = b.outputs::<f32>(n, k)?;
    let mut rstd = b.outputs::<f32>(n, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("layernorm_forward", "LN f", dt, n, shape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.layernorm_forward(
                &mut out[j],
                &mut mean[j],
                &mut rstd[j],
                &x[j],
                &gamma,
                &beta,
                n,
                c,
            )
        },
    )?;
    drop((x, out, mean, rstd));

    // Reads x, delta; writes sum, out, mean, rstd.
    let bytes = 4.0 * act + stats;
    let k = b.copies(bytes);
    let x = b.ring::<T>(nc, 2.0, k)?;
    let delta = b.ring::<T>(nc, 2.0, k)?;
    let mut sum = b.outputs::<T>(nc, k)?;
    let mut out = b.outputs::<T>(nc, k)?;
    let mut mean = b.outputs::<f32>(n, k)?;
    let mut rstd = b.outputs::<f32>(n, k)?;
    let mut i = 0;
    b.time(
        Entry::mem(
            "residual_layernorm_forward",
            "res+LN f",
            dt,
            n,
            shape.clone(),
            bytes,
        ),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.residual_layernorm_forward(
                &mut sum[j],
                &mut out[j],
                &mut mean[j],
                &mut rstd[j],
                &x[j],
                &delta[j],
                &gamma,
                &beta,
                n,
                c,
            )
        },
    )?;
    drop((x, delta, sum, out, mean, rstd));

    // Reads dout, inp, mean, rstd and the incoming dinp (it accumulates); writes dinp.
    let bytes = 4.0 * act + stats;
    let k = b.copies(bytes);
    let dout = b.ring::<T>(nc, 1.0, k)?;
    let inp = b.ring::<T>(nc, 2.0, k)?;
    let mean = b.ring::<f32>(n, 0.1, k)?;
    let rstd = b.ring::<f32>(n, 1.0, k)?;
    let mut dinp = b.ring::<T>(nc, 1.0, k)?;
    let mut dgamma = gpu.stream().alloc_zeros::<f32>(c)?;
    let mut dbeta = gpu.stream().alloc_zeros::<f32>(c)?;
    let mut i = 0;
    b.time(
        Entry::mem("layernorm_backward", "LN b", dt, n, shape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.layernorm_backward(
                &mut dinp[j],
                &mut dgamma,
                &mut dbeta,
                &dout[j],
                &inp[j],
                &gamma,
                &mean[j],
                &rstd[j],
                n,
                c,
            )
        },
    )?;
    drop((dout, inp, mean, rstd, dinp));

    // The MLP's hidden activation, 4c wide.
    let h = 4 * nc;
    let hact = es::<T>() * h as f64;
    let hshape = format!("{n}x{}", 4 * c);
    let bytes = 2.0 * hact;
    let k = b.copies(bytes);
    let hx = b.ring::<T>(h, 4.0, k)?;
    let mut hout = b.outputs::<T>(h, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("gelu_forward", "GELU f", dt, n, hshape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.gelu_forward(&mut hout[j], &hx[j], h)
        },
    )?;
    drop((hx, hout));
    let bytes = 3.0 * hact;
    let k = b.copies(bytes);
    let hx = b.ring::<T>(h, 4.0, k)?;
    let hd = b.ring::<T>(h, 1.0, k)?;
    let mut hdin = b.outputs::<T>(h, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("gelu_backward", "GELU b", dt, n, hshape, bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.gelu_backward(&mut hdin[j], &hx[j], &hd[j], h)
        },
    )?;
    drop((hx, hd, hdin));

    // Cross-entropy over the whole (padded) vocabulary; targets and losses 4 bytes a row.
    let logit_bytes = es::<T>() * (n * v) as f64;
    let lshape = format!("{n}x{v}");
    let rows = LogitRows { n, v, valid: v };
    let bytes = logit_bytes + stats;
    let k = b.copies(bytes);
    let logits = b.ring::<T>(n * v, 4.0, k)?;
    let (targets, _) = b.indices(n, v, false, k)?;
    let mut losses = b.outputs::<f32>(n, k)?;
    let mut i = 0;
    b.time(
        Entry::mem(
            "cross_entropy_forward",
            "CE f",
            dt,
            n,
            lshape.clone(),
            bytes,
        ),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.cross_entropy_forward(&mut losses[j], &logits[j], &targets[j], rows)
        },
    )?;
    drop((logits, targets, losses));
    // Reads the logits and writes their gradient in place. Later calls run on the gradient
    // the earlier ones left, which costs the same.
    let bytes = 2.0 * logit_bytes + stats;
    let k = b.copies(bytes);
    let mut logits = b.ring::<T>(n * v, 4.0, k)?;
    let (targets, _) = b.indices(n, v, false, k)?;
    let mut losses = b.outputs::<f32>(n, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("cross_entropy_fused", "CE f+b", dt, n, lshape, bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.cross_entropy_fused(
                &mut losses[j],
                &mut logits[j],
                &targets[j],
                rows,
                1.0 / n as f32,
            )
        },
    )?;
    drop((logits, targets, losses));

    // Embedding: token rows of wte plus position rows of wpe.
    let eshape = format!("{n}x{c} V{v}");
    let pos_rows = n.min(seq);
    let wte = b.random::<T>(v * c, 1.0)?;
    let wpe = b.random::<T>(seq * c, 1.0)?;
    let bytes = 2.0 * act + es::<T>() * (pos_rows * c) as f64 + 4.0 * n as f64;
    let k = b.copies(bytes);
    let (tokens, _) = b.indices(n, v, false, k)?;
    let mut emb = b.outputs::<T>(nc, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("embedding_forward", "emb f", dt, n, eshape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.embedding_forward(&mut emb[j], &tokens[j], &wte, &wpe, n, v, seq, c)
        },
    )?;
    drop((wte, wpe, tokens, emb));
    // Reads dout once; the f32 rows of dwte that tokens touch and those of dwpe are read
    // and written.
    let dout_bytes = act + 4.0 * n as f64;
    let k = b.copies(dout_bytes);
    let (tokens, unique) = b.indices(n, v, false, k)?;
    // The backward plans its work from the tokens on the host (timed with it, as in training).
    let host_tokens = tokens
        .iter()
        .map(|t| gpu.download(t))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    drop(tokens);
    let bytes = dout_bytes + 8.0 * ((unique + pos_rows) * c) as f64;
    let dout = b.ring::<T>(nc, 1.0, k)?;
    let mut dwte = gpu.stream().alloc_zeros::<f32>(v * c)?;
    let mut dwpe = gpu.stream().alloc_zeros::<f32>(seq * c)?;
    let mut i = 0;
    b.time(
        Entry::mem("embedding_backward", "emb b", dt, n, eshape, bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.embedding_backward(&mut dwte, &mut dwpe, &dout[j], &host_tokens[j], v, seq, c)
        },
    )?;
    Ok(())
}

/// Gather, scaled scatter-add and gathered row dot (mixture-of-experts routing) at `n` rows
/// of width `c`, indexing a table of `n` rows.
fn time_row_ops<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let (c, gpu) = (a.channels, b.gpu);
    let dt = T::SUFFIX;
    let nc = n * c;
    let act = es::<T>() * nc as f64;
    // A u32 index and an f32 weight (or result) per row.
    let per_row = 8.0 * n as f64;
    let shape = format!("{n}x{c}");

    let bytes = 2.0 * act + per_row;
    let k = b.copies(bytes);
    let src = b.ring::<T>(nc, 1.0, k)?;
    let (idx, _) = b.indices(n, n, true, k)?;
    let scale = b.ring::<f32>(n, 1.0, k)?;
    let mut out = b.outputs::<T>(nc, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("gather_rows", "gather", dt, n, shape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.gather_rows(&mut out[j], &src[j], &idx[j], Some(&scale[j]), n, n, c)
        },
    )?;
    drop((src, idx, scale, out));

    // Reads src and dst, writes dst.
    let bytes = 3.0 * act + per_row;
    let k = b.copies(bytes);
    let src = b.ring::<T>(nc, 1.0, k)?;
    let (idx, _) = b.indices(n, n, true, k)?;
    let scale = b.ring::<f32>(n, 1.0, k)?;
    let mut dst = b.ring::<T>(nc, 1.0, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("scatter_add_rows", "scatter", dt, n, shape.clone(), bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.scatter_add_rows(&mut dst[j], &src[j], &idx[j], Some(&scale[j]), n, n, c)
        },
    )?;
    drop((src, idx, scale, dst));

    let bytes = 2.0 * act + per_row;
    let k = b.copies(bytes);
    let ta = b.ring::<T>(nc, 1.0, k)?;
    let tb = b.ring::<T>(nc, 1.0, k)?;
    let (idx, _) = b.indices(n, n, true, k)?;
    let mut out = b.outputs::<f32>(n, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("gathered_row_dot", "row dot", dt, n, shape, bytes),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.gathered_row_dot(&mut out[j], &ta[j], &idx[j], &tb[j], n, n, c)
        },
    )?;
    Ok(())
}

/// Causal attention over `n / seq` sequences: forward, backward, and both; f32 in both of its
/// product kinds (`f32`: three tf32 products each on the tensor cores, about f32's accuracy;
/// `tf32`: one), as the GEMM rows.
fn time_attention<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let (c, seq, gpu) = (a.channels, a.seq, b.gpu);
    let s = AttnShape {
        batch: n / seq,
        seq,
        heads: a.heads,
        channels: c,
    };
    let hs = c / a.heads;
    // Causal: half of the 4 T^2 C multiply-adds per sequence of the full QK^T and PV; the
    // backward's five products (one recomputes QK^T) are 2.5 times the forward.
    let fwd = 2.0 * (s.batch * seq * seq * c) as f64;
    let shape = format!("B{} T{seq} C{c} H{}", s.batch, a.heads);
    let nc = n * c;
    let lse_len = s.batch * a.heads * seq;
    let working_set = es::<T>() * (3 * nc + nc) as f64 + 4.0 * lse_len as f64;
    let k = b.copies(working_set);
    let qkv = b.ring::<T>(3 * nc, 1.0, k)?;
    let mut out = b.outputs::<T>(nc, k)?;
    let mut lse = b.outputs::<f32>(lse_len, k)?;
    let dout = b.ring::<T>(nc, 1.0, k)?;
    let mut dqkv = b.outputs::<T>(3 * nc, k)?;
    let tensor_cores = gpu.attention_uses_tensor_cores(hs);
    for &(gemm_math, dt, rate) in gemm_modes::<T>() {
        // The tensor-core kernels run at the tensor cores' rate for their operands at best
        // (f32's at the tf32 rate: its fp32 kind does three times the products); every other
        // case runs f32 arithmetic on the CUDA cores.
        let math = match (tensor_cores, rate) {
            (false, _) => Math::Fp32,
            (true, Math::Fp32) => Math::Tf32,
            (true, rate) => rate,
        };
        let mut i = 0;
        b.time(
            Entry::compute(
                "attention_forward",
                "attn f",
                dt,
                n,
                shape.clone(),
                fwd,
                math,
            ),
            k,
            || {
                let j = cycle(&mut i, k);
                gpu.attention_forward(&mut out[j], &mut lse[j], &qkv[j], s, gemm_math)
            },
        )?;
        // Every copy's log-sum-exp as its forward left it, for the backward to read.
        for j in 0..k {
            gpu.attention_forward(&mut out[j], &mut lse[j], &qkv[j], s, gemm_math)?;
        }
        let mut i = 0;
        b.time(
            Entry::compute(
                "attention_backward",
                "attn b",
                dt,
                n,
                shape.clone(),
                2.5 * fwd,
                math,
            ),
            k,
            || {
                let j = cycle(&mut i, k);
                gpu.attention_backward(
                    &mut dqkv[j],
                    &dout[j],
                    &qkv[j],
                    &out[j],
                    &lse[j],
                    s,
                    gemm_math,
                )
            },
        )?;
        let mut i = 0;
        b.time(
            Entry::compute(
                "attention_forward+backward",
                "attn f+b",
                dt,
                n,
                shape.clone(),
                3.5 * fwd,
                math,
            ),
            k,
            || {
                let j = cycle(&mut i, k);
                gpu.attention_forward(&mut out[j], &mut lse[j], &qkv[j], s, gemm_math)?;
                gpu.attention_backward(
                    &mut dqkv[j],
                    &dout[j],
                    &qkv[j],
                    &out[j],
                    &lse[j],
                    s,
                    gemm_math,
                )
            },
        )?;
    }
    Ok(())
}

/// The GEMM math modes of operands of type `T`: the math cuBLASLt is asked for, the type
/// label of the rows, and the measured rate that bounds them.
fn gemm_modes<T: Elem>() -> &'static [(GemmMath, &'static str, Math)] {
    match T::DTYPE {
        DType::F32 => &[
            (GemmMath::Fp32, "f32", Math::Fp32),
            (GemmMath::Tf32, "tf32", Math::Tf32),
        ],
        DType::BF16 => &[(GemmMath::Fp32, "bf16", Math::Bf16)],
        // The f16 tensor-core rate is the bf16 rate on every GPU kiln supports.
        DType::F16 => &[(GemmMath::Fp32, "f16", Math::Bf16)],
    }
}

/// GPT-2's four linear layers at `n` rows, forward and backward, in each math mode `T` has.
fn time_linears<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let (c, v) = (a.channels, a.vocab);
    for &(gm, label, math) in gemm_modes::<T>() {
        for (name, c_in, c_out) in [
            ("qkv", c, 3 * c),
            ("fc", c, 4 * c),
            ("proj", 4 * c, c),
            ("lm_head", c, v),
        ] {
            time_linear::<T>(b, n, name, c_in, c_out, (gm, label, math))?;
        }
    }
    Ok(())
}

fn time_linear<T: Elem>(
    b: &mut Bench,
    n: usize,
    name: &str,
    c_in: usize,
    c_out: usize,
    (gm, dt, math): (GemmMath, &str, Math),
) -> CResult<()> {
    let gpu = b.gpu;
    let flops = 2.0 * (n * c_in * c_out) as f64;
    let shape = format!("{n}x{c_in}->{c_out}");
    let working_set = es::<T>() * (n * c_in + c_out * c_in + n * c_out + c_out) as f64;
    let k = b.copies(working_set);
    let x = b.ring::<T>(n * c_in, 1.0, k)?;
    let w = b.ring::<T>(c_out * c_in, 1.0, k)?;
    let bias = b.ring::<T>(c_out, 1.0, k)?;
    let mut out = b.outputs::<T>(n * c_out, k)?;
    let mut i = 0;
    b.time(
        Entry::compute(
            &format!("linear_forward {name}"),
            &format!("{name} f"),
            dt,
            n,
            shape.clone(),
            flops,
            math,
        ),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.linear_forward(
                &mut out[j],
                &x[j],
                &w[j],
                Some(&bias[j]),
                n,
                c_in,
                c_out,
                gm,
            )
        },
    )?;
    drop(out);
    let dout = b.ring::<T>(n * c_out, 1.0, k)?;
    let mut dinp = b.outputs::<T>(n * c_in, k)?;
    let mut dw = b.zeros::<f32>(c_out * c_in, k)?;
    let mut db = b.zeros::<f32>(c_out, k)?;
    let mut i = 0;
    b.time(
        Entry::compute(
            &format!("linear_backward {name}"),
            &format!("{name} b"),
            dt,
            n,
            shape,
            2.0 * flops,
            math,
        ),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.linear_backward(
                &mut dinp[j],
                &mut dw[j],
                false,
                Some(&mut db[j]),
                &dout[j],
                &x[j],
                &w[j],
                n,
                c_in,
                c_out,
                gm,
            )
        },
    )
}

/// The kernels `train.fused_kernels=false` runs at `n` rows: the residual add and the
/// gradient sum, the three-kernel cross-entropy and, over `n / seq` whole sequences, the
/// pieces of unfused attention (head moves, the two batched GEMMs of the forward in each math
/// mode `T` has, the causal softmax and its backward).
fn time_unfused<T: Elem>(
    b: &mut Bench,
    a: &BenchKernelsArgs,
    n: usize,
    whole: bool,
) -> CResult<()> {
    let (c, v, gpu) = (a.channels, a.vocab, b.gpu);
    let dt = T::SUFFIX;
    let nc = n * c;
    let act = es::<T>() * nc as f64;
    let shape = format!("{n}x{c}");

    // `out = a + b` and `dst += src` both read two activations and write one.
    let bytes = 3.0 * act;
    let k = b.copies(bytes);
    let x = b.ring::<T>(nc, 1.0, k)?;
    let y = b.ring::<T>(nc, 1.0, k)?;
    let mut out = b.outputs::<T>(nc, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("add", "add", dt, n, shape.clone(), bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.add(&mut out[j], &x[j], &y[j], nc)
        },
    )?;
    drop(out);
    // Later calls add to the sums the earlier ones left, which costs the same.
    let mut dst = x;
    let mut i = 0;
    b.time(
        Entry::mem("add_assign", "add=", dt, n, shape, bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.add_assign(&mut dst[j], &y[j], nc)
        },
    )?;
    drop((dst, y));

    // Three kernels: log_softmax reads the logits and writes f32 log-probabilities, nll_loss
    // reads one of them and the target per row and writes the loss, the backward reads the
    // log-probabilities and the targets again and writes the gradient.
    let nv = n * v;
    let bytes = 2.0 * es::<T>() * nv as f64 + 8.0 * nv as f64 + 16.0 * n as f64;
    let k = b.copies(bytes);
    let logits = b.ring::<T>(nv, 4.0, k)?;
    let (targets, _) = b.indices(n, v, false, k)?;
    let mut losses = b.outputs::<f32>(n, k)?;
    let mut logp = b.outputs::<f32>(nv, k)?;
    let mut dlogits = b.outputs::<T>(nv, k)?;
    let rows = LogitRows { n, v, valid: v };
    let mut i = 0;
    b.time(
        Entry::mem(
            "cross_entropy_unfused",
            "CE unf",
            dt,
            n,
            format!("{n}x{v}"),
            bytes,
        )
        .unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.cross_entropy_unfused(
                &mut losses[j],
                &mut logp[j],
                &mut dlogits[j],
                &logits[j],
                &targets[j],
                rows,
                1.0 / n as f32,
            )
        },
    )?;
    drop((logits, targets, losses, logp, dlogits));
    if whole {
        time_unfused_attention::<T>(b, a, n)?;
    }
    Ok(())
}

/// Unfused attention's kernels over `n / seq` sequences, each with the shapes
/// [`crate::nn::attention::attention_forward_unfused`] gives it.
fn time_unfused_attention<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let (c, t, gpu) = (a.channels, a.seq, b.gpu);
    let dt = T::SUFFIX;
    let s = AttnShape {
        batch: n / t,
        seq: t,
        heads: a.heads,
        channels: c,
    };
    let hs = s.head_size();
    let bh = s.batch * s.heads;
    let nc = n * c;
    let act = es::<T>() * nc as f64;
    let shape = format!("B{} T{t} C{c} H{}", s.batch, s.heads);

    // Q's C columns of the packed [n, 3C] rows into [B, H, T, hs]: C columns read, all written.
    let bytes = 2.0 * act;
    let k = b.copies(bytes);
    let qkv = b.ring::<T>(3 * nc, 1.0, k)?;
    let mut heads = b.outputs::<T>(nc, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("heads_from_rows", "heads<-", dt, n, shape.clone(), bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.heads_from_rows(&mut heads[j], &qkv[j], s, 3 * c, 0)
        },
    )?;
    drop((qkv, heads));
    // The attention output [B, H, T, hs] back into [n, C] token rows.
    let heads = b.ring::<T>(nc, 1.0, k)?;
    let mut rows = b.outputs::<T>(nc, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("heads_to_rows", "heads->", dt, n, shape.clone(), bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.heads_to_rows(&mut rows[j], &heads[j], s, c, 0)
        },
    )?;
    drop((heads, rows));

    // Both products are full T x T ones: cuBLASLt computes the masked half too, and the
    // flops count it (2 B T^2 C each).
    let tt = bh * t * t;
    let flops = 2.0 * (bh * t * t * hs) as f64;
    let working_set = es::<T>() * (2 * nc + tt) as f64;
    let scale = 1.0 / (hs as f32).sqrt();
    let products = |trans_b, m, n_out, k_in| GemmShape {
        trans_a: false,
        trans_b,
        batch: bh,
        m,
        n: n_out,
        k: k_in,
    };
    for &(gm, label, math) in gemm_modes::<T>() {
        // S = Q K^T * scale: [BH, T, hs] x [BH, T, hs]^T -> [BH, T, T].
        let k = b.copies(working_set);
        let q = b.ring::<T>(nc, 1.0, k)?;
        let kk = b.ring::<T>(nc, 1.0, k)?;
        let mut scores = b.outputs::<T>(tt, k)?;
        let qk = products(true, t, t, hs);
        let mut i = 0;
        b.time(
            Entry::compute(
                "matmul_batched QK^T",
                "QK^T",
                label,
                n,
                shape.clone(),
                flops,
                math,
            )
            .unfused(),
            k,
            || {
                let j = cycle(&mut i, k);
                gpu.matmul_batched::<T, T>(qk, scale, &q[j], &kk[j], 0.0, &mut scores[j], gm)
            },
        )?;
        drop((kk, scores));
        // O = P V: [BH, T, T] x [BH, T, hs] -> [BH, T, hs], Q's copies standing in for V.
        let probs = b.ring::<T>(tt, 1.0, k)?;
        let mut o = b.outputs::<T>(nc, k)?;
        let pv = products(false, t, hs, t);
        let mut i = 0;
        b.time(
            Entry::compute(
                "matmul_batched PV",
                "PV",
                label,
                n,
                shape.clone(),
                flops,
                math,
            )
            .unfused(),
            k,
            || {
                let j = cycle(&mut i, k);
                gpu.matmul_batched::<T, T>(pv, 1.0, &probs[j], &q[j], 0.0, &mut o[j], gm)
            },
        )?;
    }

    // Row r of the [BH*T, T] scores is query r % T: the softmax reads its causal prefix
    // (T (T + 1) / 2 values per head and sequence) and writes the whole row, zeros included.
    let rows = bh * t;
    let prefix = (bh * t * (t + 1) / 2) as f64;
    let bytes = es::<T>() * (prefix + tt as f64);
    let k = b.copies(bytes);
    let scores = b.ring::<T>(tt, 4.0, k)?;
    let mut probs = b.outputs::<T>(tt, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("causal_softmax", "softmax f", dt, n, shape.clone(), bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.causal_softmax(&mut probs[j], &scores[j], rows, t)
        },
    )?;
    drop((scores, probs));
    // Reads P and dP over the prefix, writes dS whole.
    let bytes = es::<T>() * (2.0 * prefix + tt as f64);
    let k = b.copies(bytes);
    let probs = b.ring::<T>(tt, 1.0, k)?;
    let dprobs = b.ring::<T>(tt, 1.0, k)?;
    let mut dscores = b.outputs::<T>(tt, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("causal_softmax_backward", "softmax b", dt, n, shape, bytes).unfused(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.causal_softmax_backward(&mut dscores[j], &probs[j], &dprobs[j], rows, t)
        },
    )
}

/// BK-Core over `n / seq` causal sequences of length `seq`, forward and backward (with the
/// gradient of z, as a layer that learns it takes).
fn time_bk(b: &mut Bench, a: &BenchKernelsArgs, n: usize) -> CResult<()> {
    let gpu = b.gpu;
    let s = BkShape {
        batch: n / a.seq,
        n: a.seq,
        causal: true,
    };
    let elems = s.batch * s.n;
    let shape = format!("B{} N{}", s.batch, s.n);
    let z = gpu.upload(&[0.0f32, 1.0])?;
    let mut w = gpu.bk_work(s)?;
    // Reads v, writes complex G: 12 bytes a position.
    let bytes = 12.0 * elems as f64;
    let k = b.copies(bytes);
    let v = b.ring::<f32>(elems, 1.0, k)?;
    let mut out = b.outputs::<f32>(2 * elems, k)?;
    let mut i = 0;
    b.time(
        Entry::mem("bk_core_forward", "BK f", "f32", n, shape.clone(), bytes).other(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.bk_core_forward_with(&mut w, &mut out[j], &v[j], &z, None)
        },
    )?;
    if gpu.bk_nonfinite(&mut w)? {
        return Err(CudaError::Driver(
            "the BK-Core forward produced non-finite values on random potentials".into(),
        ));
    }
    drop((v, out));
    // Reads v and dL/dG, writes dv: 16 bytes a position.
    let bytes = 16.0 * elems as f64;
    let k = b.copies(bytes);
    let v = b.ring::<f32>(elems, 1.0, k)?;
    let d_out = b.ring::<f32>(2 * elems, 1.0, k)?;
    let mut dv = b.outputs::<f32>(elems, k)?;
    let mut dz = gpu.stream().alloc_zeros::<f32>(2)?;
    let mut i = 0;
    b.time(
        Entry::mem("bk_core_backward", "BK b", "f32", n, shape, bytes).other(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.bk_core_backward_with(
                &mut w,
                &mut dv[j],
                &d_out[j],
                &v[j],
                &z,
                None,
                Some(&mut dz),
                None,
            )
        },
    )
}

/// AdamW fused and unfused (master weights only, and with a bf16 compute copy) and the
/// gradient norm's sum of squares over `--params` values.
fn time_optimizer(b: &mut Bench, a: &BenchKernelsArgs) -> CResult<()> {
    let (p, gpu) = (a.params, b.gpu);
    let shape = format!("{p}");
    let h = AdamWStep {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 10,
        grad_scale: 1.0,
    };
    // Fused: reads param, grad, m, v and writes param, m, v (28 bytes a parameter), plus the
    // bf16 copy (2). Unfused, five passes: grad read and the scaled gradient written (8), m and
    // v each read with it and written (12 + 12), param, m, v read and param written (16); the
    // copy pass reads param and writes the copy (6).
    for (kernel, label, fused, bytes_per) in [
        ("adamw_update", "AdamW", true, 28.0),
        ("adamw_update (bf16 copy)", "AdamW+cp", true, 30.0),
        ("adamw_update_unfused", "AdamW unf", false, 48.0),
        (
            "adamw_update_unfused (bf16 copy)",
            "AdamW unf+cp",
            false,
            54.0,
        ),
    ] {
        let with_copy = kernel.ends_with("(bf16 copy)");
        let bytes = bytes_per * p as f64;
        let k = b.copies(bytes);
        let mut param = b.ring::<f32>(p, 1.0, k)?;
        let grad = b.ring::<f32>(p, 1.0, k)?;
        let mut m = b.ring::<f32>(p, 0.1, k)?;
        let mut v = b.zeros::<f32>(p, k)?;
        let mut compute = if with_copy {
            b.outputs::<Bf16>(p, k)?
        } else {
            Vec::new()
        };
        let mut scaled = if fused {
            Vec::new()
        } else {
            b.outputs::<f32>(p, k)?
        };
        let entry = Entry::mem(kernel, label, "f32", p, shape.clone(), bytes);
        let entry = if fused {
            entry.other()
        } else {
            entry.unfused()
        };
        let mut i = 0;
        b.time(entry, k, || {
            let j = cycle(&mut i, k);
            if fused {
                gpu.adamw_update(
                    &mut param[j],
                    &grad[j],
                    &mut m[j],
                    &mut v[j],
                    compute.get_mut(j),
                    p,
                    h,
                )
            } else {
                gpu.adamw_update_unfused(
                    &mut param[j],
                    &grad[j],
                    &mut m[j],
                    &mut v[j],
                    &mut scaled[j],
                    compute.get_mut(j),
                    p,
                    h,
                )
            }
        })?;
    }
    let bytes = 4.0 * p as f64;
    let k = b.copies(bytes);
    let grad = b.ring::<f32>(p, 1.0, k)?;
    let mut acc = gpu.upload(&[0.0f64])?;
    let mut flag = gpu.upload(&[0u32])?;
    let mut i = 0;
    b.time(
        Entry::mem("sum_squares", "sum sq", "f32", p, shape, bytes).other(),
        k,
        || {
            let j = cycle(&mut i, k);
            gpu.sum_squares_accumulate(&mut acc, &mut flag, &grad[j], p)
        },
    )
}

/// Everything the report is written from.
#[derive(Debug, Default)]
struct Outcome {
    device: Option<String>,
    l2_bytes: Option<usize>,
    ceilings: Option<Ceilings>,
    rows: Vec<Row>,
    pytorch: Option<String>,
    notes: Vec<String>,
    skipped: Vec<String>,
    /// Kernels that failed for a reason other than memory (the command fails after writing
    /// the report).
    failed: Vec<String>,
}

pub fn run(a: BenchKernelsArgs) -> Result<()> {
    let dtypes = validate(&a)?;
    let groups = parse_groups(&a.only)?;
    let mut report = Report::new(
        "kernels",
        "CUDA kernels against the measured roofline and PyTorch",
        &a.out,
    )?;
    let mut outcome = match CudaBackend::new(a.gpu) {
        Ok(gpu) => {
            report.watch_gpu(a.gpu);
            run_gpu(&gpu, &a, &dtypes, &groups)?
        }
        Err(e) => Outcome {
            skipped: vec![format!(
                "every CUDA kernel ({}): no usable GPU ({e}); this suite times GPU kernels \
                 only, so there is nothing to measure on this machine",
                groups
                    .iter()
                    .map(|g| g.title())
                    .collect::<Vec<_>>()
                    .join("; ")
            )],
            ..Outcome::default()
        },
    };
    let failed = std::mem::take(&mut outcome.failed);
    let dir = report.dir().to_path_buf();
    write_report(report, &a, outcome)?;
    if failed.is_empty() {
        Ok(())
    } else {
        Err(KilnError::Setting(format!(
            "kernel timing failed ({}); the report in {} lists what was measured",
            failed.join("; "),
            dir.display()
        )))
    }
}

fn run_gpu(
    gpu: &CudaBackend,
    a: &BenchKernelsArgs,
    dtypes: &[Dt],
    groups: &[Group],
) -> Result<Outcome> {
    let setup_err =
        |e: CudaError| KilnError::Setting(format!("kernel benchmark setup failed: {e}"));
    println!("device: {}", gpu.info());
    let l2 = gpu.info().l2_cache_bytes;
    let ceilings = Ceilings::measure(gpu).map_err(setup_err)?;
    println!(
        "ceilings measured now: copy {:.0} GB/s, GEMM bf16 {:.0} / tf32 {:.0} / fp32 {:.1} TFLOP/s; L2 {:.0} MiB",
        ceilings.copy_gbs,
        ceilings.bf16_tflops,
        ceilings.tf32_tflops,
        ceilings.fp32_tflops,
        l2 as f64 / (1u64 << 20) as f64
    );
    let mut b = Bench {
        gpu,
        warmup: a.warmup,
        reps: a.reps,
        l2_bytes: l2,
        ceilings,
        rng: Rng::new(1, stream::INIT),
        rows: Vec::new(),
    };
    let mut o = Outcome {
        device: Some(gpu.info().to_string()),
        l2_bytes: Some(l2),
        ceilings: Some(ceilings),
        ..Outcome::default()
    };
    let hs = a.channels / a.heads;
    for &dt in dtypes {
        if !fused_attention_runs(gpu, hs) {
            o.skipped.push(format!(
                "fused attention in {}: head size {hs} (--channels / --heads) has no GPU kernel \
                 for it here; 16, 32 and 64 run on every GPU, 128 on sm_80+ (the unfused \
                 path's attention kernels take any head size and are timed)",
                dt_name(dt)
            ));
        }
    }
    let grid_groups = [Group::Memory, Group::Compute, Group::Unfused];
    if grid_groups.iter().any(|g| groups.contains(g)) {
        for &dt in dtypes {
            for &n in &a.rows {
                let whole = n.is_multiple_of(a.seq);
                let r = match dt {
                    Dt::F32 => time_at::<f32>(&mut b, a, n, whole, groups),
                    Dt::Bf16 => time_at::<Bf16>(&mut b, a, n, whole, groups),
                    Dt::F16 => time_at::<F16>(&mut b, a, n, whole, groups),
                };
                record(
                    gpu,
                    &mut o,
                    &format!("{} kernels at {n} rows", dt_name(dt)),
                    r,
                );
            }
        }
    }
    if groups.contains(&Group::Other) {
        for &n in &a.rows {
            if n.is_multiple_of(a.seq) {
                let r = time_bk(&mut b, a, n);
                record(gpu, &mut o, &format!("BK-Core at {n} rows"), r);
            }
        }
        let r = time_optimizer(&mut b, a);
        record(
            gpu,
            &mut o,
            "AdamW (fused and unfused) and sum of squares",
            r,
        );
    }
    if groups.contains(&Group::Nf4) {
        let r = time_nf4(&mut b);
        record(gpu, &mut o, "NF4 dequantisation and its GEMM", r);
        o.notes.extend(nf4_shares(&b.rows));
    }
    if groups.contains(&Group::Diversity) {
        for &dt in dtypes {
            let r = match dt {
                Dt::F32 => time_diversity::<f32>(&mut b),
                Dt::Bf16 => time_diversity::<Bf16>(&mut b),
                Dt::F16 => time_diversity::<F16>(&mut b),
            };
            record(
                gpu,
                &mut o,
                &format!("{} pairwise diversity", dt_name(dt)),
                r,
            );
        }
    }
    if let Some(n) = a.rows.iter().find(|&&n| !n.is_multiple_of(a.seq)) {
        o.skipped.push(format!(
            "attention (fused and unfused) and BK-Core at {n} rows (and any other size that is not a multiple of --seq {}): they run whole sequences",
            a.seq
        ));
    }
    o.rows = b.rows;
    if a.no_python {
        o.skipped.push("PyTorch comparison (--no-python)".into());
    } else {
        // The driver's pool keeps what kiln freed; PyTorch gets it back for its own tensors.
        if let Err(e) = gpu.release_cached_memory() {
            o.notes.push(format!(
                "kiln's cached GPU memory not released before PyTorch ran: {e}"
            ));
        }
        match pytorch_baseline(a, dtypes, groups, l2) {
            Ok(py) => {
                o.pytorch = Some(format!("PyTorch {} on {}", py.torch, py.device));
                merge_pytorch(&mut o.rows, &py.rows);
                o.skipped
                    .extend(py.skipped.into_iter().map(|s| format!("PyTorch: {s}")));
            }
            Err(why) => o.skipped.push(format!("PyTorch comparison: {why}")),
        }
    }
    Ok(o)
}

/// Whether the fused attention kernels take head size `hs` on this GPU (in every type).
fn fused_attention_runs(gpu: &CudaBackend, hs: usize) -> bool {
    [16, 32, 64].contains(&hs) || gpu.attention_uses_tensor_cores(hs)
}

fn dt_name(d: Dt) -> &'static str {
    match d {
        Dt::F32 => "f32",
        Dt::Bf16 => "bf16",
        Dt::F16 => "f16",
    }
}

/// Every kernel of one activation type at `n` rows: attention only when `whole` (`n` holds
/// whole sequences), the fused kernel only when it takes the head size.
fn time_at<T: Elem>(
    b: &mut Bench,
    a: &BenchKernelsArgs,
    n: usize,
    whole: bool,
    groups: &[Group],
) -> CResult<()> {
    let fused_attention = fused_attention_runs(b.gpu, a.channels / a.heads);
    if groups.contains(&Group::Memory) {
        time_rowwise::<T>(b, a, n)?;
        time_row_ops::<T>(b, a, n)?;
    }
    if groups.contains(&Group::Compute) {
        if whole && fused_attention {
            time_attention::<T>(b, a, n)?;
        }
        time_linears::<T>(b, a, n)?;
    }
    if groups.contains(&Group::Unfused) {
        time_unfused::<T>(b, a, n, whole)?;
    }
    Ok(())
}

/// Tokens of the GEMM an NF4 weight's workspace feeds in the NF4 group.
const NF4_TOKENS: usize = 8192;
/// NF4 weights of the group, `[rows, cols]` = `[c_out, c_in]`: Llama-3.2-1B's down and up
/// projections.
const NF4_SHAPES: [(usize, usize); 2] = [(2048, 8192), (8192, 2048)];

/// NF4 dequantisation of each [`NF4_SHAPES`] weight into a bf16 workspace, and the bf16
/// GEMM `x[NF4_TOKENS, cols] @ w^T` that reads the workspace. The parts are random bytes:
/// the kernel's time does not depend on the codes.
fn time_nf4(b: &mut Bench) -> CResult<()> {
    use crate::engine::cpu::nf4;
    let gpu = b.gpu;
    let tables: Vec<f32> = nf4::NF4_CODE
        .iter()
        .chain(nf4::dynamic_map())
        .copied()
        .collect();
    let tables = gpu.upload(&tables)?;
    for (rows, cols) in NF4_SHAPES {
        let n = rows * cols;
        let blocks = nf4::blocks(n);
        let scales = nf4::absmax_scales(blocks);
        let shape = format!("{rows}x{cols}");
        // Reads the codes, absmax codes and scales; writes the bf16 workspace.
        let bytes =
            (blocks * nf4::BLOCK_BYTES + blocks + 4 * scales) as f64 + es::<Bf16>() * n as f64;
        let k = b.copies(bytes);
        let mut packed = Vec::with_capacity(k);
        let mut codes = Vec::with_capacity(k);
        for _ in 0..k {
            let random_bytes = |len: usize, rng: &mut Rng| -> Vec<u8> {
                (0..len).map(|_| rng.below(256) as u8).collect()
            };
            packed.push(gpu.upload(&random_bytes(blocks * nf4::BLOCK_BYTES, &mut b.rng))?);
            codes.push(gpu.upload(&random_bytes(blocks, &mut b.rng))?);
        }
        let scale = b.ring::<f32>(scales, 0.1, k)?;
        let mut out = b.outputs::<Bf16>(n, k)?;
        let mut i = 0;
        b.time(
            Entry::mem(
                &format!("nf4_dequantize {shape}"),
                &format!("nf4 {shape}"),
                "bf16",
                NF4_TOKENS,
                shape.clone(),
                bytes,
            )
            .nf4(),
            k,
            || {
                let j = cycle(&mut i, k);
                let w = crate::engine::cuda::Nf4Device {
                    packed: &packed[j],
                    absmax_codes: &codes[j],
                    absmax_scales: &scale[j],
                    code_tables: &tables,
                    offset: 0.01,
                };
                gpu.nf4_dequantize(&mut out[j], &w, n)
            },
        )?;
        drop((packed, codes, scale));
        // The GEMM reads one workspace (the last one written) and fresh activations.
        let flops = 2.0 * (NF4_TOKENS * n) as f64;
        let working_set = es::<Bf16>() * (NF4_TOKENS * (cols + rows) + n) as f64;
        let kg = b.copies(working_set);
        let x = b.ring::<Bf16>(NF4_TOKENS * cols, 1.0, kg)?;
        let mut y = b.outputs::<Bf16>(NF4_TOKENS * rows, kg)?;
        let w = out.pop().expect("at least one copy");
        drop(out);
        let mut i = 0;
        b.time(
            Entry::compute(
                &format!("linear_forward nf4 {shape}"),
                &format!("gemm {shape}"),
                "bf16",
                NF4_TOKENS,
                format!("{NF4_TOKENS}x{cols}->{rows}"),
                flops,
                Math::Bf16,
            )
            .nf4(),
            kg,
            || {
                let j = cycle(&mut i, kg);
                gpu.linear_forward(
                    &mut y[j],
                    &x[j],
                    &w,
                    None,
                    NF4_TOKENS,
                    cols,
                    rows,
                    GemmMath::Fp32,
                )
            },
        )?;
    }
    Ok(())
}

/// Set sizes and embedding widths of the diversity group (one set per call).
const DIVERSITY_N: [usize; 4] = [8, 64, 512, 4096];
const DIVERSITY_D: [usize; 3] = [64, 256, 1024];

/// The diversity forward (D, the column sums and the row norms from one read of the
/// embeddings) and its gradient, for every `(n, d)` of the group. Both are memory-bound:
/// the forward reads the embeddings once, the backward reads them and writes the gradient.
/// Kernel names carry `d` and the size is `n`, so PyTorch's rows match them.
fn time_diversity<T: Elem>(b: &mut Bench) -> CResult<()> {
    use crate::engine::cpu::diversity::SetShape;
    let gpu = b.gpu;
    let dt = T::SUFFIX;
    for d in DIVERSITY_D {
        for n in DIVERSITY_N {
            let shape = SetShape { sets: 1, n, d };
            let input = es::<T>() * (n * d) as f64;
            let saved = 4.0 * (n + d + 1) as f64;
            let k = b.copies(2.0 * input + saved);
            let e = b.ring::<T>(n * d, 1.0, k)?;
            let dd = b.ring::<f32>(1, 1.0, k)?;
            let (mut value, mut s, mut rnorm) = (
                b.outputs::<f32>(1, k)?,
                b.outputs::<f32>(d, k)?,
                b.outputs::<f32>(n, k)?,
            );
            let mut de = b.outputs::<T>(n * d, k)?;
            let mut i = 0;
            b.time(
                Entry::mem(
                    &format!("diversity_forward d{d}"),
                    &format!("fwd {n}x{d}"),
                    dt,
                    n,
                    format!("n{n} d{d}"),
                    input + saved,
                )
                .diversity(),
                k,
                || {
                    let j = cycle(&mut i, k);
                    gpu.diversity_forward(&mut value[j], &mut s[j], &mut rnorm[j], &e[j], shape)
                },
            )?;
            let mut i = 0;
            b.time(
                Entry::mem(
                    &format!("diversity_backward d{d}"),
                    &format!("bwd {n}x{d}"),
                    dt,
                    n,
                    format!("n{n} d{d}"),
                    2.0 * input + saved,
                )
                .diversity(),
                k,
                || {
                    let j = cycle(&mut i, k);
                    gpu.diversity_backward(&mut de[j], &dd[j], &e[j], &s[j], &rnorm[j], shape)
                },
            )?;
        }
    }
    Ok(())
}

/// For each NF4 weight timed, the dequantisation's time as a share of its GEMM's.
fn nf4_shares(rows: &[Row]) -> Vec<String> {
    NF4_SHAPES
        .iter()
        .filter_map(|(r, c)| {
            let find = |kernel: String| rows.iter().find(|x| x.kernel == kernel);
            let deq = find(format!("nf4_dequantize {r}x{c}"))?;
            let gemm = find(format!("linear_forward nf4 {r}x{c}"))?;
            let note = format!(
                "NF4 {r}x{c}: dequantising to a bf16 workspace takes {:.1} us ({:.0} GB/s, {:.0}% of the copy rate), {:.1}% of the {:.1} us bf16 GEMM it feeds at {NF4_TOKENS} tokens",
                deq.ms * 1e3,
                deq.achieved,
                100.0 * deq.roofline_fraction,
                100.0 * deq.ms / gemm.ms,
                gemm.ms * 1e3
            );
            println!("{note}");
            Some(note)
        })
        .collect()
}

/// Files a failed group: out of memory is a size this GPU cannot hold (skipped, and the
/// driver's cache released for the next size); anything else fails the command at the end.
fn record(gpu: &CudaBackend, o: &mut Outcome, what: &str, r: CResult<()>) {
    match r {
        Ok(()) => {}
        Err(e @ (CudaError::OutOfMemory(_) | CudaError::AllocFailed { .. })) => {
            o.skipped.push(format!(
                "{what} (from the first kernel that did not fit): {e}"
            ));
            if let Err(e) = gpu.release_cached_memory() {
                o.failed
                    .push(format!("{what}: releasing memory after running out: {e}"));
            }
        }
        Err(e) => {
            o.skipped
                .push(format!("{what} (from the kernel that failed): {e}"));
            o.failed.push(format!("{what}: {e}"));
        }
    }
}

#[derive(Debug, Deserialize)]
struct PyRow {
    kernel: String,
    dtype: String,
    size: usize,
    ms: f64,
    op: String,
}

#[derive(Debug, Deserialize)]
struct PyOut {
    torch: String,
    device: String,
    rows: Vec<PyRow>,
    #[serde(default)]
    skipped: Vec<String>,
}

/// Runs `bench/pytorch_kernels.py --json` on the same grid and parses its rows.
fn pytorch_baseline(
    a: &BenchKernelsArgs,
    dtypes: &[Dt],
    groups: &[Group],
    l2: usize,
) -> std::result::Result<PyOut, String> {
    let script = super::find_script("pytorch_kernels.py")?;
    let list = |xs: &[usize]| {
        xs.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    println!("running {} (same grid, same GPU)", script.display());
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg("--json")
        .args(["--gpu", &a.gpu.to_string()])
        .args(["--rows", &list(&a.rows)])
        .args(["--channels", &a.channels.to_string()])
        .args(["--heads", &a.heads.to_string()])
        .args(["--vocab", &a.vocab.to_string()])
        .args(["--seq", &a.seq.to_string()])
        .args(["--params", &a.params.to_string()])
        .args([
            "--dtypes",
            &dtypes
                .iter()
                .map(|&d| dt_name(d))
                .collect::<Vec<_>>()
                .join(","),
        ])
        .args(["--reps", &a.reps.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--l2-bytes", &l2.to_string()])
        .args([
            "--only",
            &groups
                .iter()
                .map(|g| g.name())
                .collect::<Vec<_>>()
                .join(","),
        ])
        .args(["--max-copies", &MAX_COPIES.to_string()])
        .output()
        .map_err(|e| format!("python3 could not start ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no output");
        return Err(format!("python3 {} failed: {last}", script.display()));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("unreadable output from {}: {e}", script.display()))
}

fn merge_pytorch(rows: &mut [Row], py: &[PyRow]) {
    for r in rows {
        if let Some(p) = py
            .iter()
            .find(|p| p.kernel == r.kernel && p.dtype == r.dtype && p.size == r.size)
        {
            r.pytorch_op = Some(p.op.clone());
            r.pytorch_ms = Some(p.ms);
            r.speedup_vs_pytorch = Some(p.ms / r.ms);
        }
    }
}

fn us(ms: f64) -> String {
    format!("{:.1}", ms * 1e3)
}

/// How far an engine's `K_forward+backward` time may stray from its `K_forward` plus
/// `K_backward` before the report says so.
const PAIR_TOLERANCE: f64 = 0.2;

/// Notes on the rows whose `K_forward+backward` time, for kiln or for PyTorch, differs by more
/// than [`PAIR_TOLERANCE`] from the same engine's `K_forward` plus `K_backward` at that type and
/// size. The three are timed apart; such a gap (host time of eager launches at small sizes, or
/// work one timing shares and the other repeats) makes the combined row's speedup and the
/// parts' disagree, and the note gives both.
fn pair_consistency_notes(rows: &[Row]) -> Vec<String> {
    let mut notes = Vec::new();
    for both in rows
        .iter()
        .filter(|r| r.kernel.ends_with("_forward+backward"))
    {
        let base = both.kernel.trim_end_matches("_forward+backward");
        let find = |suffix: &str| {
            let kernel = format!("{base}{suffix}");
            rows.iter()
                .find(|r| r.kernel == kernel && r.dtype == both.dtype && r.size == both.size)
        };
        let (Some(f), Some(b)) = (find("_forward"), find("_backward")) else {
            continue;
        };
        let kiln = both.ms / (f.ms + b.ms);
        let pytorch = match (both.pytorch_ms, f.pytorch_ms, b.pytorch_ms) {
            (Some(whole), Some(fwd), Some(bwd)) => Some((whole, fwd + bwd)),
            _ => None,
        };
        let strays = |ratio: f64| (ratio - 1.0).abs() > PAIR_TOLERANCE;
        if !strays(kiln) && !pytorch.is_some_and(|(w, parts)| strays(w / parts)) {
            continue;
        }
        let mut note = format!(
            "{} {} at {} rows: timed apart, kiln's combined time is {kiln:.2}x its forward plus \
             backward",
            both.kernel, both.dtype, both.size
        );
        if let Some((whole, parts)) = pytorch {
            note += &format!(
                " and PyTorch's {:.2}x; kiln's speedup is {:.2}x from the parts and {:.2}x from \
                 the combined row, the lower the safer reading",
                whole / parts,
                parts / (f.ms + b.ms),
                whole / both.ms
            );
        }
        notes.push(note);
    }
    notes
}

fn achieved(r: &Row) -> String {
    if r.achieved_unit == "GB/s" {
        format!("{:.0} GB/s", r.achieved)
    } else {
        format!("{:.1} TFLOP/s", r.achieved)
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", 100.0 * x)
}

/// A speedup as `1.23x`, `-` when there is nothing to compare with.
fn times(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}x"))
}

fn detail_table(rows: &[Row]) -> Table {
    let mut t = Table::new(&[
        "kernel",
        "dtype",
        "shape",
        "copies",
        "median us",
        "achieved",
        "ceiling",
        "roofline",
        "PyTorch us",
        "kiln speedup",
        "PyTorch op",
    ]);
    for r in rows {
        t.row(vec![
            r.kernel.clone(),
            r.dtype.clone(),
            r.shape.clone(),
            r.copies.to_string(),
            us(r.ms),
            achieved(r),
            r.ceiling.into(),
            pct(r.roofline_fraction),
            r.pytorch_ms.map_or("-".into(), us),
            times(r.speedup_vs_pytorch),
            r.pytorch_op
                .clone()
                .map_or("-".into(), |op| format!("`{op}`")),
        ]);
    }
    t
}

/// Each kernel at the largest size it was timed at (one chart bar per kernel and type).
fn largest(rows: &[Row]) -> Vec<&Row> {
    rows.iter()
        .filter(|r| {
            !rows
                .iter()
                .any(|o| o.kernel == r.kernel && o.dtype == r.dtype && o.size > r.size)
        })
        .collect()
}

fn summary_table(rows: &[Row]) -> Table {
    let mut t = Table::new(&["kernel", "dtype", "shape", "us", "roofline", "vs torch"]);
    for r in largest(rows) {
        t.row(vec![
            r.kernel.clone(),
            r.dtype.clone(),
            r.shape.clone(),
            us(r.ms),
            pct(r.roofline_fraction),
            times(r.speedup_vs_pytorch),
        ]);
    }
    t
}

/// Bars per chart: more would crowd the labels under them.
const BARS_PER_CHART: usize = 12;

/// One bar chart per (group, type) of `value` over the kernels at their largest size, split
/// into charts of [`BARS_PER_CHART`] bars; named `<prefix>_<group>_<dtype>[_<part>]`.
fn bar_charts(
    rows: &[Row],
    prefix: &str,
    title: &str,
    y_label: &str,
    value: fn(&Row) -> Option<f64>,
) -> Vec<(String, Plot)> {
    let top = largest(rows);
    let mut keys: Vec<(Group, &str)> = Vec::new();
    for r in &top {
        if !keys.contains(&(r.group, r.dtype.as_str())) {
            keys.push((r.group, r.dtype.as_str()));
        }
    }
    keys.sort_by_key(|k| k.0);
    let mut out = Vec::new();
    for (group, dtype) in keys {
        let bars: Vec<(String, f64)> = top
            .iter()
            .filter(|r| r.group == group && r.dtype == dtype)
            .filter_map(|r| value(r).map(|v| (r.label.clone(), v)))
            .collect();
        let parts = bars.len().div_ceil(BARS_PER_CHART);
        let mut sizes: Vec<usize> = top
            .iter()
            .filter(|r| r.group == group && r.dtype == dtype)
            .map(|r| r.size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let at = match (group, sizes.as_slice()) {
            (Group::Memory | Group::Compute | Group::Unfused, [n]) => format!(" at {n} rows"),
            _ => " at the largest size of each".into(),
        };
        for (p, chunk) in bars.chunks(BARS_PER_CHART).enumerate() {
            let mut name = format!("{prefix}_{}_{dtype}", group.name());
            if parts > 1 {
                name += &format!("_{}", p + 1);
            }
            out.push((
                name,
                Plot::Bar(BarChart {
                    title: format!("{title}: {}, {dtype}{at}", group.title()),
                    y_label: y_label.into(),
                    bars: chunk.to_vec(),
                }),
            ));
        }
    }
    out
}

/// The kernels followed across the grid: the heaviest of a transformer step, one per kind.
const ACROSS_THE_GRID: [&str; 8] = [
    "residual_layernorm_forward",
    "layernorm_backward",
    "gelu_forward",
    "cross_entropy_fused",
    "embedding_backward",
    "attention_forward+backward",
    "linear_forward fc",
    "linear_backward lm_head",
];

/// Per type, roofline fraction and speedup over PyTorch against the token rows for the
/// kernels of [`ACROSS_THE_GRID`]; a plot with no line of two points or more is left out.
fn grid_plots(rows: &[Row]) -> Vec<(String, Plot)> {
    let mut types: Vec<&str> = Vec::new();
    for r in rows {
        if ACROSS_THE_GRID.contains(&r.kernel.as_str()) && !types.contains(&r.dtype.as_str()) {
            types.push(&r.dtype);
        }
    }
    let mut out = Vec::new();
    for dtype in types {
        let series = |value: fn(&Row) -> Option<f64>| -> Vec<Series> {
            ACROSS_THE_GRID
                .iter()
                .map(|k| {
                    let mut points: Vec<(f64, f64)> = rows
                        .iter()
                        .filter(|r| r.kernel == *k && r.dtype == dtype)
                        .filter_map(|r| value(r).map(|v| (r.size as f64, v)))
                        .collect();
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Series::new(*k, points)
                })
                .filter(|s| s.points.len() >= 2)
                .collect()
        };
        let plots = [
            (
                "roofline_vs_rows",
                "Fraction of the roofline against rows",
                "% of roofline",
                series(|r| Some(100.0 * r.roofline_fraction)),
            ),
            (
                "speedup_vs_rows",
                "kiln speedup over PyTorch against rows",
                "PyTorch time / kiln time",
                series(|r| r.speedup_vs_pytorch),
            ),
        ];
        for (name, title, y_label, series) in plots {
            if !series.is_empty() {
                out.push((
                    format!("{name}_{dtype}"),
                    Plot::Line(LinePlot {
                        title: format!("{title}, {dtype}"),
                        x_label: "token rows".into(),
                        y_label: y_label.into(),
                        log_x: true,
                        log_y: false,
                        series,
                    }),
                ));
            }
        }
    }
    out
}

fn write_report(mut report: Report, a: &BenchKernelsArgs, mut o: Outcome) -> Result<()> {
    // Kernels together, then types, in the order first timed; sizes ascending.
    let order = |field: fn(&Row) -> &str| {
        let mut seen: Vec<String> = Vec::new();
        for r in &o.rows {
            if !seen.iter().any(|s| s == field(r)) {
                seen.push(field(r).to_string());
            }
        }
        seen
    };
    let (kernels, types) = (order(|r| &r.kernel), order(|r| &r.dtype));
    let pos = |seen: &[String], k: &str| seen.iter().position(|f| f == k).unwrap_or(usize::MAX);
    o.rows.sort_by_key(|r| {
        (
            r.group,
            pos(&kernels, &r.kernel),
            pos(&types, &r.dtype),
            r.size,
        )
    });

    match (&o.device, &o.ceilings, o.l2_bytes) {
        (Some(device), Some(c), Some(l2)) => {
            report.text(&format!(
                "device: {device}  \nL2 cache: {:.0} MiB  \n{}",
                l2 as f64 / (1u64 << 20) as f64,
                o.pytorch
                    .as_deref()
                    .map_or("PyTorch: not run".into(), |p| format!("compared with: {p}"))
            ));
            report.heading("Ceilings, measured in this run");
            let mut t = Table::new(&["ceiling", "rate"]);
            t.row(vec![
                "device-to-device copy, 1 GiB (read + write)".into(),
                format!("{:.0} GB/s", c.copy_gbs),
            ]);
            t.row(vec![
                "bf16 GEMM 8192^3 (fp32 accumulation)".into(),
                format!("{:.0} TFLOP/s", c.bf16_tflops),
            ]);
            t.row(vec![
                "tf32 GEMM 8192^3".into(),
                format!("{:.0} TFLOP/s", c.tf32_tflops),
            ]);
            t.row(vec![
                "fp32 GEMM 4096^3".into(),
                format!("{:.1} TFLOP/s", c.fp32_tflops),
            ]);
            report.table(&t);
        }
        _ => report.text("No usable GPU: no kernel was timed (see Skipped)."),
    }
    report.heading("Method");
    report.text(&format!(
        "Grid: rows {:?} at width {}, {} heads, vocabulary {}, sequence {}; optimizer over {} \
         parameters. Time: the median of {} samples of device events after {} warm-up calls. \
         `copies`: how many copies of its buffers a kernel's calls cycle through, so that \
         none finds its data in L2 from the call before (working sets under twice the L2 \
         size; at most {MAX_COPIES}). `roofline` = floor time / median time, the floor being \
         the bytes the kernel must move (inputs read once, outputs written once) over the copy \
         bandwidth, or its floating-point work over the GEMM rate of its `ceiling` math mode \
         (attention: causal, 2 B T^2 C forward, 2.5 times that backward). The `unfused` group \
         holds the kernels `train.fused_kernels=false` runs instead; an operation of several \
         kernels counts the bytes its kernels move between them, so its floor includes the \
         intermediates the fused kernel never stores: `cross_entropy_unfused` (log_softmax, \
         nll_loss, backward) writes f32 log-probabilities and reads them back, 2 x logits + 8 \
         bytes per logit; `adamw_update_unfused` makes five passes, 48 bytes a parameter (54 \
         with the bf16 copy) against the fused 28 (30). `causal_softmax` reads each row's \
         causal prefix and writes the whole row. `matmul_batched` (S = Q K^T * scale, O = P V \
         over [B*H, T, hs]) computes the full T x T products, masked half included, and is \
         counted so: 2 B T^2 C each. `kiln speedup` = PyTorch time / kiln time on the same \
         operation, sizes and rotation (`bench/pytorch_kernels.py` in this command: eager, \
         its attention rows replayed from CUDA graphs where they capture, as their op says); \
         PyTorch has no BK-Core. Where the two differ beyond speed: kiln's backward kernels \
         accumulate weight gradients in f32 where autograd returns them in the activation \
         type, kiln's embedding forward adds the position rows in the same kernel, kiln's \
         Q K^T applies the 1/sqrt(hs) scale in the GEMM where PyTorch's row is the plain \
         `torch.bmm`, and PyTorch's causal softmax reads and masks the whole T x T row.",
        a.rows, a.channels, a.heads, a.vocab, a.seq, a.params, a.reps, a.warmup
    ));
    if !o.rows.is_empty() {
        report.heading("Kernels");
        report.table(&detail_table(&o.rows));
        for (name, plot) in bar_charts(
            &o.rows,
            "roofline",
            "Fraction of the roofline",
            "% of roofline",
            |r| Some(100.0 * r.roofline_fraction),
        ) {
            report.plot(&name, &plot)?;
        }
        for (name, plot) in bar_charts(
            &o.rows,
            "speedup",
            "kiln speedup over PyTorch",
            "PyTorch time / kiln time",
            |r| r.speedup_vs_pytorch,
        ) {
            report.plot(&name, &plot)?;
        }
        for (name, plot) in grid_plots(&o.rows) {
            report.plot(&name, &plot)?;
        }
    }
    for n in o
        .notes
        .iter()
        .cloned()
        .chain(pair_consistency_notes(&o.rows))
    {
        report.note(n);
    }
    for s in &o.skipped {
        report.skip(s.clone());
    }
    report.result("device", &o.device)?;
    report.result("l2_bytes", o.l2_bytes)?;
    report.result("ceilings", o.ceilings)?;
    report.result(
        "grid",
        serde_json::json!({
            "rows": a.rows, "channels": a.channels, "heads": a.heads, "vocab": a.vocab,
            "seq": a.seq, "params": a.params, "dtypes": a.dtypes, "reps": a.reps,
            "warmup": a.warmup, "max_copies": MAX_COPIES,
        }),
    )?;
    report.result("pytorch", &o.pytorch)?;
    report.result("rows", &o.rows)?;
    report.finish(&summary_table(&o.rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(out: PathBuf) -> BenchKernelsArgs {
        BenchKernelsArgs {
            gpu: 0,
            out,
            rows: vec![2048, 8192],
            channels: 768,
            heads: 12,
            vocab: 50304,
            seq: 1024,
            params: 1000,
            dtypes: vec!["f32".into(), "bf16".into()],
            reps: 5,
            warmup: 1,
            no_python: true,
            only: vec![],
        }
    }

    #[test]
    fn without_a_gpu_the_report_lists_every_kernel_as_skipped() {
        if crate::engine::cuda::probe().is_ok() {
            return; // the GPU path needs the device; `kiln bench kernels` there covers it
        }
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("kernels");
        run(args(out.clone())).unwrap();
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("## Skipped\n\n- every CUDA kernel (memory-bound kernels; GEMMs and attention; unfused path (train.fused_kernels=false); optimizer, gradient norm, BK-Core; NF4 dequantisation beside the bf16 GEMM it feeds; pairwise cosine diversity (forward and gradient)): no usable GPU"), "{md}");
        assert!(md.contains("No usable GPU: no kernel was timed"), "{md}");
        let json = crate::report::read_results(&out);
        assert_eq!(json["suite"], "kernels");
        assert_eq!(json["rows"].as_array().unwrap().len(), 0);
        assert!(json["ceilings"].is_null());
        assert_eq!(json["grid"]["rows"], serde_json::json!([2048, 8192]));
    }

    #[test]
    fn bad_flags_are_refused_before_anything_runs() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = args(dir.path().join("k"));
        a.dtypes = vec!["bf8".into()];
        let e = run(a).unwrap_err().to_string();
        assert!(e.contains("unknown type \"bf8\""), "{e}");
        let mut a = args(dir.path().join("k"));
        a.heads = 5;
        assert!(
            run(a)
                .unwrap_err()
                .to_string()
                .contains("not a multiple of --heads")
        );
        let mut a = args(dir.path().join("k"));
        a.rows = vec![2048, 0];
        assert!(run(a).unwrap_err().to_string().contains("--rows"));
        assert!(
            !dir.path().join("k").exists(),
            "nothing is written for bad flags"
        );
    }

    #[test]
    fn copies_cover_twice_the_l2_and_stay_bounded() {
        let l2 = 50 << 20;
        // Past twice the L2, one copy; a working set of a quarter of L2 needs eight others.
        assert_eq!(copies_for(200e6, l2), 1);
        assert_eq!(copies_for(2.0 * l2 as f64, l2), 1);
        assert_eq!(copies_for(l2 as f64 / 4.0, l2), 9);
        let ws = 3e6;
        let k = copies_for(ws, l2);
        assert!((k - 1) as f64 * ws >= 2.0 * l2 as f64, "{k}");
        assert!(
            (k - 2) as f64 * ws < 2.0 * l2 as f64,
            "{k} is more than needed"
        );
        // Tiny kernels stop at the cap; an unknown L2 size rotates nothing.
        assert_eq!(copies_for(64.0, l2), MAX_COPIES);
        assert_eq!(copies_for(1e3, 0), 1);
        let mut i = 0;
        let seen: Vec<usize> = (0..7).map(|_| cycle(&mut i, 3)).collect();
        assert_eq!(seen, [0, 1, 2, 0, 1, 2, 0]);
    }

    const CEILINGS: Ceilings = Ceilings {
        copy_gbs: 4000.0,
        bf16_tflops: 700.0,
        tf32_tflops: 350.0,
        fp32_tflops: 50.0,
    };

    #[test]
    fn a_combined_row_far_from_its_parts_gets_a_note() {
        let row = |kernel: &str, ms: f64, pytorch_ms: f64| {
            let mut r = make_row(
                Entry::compute(kernel, kernel, "bf16", 4096, "x".into(), 1e9, Math::Bf16),
                ms,
                1,
                &CEILINGS,
            );
            r.pytorch_ms = Some(pytorch_ms);
            r
        };
        // kiln: 0.12 ms against 0.03 + 0.09 (consistent); PyTorch: 0.35 against 0.07 + 0.16.
        let mut rows = vec![
            row("attention_forward", 0.03, 0.07),
            row("attention_backward", 0.09, 0.16),
            row("attention_forward+backward", 0.12, 0.35),
        ];
        let notes = pair_consistency_notes(&rows);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert_eq!(
            notes[0],
            "attention_forward+backward bf16 at 4096 rows: timed apart, kiln's combined time is \
             1.00x its forward plus backward and PyTorch's 1.52x; kiln's speedup is 1.92x from \
             the parts and 2.92x from the combined row, the lower the safer reading"
        );
        // Within a fifth on both sides: no note; another size's parts are not this size's.
        rows[2].pytorch_ms = Some(0.25);
        assert!(pair_consistency_notes(&rows).is_empty());
        rows[1].size = 8192;
        rows[2].pytorch_ms = Some(0.35);
        assert!(pair_consistency_notes(&rows).is_empty());
    }

    #[test]
    fn rows_get_rates_fractions_and_speedups() {
        // 4 GB at 4000 GB/s is 1 ms: at 2 ms the kernel reaches half the roofline.
        let r = make_row(
            Entry::mem("gelu_forward", "GELU f", "bf16", 8192, "x".into(), 4e9),
            2.0,
            3,
            &CEILINGS,
        );
        assert!((r.achieved - 2000.0).abs() < 1e-9 && r.achieved_unit == "GB/s");
        assert!((r.roofline_fraction - 0.5).abs() < 1e-12);
        assert_eq!(
            (r.ceiling, r.copies, achieved(&r)),
            ("copy", 3, "2000 GB/s".to_string())
        );
        // 7 TFLOP at 700 TFLOP/s is 10 ms; at 20 ms, 350 TFLOP/s and half the roofline.
        let g = make_row(
            Entry::compute(
                "linear_forward fc",
                "fc f",
                "bf16",
                8192,
                "x".into(),
                7e12,
                Math::Bf16,
            ),
            20.0,
            1,
            &CEILINGS,
        );
        assert!((g.achieved - 350.0).abs() < 1e-9 && g.ceiling == "bf16");
        assert!((g.roofline_fraction - 0.5).abs() < 1e-12);
        assert_eq!(achieved(&g), "350.0 TFLOP/s");
        let t = make_row(
            Entry::compute(
                "linear_forward fc",
                "fc f",
                "tf32",
                8192,
                "x".into(),
                7e12,
                Math::Tf32,
            ),
            20.0,
            1,
            &CEILINGS,
        );
        assert!((t.roofline_fraction - 1.0).abs() < 1e-12);
        // An unfused-path row: its own group, the same rate and roofline arithmetic.
        let u = make_row(
            Entry::compute(
                "matmul_batched QK^T",
                "QK^T",
                "tf32",
                32768,
                "B32 T1024 C768 H12".into(),
                3.5e12,
                Math::Tf32,
            )
            .unfused(),
            20.0,
            1,
            &CEILINGS,
        );
        assert_eq!((u.group, u.ceiling), (Group::Unfused, "tf32"));
        assert!((u.roofline_fraction - 0.5).abs() < 1e-12);
        assert_eq!(serde_json::to_value(&u).unwrap()["group"], "unfused");

        let mut rows = vec![r, g, t, u];
        let py = |kernel: &str, dtype: &str, ms| PyRow {
            kernel: kernel.into(),
            dtype: dtype.into(),
            size: 8192,
            ms,
            op: "F.op".into(),
        };
        merge_pytorch(
            &mut rows,
            &[
                py("gelu_forward", "bf16", 3.0),
                py("linear_forward fc", "f32", 1.0),
                py("gelu_forward", "f32", 9.0),
                PyRow {
                    size: 32768,
                    ..py("matmul_batched QK^T", "tf32", 40.0)
                },
            ],
        );
        assert_eq!(rows[0].speedup_vs_pytorch, Some(1.5));
        assert_eq!(rows[0].pytorch_op.as_deref(), Some("F.op"));
        assert_eq!(rows[1].speedup_vs_pytorch, None, "no bf16 fc from PyTorch");
        assert_eq!(times(rows[0].speedup_vs_pytorch), "1.50x");
        assert_eq!(times(None), "-");
        let md = detail_table(&rows).markdown();
        assert!(md.contains("| gelu_forward | bf16 | x | 3 | 2000.0 | 2000 GB/s | copy | 50% | 3000.0 | 1.50x | `F.op` |"), "{md}");
        assert!(md.contains("| matmul_batched QK^T | tf32 | B32 T1024 C768 H12 | 1 | 20000.0 | 175.0 TFLOP/s | tf32 | 50% | 40000.0 | 2.00x | `F.op` |"), "{md}");
    }

    #[test]
    fn the_python_scripts_json_is_read() {
        // One line as `bench/pytorch_kernels.py --json` prints it.
        let line = r#"{"torch": "2.15.0", "device": "NVIDIA H200", "rows": [{"kernel":
            "layernorm_forward", "dtype": "bf16", "size": 8192, "ms": 0.0123, "op":
            "F.layer_norm(x)"}, {"kernel": "causal_softmax_backward", "dtype": "f32", "size":
            2048, "ms": 0.5, "op": "autograd of masked_fill + softmax"}], "skipped":
            ["bk_core_forward, bk_core_backward: none"]}"#;
        let py: PyOut = serde_json::from_str(line).unwrap();
        assert_eq!(
            (py.torch.as_str(), py.device.as_str()),
            ("2.15.0", "NVIDIA H200")
        );
        assert_eq!(py.rows[0].kernel, "layernorm_forward");
        assert_eq!((py.rows[0].size, py.rows[0].ms), (8192, 0.0123));
        assert_eq!(
            (py.rows[1].kernel.as_str(), py.rows[1].dtype.as_str()),
            ("causal_softmax_backward", "f32")
        );
        assert_eq!(py.skipped.len(), 1);
    }

    /// Rows as a GPU run would give them, for the report and its charts.
    fn synthetic_rows() -> Vec<Row> {
        let mut rows = Vec::new();
        for dtype in ["f32", "bf16"] {
            for n in [2048usize, 8192] {
                let scale = n as f64 / 2048.0;
                for (i, (kernel, label)) in [
                    ("layernorm_forward", "LN f"),
                    ("residual_layernorm_forward", "res+LN f"),
                    ("layernorm_backward", "LN b"),
                    ("gelu_forward", "GELU f"),
                    ("gelu_backward", "GELU b"),
                    ("cross_entropy_forward", "CE f"),
                    ("cross_entropy_fused", "CE f+b"),
                    ("embedding_forward", "emb f"),
                    ("embedding_backward", "emb b"),
                    ("gather_rows", "gather"),
                    ("scatter_add_rows", "scatter"),
                    ("gathered_row_dot", "row dot"),
                    ("extra_kernel", "extra"),
                ]
                .into_iter()
                .enumerate()
                {
                    let bytes = 1e7 * scale * (1.0 + i as f64);
                    let ms = 0.004 * scale * (1.0 + i as f64) * (1.0 + 0.1 * i as f64);
                    let mut r = make_row(
                        Entry::mem(kernel, label, dtype, n, format!("{n}x768"), bytes),
                        ms,
                        2,
                        &CEILINGS,
                    );
                    if i % 4 != 3 {
                        merge_pytorch(
                            std::slice::from_mut(&mut r),
                            &[PyRow {
                                kernel: kernel.into(),
                                dtype: dtype.into(),
                                size: n,
                                ms: ms * (0.8 + 0.2 * i as f64),
                                op: "torch".into(),
                            }],
                        );
                    }
                    rows.push(r);
                }
                let flops = 2.0 * (n * 768 * 3072) as f64;
                rows.push(make_row(
                    Entry::compute(
                        "linear_forward fc",
                        "fc f",
                        dtype,
                        n,
                        "fc".into(),
                        flops,
                        Math::Bf16,
                    ),
                    flops / 400e12 * 1e3,
                    1,
                    &CEILINGS,
                ));
                // Two kernels of the unfused path, one with a PyTorch time.
                let bytes = 3.0 * 2.0 * (n * 768) as f64;
                let ms = bytes / 3000e9 * 1e3;
                let mut add = make_row(
                    Entry::mem("add", "add", dtype, n, format!("{n}x768"), bytes).unfused(),
                    ms,
                    4,
                    &CEILINGS,
                );
                merge_pytorch(
                    std::slice::from_mut(&mut add),
                    &[PyRow {
                        kernel: "add".into(),
                        dtype: dtype.into(),
                        size: n,
                        ms: 1.2 * ms,
                        op: "torch.add(a, b)".into(),
                    }],
                );
                rows.push(add);
                rows.push(make_row(
                    Entry::compute(
                        "matmul_batched PV",
                        "PV",
                        dtype,
                        n,
                        "PV".into(),
                        flops,
                        Math::Bf16,
                    )
                    .unfused(),
                    flops / 300e12 * 1e3,
                    1,
                    &CEILINGS,
                ));
            }
        }
        rows.push(make_row(
            Entry::mem("adamw_update", "AdamW", "f32", 1000, "1000".into(), 28e3).other(),
            0.01,
            256,
            &CEILINGS,
        ));
        rows
    }

    #[test]
    fn the_report_has_every_row_and_a_chart_per_group_and_type() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("kernels");
        let a = args(out.clone());
        let o = Outcome {
            device: Some("test GPU".into()),
            l2_bytes: Some(50 << 20),
            ceilings: Some(CEILINGS),
            rows: {
                // Largest size first: the report still lists each kernel's sizes ascending.
                let mut rows = synthetic_rows();
                rows.sort_by_key(|r| std::cmp::Reverse(r.size));
                rows
            },
            pytorch: Some("PyTorch 2.x on test GPU".into()),
            skipped: vec!["PyTorch: bk_core_forward has no PyTorch equivalent".into()],
            ..Outcome::default()
        };
        write_report(Report::new("kernels", "kernels", &out).unwrap(), &a, o).unwrap();
        // 13 memory-bound kernels per type: two roofline charts each (12 bars per chart).
        for name in [
            "roofline_memory_f32_1",
            "roofline_memory_f32_2",
            "roofline_memory_bf16_1",
            "roofline_compute_bf16",
            "roofline_other_f32",
            "roofline_unfused_f32",
            "roofline_unfused_bf16",
            "speedup_memory_f32",
            "speedup_memory_bf16",
            "speedup_unfused_bf16",
        ] {
            crate::report::plot::tests::assert_png(&out.join(format!("{name}.png")));
        }
        // Across the grid: the kernels with two sizes or more, per type.
        for name in [
            "roofline_vs_rows_f32",
            "roofline_vs_rows_bf16",
            "speedup_vs_rows_f32",
        ] {
            crate::report::plot::tests::assert_png(&out.join(format!("{name}.png")));
        }
        // No PyTorch time for the GEMM or AdamW: no speedup chart for them.
        assert!(!out.join("speedup_compute_bf16.png").exists());
        assert!(!out.join("speedup_other_f32.png").exists());
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(
            md.contains("| bf16 GEMM 8192^3 (fp32 accumulation) | 700 TFLOP/s |"),
            "{md}"
        );
        assert!(
            md.contains("compared with: PyTorch 2.x on test GPU"),
            "{md}"
        );
        // Kernels grouped: both sizes of a kernel's f32 rows sit together.
        let ln = md.find("| layernorm_forward | f32 | 2048x768").unwrap();
        let ln2 = md.find("| layernorm_forward | f32 | 8192x768").unwrap();
        let res = md
            .find("| residual_layernorm_forward | f32 | 2048x768")
            .unwrap();
        assert!(ln < ln2 && ln2 < res, "{md}");
        // Groups in order: the unfused path after the GEMMs, before the optimizer.
        let fc = md.find("| linear_forward fc | bf16").unwrap();
        let add = md.find("| add | f32 | 2048x768").unwrap();
        let adamw = md.find("| adamw_update | f32").unwrap();
        assert!(fc < add && add < adamw, "{md}");
        assert!(
            md.contains("unfused path (train.fused_kernels=false)"),
            "{md}"
        );
        let json = crate::report::read_results(&out);
        assert_eq!(json["rows"].as_array().unwrap().len(), 2 * 2 * 16 + 1);
        assert_eq!(json["ceilings"]["copy_gbs"], 4000.0);
        let ln = &json["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["kernel"] == "layernorm_forward")
            .unwrap();
        assert!(ln["speedup_vs_pytorch"].as_f64().unwrap() > 0.0);
        assert_eq!(ln["group"], "memory");
        assert_eq!(ln["copies"], 2);
    }
}

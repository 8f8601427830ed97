//! `kiln bench kernels`: the device time of every GPU kernel at one model's sizes, next to
//! the floor set by the measured memory bandwidth (a device-to-device copy) or, for GEMMs,
//! the rate of one large bf16 GEMM, all measured in the same run.
//!
//! A memory-bound kernel's floor is the bytes it must move (each input read once, each
//! output written once) over the copy bandwidth; the table shows the time, the achieved
//! rate and how far above the floor the kernel is.

use crate::engine::cuda::{AdamWStep, Bf16, CudaBackend, CudaError, Elem, GemmMath, LogitRows};
use crate::engine::rng::{Rng, stream};
use crate::error::{KilnError, Result};
use crate::hw::probe;
use clap::Args;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench kernels
  kiln bench kernels --rows 16384 --vocab 50304")]
pub struct BenchKernelsArgs {
    /// Which GPU (CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Token rows per step (batch x sequence; GPT-2 small at 8 x 1024 by default).
    #[arg(long, default_value_t = 8192)]
    pub rows: usize,
    /// Model width.
    #[arg(long, default_value_t = 768)]
    pub channels: usize,
    /// Vocabulary size (padded, as GPT-2 trains it).
    #[arg(long, default_value_t = 50304)]
    pub vocab: usize,
    /// Sequence length (rows of the position table).
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Parameters updated by the AdamW and gradient-norm timings.
    #[arg(long, default_value_t = 124_475_904)]
    pub params: usize,
    /// Timed runs per kernel (the median is shown).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
}

/// What bounds a kernel: bytes through memory, or floating-point work on the matrix units.
enum Work {
    Bytes(f64),
    Flops(f64),
}

struct Timing {
    kernel: String,
    dtype: &'static str,
    shape: String,
    ms: f64,
    work: Work,
}

struct Bench<'a> {
    gpu: &'a CudaBackend,
    reps: usize,
    rng: Rng,
    rows: Vec<Timing>,
}

impl Bench<'_> {
    fn random<T: Elem>(
        &mut self,
        n: usize,
        scale: f32,
    ) -> std::result::Result<cudarc::driver::CudaSlice<T>, CudaError> {
        let host: Vec<f32> = (0..n)
            .map(|_| (self.rng.next_f32() * 2.0 - 1.0) * scale)
            .collect();
        self.gpu.upload_as::<T>(&host)
    }

    fn time(
        &mut self,
        kernel: &str,
        dtype: &'static str,
        shape: String,
        work: Work,
        f: impl FnMut() -> std::result::Result<(), CudaError>,
    ) -> std::result::Result<(), CudaError> {
        let ms = self.gpu.time_median_ms(3, self.reps, f)?;
        self.rows.push(Timing {
            kernel: kernel.into(),
            dtype,
            shape,
            ms,
            work,
        });
        Ok(())
    }
}

pub fn run(a: BenchKernelsArgs) -> Result<()> {
    let gpu = CudaBackend::new(a.gpu)
        .map_err(|e| KilnError::Setting(format!("no GPU to time kernels on: {e}")))?;
    println!("device: {}", gpu.info());
    let mut b = Bench {
        gpu: &gpu,
        reps: a.reps,
        rng: Rng::new(1, stream::INIT),
        rows: Vec::new(),
    };
    let (copy_gbs, gemm_tflops) = ceilings(&mut b).map_err(engine_err)?;
    println!(
        "ceilings measured now: device copy {copy_gbs:.0} GB/s (read + write), bf16 GEMM 8192^3 {gemm_tflops:.0} TFLOP/s"
    );
    let results = time_all::<f32>(&mut b, &a)
        .and_then(|_| time_all::<Bf16>(&mut b, &a))
        .and_then(|_| time_gemms(&mut b, &a))
        .and_then(|_| time_optimizer(&mut b, &a));
    print_table(&b.rows, copy_gbs, gemm_tflops);
    results.map_err(engine_err)
}

fn engine_err(e: CudaError) -> KilnError {
    KilnError::Setting(format!("kernel timing failed: {e}"))
}

/// The device-to-device copy rate (1 GiB) and one large bf16 GEMM's rate (8192^3).
fn ceilings(b: &mut Bench) -> std::result::Result<(f64, f64), CudaError> {
    Ok((
        probe::gpu_copy_gbs(b.gpu, 1 << 30)?,
        probe::gpu_gemm_tflops::<Bf16>(b.gpu, 8192, GemmMath::Fp32)?,
    ))
}

fn time_all<T: Elem>(b: &mut Bench, a: &BenchKernelsArgs) -> std::result::Result<(), CudaError> {
    let (n, c, v, seq) = (a.rows, a.channels, a.vocab, a.seq);
    let es = std::mem::size_of::<T>() as f64;
    let dt = T::SUFFIX;
    let nc = (n * c) as f64;
    let shape = format!("{n}x{c}");

    let x = b.random::<T>(n * c, 2.0)?;
    let delta = b.random::<T>(n * c, 2.0)?;
    let gamma = b.random::<T>(c, 1.0)?;
    let beta = b.random::<T>(c, 1.0)?;
    let mut sum = b.gpu.alloc::<T>(n * c)?;
    let mut out = b.gpu.alloc::<T>(n * c)?;
    let mut mean = b.gpu.alloc::<f32>(n)?;
    let mut rstd = b.gpu.alloc::<f32>(n)?;
    let gpu = b.gpu;
    b.time(
        "residual_layernorm_forward",
        dt,
        shape.clone(),
        Work::Bytes(4.0 * nc * es),
        || {
            gpu.residual_layernorm_forward(
                &mut sum, &mut out, &mut mean, &mut rstd, &x, &delta, &gamma, &beta, n, c,
            )
        },
    )?;
    let mut dinp = b.random::<T>(n * c, 1.0)?;
    let mut dgamma = b.random::<f32>(c, 1.0)?;
    let mut dbeta = b.random::<f32>(c, 1.0)?;
    b.time(
        "layernorm_backward",
        dt,
        shape.clone(),
        Work::Bytes(4.0 * nc * es),
        || {
            gpu.layernorm_backward(
                &mut dinp,
                &mut dgamma,
                &mut dbeta,
                &delta,
                &sum,
                &gamma,
                &mean,
                &rstd,
                n,
                c,
            )
        },
    )?;
    drop((sum, out, dinp));

    let h = 4 * n * c;
    let hx = b.random::<T>(h, 4.0)?;
    let hd = b.random::<T>(h, 1.0)?;
    let mut hout = b.gpu.alloc::<T>(h)?;
    b.time(
        "gelu_forward",
        dt,
        format!("{n}x{}", 4 * c),
        Work::Bytes(2.0 * h as f64 * es),
        || gpu.gelu_forward(&mut hout, &hx, h),
    )?;
    b.time(
        "gelu_backward",
        dt,
        format!("{n}x{}", 4 * c),
        Work::Bytes(3.0 * h as f64 * es),
        || gpu.gelu_backward(&mut hout, &hx, &hd, h),
    )?;
    drop((hx, hd, hout));

    let mut logits = b.random::<T>(n * v, 4.0)?;
    let targets: Vec<u32> = (0..n).map(|_| b.rng.below(v as u64) as u32).collect();
    let targets = gpu.upload(&targets)?;
    let mut losses = gpu.alloc::<f32>(n)?;
    let nv = (n * v) as f64;
    b.time(
        "cross_entropy_fused",
        dt,
        format!("{n}x{v}"),
        Work::Bytes(2.0 * nv * es),
        || {
            gpu.cross_entropy_fused(
                &mut losses,
                &mut logits,
                &targets,
                LogitRows { n, v, valid: v },
                1.0 / n as f32,
            )
        },
    )?;
    drop(logits);

    let wte = b.random::<T>(v * c, 1.0)?;
    let wpe = b.random::<T>(seq * c, 1.0)?;
    let tokens_host: Vec<u32> = (0..n).map(|_| b.rng.below(v as u64) as u32).collect();
    let unique = tokens_host
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len() as f64;
    let tokens = gpu.upload(&tokens_host)?;
    let mut emb = gpu.alloc::<T>(n * c)?;
    b.time(
        "embedding_forward",
        dt,
        format!("{n}x{c} V{v}"),
        Work::Bytes(2.0 * nc * es),
        || gpu.embedding_forward(&mut emb, &tokens, &wte, &wpe, n, v, seq, c),
    )?;
    let mut dwte = b.random::<f32>(v * c, 1.0)?;
    let mut dwpe = b.random::<f32>(seq * c, 1.0)?;
    // dout read once per table; touched rows of dwte and all of dwpe read and written.
    let bytes = 2.0 * nc * es + 8.0 * (unique + seq as f64) * c as f64;
    b.time(
        "embedding_backward",
        dt,
        format!("{n}x{c} V{v}"),
        Work::Bytes(bytes),
        || gpu.embedding_backward(&mut dwte, &mut dwpe, &emb, &tokens, n, v, seq, c),
    )?;
    Ok(())
}

fn time_gemms(b: &mut Bench, a: &BenchKernelsArgs) -> std::result::Result<(), CudaError> {
    let (n, c, v) = (a.rows, a.channels, a.vocab);
    for (name, c_in, c_out) in [
        ("qkv", c, 3 * c),
        ("fc", c, 4 * c),
        ("proj", 4 * c, c),
        ("lm_head", c, v),
    ] {
        time_linear::<f32>(b, name, n, c_in, c_out, GemmMath::Fp32, "f32")?;
        time_linear::<f32>(b, name, n, c_in, c_out, GemmMath::Tf32, "tf32")?;
        time_linear::<Bf16>(b, name, n, c_in, c_out, GemmMath::Fp32, "bf16")?;
    }
    Ok(())
}

fn time_linear<T: Elem>(
    b: &mut Bench,
    name: &str,
    n: usize,
    c_in: usize,
    c_out: usize,
    math: GemmMath,
    label: &'static str,
) -> std::result::Result<(), CudaError> {
    let gpu = b.gpu;
    let x = b.random::<T>(n * c_in, 1.0)?;
    let w = b.random::<T>(c_out * c_in, 1.0)?;
    let bias = b.random::<T>(c_out, 1.0)?;
    let mut out = gpu.alloc::<T>(n * c_out)?;
    let flops = 2.0 * (n * c_in * c_out) as f64;
    let shape = format!("{n}x{c_in}->{c_out}");
    b.time(
        &format!("linear_forward {name}"),
        label,
        shape.clone(),
        Work::Flops(flops),
        || gpu.linear_forward(&mut out, &x, &w, Some(&bias), n, c_in, c_out, math),
    )?;
    let mut dinp = gpu.alloc::<T>(n * c_in)?;
    let mut dw = b.random::<f32>(c_out * c_in, 1.0)?;
    let mut db = b.random::<f32>(c_out, 1.0)?;
    b.time(
        &format!("linear_backward {name}"),
        label,
        shape,
        Work::Flops(2.0 * flops),
        || {
            gpu.linear_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &out,
                &x,
                &w,
                n,
                c_in,
                c_out,
                math,
            )
        },
    )?;
    Ok(())
}

fn time_optimizer(b: &mut Bench, a: &BenchKernelsArgs) -> std::result::Result<(), CudaError> {
    let gpu = b.gpu;
    let p = a.params;
    let mut param = b.random::<f32>(p, 1.0)?;
    let grad = b.random::<f32>(p, 1.0)?;
    let mut m = b.random::<f32>(p, 0.1)?;
    let mut v = b.random::<f32>(p, 0.01)?;
    let mut compute = gpu.alloc::<Bf16>(p)?;
    let h = AdamWStep {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 10,
        grad_scale: 1.0,
    };
    // Reads param, grad, m, v; writes param, m, v and the bf16 copy.
    b.time(
        "adamw_update",
        "bf16",
        format!("{p}"),
        Work::Bytes(p as f64 * 30.0),
        || gpu.adamw_update(&mut param, &grad, &mut m, &mut v, Some(&mut compute), p, h),
    )?;
    let mut acc = gpu.upload(&[0.0f64])?;
    let mut flag = gpu.upload(&[0u32])?;
    b.time(
        "sum_squares",
        "f32",
        format!("{p}"),
        Work::Bytes(p as f64 * 4.0),
        || gpu.sum_squares_accumulate(&mut acc, &mut flag, &grad, p),
    )?;
    Ok(())
}

fn print_table(rows: &[Timing], copy_gbs: f64, gemm_tflops: f64) {
    println!(
        "{:<26} | {:<5} | {:<20} | {:>10} | {:>13} | {:>10} | {:>8}",
        "kernel", "dtype", "shape", "median us", "achieved", "floor us", "x floor"
    );
    println!("{}", "-".repeat(110));
    for r in rows {
        let us = r.ms * 1e3;
        let (achieved, floor_us) = match r.work {
            Work::Bytes(bytes) => (
                format!("{:.0} GB/s", bytes / (r.ms * 1e-3) / 1e9),
                bytes / (copy_gbs * 1e9) * 1e6,
            ),
            Work::Flops(f) => (
                format!("{:.1} TFLOP/s", f / (r.ms * 1e-3) / 1e12),
                f / (gemm_tflops * 1e12) * 1e6,
            ),
        };
        println!(
            "{:<26} | {:<5} | {:<20} | {:>10.1} | {:>13} | {:>10.1} | {:>8.2}",
            r.kernel,
            r.dtype,
            r.shape,
            us,
            achieved,
            floor_us,
            us / floor_us
        );
    }
}

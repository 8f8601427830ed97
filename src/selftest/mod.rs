//! `kiln selftest`: every GPU kernel against its CPU reference, on fresh random inputs.
//!
//! Each check draws new random inputs (never zeros), fills every output the kernel overwrites
//! with NaN first (so an element it forgets to write fails), gives accumulating outputs random
//! starting values (so a kernel that overwrites instead of adding fails), runs the CPU
//! reference from `engine::cpu` on the same values (rounded to bf16 or f16 where the GPU reads
//! them),
//! and reports the largest relative error against a bound set by the precision. NaN never
//! passes. With no usable GPU the command says why in one line and exits 0 ("skipped"), so it
//! can run anywhere; with a GPU any failure gives a non-zero exit.
//!
//! This module draws the inputs, holds the bounds and prints the table. The checks live by kind
//! of kernel in `norms`, `elementwise`, `gemm`, `attention`, `decode` (the key/value cache,
//! the few-row products and the sampler), `optim` and `bk`; `kernels` lists the `kernels`
//! group's checks in order; `training`, `nf4` and `diversity` hold the other groups.

use crate::config::ResolvedConfig;
use crate::data;
use crate::engine::AttnShape;
use crate::engine::cpu;
use crate::engine::cpu::bk_core::BkShape;
use crate::engine::cuda::{
    self, AdamWStep, Bf16, CudaBackend, CudaError, Elem, F16, GemmMath, LogitRows,
};
use crate::engine::quant::Nf4Weight;
use crate::engine::rng::{Rng, stream};
use crate::engine::{DType, Device, MemoryPool, Tensor, ops};
use crate::engine::{GemmShape, MatrixView};
use crate::error::{KilnError, Result};
use crate::nn::{Kernels, attention as nn_attention};
use crate::train::{Precision, Trainer};
use clap::Args;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use std::time::Instant;

mod attention;
mod bk;
mod decode;
mod diversity;
mod elementwise;
mod gemm;
mod kernels;
mod nf4;
mod norms;
mod optim;
mod training;
use attention::*;
use bk::*;
use decode::*;
use diversity::*;
use elementwise::*;
use gemm::*;
use kernels::*;
use nf4::*;
use norms::*;
use optim::*;
use training::*;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln selftest
  kiln selftest --gpu 1 --seed 7
  kiln selftest --only nf4
  kiln selftest --only kernels,memory
  kiln selftest --only kernels --match sample_rows,cache_attention")]
pub struct SelftestArgs {
    /// Which GPU to test (CUDA ordinal).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Seed of the random inputs; every run with the same seed draws the same inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run only these groups of checks (comma-separated): kernels (every kernel against its
    /// CPU reference), unfused (the unfused attention chain), memory (out-of-memory recovery
    /// and the micro-batch split), training (CPU-vs-GPU training parity, optimizer offload,
    /// block recomputation, the fp16 loss scaler), nf4 (NF4 dequantisation bit for bit),
    /// diversity (the pairwise cosine diversity kernel and its gradient). Default: all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Of the kernels group, run only the checks whose kernel name (the table's first column)
    /// contains one of these (comma-separated), to check a changed kernel without the whole
    /// table. Default: every kernel check.
    #[arg(long = "match", value_delimiter = ',', value_name = "NAME")]
    pub matching: Vec<String>,
}

/// Which kernel checks run (`--match`): those whose kernel name contains one of the patterns,
/// or all of them when there is none.
pub struct KernelFilter(Vec<String>);

impl KernelFilter {
    pub fn new(patterns: &[String]) -> KernelFilter {
        KernelFilter(
            patterns
                .iter()
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
        )
    }

    /// Whether the check of `kernel` runs.
    pub fn wants(&self, kernel: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|p| kernel.contains(p.as_str()))
    }

    fn is_all(&self) -> bool {
        self.0.is_empty()
    }
}

/// The groups of checks `--only` selects from.
const GROUPS: [&str; 6] = [
    "kernels",
    "unfused",
    "memory",
    "training",
    "nf4",
    "diversity",
];

/// Which groups run: all of them when `only` is empty, or the kernels group alone when
/// kernel checks are picked by name (`matching`, which other groups do not take).
fn selected_groups(only: &[String], matching: &KernelFilter) -> Result<Vec<&'static str>> {
    if only.is_empty() {
        return Ok(if matching.is_all() {
            GROUPS.to_vec()
        } else {
            vec!["kernels"]
        });
    }
    let mut groups = Vec::new();
    for name in only {
        let name = name.trim();
        match GROUPS.iter().find(|g| **g == name) {
            Some(g) if !groups.contains(g) => groups.push(*g),
            Some(_) => {}
            None => {
                return Err(KilnError::Setting(format!(
                    "--only: unknown group {name:?}; use one or more of {}, comma-separated",
                    GROUPS.join(", ")
                )));
            }
        }
    }
    if !matching.is_all() && !groups.contains(&"kernels") {
        return Err(KilnError::Setting(
            "--match picks kernel checks by name: add kernels to --only, or leave --only out"
                .into(),
        ));
    }
    Ok(groups)
}

/// fp32 kernels: reduction order differs from the CPU, nothing else.
const BOUND_FP32: f64 = 1e-4;
/// TF32 rounds every operand to a 10-bit mantissa (relative error up to 2^-11 each); over a
/// long dot product of random signs the worst output lands near 4e-4 of the largest.
const BOUND_TF32: f64 = 1e-3;
/// f32 attention on tf32 tensor cores: Q, K, V, P and dS each rounded once to tf32's 10-bit
/// mantissa, the precision of f16 (and f16's exponent range is no issue in f32), so f16's
/// attention bound.
const BOUND_TF32_ATTENTION: f64 = BOUND_F16;
/// f32 attention on the tensor cores as three tf32 products each: a product is within 2^-20 of
/// the exact one (the low halves' product is dropped, the low half rounded), 16x f32's
/// rounding; the fp32 bound times 4 (measured worst 1.4e-4 on an H100, a windowed GQA
/// backward at head size 128).
const BOUND_3XTF32_ATTENTION: f64 = 4.0 * BOUND_FP32;
/// bf16 outputs carry one rounding to an 8-bit mantissa (2^-9 relative) on top.
const BOUND_BF16: f64 = 1e-2;
/// f16 outputs carry one rounding to an 11-bit mantissa (2^-11 relative), four times finer;
/// small elements measured against the floor see up to 2^-10, so the bound leaves 2x over that.
const BOUND_F16: f64 = 2e-3;

/// `max_i |got_i - want_i| / max(|want_i|, floor * max_j |want_j|)`: relative error per
/// element, except that elements far below the buffer's largest are measured against a
/// fraction `floor` of it (`floor = 1` is error relative to the maximum, used for GEMMs).
/// A non-finite value where the reference is finite, or a length mismatch, is infinite error.
fn rel_err(got: &[f32], want: &[f32], floor: f64) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let max = want.iter().fold(0.0f64, |m, &w| m.max((w as f64).abs()));
    let floor = (floor * max).max(f64::MIN_POSITIVE);
    got.iter().zip(want).fold(0.0f64, |worst, (&g, &w)| {
        let (g, w) = (g as f64, w as f64);
        let e = if g.is_finite() != w.is_finite() || g.is_nan() {
            f64::INFINITY
        } else if !w.is_finite() {
            if g == w { 0.0 } else { f64::INFINITY }
        } else {
            (g - w).abs() / w.abs().max(floor)
        };
        worst.max(e)
    })
}

/// Elementwise outputs: errors of tiny elements are measured against 1% of the largest.
const ELEMENTWISE_FLOOR: f64 = 1e-2;
/// GEMM outputs: error relative to the largest output.
const GEMM_FLOOR: f64 = 1.0;

/// 16-bit attention on the tensor cores rounds the probabilities P and score gradients dS to
/// the operand type before their products, as a GEMM's operands are (and as FlashAttention
/// and SDPA do), so an output's error is a fraction of the terms it sums rather than of
/// itself: an element that cancels to near zero keeps its neighbours' absolute error. So
/// each head's vector of a token (its `head_size` elements of O, dQ, dK or dV) is measured
/// against its own largest element, as a GEMM's output against the largest; a vector whose
/// largest is under 1% of the buffer's (the first query's dQ is exactly 0) against that 1%.
fn rel_err_per_head(got: &[f32], want: &[f32], head_size: usize) -> f64 {
    if got.len() != want.len() || head_size == 0 || !want.len().is_multiple_of(head_size) {
        return f64::INFINITY;
    }
    let largest = |v: &[f32]| v.iter().fold(0.0f64, |m, &w| m.max((w as f64).abs()));
    let floor = ELEMENTWISE_FLOOR * largest(want);
    got.chunks(head_size)
        .zip(want.chunks(head_size))
        .fold(0.0f64, |worst, (g, w)| {
            // rel_err(.., 1.0) is the largest |g - w| over the vector's largest (infinite for
            // a non-finite value); rescaled, it is over `scale` instead.
            let own = largest(w).max(f64::MIN_POSITIVE);
            let scale = own.max(floor);
            worst.max(rel_err(g, w, 1.0) * own / scale)
        })
}

/// Fresh random inputs; each call continues the stream, so no two buffers repeat.
struct Inputs(Rng);

impl Inputs {
    /// Uniform in [-scale, scale), rounded to `dtype` (what the GPU will read).
    fn uniform(&mut self, n: usize, scale: f32, dtype: DType) -> Vec<f32> {
        (0..n)
            .map(|_| dtype.round((self.0.next_f32() * 2.0 - 1.0) * scale))
            .collect()
    }

    fn positive(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (self.0.next_f32() + 1e-3) * scale).collect()
    }

    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        // Half the positions draw from 16 tokens, so repeated tokens are certain.
        (0..n)
            .map(|i| {
                if i % 2 == 0 {
                    (self.0.below(16) * 3) as u32
                } else {
                    self.0.below(vocab as u64) as u32
                }
            })
            .collect()
    }
}

/// One line of the report.
struct Row {
    kernel: String,
    dtype: &'static str,
    shape: String,
    result: std::result::Result<f64, CudaError>,
    bound: f64,
}

impl Row {
    fn passed(&self) -> bool {
        matches!(self.result, Ok(e) if e <= self.bound)
    }
}

pub fn run(args: SelftestArgs) -> Result<()> {
    let filter = KernelFilter::new(&args.matching);
    let groups = selected_groups(&args.only, &filter)?;
    if let Err(why) = cuda::probe() {
        println!("selftest skipped: {why}");
        return Ok(());
    }
    let t0 = Instant::now();
    let first = match CudaBackend::new(args.gpu) {
        Ok(b) => b,
        Err(e @ (CudaError::LibraryMissing { .. } | CudaError::NoDevice(_))) => {
            println!("selftest skipped: {e}");
            return Ok(());
        }
        Err(e) => {
            return Err(KilnError::SelfTest(format!(
                "the CUDA backend did not start: {e}"
            )));
        }
    };
    let first_start = t0.elapsed();
    let first_report = first.compile_report();
    drop(first);
    let t1 = Instant::now();
    let gpu = CudaBackend::new(args.gpu)
        .map_err(|e| KilnError::SelfTest(format!("the CUDA backend did not restart: {e}")))?;
    let second_start = t1.elapsed();
    let second_report = gpu.compile_report();

    println!("device: {}", gpu.info());
    println!(
        "kernel cache: {}",
        cuda::nvrtc::cache_dir().map_or("none (no HOME or XDG_CACHE_HOME)".into(), |d| d
            .display()
            .to_string())
    );
    for (label, report, total) in [
        ("first start ", first_report, first_start),
        ("second start", second_report, second_start),
    ] {
        println!(
            "{label}: {} programs compiled, {} from cache, kernels ready in {:.1} ms (backend start {:.1} ms)",
            report.compiled,
            report.from_cache,
            report.elapsed.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3
        );
    }

    if groups.len() < GROUPS.len() {
        println!("groups: {} (--only)", groups.join(", "));
    }
    let mut inputs = Inputs(Rng::new(args.seed, stream::INIT));
    let mut failed = 0;
    let mut checks = 0;
    if groups.contains(&"kernels") {
        let started = Instant::now();
        if !filter.is_all() {
            println!("kernel checks: those matching {}", args.matching.join(","));
        }
        let rows = run_checks(&gpu, &mut inputs, &filter);
        if rows.is_empty() && !filter.is_all() {
            return Err(KilnError::Setting(format!(
                "--match {}: no kernel check's name contains it; `kiln selftest --only kernels` \
                 lists every check's kernel in its table's first column",
                args.matching.join(",")
            )));
        }
        print_table(&rows);
        let kernel_failures = rows.iter().filter(|r| !r.passed()).count();
        println!(
            "{} checks, {} failed, in {:.1} s",
            rows.len(),
            kernel_failures,
            started.elapsed().as_secs_f64()
        );
        for r in &rows {
            if let Err(e) = &r.result {
                println!("{} ({}, {}): {e}", r.kernel, r.dtype, r.shape);
            }
        }
        failed += kernel_failures;
        checks += rows.len();
    }
    if groups.contains(&"diversity") {
        let (n, bad) = report_rows(&diversity_rows(&gpu, &mut inputs));
        checks += n;
        failed += bad;
    }
    let pool = MemoryPool::with_cuda(std::sync::Arc::new(gpu));
    if groups.contains(&"kernels") {
        let (n, bad) = report_rows(&prefill_attention_rows(&pool, &mut inputs));
        checks += n;
        failed += bad;
    }
    if groups.contains(&"unfused") {
        let (n, bad) = report_rows(&unfused_attention_rows(&pool, &mut inputs));
        checks += n;
        failed += bad;
    }
    if groups.contains(&"memory") {
        let oom = out_of_memory_is_recoverable(&pool);
        failed += usize::from(oom.is_err());
        checks += 1;
        match oom {
            Ok(msg) => println!("out of memory: {msg} PASS"),
            Err(msg) => println!("out of memory: {msg} FAIL"),
        }
        let split = out_of_memory_splits(&pool, args.seed);
        failed += usize::from(split.is_err());
        checks += 1;
        match split {
            Ok(msg) => println!("out-of-memory split: {msg} PASS"),
            Err(msg) => println!("out-of-memory split: {msg} FAIL"),
        }
    }
    if groups.contains(&"nf4") {
        for (what, outcome) in nf4_checks(&pool, &mut inputs) {
            failed += usize::from(outcome.is_err());
            checks += 1;
            match outcome {
                Ok(msg) => println!("{what}: {msg} PASS"),
                Err(msg) => println!("{what}: {msg} FAIL"),
            }
        }
    }
    if groups.contains(&"training") {
        let (training_checks, training_failures) = training_checks(&pool, args.seed);
        checks += training_checks;
        failed += training_failures;
    }
    println!("{checks} checks in all, {failed} failed");
    if failed > 0 {
        return Err(KilnError::SelfTest(format!(
            "{failed} of {checks} GPU checks failed"
        )));
    }
    Ok(())
}

/// Prints a group's rows, then each error in full; returns (checks, failures).
fn report_rows(rows: &[Row]) -> (usize, usize) {
    print_table(rows);
    for r in rows {
        if let Err(e) = &r.result {
            println!("{} ({}, {}): {e}", r.kernel, r.dtype, r.shape);
        }
    }
    (rows.len(), rows.iter().filter(|r| !r.passed()).count())
}

fn print_table(rows: &[Row]) {
    println!(
        "{:<30} | {:<5} | {:<22} | {:>12} | {:>7} | result",
        "kernel", "dtype", "shape", "max rel err", "bound"
    );
    println!("{}", "-".repeat(96));
    for r in rows {
        let err = match &r.result {
            Ok(e) => format!("{e:.3e}"),
            Err(_) => "error".to_string(),
        };
        println!(
            "{:<30} | {:<5} | {:<22} | {:>12} | {:>7.0e} | {}",
            r.kernel,
            r.dtype,
            r.shape,
            err,
            r.bound,
            if r.passed() { "PASS" } else { "FAIL" }
        );
    }
}

type Check = std::result::Result<f64, CudaError>;

/// The sampler's bound whatever the dtype: both sides read the same rounded logits, so only
/// f32 rounding of `exp` (at most a row or two in a hundred landing on a boundary) and of
/// the log-sum-exp separate them. Other kernels keep their dtype's bound.
fn bound_of(kernel: &str, dtype_bound: f64) -> f64 {
    match kernel {
        "sample_rows" => SAMPLE_BOUND,
        // The reference rounds its queries, keys and values to the type as the kernel does,
        // but forms them in another order (norm and bias, then rotation): a rounding that
        // falls the other way moves a flat softmax's small outputs by a few steps.
        "cache_attention_append" => 3.0 * dtype_bound,
        _ => dtype_bound,
    }
}

/// The largest difference between `a` and `b` where their bits differ (at least the smallest
/// positive f64, so that any difference shows), 0 where all agree.
fn bits_differ(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| {
        if x.to_bits() == y.to_bits() {
            m
        } else {
            m.max(((x - y).abs() as f64).max(f64::MIN_POSITIVE))
        }
    })
}

/// A device buffer of `n` NaNs in `T`: whatever the kernel does not write stays NaN.
fn poisoned<T: Elem>(gpu: &CudaBackend, n: usize) -> std::result::Result<CudaSlice<T>, CudaError> {
    gpu.upload_as::<T>(&vec![f32::NAN; n])
}

/// The worst of several buffers' errors.
fn worst(errs: &[f64]) -> f64 {
    errs.iter().fold(
        0.0f64,
        |w, &e| if e.is_nan() { f64::INFINITY } else { w.max(e) },
    )
}

impl Inputs {
    fn positions(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n).map(|_| self.0.below(below as u64) as u32).collect()
    }
}

impl Inputs {
    /// `rows` row indices below `src_rows`, repeating (a gather may read a row twice).
    fn row_indices(&mut self, rows: usize, src_rows: usize) -> Vec<u32> {
        (0..rows)
            .map(|_| self.0.below(src_rows as u64) as u32)
            .collect()
    }

    /// `rows` distinct row indices below `src_rows`, in random order (a scatter's).
    fn distinct_row_indices(&mut self, rows: usize, src_rows: usize) -> Vec<u32> {
        let mut all: Vec<u32> = (0..src_rows as u32).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, self.0.below(i as u64 + 1) as usize);
        }
        all.truncate(rows);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recomputation and out-of-memory checks hold on the CPU too, so a GPU failure of
    /// either points at the GPU path, not at the check.
    #[test]
    fn the_training_checks_pass_on_the_cpu() {
        let cpu = MemoryPool::new(Device::Cpu);
        let msg = recompute_is_exact(&cpu, 1).unwrap();
        assert!(msg.contains("bit-identical"), "{msg}");
        let msg = out_of_memory_splits(&cpu, 1).unwrap();
        assert!(msg.contains("split 8 -> 4"), "{msg}");
        assert_eq!(cpu.stats().limit, 0, "the check removes its cap");
    }

    /// The parity check's Llama configurations resolve and train: two CPU runs of the one
    /// with query/key norms and biases give the same losses, which fall.
    #[test]
    fn the_llama_parity_configurations_train_on_the_cpu() {
        let cpu = MemoryPool::new(Device::Cpu);
        let losses = training::training_parity(&cpu, training::QWEN.1, "fp32", 1).unwrap();
        assert_eq!(losses.len(), 50);
        assert!(losses.iter().all(|(a, b)| a == b), "{losses:?}");
        assert!(losses[49].0 < losses[0].0 - 0.5, "{losses:?}");
    }

    /// The offload check leaves out exactly the key third of every GPT attention's QKV bias,
    /// found by the names the model gives its parameters.
    #[test]
    fn key_bias_is_the_middle_third_of_each_qkv_bias() {
        use crate::models::gpt::{Gpt, GptConfig};
        use crate::nn::Params;
        let cpu = MemoryPool::new(Device::Cpu);
        let cfg = GptConfig {
            vocab: 11,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            context: 4,
            tied_head: true,
        };
        let gpt = Gpt::new(&cpu, cfg, 1).unwrap();
        let ranges: Vec<_> = gpt
            .params()
            .iter()
            .map(|p| key_bias(&p.name, p.value.len()))
            .filter(|r| !r.is_empty())
            .collect();
        assert_eq!(ranges, vec![8..16, 8..16]);
    }

    #[test]
    fn relative_error_catches_nan_and_tiny_elements() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0], 1e-2), 0.0);
        assert!(rel_err(&[f32::NAN], &[1.0], 1e-2).is_infinite());
        assert!(rel_err(&[1.0], &[1.0, 2.0], 1e-2).is_infinite());
        // A 100% error on an element at 1e-4 of the maximum: measured against 1% of the max.
        let e = rel_err(&[100.0, 2e-2], &[100.0, 1e-2], 1e-2);
        assert!((e - 1e-2).abs() < 1e-9, "{e}");
        // Relative to the max (GEMM style).
        let e = rel_err(&[10.0, 1.1], &[10.0, 1.0], 1.0);
        assert!((e - 1e-2).abs() < 1e-6, "{e}");
    }

    #[test]
    fn without_a_gpu_selftest_skips_and_succeeds() {
        if cuda::probe().is_ok() {
            return; // a GPU is present: the real run is `kiln selftest` itself
        }
        run(SelftestArgs {
            gpu: 0,
            seed: 1,
            only: vec![],
            matching: vec![],
        })
        .unwrap();
    }

    #[test]
    fn only_takes_known_groups() {
        let all = KernelFilter::new(&[]);
        assert_eq!(selected_groups(&[], &all).unwrap(), GROUPS.to_vec());
        let picked =
            selected_groups(&["nf4".into(), " kernels".into(), "nf4".into()], &all).unwrap();
        assert_eq!(picked, vec!["nf4", "kernels"]);
        let e = selected_groups(&["nf5".into()], &all).unwrap_err();
        assert!(
            e.to_string().contains("unknown group \"nf5\"") && e.exit_code() == 2,
            "{e}"
        );
    }

    #[test]
    fn match_picks_kernel_checks_by_name() {
        let some = KernelFilter::new(&["sample_rows".into(), " cache_attention".into()]);
        assert!(some.wants("sample_rows") && some.wants("cache_attention_append"));
        assert!(!some.wants("kv_append") && !some.wants("attention_forward"));
        let all = KernelFilter::new(&["".into()]);
        assert!(all.is_all() && all.wants("anything"));
        // Picking checks by name runs the kernels group alone, and needs it.
        assert_eq!(selected_groups(&[], &some).unwrap(), vec!["kernels"]);
        assert_eq!(
            selected_groups(&["kernels".into(), "nf4".into()], &some).unwrap(),
            vec!["kernels", "nf4"]
        );
        let e = selected_groups(&["nf4".into()], &some).unwrap_err();
        assert!(
            e.to_string().contains("add kernels to --only") && e.exit_code() == 2,
            "{e}"
        );
    }

    /// The NF4 checks on the CPU pool: the check itself passes where both sides are the
    /// reference, so a GPU failure points at the kernel.
    #[test]
    fn the_nf4_checks_pass_on_the_cpu() {
        let cpu = MemoryPool::new(Device::Cpu);
        let outcomes = nf4_checks(&cpu, &mut Inputs(Rng::new(1, stream::INIT)));
        assert_eq!(outcomes.len(), 12);
        for (what, outcome) in outcomes {
            let msg = outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(msg.contains("bit-identical"), "{what}: {msg}");
        }
        assert_eq!(cpu.stats().current, 0);
    }
}

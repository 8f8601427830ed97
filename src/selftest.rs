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
use crate::nn::{Kernels, attention};
use crate::train::{Precision, Trainer};
use clap::Args;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln selftest
  kiln selftest --gpu 1 --seed 7
  kiln selftest --only nf4
  kiln selftest --only kernels,memory")]
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

/// Which groups run: all of them when `only` is empty.
fn selected_groups(only: &[String]) -> Result<Vec<&'static str>> {
    if only.is_empty() {
        return Ok(GROUPS.to_vec());
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
    let groups = selected_groups(&args.only)?;
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
        let rows = run_checks(&gpu, &mut inputs);
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

/// CPU-vs-GPU training parity, optimizer offload, block recomputation and the fp16 loss
/// scaler; returns (checks, failures).
fn training_checks(pool: &Arc<MemoryPool>, seed: u64) -> (usize, usize) {
    let (mut checks, mut failed) = (0, 0);
    // ResNet-BK routes tokens by comparing router outputs: where the GPU's summation order
    // flips a near-tie, a token meets another expert, so its fp32 bound is looser than GPT's.
    const GPT: (&str, &[&str]) = ("tiny GPT", &[]);
    const RESNET_BK: (&str, &[&str]) = ("tiny ResNet-BK", &["model.kind=resnet_bk"]);
    // The unfused kernels on the GPU against the unfused CPU run (itself equal to the fused
    // one; see tests/trainer.rs), under the fused GPT's bounds.
    const GPT_UNFUSED: (&str, &[&str]) = ("tiny GPT, unfused", &["train.fused_kernels=false"]);
    for ((model, kind), precision, bound) in [
        (GPT, "fp32", 1e-4),
        (GPT, "tf32", 2e-2),
        (GPT, "bf16-mixed", 2e-2),
        (GPT, "fp16-mixed", 2e-2),
        (GPT_UNFUSED, "fp32", 1e-4),
        (GPT_UNFUSED, "bf16-mixed", 2e-2),
        (RESNET_BK, "fp32", 1e-3),
        (RESNET_BK, "bf16-mixed", 3e-2),
    ] {
        match training_parity(pool, kind, precision, seed) {
            Ok(losses) => {
                let diffs: Vec<f64> = losses
                    .iter()
                    .map(|(a, b)| (a - b).abs() / a.abs().max(1e-12))
                    .collect();
                let (at, worst) = diffs
                    .iter()
                    .enumerate()
                    .fold((0, 0.0f64), |b, (i, &d)| if d > b.1 { (i, d) } else { b });
                let ok = worst <= bound;
                checks += 1;
                failed += usize::from(!ok);
                println!(
                    "training parity {precision}: {model}, 50 steps CPU fp32 vs GPU, max relative loss difference {worst:.2e} at step {} (losses {:.5} vs {:.5}; bound {bound:.0e}) {}; steps 1/10/25/50: {:.1e} {:.1e} {:.1e} {:.1e}",
                    at + 1,
                    losses[at].0,
                    losses[at].1,
                    if ok { "PASS" } else { "FAIL" },
                    diffs[0],
                    diffs[9],
                    diffs[24],
                    diffs[49]
                );
            }
            Err(e) => {
                checks += 1;
                failed += 1;
                println!("training parity {precision}: {model}: FAIL ({e})");
            }
        }
    }
    // The GPU's AdamW and the host's round sqrt and division differently in the last bit.
    // Adam normalises each update, so on elements whose gradient is rounding noise (the key
    // bias has an exactly zero true gradient) that bit becomes an update of either sign:
    // measured 1.05e-4 of the largest update after 3 fp32 steps on an H200.
    for (precision, bound) in [("fp32", 1e-3), ("bf16-mixed", 1e-2)] {
        let result = offload_parity(pool, precision, seed, bound);
        checks += 1;
        failed += usize::from(result.is_err());
        match result {
            Ok(msg) => println!("optimizer offload {precision}: {msg} PASS"),
            Err(msg) => println!("optimizer offload {precision}: {msg} FAIL"),
        }
    }
    for (what, check) in [
        (
            "block recomputation",
            recompute_is_exact as fn(&Arc<MemoryPool>, u64) -> _,
        ),
        ("fp16 loss scaler", fp16_scaler_backs_off),
    ] {
        let outcome = check(pool, seed);
        checks += 1;
        failed += usize::from(outcome.is_err());
        match outcome {
            Ok(msg) => println!("{what}: {msg} PASS"),
            Err(msg) => println!("{what}: {msg} FAIL"),
        }
    }
    (checks, failed)
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

fn run_checks(gpu: &CudaBackend, inp: &mut Inputs) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut push = |kernel: &str, dtype: &'static str, shape: String, bound: f64, result| {
        rows.push(Row {
            kernel: kernel.to_string(),
            dtype,
            shape,
            result,
            bound,
        })
    };
    macro_rules! both_dtypes {
        ($f:ident, $name:expr, $shape:expr, $($arg:expr),*) => {
            push($name, "f32", $shape.clone(), bound_of($name, BOUND_FP32), $f::<f32>(gpu, inp, $($arg),*));
            push($name, "bf16", $shape.clone(), bound_of($name, BOUND_BF16), $f::<Bf16>(gpu, inp, $($arg),*));
            push($name, "f16", $shape.clone(), bound_of($name, BOUND_F16), $f::<F16>(gpu, inp, $($arg),*));
        };
    }
    for (n, c) in [(1024, 768), (70, 768), (37, 1001)] {
        let shape = format!("{n}x{c}");
        both_dtypes!(check_layernorm_forward, "layernorm_forward", shape, n, c);
        both_dtypes!(
            check_residual_layernorm,
            "residual_layernorm_forward",
            shape,
            n,
            c
        );
        both_dtypes!(check_layernorm_backward, "layernorm_backward", shape, n, c);
    }
    for n in [(1 << 20) + 3, 1000] {
        both_dtypes!(check_dropout, "dropout", &format!("{n} p 0.1"), n);
        both_dtypes!(check_gelu_forward, "gelu_forward", &format!("{n}"), n);
        both_dtypes!(check_gelu_backward, "gelu_backward", &format!("{n}"), n);
    }
    // 50304 f32 fits a Hopper block's shared memory (the staged kernel), 65536 f32 and
    // Llama-3's 128256 do not. GPT-2's 50257 tokens padded to 50304 columns checks the
    // masking of the padding. On Hopper the rows of whole 16-byte pieces split over clusters
    // of 2, 4 or 8 blocks; 50264 leaves the cluster's last block a shorter share, Qwen's
    // 151936 takes 8 blocks in bf16, and 1001 runs the single-block kernels.
    for (n, v, valid) in [
        (64, 50304, 50257),
        (4, 65536, 65536),
        (3, 128256, 128256),
        (6, 50264, 50000),
        (5, 151936, 151669),
        (7, 1001, 1001),
    ] {
        let shape = format!("{n}x{v} valid {valid}");
        both_dtypes!(
            check_cross_entropy_forward,
            "cross_entropy_forward",
            shape,
            n,
            v,
            valid
        );
        both_dtypes!(
            check_cross_entropy_fused,
            "cross_entropy_fused",
            shape,
            n,
            v,
            valid
        );
        both_dtypes!(
            check_cross_entropy_unfused,
            "cross_entropy_unfused",
            shape,
            n,
            v,
            valid
        );
    }
    // The residual add of the unfused path: a GPT-2-wide stream and a ragged length (the
    // one-at-a-time tail).
    for n in [8192 * 768, 1001] {
        both_dtypes!(check_add, "add, add_assign", &format!("{n}"), n);
    }
    // Stacking three rank-16 adapters' A (Llama-3.2-1B width) and adding one's rows of the
    // stacked gradient back, and ragged sizes.
    for (n, at) in [(16 * 2048, 16 * 2048), (37, 11)] {
        let shape = format!("n{n} at{at}");
        both_dtypes!(check_offsets, "copy_into_at, add_assign_from", shape, n, at);
    }
    // A rank-16 adapter's columns of a fused QKV projection (SmolLM2 shape), and ragged sizes.
    for (n, row, col0, c) in [(16384, 960, 576, 192), (37, 101, 13, 29)] {
        let shape = format!("N{n} row{row} cols{col0}+{c}");
        both_dtypes!(
            check_cols,
            "add_cols_scaled, cols_scaled",
            shape,
            n,
            row,
            col0,
            c
        );
    }
    for (vocab, seq, n, c) in [(50304, 256, 1024, 768), (97, 5, 23, 33)] {
        let shape = format!("V{vocab} T{seq} N{n} C{c}");
        both_dtypes!(
            check_embedding_forward,
            "embedding_forward",
            shape,
            vocab,
            seq,
            n,
            c
        );
        both_dtypes!(
            check_embedding_backward,
            "embedding_backward",
            shape,
            vocab,
            seq,
            n,
            c
        );
    }
    // Llama-family operations. RMSNorm at SmolLM2's and Llama-3.2-1B's widths (rows held in
    // registers; the fused backward's chunks of 16 rows then end ragged at 70 rows), a ragged one
    // (not a multiple of the block, an odd row count) and one too wide to hold (both read
    // twice).
    for (n, c, eps) in [
        (1024, 576, 1e-5),
        (70, 576, 1e-5),
        (512, 2048, 1e-5),
        (37, 1001, 1e-6),
        (9, 8192, 1e-5),
    ] {
        let shape = format!("{n}x{c}");
        both_dtypes!(check_rmsnorm_forward, "rmsnorm_forward", shape, n, c, eps);
        both_dtypes!(
            check_residual_rmsnorm,
            "residual_rmsnorm_forward",
            shape,
            n,
            c,
            eps
        );
        both_dtypes!(check_rmsnorm_backward, "rmsnorm_backward", shape, n, c);
    }
    // Rotary embeddings with grouped-query heads: SmolLM2 (9 heads over 3), Llama-3.2-1B (32
    // over 8, Llama 3 frequency scaling), Qwen3-0.6B (head 128), partial rotary (32 of 64),
    // multi-query (one key/value head) and plain multi-head, ragged row counts.
    let llama3 = cpu::rope::Llama3Scaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192,
    };
    for (rows, heads, kv_heads, head_dim, rot_dim, theta, scaling) in [
        (1024, 9, 3, 64, 64, 100_000.0, None),
        (512, 32, 8, 64, 64, 500_000.0, Some(llama3)),
        (256, 16, 8, 128, 128, 1_000_000.0, None),
        (37, 4, 2, 64, 32, 10_000.0, None),
        (19, 8, 1, 16, 16, 10_000.0, None),
        (23, 3, 3, 32, 24, 10_000.0, None),
        // A head size that is no multiple of 4: one dimension a thread.
        (17, 6, 2, 18, 10, 10_000.0, None),
    ] {
        let s = cpu::rope::RopeShape {
            rows,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
        };
        let shape = format!("R{rows} H{heads}/{kv_heads} D{head_dim} rot{rot_dim}");
        let (cos, sin) = cpu::rope::rope_tables(
            &cpu::rope::inverse_frequencies(theta, rot_dim, scaling),
            ROPE_POSITIONS,
        );
        let tables = (&cos[..], &sin[..]);
        both_dtypes!(check_rope_forward, "rope_expand_forward", shape, s, tables);
        both_dtypes!(
            check_rope_backward,
            "rope_expand_backward",
            shape,
            s,
            tables
        );
    }
    // The key/value cache of generation at SmolLM2's, Llama-3.2-1B's, a Qwen3-like and a
    // multi-query shape (two blocks of eight query heads per key/value head):
    // decode steps of 64 sequences in distinct slots at positions up to 1500 and of 4 long
    // ones (rows split over the cache length, some splits empty), and a prefill of 37 tokens
    // into one slot. Cache positions no row covers hold NaN, so a stray read or write shows.
    for (heads, kv_heads, head_dim, theta) in [
        (9, 3, 64, 100_000.0),
        (32, 8, 64, 500_000.0),
        (16, 8, 128, 1_000_000.0),
        (16, 1, 64, 10_000.0),
    ] {
        let (cos, sin) = cpu::rope::rope_tables(
            &cpu::rope::inverse_frequencies(theta, head_dim, None),
            KV_MAX_LEN,
        );
        let tables = (&cos[..], &sin[..]);
        for call in [KvCall::Decode(64), KvCall::Decode(4), KvCall::Prefill(37)] {
            let (c, slot, pos) = call.rows(inp, kv_heads, head_dim);
            let s = cpu::rope::RopeShape {
                rows: slot.len(),
                heads,
                kv_heads,
                head_dim,
                rot_dim: head_dim,
            };
            let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
            let plan = |read: usize| {
                cuda::attention_plan(
                    s.rows,
                    heads,
                    kv_heads,
                    head_dim,
                    read,
                    gpu.info().sm_count as usize,
                )
            };
            let splits = |read: usize| plan(read).map_or(0, |p| p.splits);
            // Whether the one appending kernel runs (wide blocks, head sizes to 128), not the
            // append and attention kernels in turn.
            let fused = |read: usize| plan(read).is_some_and(|p| p.wide && p.lanes < 32);
            let base = format!("R{} H{heads}/{kv_heads} D{head_dim}", s.rows);
            let rows = (&slot[..], &pos[..]);
            both_dtypes!(check_kv_append, "kv_append", base, s, c, rows, tables, None);
            // The folded decode step's append: the projection of an unnormalised stream of
            // 576 (SmolLM2's width), each row scaled by its RMSNorm factor first, and with a
            // bias after it (Qwen2's).
            for bias in [false, true] {
                let shape = format!("{base}{}", if bias { " bias" } else { "" });
                both_dtypes!(
                    check_kv_append,
                    "kv_append_normed",
                    shape,
                    s,
                    c,
                    rows,
                    tables,
                    Some(bias)
                );
            }
            // Partial rotary dimensions at SmolLM2's shape: 32 of 64 takes the row kernels
            // (pieces of eight, dimensions past 32 passed through), 24 the element kernels
            // (its halves of 12 split a piece).
            if heads == 9 && matches!(call, KvCall::Prefill(_)) {
                for rot_dim in [32, 24] {
                    let (cos, sin) = cpu::rope::rope_tables(
                        &cpu::rope::inverse_frequencies(theta, rot_dim, None),
                        KV_MAX_LEN,
                    );
                    let s = cpu::rope::RopeShape { rot_dim, ..s };
                    let shape = format!("{base} rot{rot_dim}");
                    let tables = (&cos[..], &sin[..]);
                    both_dtypes!(
                        check_kv_append,
                        "kv_append",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        None
                    );
                    both_dtypes!(
                        check_kv_append,
                        "kv_append_normed",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        Some(true)
                    );
                }
            }
            // The decode step's append and attention in one kernel, with and without a bias
            // and a window, against the two CPU ops in turn (a prefill keeps two kernels).
            if let KvCall::Decode(_) = call {
                for (bias, window) in [(false, 0), (true, 0), (false, 700)] {
                    let read = if window > 0 {
                        longest.min(window)
                    } else {
                        longest
                    };
                    let shape = format!(
                        "{base}{}{} split{} {}",
                        if bias { " bias" } else { "" },
                        if window > 0 {
                            format!(" W{window}")
                        } else {
                            String::new()
                        },
                        splits(read),
                        if fused(read) { "fused" } else { "two kernels" }
                    );
                    both_dtypes!(
                        check_cache_attention_append,
                        "cache_attention_append",
                        shape,
                        s,
                        c,
                        rows,
                        tables,
                        (bias, window)
                    );
                }
            }
            let shape = format!("{base} split{}", splits(longest));
            both_dtypes!(
                check_cache_attention,
                "cache_attention",
                shape,
                heads,
                0,
                c,
                rows
            );
            // Within a sliding window: one shorter than the prefill, and one that still
            // leaves the long decode rows split.
            let window = match call {
                KvCall::Prefill(_) => 16,
                KvCall::Decode(_) => 700,
            };
            let shape = format!("{base} W{window} split{}", splits(longest.min(window)));
            both_dtypes!(
                check_cache_attention,
                "cache_attention_window",
                shape,
                heads,
                window,
                c,
                rows
            );
        }
        let c = cpu::kv_cache::CacheShape {
            slots: 4,
            kv_heads,
            max_len: 300,
            head_dim,
        };
        let shape = format!("K{kv_heads} D{head_dim} 257 of 300");
        both_dtypes!(check_copy_cache_slot, "copy_cache_slot", shape, c);
    }
    // SwiGLU at SmolLM2's and Llama-3.2-1B's FFN widths (four per access) and a ragged width
    // (one at a time).
    for (n, f) in [(1024, 1536), (128, 8192), (37, 1001)] {
        let shape = format!("{n}x2x{f}");
        both_dtypes!(check_swiglu_forward, "swiglu_forward", shape, n, f);
        both_dtypes!(
            check_swiglu_forward_normed,
            "swiglu_forward_normed",
            shape,
            n,
            f
        );
        both_dtypes!(check_swiglu_backward, "swiglu_backward", shape, n, f);
    }
    // The token table's backward alone (rotary models): SmolLM2's vocabulary and width, a
    // ragged shape, and rows wider than a block (two passes, the second with idle threads)
    // whose hot token has more positions than a block stages at once.
    for (vocab, n, c) in [(49152, 2048, 576), (97, 23, 33), (1000, 4096, 1536)] {
        let shape = format!("V{vocab} N{n} C{c}");
        both_dtypes!(
            check_token_embedding_backward,
            "token_embedding_backward",
            shape,
            vocab,
            n,
            c
        );
    }
    // The sampler at SmolLM2's and Llama 3's vocabularies and a ragged one, for greedy with
    // a penalty, nucleus, top-k with min-p and a penalty, and the full distribution; one
    // case per vocabulary maps rows to shared logits rows and permuted slots, as a prefill's
    // samples do. The error is the fraction of rows drawing another token than the CPU
    // (ties and rounding only) or the log-probability's relative error, whichever is worse;
    // a slot state (position, counter, presence) that differs is a failure.
    // Each row is split over many blocks, as many as fill the GPU for the call's row count:
    // 96 rows, the 64 rows of a decode batch, and 16 rows drawn one per call (batch 1, the
    // most blocks per row, and the scratch reused call after call).
    for (vocab, rows, per_call) in [
        (49152usize, 96usize, 96usize),
        (49152, 64, 64),
        (128256, 96, 96),
        (128256, 64, 64),
        (128256, 16, 1),
        (1001, 96, 96),
    ] {
        for (name, p, mapped, scale) in sample_cases() {
            let shape = format!("V{vocab} R{rows}/{per_call} {name}");
            both_dtypes!(
                check_sample_rows,
                "sample_rows",
                shape,
                vocab,
                (p, scale),
                mapped,
                rows,
                per_call
            );
        }
    }
    push(
        "gather_slot_rows",
        "u32",
        "37 rows of 50 slots".into(),
        0.0,
        check_gather_slot_rows(gpu, inp),
    );
    // Mixture-of-experts routing: 1.5 slots per token over a GPT-2-wide stream, and a ragged
    // shape with a width that is not a multiple of the block.
    for (src_rows, rows, c) in [(8192, 12288, 768), (37, 29, 33)] {
        let shape = format!("{rows} of {src_rows}x{c}");
        both_dtypes!(check_gather_rows, "gather_rows", shape, src_rows, rows, c);
        both_dtypes!(
            check_scatter_add_rows,
            "scatter_add_rows",
            shape,
            src_rows,
            rows.min(src_rows),
            c
        );
        both_dtypes!(
            check_gathered_row_dot,
            "gathered_row_dot",
            shape,
            src_rows,
            rows,
            c
        );
    }
    for n in [1_000_003, 77] {
        for (kernels, name) in [
            (Kernels::Fused, "adamw_update"),
            (Kernels::Unfused, "adamw_update_unfused"),
        ] {
            let master_only = check_adamw::<f32>(gpu, inp, n, false, kernels);
            push(
                &format!("{name} (master only)"),
                "f32",
                format!("{n}"),
                BOUND_FP32,
                master_only,
            );
            both_dtypes!(check_adamw, name, &format!("{n}"), n, true, kernels);
        }
    }
    // One launch over ragged tensors (tails of 1-3, a single piece, one past a piece), each
    // with its own weight decay, against the CPU update of each alone.
    let sizes = [77, 1_000_003, 16384, 16385, 1, 6];
    let shape = format!("{sizes:?}");
    let r = check_adamw_many::<f32>(gpu, inp, &sizes, false);
    push(
        "adamw_update_many (master only)",
        "f32",
        shape.clone(),
        BOUND_FP32,
        r,
    );
    both_dtypes!(check_adamw_many, "adamw_update_many", &shape, &sizes, true);
    for n in [10_000_019, 1000] {
        let r = check_sum_squares(gpu, inp, n, None);
        push("sum_squares", "f32", format!("{n}"), BOUND_FP32, r);
    }
    let sizes = [2_359_296, 0, 768, 1_000_003, 1];
    let r = check_sum_squares_many(gpu, inp, &sizes);
    push(
        "sum_squares_many",
        "f32",
        format!("{sizes:?}"),
        BOUND_FP32,
        r,
    );
    for (bad, name) in [
        (f32::NAN, "sum_squares (NaN flag)"),
        (f32::INFINITY, "sum_squares (inf flag)"),
    ] {
        let r = check_sum_squares(gpu, inp, 100_003, Some(bad));
        push(name, "f32", "100003".into(), 0.0, r);
    }
    for (n, c_in, c_out) in [(512, 768, 2304), (37, 53, 29)] {
        let shape = format!("{n}x{c_in}->{c_out}");
        for (label, math, b) in [
            ("f32", GemmMath::Fp32, BOUND_FP32),
            ("tf32", GemmMath::Tf32, BOUND_TF32),
        ] {
            let r = check_linear_forward::<f32>(gpu, inp, n, c_in, c_out, math);
            push("linear_forward", label, shape.clone(), b, r);
            let r = check_linear_backward::<f32>(gpu, inp, n, c_in, c_out, math);
            push("linear_backward", label, shape.clone(), b, r);
        }
        let r = check_linear_forward::<Bf16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
        push("linear_forward", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_linear_backward::<Bf16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
        push("linear_backward", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_linear_forward::<F16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
        push("linear_forward", "f16", shape.clone(), BOUND_F16, r);
        let r = check_linear_backward::<F16>(gpu, inp, n, c_in, c_out, GemmMath::Fp32);
        push("linear_backward", "f16", shape.clone(), BOUND_F16, r);
        let r = check_matmul_tt(gpu, inp, n, c_in, c_out);
        push("matmul (A^T B^T)", "f32", shape, BOUND_FP32, r);
    }
    // A decode step's products of a few rows on the tensor cores: SmolLM2-135M's and
    // Llama-3.2-1B's projections at batches 1 to 64 (row counts off the 8-row tiles too), written
    // and added into the output, and the gate/up product fused with the row's norm and SwiGLU.
    for (rows, k, n, accumulate) in [
        (1, 576, 960, false),
        (7, 576, 576, true),
        (64, 1536, 576, true),
        (33, 2048, 3072, false),
        (64, 576, 960, false),
        (16, 8192, 2048, true),
    ] {
        let shape = format!("{rows}x{k}->{n}{}", if accumulate { " +=" } else { "" });
        let r = check_few_rows_product::<Bf16>(gpu, inp, rows, k, n, accumulate);
        push("few_rows_product", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_few_rows_product::<F16>(gpu, inp, rows, k, n, accumulate);
        push("few_rows_product", "f16", shape, BOUND_F16, r);
    }
    for (rows, k, f) in [
        (1, 576, 1536),
        (64, 576, 1536),
        (20, 2048, 8192),
        (9, 64, 16),
    ] {
        let shape = format!("{rows}x{k}->2x{f}");
        let r = check_few_rows_swiglu::<Bf16>(gpu, inp, rows, k, f);
        push("few_rows_swiglu", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_few_rows_swiglu::<F16>(gpu, inp, rows, k, f);
        push("few_rows_swiglu", "f16", shape, BOUND_F16, r);
    }
    // The decode MLP's chain (fused gate/up, then the down product added into the stream),
    // three layers, launched overlapped where the GPU can (engine/cuda/overlap.rs): the same
    // bits as plain launches, and the CPU's chain within the bound.
    for (rows, k, f) in [(1, 576, 1536), (64, 576, 1536), (8, 2048, 8192)] {
        let shape = format!("3 x {rows}x{k}->2x{f}->{k}");
        let r = check_overlapped_chain::<Bf16>(gpu, inp, rows, k, f);
        push(
            "few_rows chain (overlapped)",
            "bf16",
            shape.clone(),
            BOUND_BF16,
            r,
        );
        let r = check_overlapped_chain::<F16>(gpu, inp, rows, k, f);
        push("few_rows chain (overlapped)", "f16", shape, BOUND_F16, r);
    }
    // A product with the GELU in its epilogue, and the backward through it: GPT-2's MLP
    // (768 -> 3072 and back), a shape whose widths are multiples of 8 (the epilogue's), and one
    // whose are not (the separate kernels).
    for (n, c, hidden) in [(512, 768, 3072), (37, 56, 24), (37, 53, 29)] {
        let shape = format!("{n}x{c}->{hidden}");
        for (label, math, b) in [
            ("f32", GemmMath::Fp32, BOUND_FP32),
            ("tf32", GemmMath::Tf32, BOUND_TF32),
        ] {
            let r = check_linear_gelu::<f32>(gpu, inp, n, c, hidden, math);
            push("linear_gelu", label, shape.clone(), b, r);
        }
        let r = check_linear_gelu::<Bf16>(gpu, inp, n, c, hidden, GemmMath::Fp32);
        push("linear_gelu", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_linear_gelu::<F16>(gpu, inp, n, c, hidden, GemmMath::Fp32);
        push("linear_gelu", "f16", shape, BOUND_F16, r);
    }
    // The unfused attention's products: S = Q K^T (GPT-2's 12 heads of 64 at T = 1024 over
    // a batch of 4), P^T dO, and ragged sizes in every transpose combination.
    for (trans_a, trans_b, batch, m, n, k) in [
        (false, true, 48, 1024, 1024, 64),
        (true, false, 48, 1024, 64, 1024),
        (false, false, 7, 77, 33, 130),
        (true, true, 3, 45, 19, 70),
    ] {
        let g = GemmShape {
            trans_a,
            trans_b,
            batch,
            m,
            n,
            k,
        };
        let shape = format!(
            "{batch} x {}{m}x{k} {}{k}x{n}",
            if trans_a { "T " } else { "" },
            if trans_b { "T " } else { "" }
        );
        let r = check_matmul_batched::<f32>(gpu, inp, g);
        push("matmul_batched", "f32", shape.clone(), BOUND_FP32, r);
        let r = check_matmul_batched::<Bf16>(gpu, inp, g);
        push("matmul_batched", "bf16", shape, BOUND_BF16, r);
    }
    // Products on column blocks of wider matrices (an adapter's columns of a fused projection),
    // added into a block of C (beta 1): the adapter's forward, dh, dB and dx; the last with
    // an odd column offset, so the operands are not 16-byte aligned.
    for (trans_a, trans_b, m, n, k, off) in [
        (false, true, 1000, 192, 16, 576),
        (false, false, 1000, 16, 192, 576),
        (true, false, 192, 16, 1000, 576),
        (false, false, 77, 45, 16, 3),
    ] {
        let g = GemmShape::single(trans_a, trans_b, m, n, k);
        let shape = format!(
            "{}{m}x{k} {}{k}x{n} at column {off}",
            if trans_a { "T " } else { "" },
            if trans_b { "T " } else { "" }
        );
        let r = check_matmul_view::<f32, f32>(gpu, inp, g, off);
        push("matmul_view", "f32", shape.clone(), BOUND_FP32, r);
        let r = check_matmul_view::<Bf16, Bf16>(gpu, inp, g, off);
        push("matmul_view", "bf16", shape.clone(), BOUND_BF16, r);
        let r = check_matmul_view::<Bf16, f32>(gpu, inp, g, off);
        push("matmul_view", "bf16 into f32", shape, BOUND_BF16, r);
    }
    // The last shape has head size 64 (the tensor-core path in bf16) and a ragged last tile.
    for (b, t, nh, c) in [
        (4, 1024, 12, 768),
        (3, 77, 2, 32),
        (2, 130, 4, 64),
        (2, 200, 2, 128),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, 0, GemmMath::Fp32);
        let bound = f32_attention_bound(gpu, s.head_size());
        push("attention_forward", "f32", shape.clone(), bound, fwd);
        push("attention_backward", "f32", shape.clone(), bound, bwd);
        if gpu.attention_uses_tensor_cores(s.head_size()) {
            let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, 0, GemmMath::Tf32);
            push(
                "attention_forward",
                "tf32",
                shape.clone(),
                BOUND_TF32_ATTENTION,
                fwd,
            );
            push(
                "attention_backward",
                "tf32",
                shape.clone(),
                BOUND_TF32_ATTENTION,
                bwd,
            );
        }
        let (fwd, bwd) = check_attention::<Bf16>(gpu, inp, s, 0, GemmMath::Fp32);
        push("attention_forward", "bf16", shape.clone(), BOUND_BF16, fwd);
        push("attention_backward", "bf16", shape.clone(), BOUND_BF16, bwd);
        let (fwd, bwd) = check_attention::<F16>(gpu, inp, s, 0, GemmMath::Fp32);
        push("attention_forward", "f16", shape.clone(), BOUND_F16, fwd);
        push("attention_backward", "f16", shape, BOUND_F16, bwd);
    }
    // Sliding-window attention (Mistral, Qwen2): windows shorter than a tile, not a multiple
    // of one, and longer than several, over head sizes 64 (the tensor cores in bf16) and 32;
    // then a window of the whole sequence, which must change nothing, bit for bit.
    for (b, t, nh, c, window) in [
        (2, 192, 4, 256, 64),
        (2, 300, 2, 128, 100),
        (1, 257, 2, 128, 17),
        (2, 200, 4, 128, 37),
        (1, 130, 3, 96, 1),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c} W{window}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, window, GemmMath::Fp32);
        let bound = f32_attention_bound(gpu, s.head_size());
        push("attention_forward_window", "f32", shape.clone(), bound, fwd);
        push(
            "attention_backward_window",
            "f32",
            shape.clone(),
            bound,
            bwd,
        );
        if gpu.attention_uses_tensor_cores(s.head_size()) {
            let (fwd, bwd) = check_attention::<f32>(gpu, inp, s, window, GemmMath::Tf32);
            let bound = BOUND_TF32_ATTENTION;
            push(
                "attention_forward_window",
                "tf32",
                shape.clone(),
                bound,
                fwd,
            );
            push(
                "attention_backward_window",
                "tf32",
                shape.clone(),
                bound,
                bwd,
            );
        }
        let (fwd, bwd) = check_attention::<Bf16>(gpu, inp, s, window, GemmMath::Fp32);
        push(
            "attention_forward_window",
            "bf16",
            shape.clone(),
            BOUND_BF16,
            fwd,
        );
        push(
            "attention_backward_window",
            "bf16",
            shape.clone(),
            BOUND_BF16,
            bwd,
        );
        let (fwd, bwd) = check_attention::<F16>(gpu, inp, s, window, GemmMath::Fp32);
        push(
            "attention_forward_window",
            "f16",
            shape.clone(),
            BOUND_F16,
            fwd,
        );
        push("attention_backward_window", "f16", shape, BOUND_F16, bwd);
    }
    for (b, t, nh, c) in [(2, 200, 4, 256), (2, 77, 2, 64)] {
        let shape = format!("B{b} T{t} H{nh} C{c} W{t} vs none");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        both_dtypes!(
            check_attention_full_window,
            "attention_full_window",
            shape,
            s,
            GemmMath::Fp32
        );
    }
    // Every attention kernel sums in a fixed order (no atomics): two runs agree bit for bit
    // (bound 0), here on a long sequence with thousands of blocks.
    let s = AttnShape {
        batch: 4,
        seq: 4096,
        heads: 12,
        channels: 768,
    };
    for (dtype, result) in [
        ("f32", check_attention_repeatable::<f32>(gpu, inp, s)),
        ("bf16", check_attention_repeatable::<Bf16>(gpu, inp, s)),
        ("f16", check_attention_repeatable::<F16>(gpu, inp, s)),
    ] {
        let shape = "B4 T4096 H12 C768 twice".to_string();
        push("attention_repeatable", dtype, shape, 0.0, result);
    }
    // The tensor-core kernels at head sizes 64 and 128 in f32 (both product kinds), bf16 and
    // f16, on the layout
    // grouped-query attention gives them: 8 query heads over 2 key/value heads, each key/value
    // head repeated over its 4 query heads as rope_expand packs them. Sequence ends that are no
    // multiple of a tile (64 rows; 32-row key tiles at head size 128), windows longer than a
    // block, and one shorter than a 64-row block but longer than a 32-row tile.
    for (b, t, heads, kv_heads, hs, window) in [
        (2, 520, 8, 2, 128, 0),
        (2, 300, 8, 2, 128, 100),
        (1, 333, 8, 2, 128, 37),
        (2, 520, 8, 2, 64, 0),
        (2, 300, 8, 2, 64, 100),
    ] {
        let s = AttnShape {
            batch: b,
            seq: t,
            heads,
            channels: heads * hs,
        };
        let (forward, backward, shape) = if window > 0 {
            (
                "attention_forward_gqa_window",
                "attention_backward_gqa_window",
                format!("B{b} T{t} H{heads}/{kv_heads} D{hs} W{window}"),
            )
        } else {
            (
                "attention_forward_gqa",
                "attention_backward_gqa",
                format!("B{b} T{t} H{heads}/{kv_heads} D{hs}"),
            )
        };
        for (label, math, bound) in [
            ("f32", GemmMath::Fp32, BOUND_3XTF32_ATTENTION),
            ("tf32", GemmMath::Tf32, BOUND_TF32_ATTENTION),
        ] {
            let (fwd, bwd) = check_attention_grouped::<f32>(gpu, inp, s, kv_heads, window, math);
            push(forward, label, shape.clone(), bound, fwd);
            push(backward, label, shape.clone(), bound, bwd);
        }
        let (fwd, bwd) =
            check_attention_grouped::<Bf16>(gpu, inp, s, kv_heads, window, GemmMath::Fp32);
        push(forward, "bf16", shape.clone(), BOUND_BF16, fwd);
        push(backward, "bf16", shape.clone(), BOUND_BF16, bwd);
        // f16's bound holds per head vector: P (times 2^12) and dS (scaled per row) rounded
        // to f16 keep 11 bits, as the output's own rounding does.
        let (fwd, bwd) =
            check_attention_grouped::<F16>(gpu, inp, s, kv_heads, window, GemmMath::Fp32);
        push(forward, "f16", shape.clone(), BOUND_F16, fwd);
        push(backward, "f16", shape, BOUND_F16, bwd);
    }
    // f16's range: score gradients dS past f16's largest value, as fp16-mixed's loss scale
    // gives them, with dQ, dK and dV inside it.
    for (t, heads, hs) in [(256, 4, 128), (256, 4, 64)] {
        let s = AttnShape {
            batch: 1,
            seq: t,
            heads,
            channels: heads * hs,
        };
        push(
            "attention_backward_large_ds",
            "f16",
            format!("B1 T{t} H{heads} D{hs} dS>65504"),
            BOUND_F16,
            check_attention_large_ds::<F16>(gpu, inp, s),
        );
    }
    // A window of the whole sequence changes nothing at head size 128 either (the tensor-core
    // kernels only: the CUDA-core ones have no head size 128).
    let s = AttnShape {
        batch: 2,
        seq: 200,
        heads: 2,
        channels: 256,
    };
    let shape = "B2 T200 H2 C256 W200 vs none".to_string();
    for (label, math) in [("f32", GemmMath::Fp32), ("tf32", GemmMath::Tf32)] {
        let r = check_attention_full_window::<f32>(gpu, inp, s, math);
        push("attention_full_window", label, shape.clone(), 0.0, r);
    }
    let r = check_attention_full_window::<Bf16>(gpu, inp, s, GemmMath::Fp32);
    push("attention_full_window", "bf16", shape.clone(), 0.0, r);
    let r = check_attention_full_window::<F16>(gpu, inp, s, GemmMath::Fp32);
    push("attention_full_window", "f16", shape, 0.0, r);
    // Encoder operations. Layernorm with BERT's eps of 1e-12 on rows of small spread (GPT-2's
    // 1e-5 would change their rstd several-fold, so a lost eps shows), plain and residual.
    for (n, c) in [(512, 384), (37, 1001)] {
        let shape = format!("{n}x{c} eps 1e-12");
        both_dtypes!(
            check_layernorm_eps,
            "layernorm_forward_eps",
            shape,
            n,
            c,
            1e-12
        );
    }
    for n in [(1 << 20) + 3, 1000] {
        both_dtypes!(
            check_gelu_erf_forward,
            "gelu_erf_forward",
            &format!("{n}"),
            n
        );
        both_dtypes!(
            check_gelu_erf_backward,
            "gelu_erf_backward",
            &format!("{n}"),
            n
        );
    }
    // Padding masks: full, ragged and single-token sequences; MiniLM's 12 heads of 32, and
    // head sizes 16 and 64 with lengths past one tile of keys.
    for (b, t, nh, c, lens) in [
        (4, 64, 12, 384, vec![64, 17, 1, 33]),
        (3, 77, 2, 32, vec![5, 77, 40]),
        (2, 130, 4, 256, vec![130, 65]),
    ] {
        let shape = format!("B{b} T{t} H{nh} C{c}");
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        both_dtypes!(
            check_masked_attention,
            "masked_attention_forward",
            shape,
            s,
            &lens
        );
        both_dtypes!(check_padded_softmax, "padded_softmax", shape, s, &lens);
        both_dtypes!(
            check_softmax_backward_rows,
            "softmax_backward_rows",
            shape,
            s,
            &lens
        );
    }
    // The fused kernels (one team of warps per sequence, staged in shared memory): N = 1,
    // ragged N (chunks past the end, teams past the batch), several sequences per block (N up
    // to 512), teams of 2, 4, 8 and 16 warps (N = 1000, 2048, 4096, 8192), with and without
    // off-diagonals; N = 20000 is past their limits (the forward's shared memory on every
    // supported GPU, the backward's 16 positions per thread) and takes the multi-launch path,
    // whose chunk scan then spans more chunks than a warp has lanes.
    for (batch, n, causal, off) in [
        (3, 1000, false, true),
        (2, 1000, true, true),
        (4, 1, false, true),
        (64, 100, false, true),
        (5, 37, true, true),
        (9, 128, true, false),
        (17, 512, false, false),
        (3, 2048, false, true),
        (2, 4096, true, false),
        (1, 8192, false, true),
        (2, 8192, true, true),
        (3, 8192, false, false),
        (1, 20000, false, true),
        (2, 20000, true, false),
        // The warp kernels (unit off-diagonals, small calls, N of 128, 256 or 512), with
        // warps past the batch in the last block.
        (8, 128, false, false),
        (3, 256, true, false),
        (6, 256, false, false),
        (5, 512, true, false),
        // The long-chunk kernels (unit off-diagonals, calls above 2^17 positions, N a multiple
        // of 32 chunks): several sequences per block with some past the batch, blocks of 4 to
        // 16 warps per sequence, chunks of 16, 32 and 64 positions (the last two only in
        // calls of millions of positions), both modes.
        (65, 2048, false, false),
        (66, 2048, true, false),
        (33, 4096, false, false),
        (17, 8192, false, false),
        (17, 8192, true, false),
        (9, 16384, false, false),
        (256, 8192, false, false),
        (512, 8192, true, false),
    ] {
        let shape = format!(
            "B{batch} N{n} {}{}",
            if causal { "causal" } else { "full" },
            if off { "" } else { " unit off-diag" }
        );
        let (fwd, bwd) = check_bk_core(gpu, inp, BkShape { batch, n, causal }, off, 3.0, 0.5);
        push("bk_core_forward", "f32", shape.clone(), BOUND_BK, fwd);
        push("bk_core_backward", "f32", shape, BOUND_BK, bwd);
    }
    // Inputs at the edges of the unit-off-diagonal kernels' numerics, full mode: a potential
    // up to 2e9 (the long-chunk kernels renormalise their maps twice as often once some |s|
    // reaches 1e9; the warp kernels renormalise on every second step), and a small Im z,
    // where |r| and |q| can come down to Im z.
    for (batch, n, v_scale, z_im_min, what) in [
        (64, 8192, 2e9, 0.5, "v up to 2e9"),
        (4, 128, 2e9, 0.5, "v up to 2e9"),
        (65, 2048, 3.0, 0.1, "Im z in [0.1, 0.2)"),
        (17, 8192, 3.0, 0.1, "Im z in [0.1, 0.2)"),
    ] {
        let s = BkShape {
            batch,
            n,
            causal: false,
        };
        let (fwd, bwd) = check_bk_core(gpu, inp, s, false, v_scale, z_im_min);
        let shape = format!("B{batch} N{n} full unit off-diag, {what}");
        push("bk_core_forward", "f32", shape.clone(), BOUND_BK, fwd);
        push("bk_core_backward", "f32", shape, BOUND_BK, bwd);
    }
    push(
        "bk_core (NaN flag)",
        "f32",
        "B2 N300".into(),
        0.0,
        check_bk_core_flags_nan(gpu, inp),
    );
    rows
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

const SAMPLE_BOUND: f64 = 2e-2;

/// The sampler's cases: name, settings, whether rows map to shared logits rows, and the
/// logits' scale.
fn sample_cases() -> Vec<(&'static str, cpu::sampling::SampleParams, bool, f32)> {
    use cpu::sampling::SampleParams;
    let plain = SampleParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };
    vec![
        (
            "greedy pen1.3",
            SampleParams {
                temperature: 0.0,
                repetition_penalty: 1.3,
                ..plain
            },
            false,
            6.0,
        ),
        (
            "T0.9 p0.9",
            SampleParams {
                temperature: 0.9,
                top_p: 0.9,
                ..plain
            },
            false,
            6.0,
        ),
        (
            "T0.7 k50 minp0.05 pen1.2",
            SampleParams {
                temperature: 0.7,
                top_k: 50,
                min_p: 0.05,
                repetition_penalty: 1.2,
                ..plain
            },
            false,
            6.0,
        ),
        ("T1 mapped", plain, true, 6.0),
        // Nearly flat logits (within 0.3, a few bins of T/8): thousands of candidates per row
        // share a few bins, the contended path of the histograms and the threshold search;
        // with top-k as well, both cuts are searched among the same candidates.
        (
            "T0.9 p0.9 flat",
            SampleParams {
                temperature: 0.9,
                top_p: 0.9,
                ..plain
            },
            false,
            0.3,
        ),
        (
            "T0.9 k50 p0.9 flat",
            SampleParams {
                temperature: 0.9,
                top_k: 50,
                top_p: 0.9,
                ..plain
            },
            false,
            0.3,
        ),
    ]
}

/// The rows of a decode step over some slots (padding rows naming no slot among them)
/// gathered on both devices; the error is the fraction of entries that differ.
fn check_gather_slot_rows(gpu: &CudaBackend, inp: &mut Inputs) -> Check {
    use cpu::sampling::{HostSlots, gather_slot_rows};
    let slots = 50;
    let pos: Vec<u32> = (0..slots).map(|_| inp.0.next_u64() as u32 % 1000).collect();
    let mut host = HostSlots::new(pos, vec![7; slots], &[], 1000, 1000);
    host.tokens = (0..slots).map(|_| inp.0.next_u64() as u32 % 1000).collect();
    let ids: Vec<u32> = (0..37)
        .map(|i| {
            if i % 9 == 8 {
                u32::MAX
            } else {
                (i * 7 % slots) as u32
            }
        })
        .collect();
    let (mut want_t, mut want_p) = (vec![0u32; ids.len()], vec![0u32; ids.len()]);
    gather_slot_rows(&host, &ids, &mut want_t, &mut want_p);
    let dev = gpu.upload_slots(&host)?;
    let d_ids = gpu.upload(&ids)?;
    let mut got_t = gpu.upload(&vec![0xdead_beefu32; ids.len()])?;
    let mut got_p = gpu.upload(&vec![0xdead_beefu32; ids.len()])?;
    gpu.gather_slot_rows(&dev, &d_ids, &mut got_t, &mut got_p)?;
    let (got_t, got_p) = (gpu.download(&got_t)?, gpu.download(&got_p)?);
    let differ = (0..ids.len())
        .filter(|&i| got_t[i] != want_t[i] || got_p[i] != want_p[i])
        .count();
    Ok(differ as f64 / ids.len() as f64)
}

/// `rows` rows of random logits uniform within `scale` (6: peaked enough that top-p keeps a
/// part of the vocabulary; 0.3: nearly flat, thousands of candidates in a few bins) drawn on
/// both devices from the same slot state, `per_call` rows per GPU call.
#[allow(clippy::too_many_arguments)]
fn check_sample_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    (p, scale): (cpu::sampling::SampleParams, f32),
    mapped: bool,
    rows: usize,
    per_call: usize,
) -> Check {
    use cpu::sampling::{HostSlots, sample_rows};
    let stride = crate::models::padded_vocab(vocab);
    let logit_rows = if mapped { rows / 2 } else { rows };
    let logits = inp.uniform(logit_rows * stride, scale, T::DTYPE);
    let slots = rows + 3;
    let max_len = 50;
    let history: Vec<Vec<u32>> = (0..slots).map(|_| inp.tokens(40, vocab)).collect();
    let history: Vec<&[u32]> = history.iter().map(|h| &h[..]).collect();
    let pos: Vec<u32> = (0..slots).map(|i| (i % max_len) as u32).collect();
    let seeds: Vec<u64> = (0..slots).map(|_| inp.0.next_u64()).collect();
    let mut host = HostSlots::new(pos, seeds, &history, vocab, max_len);
    host.counters = (0..slots as u64).map(|i| i * 7).collect();
    let mut dev = gpu.upload_slots(&host)?;
    let (src, slot): (Vec<u32>, Vec<u32>) = if mapped {
        (0..rows as u32)
            .map(|r| (r / 2, (rows as u32 + 2) - r))
            .unzip()
    } else {
        ((0..rows as u32).collect(), (0..rows as u32).collect())
    };
    let (h_src, h_slot) = if mapped {
        (Some(&src[..]), Some(&slot[..]))
    } else {
        (None, None)
    };
    sample_rows(&logits, stride, h_src, h_slot, &mut host, &p, rows);
    let d_logits = gpu.upload_as::<T>(&logits)?;
    if per_call >= rows {
        let (d_src, d_slot) = (gpu.upload(&src)?, gpu.upload(&slot)?);
        gpu.sample_rows::<T>(
            &d_logits,
            stride,
            rows,
            mapped.then_some(&d_src),
            mapped.then_some(&d_slot),
            &mut dev,
            &p,
        )?;
    } else {
        // Fewer rows per call: each call names its rows' logits rows and slots.
        for (src, slot) in src.chunks(per_call).zip(slot.chunks(per_call)) {
            let (d_src, d_slot) = (gpu.upload(src)?, gpu.upload(slot)?);
            gpu.sample_rows::<T>(
                &d_logits,
                stride,
                src.len(),
                Some(&d_src),
                Some(&d_slot),
                &mut dev,
                &p,
            )?;
        }
    }
    let tokens = gpu.download(&dev.tokens)?;
    let logprobs = gpu.download(&dev.logprobs)?;
    let mut differ = 0usize;
    let mut lp_err = 0.0f64;
    for &s in &slot {
        let s = s as usize;
        if tokens[s] != host.tokens[s] {
            differ += 1;
        } else {
            let (g, w) = (logprobs[s] as f64, host.logprobs[s] as f64);
            lp_err = lp_err.max(if g.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs() / w.abs().max(1.0)
            });
        }
    }
    // Untouched slots keep their state; drawn ones advance exactly as on the host (a slot
    // whose token differs differs in its presence bit too, so masks are compared only where
    // tokens agree).
    let state_ok =
        gpu.download(&dev.pos)? == host.pos && gpu.download(&dev.counters)? == host.counters && {
            let words = cpu::sampling::mask_words(vocab);
            let mask = gpu.download(&dev.presence)?;
            (0..slots).all(|s| {
                tokens[s] != host.tokens[s]
                    || mask[s * words..(s + 1) * words] == host.presence[s * words..(s + 1) * words]
            })
        };
    if !state_ok {
        return Ok(f64::INFINITY);
    }
    Ok(worst(&[differ as f64 / rows as f64, lp_err]))
}

/// bf16 for a chain of kernels that each round their output, as the unfused attention does
/// (S, P and O in the forward; the dO heads, dV, dP, dS, dQ and dK in the backward), against
/// an f32 reference that rounds only its inputs: each rounding adds up to 2^-9 relative, and
/// the one of P passes into O and every gradient, so the bound is a few times the single
/// rounding's 1e-2.
const BOUND_BF16_CHAIN: f64 = 5e-2;

/// A GPU prefill's attention through the training attention (`ops::cache_attention_at` on
/// rows that form runs from position 0: queries and cached keys and values packed, padded to
/// the longest run) against the CPU's cache attention, on tensors of the GPU pool: three
/// prompts of ragged lengths in scrambled slots of a cache whose other positions hold NaN, at
/// SmolLM2's, Llama-3.2-1B's and a head size 128 shape, with and without a window. Measured
/// per head vector against the head's largest output, as the training attention is.
fn prefill_attention_rows(pool: &Arc<MemoryPool>, inp: &mut Inputs) -> Vec<Row> {
    let mut rows = Vec::new();
    let lens = [37usize, 20, 29];
    let slots = [2u32, 0, 3];
    let slot: Vec<u32> = lens
        .iter()
        .zip(slots)
        .flat_map(|(&n, s)| std::iter::repeat_n(s, n))
        .collect();
    let pos: Vec<u32> = lens.iter().flat_map(|&n| 0..n as u32).collect();
    for (heads, kv_heads, head_dim) in [(9, 3, 64), (32, 8, 64), (16, 8, 128)] {
        for window in [0, 16] {
            let c = cpu::kv_cache::CacheShape {
                slots: 4,
                kv_heads,
                max_len: 64,
                head_dim,
            };
            for (label, dtype, bound) in [
                ("bf16", DType::BF16, BOUND_BF16),
                ("f16", DType::F16, BOUND_F16),
            ] {
                let k = kv_cache_input(inp, c, (&slot, &pos), dtype);
                let v = kv_cache_input(inp, c, (&slot, &pos), dtype);
                let q = inp.uniform(slot.len() * heads * head_dim, 3.0, dtype);
                let mut want = vec![0.0; q.len()];
                cpu::kv_cache::cache_attention(
                    &mut want, &q, &k, &v, &slot, &pos, heads, window, c,
                );
                let got = (|| {
                    let t = |data: &[f32], shape: &[usize]| {
                        Tensor::from_vec(pool, shape, dtype, data.to_vec())
                    };
                    let (q, k, v) = (
                        t(&q, &[slot.len(), heads * head_dim])?,
                        t(&k, &[c.len()])?,
                        t(&v, &[c.len()])?,
                    );
                    let at = ops::CacheRows::host(&q, &slot, &pos, head_dim)?;
                    let out = ops::cache_attention_at(&q, &k, &v, &at, heads, window, lens[0], c)?;
                    out.to_vec()
                })();
                let result = got
                    .map(|g| rel_err_per_head(&g, &want, head_dim))
                    .map_err(|e| CudaError::Driver(e.to_string()));
                rows.push(Row {
                    kernel: "prefill_attention".into(),
                    dtype: label,
                    shape: format!(
                        "runs 37,20,29 H{heads}/{kv_heads} D{head_dim}{}",
                        if window > 0 { " W16" } else { "" }
                    ),
                    result,
                    bound,
                });
            }
        }
    }
    rows
}

/// The unfused attention chain on tensors of the GPU pool: GPT-2's shape, ragged sequence
/// lengths (not multiples of 32) and head sizes 16, 32 and 64.
fn unfused_attention_rows(pool: &Arc<MemoryPool>, inp: &mut Inputs) -> Vec<Row> {
    let mut rows = Vec::new();
    for (b, t, nh, c) in [
        (4, 1024, 12, 768),
        (3, 77, 2, 32),
        (2, 130, 4, 64),
        (2, 45, 3, 192),
    ] {
        let s = AttnShape {
            batch: b,
            seq: t,
            heads: nh,
            channels: c,
        };
        for (label, dtype, bound) in [
            ("f32", DType::F32, BOUND_FP32),
            ("bf16", DType::BF16, BOUND_BF16_CHAIN),
        ] {
            let (fwd, bwd) = match check_attention_unfused(pool, inp, s, dtype) {
                Ok((f, b)) => (Ok(f), Ok(b)),
                Err(e) => (Err(CudaError::Driver(e.clone())), Err(CudaError::Driver(e))),
            };
            for (kernel, result) in [
                ("attention_forward_unfused", fwd),
                ("attention_backward_unfused", bwd),
            ] {
                rows.push(Row {
                    kernel: kernel.into(),
                    dtype: label,
                    shape: format!("B{b} T{t} H{nh} C{c}"),
                    result,
                    bound,
                });
            }
        }
    }
    rows
}

/// BK-Core runs its recurrences in f32 against an f64 reference; each G_ii carries the
/// rounding of O(1) contracting steps, and the gradient sums of z and the off-diagonals add
/// up to B x N terms, so the bound sits above the elementwise fp32 one.
const BOUND_BK: f64 = 1e-3;

/// BK-Core forward and backward (with learned z, and learned off-diagonals when `with_off`;
/// ones otherwise) against the f64 CPU reference on the same f32 inputs: v uniform within
/// `v_scale`, Im z between `z_im_min` and twice that.
fn check_bk_core(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: BkShape,
    with_off: bool,
    v_scale: f32,
    z_im_min: f32,
) -> (Check, Check) {
    use cpu::bk_core::{BkCoeffs, Cx};
    let BkShape { batch, n, .. } = s;
    let has_off = with_off && n > 1;
    let elems = batch * n;
    let v = inp.uniform(elems, v_scale, DType::F32);
    // At n = 1 there are no off-diagonals; one unused value keeps the buffers non-empty.
    let m = (n - 1).max(1);
    let b: Vec<f32> = inp.positive(m, 1.0).iter().map(|x| x + 0.5).collect();
    let c: Vec<f32> = inp.positive(m, 1.0).iter().map(|x| x + 0.5).collect();
    let z = [
        inp.uniform(1, 0.5, DType::F32)[0],
        z_im_min * (1.0 + inp.positive(1, 1.0)[0]),
    ];
    let d_out = inp.uniform(2 * elems, 1.0, DType::F32);
    let (dz0, db0, dc0) = (
        inp.uniform(2, 1.0, DType::F32),
        inp.uniform(m, 1.0, DType::F32),
        inp.uniform(m, 1.0, DType::F32),
    );
    let wide = |x: &[f32]| x.iter().map(|&y| y as f64).collect::<Vec<f64>>();
    let (v64, b64, c64) = (wide(&v), wide(&b), wide(&c));
    let offdiag = has_off.then_some((&b64[..n - 1], &c64[..n - 1]));
    let k = BkCoeffs {
        z: Cx::new(z[0] as f64, z[1] as f64),
        offdiag,
    };
    let mut out = vec![0.0f64; 2 * elems];
    cpu::bk_core::forward(&mut out, &v64, k, s);
    let mut dv = vec![0.0f64; elems];
    let g = cpu::bk_core::backward(&mut dv, &wide(&d_out), &v64, k, s);
    let narrow = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<f32>>();
    let fwd = || -> Check {
        let (d_v, d_z) = (gpu.upload(&v)?, gpu.upload(&z)?);
        let (d_b, d_c) = (gpu.upload(&b)?, gpu.upload(&c)?);
        let off = has_off.then_some((&d_b, &d_c));
        let mut d_out = poisoned::<f32>(gpu, 2 * elems)?;
        if !gpu.bk_core_forward(&mut d_out, &d_v, &d_z, off, s)? {
            return Ok(f64::INFINITY);
        }
        Ok(rel_err(
            &gpu.download(&d_out)?,
            &narrow(&out),
            ELEMENTWISE_FLOOR,
        ))
    };
    let bwd = || -> Check {
        let (d_v, d_z, d_g) = (gpu.upload(&v)?, gpu.upload(&z)?, gpu.upload(&d_out)?);
        let (d_b, d_c) = (gpu.upload(&b)?, gpu.upload(&c)?);
        let mut d_dv = poisoned::<f32>(gpu, elems)?;
        let mut d_dz = gpu.upload(&dz0)?;
        let (mut d_db, mut d_dc) = (gpu.upload(&db0)?, gpu.upload(&dc0)?);
        let (off, doff) = if has_off {
            (Some((&d_b, &d_c)), Some((&mut d_db, &mut d_dc)))
        } else {
            (None, None)
        };
        gpu.bk_core_backward(&mut d_dv, &d_g, &d_v, &d_z, off, s, Some(&mut d_dz), doff)?;
        let plus = |start: &[f32], add: Vec<f64>| -> Vec<f32> {
            start
                .iter()
                .zip(add)
                .map(|(&a, b)| (a as f64 + b) as f32)
                .collect()
        };
        let want_dz = plus(&dz0, vec![g.dz.0, g.dz.1]);
        // Untouched at n = 1 (g.dp is empty) or without off-diagonals (none are passed), so
        // the starting values come back.
        let dp = |i: usize, other: &[f64]| match g.dp.get(i) {
            Some(d) if has_off => d * other[i],
            _ => 0.0,
        };
        let want_db = plus(&db0, (0..m).map(|i| dp(i, &c64)).collect());
        let want_dc = plus(&dc0, (0..m).map(|i| dp(i, &b64)).collect());
        Ok(worst(&[
            rel_err(&gpu.download(&d_dv)?, &narrow(&dv), ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_dz)?, &want_dz, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_db)?, &want_db, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_dc)?, &want_dc, ELEMENTWISE_FLOOR),
        ]))
    };
    (fwd(), bwd())
}

/// A NaN in the potential must raise the forward's non-finite flag (0 = raised).
fn check_bk_core_flags_nan(gpu: &CudaBackend, inp: &mut Inputs) -> Check {
    let s = BkShape {
        batch: 2,
        n: 300,
        causal: false,
    };
    let mut v = inp.uniform(600, 1.0, DType::F32);
    v[417] = f32::NAN;
    let mut out = poisoned::<f32>(gpu, 1200)?;
    let finite = gpu.bk_core_forward(
        &mut out,
        &gpu.upload(&v)?,
        &gpu.upload(&[0.0f32, 1.0])?,
        None,
        s,
    )?;
    Ok(if finite { f64::INFINITY } else { 0.0 })
}

/// Asks the device for more memory than it has: the answer must be a typed out-of-memory
/// error, with the pool's books unchanged and the next allocation working.
fn out_of_memory_is_recoverable(
    pool: &std::sync::Arc<MemoryPool>,
) -> std::result::Result<String, String> {
    let total = pool.cuda().map_err(|e| e.to_string())?.info().total_memory;
    let before = pool.stats().current;
    let too_big = 2 * total / 4; // f32 elements: twice the device's bytes
    match crate::engine::Tensor::zeros(pool, &[too_big], DType::F32) {
        Err(crate::engine::EngineError::OutOfMemory { requested, .. }) => {
            if pool.stats().current != before {
                return Err("the refused allocation stayed on the books".into());
            }
            let small = crate::engine::Tensor::zeros(pool, &[1 << 20], DType::F32)
                .map_err(|e| format!("allocation after OOM failed: {e}"))?;
            drop(small);
            // Kernel scratch buffers come straight from the backend: the same typed error.
            let gpu = pool.cuda().map_err(|e| e.to_string())?;
            match gpu
                .alloc::<f32>(too_big)
                .map_err(crate::engine::EngineError::from)
            {
                Err(crate::engine::EngineError::OutOfMemory { .. }) => {}
                Err(e) => return Err(format!("a scratch allocation's OOM became: {e}")),
                Ok(_) => return Err("a scratch buffer of twice the device memory".into()),
            }
            Ok(format!(
                "asking for {:.1} GiB gave a typed error; the pool stayed usable",
                requested as f64 / (1u64 << 30) as f64
            ))
        }
        Err(e) => Err(format!("expected out-of-memory, got: {e}")),
        Ok(_) => Err("an allocation of twice the device memory succeeded".into()),
    }
}

/// A small GPT (6 blocks, d_model 128, 8 x 128 tokens) for the recomputation and
/// out-of-memory checks.
fn small_gpt(seed: u64, extra: &[&str]) -> Result<crate::config::Config> {
    let overrides: Vec<String> = [
        "model.d_model=128",
        "model.n_layers=6",
        "model.n_heads=4",
        "model.context=128",
        "train.seq_len=128",
        "train.micro_batch=8",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .chain([format!("train.seed={seed}")])
    .collect();
    Ok(ResolvedConfig::resolve(None, &overrides)?.config)
}

fn small_batches(seed: u64, steps: u64, rows: usize) -> Result<Vec<data::Batch>> {
    let corpus = data::Corpus::load(None)?;
    let tokens = data::Tokenizer::encode(&data::ByteTokenizer, &corpus.text[..200_000]);
    Ok((0..steps)
        .map(|step| data::train_batch(&tokens, seed, step, 0, rows, 128))
        .collect())
}

/// Recomputing blocks on the GPU: every gradient bit-identical to those from kept
/// activations, in fp32 and bf16-mixed (the GPU kernels are deterministic), and a lower peak.
fn recompute_is_exact(
    gpu: &std::sync::Arc<MemoryPool>,
    seed: u64,
) -> std::result::Result<String, String> {
    let run = || -> Result<String> {
        let batch = small_batches(seed, 1, 8)?;
        gpu.set_tf32(false);
        let mut peaks = Vec::new();
        for precision in [Precision::Fp32, Precision::Bf16Mixed] {
            let mut grads = Vec::new();
            for policy in ["none", "blocks"] {
                let cfg = small_gpt(seed, &[&format!("train.recompute={policy}")])?;
                let mut t = Trainer::new(&cfg, 256, gpu, precision)?;
                let before = gpu.stats().current;
                gpu.reset_peak();
                t.accumulate(&batch)?;
                peaks.push(gpu.stats().peak - before);
                let bits: Vec<Vec<u32>> = t
                    .model
                    .params()
                    .iter()
                    .map(|p| Ok(p.grad.to_vec()?.iter().map(|g| g.to_bits()).collect()))
                    .collect::<Result<_>>()?;
                grads.push(bits);
            }
            if grads[0] != grads[1] {
                return Err(KilnError::SelfTest(format!(
                    "{precision}: gradients with recomputation differ from kept activations"
                )));
            }
        }
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        Ok(format!(
            "gradients bit-identical in fp32 and bf16-mixed; activation peak {:.1} -> {:.1} MiB (fp32), {:.1} -> {:.1} MiB (bf16-mixed)",
            mib(peaks[0]),
            mib(peaks[1]),
            mib(peaks[2]),
            mib(peaks[3])
        ))
    };
    run().map_err(|e| e.to_string())
}

/// A pool cap between the peaks of 4 and 8 sequences per pass: the GPU run splits to 4 in its
/// first step, frees everything each step, and its losses follow an uncapped run's.
fn out_of_memory_splits(
    gpu: &std::sync::Arc<MemoryPool>,
    seed: u64,
) -> std::result::Result<String, String> {
    let run = || -> Result<String> {
        gpu.set_tf32(false);
        let cfg = small_gpt(seed, &[])?;
        let batches = small_batches(seed, 3, 8)?;
        let peak = |rows: usize| -> Result<usize> {
            let mut t = Trainer::new(&cfg, 256, gpu, Precision::Fp32)?;
            gpu.reset_peak();
            t.step(&small_batches(seed, 1, rows)?)?;
            Ok(gpu.stats().peak)
        };
        let (peak8, peak4) = (peak(8)?, peak(4)?);
        let losses = |cap: usize| -> Result<(Vec<f64>, Option<usize>)> {
            let mut t = Trainer::new(&cfg, 256, gpu, Precision::Fp32)?;
            let resident = gpu.stats().current;
            gpu.set_limit(cap);
            let mut out = Vec::new();
            for b in &batches {
                let step = t.step(std::slice::from_ref(b));
                if gpu.stats().current != resident {
                    gpu.set_limit(0);
                    return Err(KilnError::SelfTest("a step left memory booked".into()));
                }
                out.push(step?.loss);
            }
            gpu.set_limit(0);
            Ok((out, t.passes.learned()))
        };
        let (plain, _) = losses(0)?;
        let (capped, learned) = losses((peak4 + peak8) / 2)?;
        if learned != Some(4) {
            return Err(KilnError::SelfTest(format!(
                "a cap between the peaks of 4 ({peak4} B) and 8 ({peak8} B) sequences left {learned:?} per pass, want 4"
            )));
        }
        let worst = plain
            .iter()
            .zip(&capped)
            .map(|(a, b)| (a - b).abs() / a.abs())
            .fold(0.0f64, f64::max);
        if worst > 1e-5 {
            return Err(KilnError::SelfTest(format!(
                "losses after the split differ by {worst:.1e} relative: {plain:?} vs {capped:?}"
            )));
        }
        Ok(format!(
            "split 8 -> 4 sequences per pass under a cap of {:.1} MiB; 3 losses within {worst:.1e} of the uncapped run",
            ((peak4 + peak8) / 2) as f64 / (1u64 << 20) as f64
        ))
    };
    run().map_err(|e| e.to_string())
}

/// A tiny GPT in fp16-mixed with a loss scale of 2^40: its fp16 output gradient overflows, so
/// the first step must be skipped (no update, no schedule step) and the scale halved.
fn fp16_scaler_backs_off(
    gpu: &std::sync::Arc<MemoryPool>,
    seed: u64,
) -> std::result::Result<String, String> {
    let overrides: Vec<String> = [
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.context=64",
        "train.seq_len=64",
        "train.micro_batch=8",
        "train.steps=20",
        "train.loss_scale_init=1099511627776",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("train.seed={seed}")])
    .collect();
    let run = || -> Result<String> {
        let cfg = ResolvedConfig::resolve(None, &overrides)?.config;
        let corpus = data::Corpus::load(None)?;
        let tokens = data::Tokenizer::encode(&data::ByteTokenizer, &corpus.text[..100_000]);
        gpu.set_tf32(false);
        let mut t = Trainer::new(&cfg, 256, gpu, Precision::Fp16Mixed)?;
        let before = t.model.params()[0].value.to_vec()?;
        let first = t.step(&[data::train_batch(&tokens, seed, 0, 0, 8, 64)])?;
        let unchanged = t.model.params()[0].value.to_vec()? == before;
        let (scale, step) = (t.loss_scale(), t.state.step);
        if !first.skipped || step != 0 || !unchanged || scale != 549_755_813_888.0 {
            return Err(KilnError::SelfTest(format!(
                "first step at scale 2^40: skipped {}, schedule step {step}, weights unchanged {unchanged}, scale now {scale:e} (want skipped, 0, unchanged, 2^39)",
                first.skipped
            )));
        }
        let mut skipped = 1;
        for i in 1..60u64 {
            if t.step(&[data::train_batch(&tokens, seed, i, 0, 8, 64)])?
                .skipped
            {
                skipped += 1;
            }
            if t.state.step >= 5 {
                break;
            }
        }
        if t.state.step < 5 {
            return Err(KilnError::SelfTest(format!(
                "training did not resume: {skipped} steps skipped, scale {:e}",
                t.loss_scale()
            )));
        }
        Ok(format!(
            "scale 2^40 overflowed: step skipped, weights kept, scale halved; resumed after {skipped} skipped steps at scale 2^{}",
            t.loss_scale().log2()
        ))
    };
    run().map_err(|e| e.to_string())
}

/// Trains a tiny model (a GPT, or the kind `kind` overrides name) for 50 steps from one seed
/// on the same batches on the CPU (fp32) and on the GPU (`precision`); returns both losses at
/// every step.
fn training_parity(
    gpu: &std::sync::Arc<MemoryPool>,
    kind: &[&str],
    precision: &str,
    seed: u64,
) -> Result<Vec<(f64, f64)>> {
    let overrides: Vec<String> = [
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.context=64",
        "train.seq_len=64",
        "train.micro_batch=8",
        "train.steps=50",
        // A gentle schedule: at lr 3e-3 this tiny model has a loss spike near step 30 where
        // any rounding difference is amplified for a few steps, which says nothing about the
        // kernels.
        "optim.lr=1e-3",
        "optim.warmup_steps=10",
    ]
    .iter()
    .chain(kind)
    .map(|s| s.to_string())
    .chain([format!("train.seed={seed}")])
    .collect();
    let cfg = ResolvedConfig::resolve(None, &overrides)?.config;
    let corpus = data::Corpus::load(None)?;
    let tokens = data::Tokenizer::encode(&data::ByteTokenizer, &corpus.text[..1_000_000]);
    let gpu_precision = Precision::parse(precision)?;
    gpu.set_tf32(gpu_precision == Precision::Tf32);
    let cpu = MemoryPool::new(Device::Cpu);
    let mut on_cpu = Trainer::new(&cfg, 256, &cpu, Precision::Fp32)?;
    let mut on_gpu = Trainer::new(&cfg, 256, gpu, gpu_precision)?;
    let mut diffs = Vec::with_capacity(50);
    for step in 0..50u64 {
        let batch = [data::train_batch(&tokens, seed, step, 0, 8, 64)];
        let a = on_cpu.step(&batch)?.loss;
        let b = on_gpu.step(&batch)?.loss;
        diffs.push((a, b));
    }
    Ok(diffs)
}

/// A tiny GPT trained 3 steps on the GPU twice from one seed, with the optimizer on the device
/// and offloaded to the host. Checks that the device books of the offloaded one are lower by
/// the moments, and the masters under mixed precision (under fp32 the master's place is taken
/// by the f32 compute copy); that the parameter updates agree within `bound` of the largest
/// update (the host AdamW pass against the GPU kernel; they differ in fused multiply-adds);
/// and that every compute copy on the GPU is exactly its host master rounded, which shows
/// each uploaded chunk landed where it belongs.
fn offload_parity(
    gpu: &std::sync::Arc<MemoryPool>,
    precision: &str,
    seed: u64,
    bound: f64,
) -> std::result::Result<String, String> {
    let overrides = |offload: bool| -> Vec<String> {
        [
            "model.d_model=64",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.context=64",
            "train.seq_len=64",
            "train.micro_batch=8",
            "train.steps=3",
            "optim.warmup_steps=0",
            "optim.grad_clip=0.5",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([
            format!("train.seed={seed}"),
            format!("train.offload_optimizer={offload}"),
        ])
        .collect()
    };
    let run = || -> Result<String> {
        let precision = Precision::parse(precision)?;
        gpu.set_tf32(false);
        let corpus = data::Corpus::load(None)?;
        let tokens = data::Tokenizer::encode(&data::ByteTokenizer, &corpus.text[..100_000]);
        let mut built = Vec::new();
        for offload in [false, true] {
            let cfg = ResolvedConfig::resolve(None, &overrides(offload))?.config;
            let before = gpu.stats().current;
            let t = Trainer::new(&cfg, 256, gpu, precision)?;
            built.push((gpu.stats().current - before, t));
        }
        let (offloaded_bytes, mut offloaded) = built.pop().expect("two trainers");
        let (in_place_bytes, mut in_place) = built.pop().expect("two trainers");
        let n: usize = in_place.model.params().iter().map(|p| p.value.len()).sum();
        let saving = if precision.compute_dtype().is_some() {
            12 * n
        } else {
            8 * n
        };
        if in_place_bytes.checked_sub(offloaded_bytes) != Some(saving) {
            return Err(KilnError::SelfTest(format!(
                "device books: {in_place_bytes} bytes in place, {offloaded_bytes} offloaded; want a difference of {saving} ({n} parameters)"
            )));
        }
        let start: Vec<Vec<f32>> = in_place
            .model
            .params()
            .iter()
            .map(|p| p.value.to_vec())
            .collect::<std::result::Result<_, _>>()?;
        for step in 0..3u64 {
            let batch = [data::train_batch(&tokens, seed, step, 0, 8, 64)];
            in_place.step(&batch)?;
            offloaded.step(&batch)?;
        }
        gpu.cuda()?
            .synchronize()
            .map_err(crate::engine::EngineError::from)?;
        let (mut worst_diff, mut largest) = (0.0f64, 0.0f64);
        for ((a, b), w0) in in_place
            .model
            .params()
            .iter()
            .zip(offloaded.model.params())
            .zip(&start)
        {
            let (wa, wb) = (a.value.to_vec()?, b.value.to_vec()?);
            let noise = key_bias(&b.name, wa.len());
            for (i, ((&x, &y), &w)) in wa.iter().zip(&wb).zip(w0).enumerate() {
                let (ua, ub) = ((x - w) as f64, (y - w) as f64);
                if noise.contains(&i) {
                    // Still finite, or the run is broken.
                    if !(ua.is_finite() && ub.is_finite()) {
                        worst_diff = f64::INFINITY;
                    }
                    continue;
                }
                // f64::max drops NaN; a non-finite update must fail instead.
                let diff = (ua - ub).abs();
                worst_diff = if diff.is_finite() {
                    worst_diff.max(diff)
                } else {
                    f64::INFINITY
                };
                largest = largest.max(ua.abs());
            }
            let dtype = precision.compute_dtype().unwrap_or(DType::F32);
            let compute = b.weight().to_vec()?;
            if compute
                .iter()
                .zip(&wb)
                .any(|(&c, &m)| c.to_bits() != dtype.round(m).to_bits())
            {
                return Err(KilnError::SelfTest(format!(
                    "{}: the GPU compute copy is not the host master rounded to {dtype:?}",
                    b.name
                )));
            }
        }
        let err = worst_diff / largest.max(f64::MIN_POSITIVE);
        if err > bound {
            return Err(KilnError::SelfTest(format!(
                "3 steps: updates differ by {err:.2e} of the largest update (bound {bound:.0e})"
            )));
        }
        Ok(format!(
            "3 steps: updates agree within {err:.2e} of the largest (bound {bound:.0e}); compute copies exact; device books {:.2} MiB lower ({n} parameters); host {:.2} MiB page-locked",
            saving as f64 / (1u64 << 20) as f64,
            offloaded.opt.host_memory().map_or(0, |h| h.current) as f64 / (1u64 << 20) as f64
        ))
    };
    run().map_err(|e| e.to_string())
}

/// The elements of parameter `name` (of `len` elements) that are GPT's key bias: softmax is
/// the same for every shift of a row's scores, so its true gradient is exactly zero and what
/// its gradient holds is rounding noise, of either sign. AdamW normalises each element's
/// update, so that noise becomes an update as large as any, and the last-bit difference
/// between the host's and the GPU's AdamW (which, under bf16-mixed, can flip the rounding of a
/// compute copy and so every later gradient's last bits) turns its sign: 1.27e-2 of the
/// largest update after 3 bf16-mixed steps on an H200 with them, 2.98e-4 without
/// (2026-11-27). The offload check leaves these elements out.
fn key_bias(name: &str, len: usize) -> std::ops::Range<usize> {
    if name.ends_with("attn.qkv.bias") {
        len / 3..2 * len / 3
    } else {
        0..0
    }
}

/// Flash-style attention (log-sum-exp saved, no T x T matrix) against the CPU kernel, which
/// stores the probabilities: forward output, then the whole dqkv; within a sliding `window`
/// (0: none); `math` picks f32's products (16-bit activations ignore it).
fn check_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let (b, t, c) = (s.batch, s.seq, s.channels);
    let qkv = inp.uniform(b * t * 3 * c, 2.0, T::DTYPE);
    let dout = inp.uniform(b * t * c, 1.0, T::DTYPE);
    compare_attention::<T>(gpu, &qkv, &dout, s, window, math)
}

/// The GPU's attention forward and backward on `qkv` and `dout` against the CPU kernel's:
/// the output's error, then dqkv's.
///
/// Under tf32 the inputs are first rounded to tf32, as the 16-bit checks draw inputs their
/// type holds: the check measures the kernels' own roundings (P, dS, the row term), not the
/// policy's rounding of every f32 operand, which the tf32 GEMMs make too. That one is large in
/// the backward: dS = P (dP - d) subtracts nearly equal terms, and dP = dO V^T carries dO's and
/// V's rounding, 1e-2 to 3e-2 of each head's largest gradient against the exact f32
/// reference (measured on an H100).
fn compare_attention<T: Elem>(
    gpu: &CudaBackend,
    qkv: &[f32],
    dout: &[f32],
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let rounded: [Vec<f32>; 2];
    let (qkv, dout) = if T::DTYPE == DType::F32 && math == GemmMath::Tf32 {
        rounded = [qkv, dout].map(|x| x.iter().map(|&v| round_tf32(v)).collect());
        (&rounded[0][..], &rounded[1][..])
    } else {
        (qkv, dout)
    };
    let (b, t, nh, c) = (s.batch, s.seq, s.heads, s.channels);
    let mut out = vec![0.0; b * t * c];
    let mut probs = vec![0.0; b * nh * t * t];
    cpu::attention::windowed_attention_forward(&mut out, &mut probs, qkv, s, window);
    let (o, g) = match gpu_attention::<T>(gpu, qkv, dout, s, window, math) {
        Ok((o, _, g)) => (o, g),
        Err(e) => return (Err(e.clone()), Err(e)),
    };
    let mut dqkv = vec![0.0; qkv.len()];
    if !gpu.attention_uses_tensor_cores(s.head_size()) {
        // The CUDA-core kernels keep P, dS and the row term d in f32: elementwise.
        cpu::attention::windowed_attention_backward(&mut dqkv, dout, qkv, &probs, s, window);
        (
            Ok(rel_err(&o, &out, ELEMENTWISE_FLOOR)),
            Ok(rel_err(&g, &dqkv, ELEMENTWISE_FLOOR)),
        )
    } else {
        // The tensor cores take d_i = dO_i . O_i from the stored output, as FlashAttention
        // does (exact math on the output as stored); the reference uses the same d, from the
        // output the GPU stored.
        let d = row_term(dout, &o, s);
        cpu::attention::attention_backward_given_row_term(
            &mut dqkv, dout, qkv, &probs, &d, s, window,
        );
        (
            Ok(rel_err_per_head(&o, &out, s.head_size())),
            Ok(rel_err_per_head(&g, &dqkv, s.head_size())),
        )
    }
}

/// The bound of f32 attention at `head_size`: three tf32 products on the tensor cores, or f32
/// arithmetic on the CUDA cores.
fn f32_attention_bound(gpu: &CudaBackend, head_size: usize) -> f64 {
    if gpu.attention_uses_tensor_cores(head_size) {
        BOUND_3XTF32_ATTENTION
    } else {
        BOUND_FP32
    }
}

/// `x` rounded to tf32's 10 mantissa bits (to nearest, ties away from zero, as `cvt.rna`).
fn round_tf32(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    f32::from_bits((x.to_bits() + 0x1000) & !0x1fff)
}

/// `d_i = dO_i . O_i` per batch, head and row (`[B, NH, T]`), summed in f64.
fn row_term(dout: &[f32], out: &[f32], s: AttnShape) -> Vec<f32> {
    let (t, c, hs) = (s.seq, s.channels, s.head_size());
    let mut d = vec![0.0f32; s.batch * s.heads * t];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let at = (b * t + i) * c + h * hs;
                let dot: f64 = dout[at..at + hs]
                    .iter()
                    .zip(&out[at..at + hs])
                    .map(|(&g, &o)| g as f64 * o as f64)
                    .sum();
                d[(b * s.heads + h) * t + i] = dot as f32;
            }
        }
    }
    d
}

/// Attention on the layout grouped-query heads reach the kernels in: `kv_heads` key/value
/// heads, each repeated over its `heads / kv_heads` query heads (as rope_expand packs them),
/// so that groups of heads share their keys and values; against the CPU kernel as in
/// [`check_attention`].
fn check_attention_grouped<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    kv_heads: usize,
    window: usize,
    math: GemmMath,
) -> (Check, Check) {
    let (c, d, group) = (s.channels, s.head_size(), s.heads / kv_heads);
    let mut qkv = inp.uniform(s.batch * s.seq * 3 * c, 2.0, T::DTYPE);
    for row in qkv.chunks_mut(3 * c) {
        for head in 0..s.heads {
            // The group's first head holds its key and value.
            let first = head / group * group;
            if first != head {
                for part in [c, 2 * c] {
                    row.copy_within(part + first * d..part + (first + 1) * d, part + head * d);
                }
            }
        }
    }
    let dout = inp.uniform(s.batch * s.seq * c, 1.0, T::DTYPE);
    compare_attention::<T>(gpu, &qkv, &dout, s, window, math)
}

/// The largest score gradient `|dS_ij| = |P_ij (dP_ij - d_i)|` of causal attention, with
/// `dP_ij = dO_i . V_j` and `d_i = sum_j P_ij dP_ij`, from the CPU forward's probabilities.
fn largest_score_gradient(probs: &[f32], qkv: &[f32], dout: &[f32], s: AttnShape) -> f32 {
    let (t, c, d) = (s.seq, s.channels, s.head_size());
    let mut largest = 0.0f32;
    let mut dp = vec![0.0f32; t];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                let g = &dout[(b * t + i) * c + h * d..][..d];
                let p = &probs[((b * s.heads + h) * t + i) * t..][..t];
                for (j, x) in dp.iter_mut().enumerate().take(i + 1) {
                    let v = &qkv[(b * t + j) * 3 * c + 2 * c + h * d..][..d];
                    *x = g.iter().zip(v).map(|(a, b)| a * b).sum();
                }
                let row_d: f32 = (0..=i).map(|j| p[j] * dp[j]).sum();
                for j in 0..=i {
                    largest = largest.max((p[j] * (dp[j] - row_d)).abs());
                }
            }
        }
    }
    largest
}

/// f16's largest finite value.
const F16_MAX: f32 = 65504.0;

/// The backward with score gradients past f16's range: dO scaled (as fp16-mixed's loss
/// scale scales it) so that the largest |dS| lands above f16's largest value, near 2^17,
/// while every element of dQ, dK and dV stays under 90% of it. Q and K in [-1, 1] and V in
/// [-8, 8] make dS = P (dO . V - d) large beside dQ and dK (which scale with K and Q). The
/// tensor-core kernels scale dS per row before rounding it to f16 (unscaled it would become
/// inf); the error is dqkv's against the CPU kernel, whose f32 has the range.
fn check_attention_large_ds<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, s: AttnShape) -> Check {
    let (b, t, nh, c) = (s.batch, s.seq, s.heads, s.channels);
    let mut qkv = inp.uniform(b * t * 3 * c, 1.0, T::DTYPE);
    for row in qkv.chunks_mut(3 * c) {
        row[2 * c..].iter_mut().for_each(|v| *v *= 8.0);
    }
    let unit_dout = inp.uniform(b * t * c, 1.0, T::DTYPE);
    let mut out = vec![0.0; b * t * c];
    let mut probs = vec![0.0; b * nh * t * t];
    cpu::attention::windowed_attention_forward(&mut out, &mut probs, &qkv, s, 0);
    let backward = |dout: &[f32]| {
        let mut dqkv = vec![0.0; qkv.len()];
        cpu::attention::windowed_attention_backward(&mut dqkv, dout, &qkv, &probs, s, 0);
        let largest = dqkv.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        (dqkv, largest)
    };
    // The backward is linear in dO: the scale that puts either limit where it should be.
    let (_, unit_grad) = backward(&unit_dout);
    let unit_ds = largest_score_gradient(&probs, &qkv, &unit_dout, s);
    let scale = (0.9 * F16_MAX / unit_grad).min((1u32 << 17) as f32 / unit_ds);
    let dout: Vec<f32> = unit_dout
        .iter()
        .map(|x| T::DTYPE.round(x * scale))
        .collect();
    let (_, largest_grad) = backward(&dout);
    let largest_ds = largest_score_gradient(&probs, &qkv, &dout, s);
    if largest_ds <= F16_MAX || largest_grad >= 0.95 * F16_MAX {
        return Err(CudaError::Shape {
            op: "attention",
            detail: format!(
                "these inputs cannot take |dS| past f16's range with dqkv inside it (largest \
                 |dS| {largest_ds:.0}, |dqkv| {largest_grad:.0})"
            ),
        });
    }
    let (o, _, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    // As in `compare_attention`: the reference takes the kernels' row term, from the output
    // the GPU stored, and each head's vector is measured against its largest element.
    let mut dqkv = vec![0.0; qkv.len()];
    let d = row_term(&dout, &o, s);
    cpu::attention::attention_backward_given_row_term(&mut dqkv, &dout, &qkv, &probs, &d, s, 0);
    Ok(rel_err_per_head(&g, &dqkv, s.head_size()))
}

/// The attention output, log-sum-exp and dqkv a GPU computed.
type AttentionResults = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The GPU's attention forward (output and log-sum-exp) and backward on fresh buffers.
fn gpu_attention<T: Elem>(
    gpu: &CudaBackend,
    qkv: &[f32],
    dout: &[f32],
    s: AttnShape,
    window: usize,
    math: GemmMath,
) -> std::result::Result<AttentionResults, CudaError> {
    let d_qkv = gpu.upload_as::<T>(qkv)?;
    let mut d_out = poisoned::<T>(gpu, dout.len())?;
    let mut d_lse = poisoned::<f32>(gpu, s.batch * s.heads * s.seq)?;
    gpu.windowed_attention_forward(&mut d_out, &mut d_lse, &d_qkv, s, window, math)?;
    let mut d_dqkv = poisoned::<T>(gpu, qkv.len())?;
    let d_dout = gpu.upload_as::<T>(dout)?;
    gpu.windowed_attention_backward(
        &mut d_dqkv,
        &d_dout,
        &d_qkv,
        &d_out,
        &d_lse,
        s,
        window,
        math,
    )?;
    Ok((
        gpu.download_f32(&d_out)?,
        gpu.download_f32(&d_lse)?,
        gpu.download_f32(&d_dqkv)?,
    ))
}

/// A window at least as long as the sequence against none on the GPU: the output, the
/// log-sum-exp and dqkv must agree bit for bit (the largest difference, bound 0).
fn check_attention_full_window<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    math: GemmMath,
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, T::DTYPE);
    let (o, l, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, math)?;
    let (wo, wl, wg) = gpu_attention::<T>(gpu, &qkv, &dout, s, s.seq, math)?;
    Ok(bits_differ(&o, &wo)
        .max(bits_differ(&l, &wl))
        .max(bits_differ(&g, &wg)))
}

/// The same attention forward and backward twice: 0 when every output bit agrees.
fn check_attention_repeatable<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, s: AttnShape) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, T::DTYPE);
    let (o, l, g) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    let (ro, rl, rg) = gpu_attention::<T>(gpu, &qkv, &dout, s, 0, GemmMath::Fp32)?;
    Ok(bits_differ(&o, &ro)
        .max(bits_differ(&l, &rl))
        .max(bits_differ(&g, &rg)))
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

/// Bidirectional attention with a key padding mask against the CPU kernel; every row of
/// the output is compared, padded query rows included.
fn check_masked_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, T::DTYPE);
    let mut out = vec![0.0; s.batch * s.seq * s.channels];
    cpu::attention_masked::masked_attention_forward(&mut out, &qkv, lens, s);
    let d_lens = gpu.upload(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.masked_attention_forward(&mut d_out, &gpu.upload_as::<T>(&qkv)?, &d_lens, s)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

/// The encoder's training softmax over `[B, H, T, T]` with its key padding mask.
fn check_padded_softmax<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let n = s.batch * s.heads * s.seq * s.seq;
    let scores = inp.uniform(n, 4.0, T::DTYPE);
    let mut probs = vec![0.0; n];
    cpu::attention_masked::padded_softmax(&mut probs, &scores, lens, s.heads, s.seq);
    let d_lens = gpu.upload(&lens.iter().map(|&l| l as i32).collect::<Vec<_>>())?;
    let mut d_probs = poisoned::<T>(gpu, n)?;
    gpu.padded_softmax(&mut d_probs, &gpu.upload_as::<T>(&scores)?, &d_lens, s)?;
    Ok(rel_err(
        &gpu.download_f32(&d_probs)?,
        &probs,
        ELEMENTWISE_FLOOR,
    ))
}

/// The whole-row softmax backward, on probabilities with padded keys zeroed as the forward
/// leaves them.
fn check_softmax_backward_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: AttnShape,
    lens: &[u32],
) -> Check {
    let n = s.batch * s.heads * s.seq * s.seq;
    let scores = inp.uniform(n, 4.0, T::DTYPE);
    let mut probs = vec![0.0; n];
    cpu::attention_masked::padded_softmax(&mut probs, &scores, lens, s.heads, s.seq);
    let probs: Vec<f32> = probs.iter().map(|&p| T::DTYPE.round(p)).collect();
    let dprobs = inp.uniform(n, 1.0, T::DTYPE);
    let mut dscores = vec![0.0; n];
    cpu::attention_masked::softmax_backward(&mut dscores, &probs, &dprobs, s.seq);
    let mut d_ds = poisoned::<T>(gpu, n)?;
    gpu.softmax_backward_rows(
        &mut d_ds,
        &gpu.upload_as::<T>(&probs)?,
        &gpu.upload_as::<T>(&dprobs)?,
        s.batch * s.heads * s.seq,
        s.seq,
    )?;
    Ok(rel_err(
        &gpu.download_f32(&d_ds)?,
        &dscores,
        ELEMENTWISE_FLOOR,
    ))
}

/// Layernorm and residual layernorm with `eps`, on rows whose spread (1e-3) makes the
/// epsilon matter.
fn check_layernorm_eps<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 1e-3, d), inp.uniform(n * c, 1e-3, d));
    let (g, b) = (inp.uniform(c, 1.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward_eps(&mut out, &mut mean, &mut rstd, &x, &g, &b, c, eps);
    // As in check_residual_layernorm: in bf16 and f16 the GPU normalises the stored sum.
    let sum: Vec<f32> = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
    let (mut r_out, mut r_mean, mut r_rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward_eps(
        &mut r_out,
        &mut r_mean,
        &mut r_rstd,
        &sum,
        &g,
        &b,
        c,
        eps,
    );
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let (d_g, d_b) = (gpu.upload_as::<T>(&g)?, gpu.upload_as::<T>(&b)?);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    gpu.layernorm_forward_eps(
        &mut d_out,
        &mut d_mean,
        &mut d_rstd,
        &d_x,
        &d_g,
        &d_b,
        n,
        c,
        eps,
    )?;
    let (mut d_sum, mut d_rout) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let (mut d_rmean, mut d_rrstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    gpu.residual_layernorm_forward_eps(
        &mut d_sum,
        &mut d_rout,
        &mut d_rmean,
        &mut d_rrstd,
        &d_x,
        &d_delta,
        &d_g,
        &d_b,
        n,
        c,
        eps,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_rout)?, &r_out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rrstd)?, &r_rstd, ELEMENTWISE_FLOOR),
    ]))
}

fn check_gelu_erf_forward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let x = inp.uniform(n, 6.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::gelu_erf::gelu_erf_forward(&mut out, &x);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.gelu_erf_forward(&mut d_out, &gpu.upload_as::<T>(&x)?, n)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

fn check_gelu_erf_backward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let (x, dout) = (inp.uniform(n, 6.0, T::DTYPE), inp.uniform(n, 1.0, T::DTYPE));
    let mut dx = vec![0.0; n];
    cpu::gelu_erf::gelu_erf_backward(&mut dx, &x, &dout);
    let mut d_dx = poisoned::<T>(gpu, n)?;
    gpu.gelu_erf_backward(
        &mut d_dx,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&dout)?,
        n,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR))
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

fn check_layernorm_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g, b) = (
        inp.uniform(n * c, 2.0, d),
        inp.uniform(c, 1.0, d),
        inp.uniform(c, 1.0, d),
    );
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &g, &b, c);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    let (d_x, d_g, d_b) = (
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
        gpu.upload_as::<T>(&b)?,
    );
    gpu.layernorm_forward(&mut d_out, &mut d_mean, &mut d_rstd, &d_x, &d_g, &d_b, n, c)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_mean)?, &mean, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

fn check_residual_layernorm<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 2.0, d), inp.uniform(n * c, 2.0, d));
    let (g, b) = (inp.uniform(c, 1.0, d), inp.uniform(c, 1.0, d));
    // The reference: the fused CPU kernel in f32; in bf16 the GPU stores the sum rounded and
    // normalises the stored value, so the reference does the same.
    let (mut sum, mut out) = (vec![0.0; n * c], vec![0.0; n * c]);
    let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
    if d == DType::F32 {
        cpu::layernorm::residual_layernorm_forward(
            &mut sum, &mut out, &mut mean, &mut rstd, &x, &delta, &g, &b, c,
        );
    } else {
        sum = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
        cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &sum, &g, &b, c);
    }
    let (mut d_sum, mut d_out) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let (mut d_mean, mut d_rstd) = (poisoned::<f32>(gpu, n)?, poisoned::<f32>(gpu, n)?);
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let (d_g, d_b) = (gpu.upload_as::<T>(&g)?, gpu.upload_as::<T>(&b)?);
    gpu.residual_layernorm_forward(
        &mut d_sum,
        &mut d_out,
        &mut d_mean,
        &mut d_rstd,
        &d_x,
        &d_delta,
        &d_g,
        &d_b,
        n,
        c,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_mean)?, &mean, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

fn check_layernorm_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g, b) = (
        inp.uniform(n * c, 2.0, d),
        inp.uniform(c, 1.0, d),
        inp.uniform(c, 1.0, d),
    );
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    cpu::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &g, &b, c);
    let dout = inp.uniform(n * c, 1.0, d);
    // All three gradients accumulate: start them from random values, not zeros.
    let (dinp0, dg0, db0) = (
        inp.uniform(n * c, 1.0, d),
        inp.uniform(c, 1.0, DType::F32),
        inp.uniform(c, 1.0, DType::F32),
    );
    let (mut dinp, mut dg, mut db) = (dinp0.clone(), dg0.clone(), db0.clone());
    cpu::layernorm::layernorm_backward(&mut dinp, &mut dg, &mut db, &dout, &x, &g, &mean, &rstd, c);
    let mut d_dinp = gpu.upload_as::<T>(&dinp0)?;
    let (mut d_dg, mut d_db) = (gpu.upload(&dg0)?, gpu.upload(&db0)?);
    let (d_dout, d_x, d_g) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
    );
    let (d_mean, d_rstd) = (gpu.upload(&mean)?, gpu.upload(&rstd)?);
    gpu.layernorm_backward(
        &mut d_dinp,
        &mut d_dg,
        &mut d_db,
        &d_dout,
        &d_x,
        &d_g,
        &d_mean,
        &d_rstd,
        n,
        c,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dinp)?, &dinp, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dg)?, &dg, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_db)?, &db, ELEMENTWISE_FLOOR),
    ]))
}

/// Dropout: the GPU drops exactly the elements the CPU drops (a mismatched mask would leave a
/// whole value's error, far past the bound) and scales the rest alike.
fn check_dropout<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let x = inp.uniform(n, 2.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::dropout::dropout(&mut out, &x, 0.1, 0x5EED);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.dropout(&mut d_out, &gpu.upload_as::<T>(&x)?, n, 0.1, 0x5EED)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

fn check_gelu_forward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let x = inp.uniform(n, 6.0, T::DTYPE);
    let mut out = vec![0.0; n];
    cpu::gelu::gelu_forward(&mut out, &x);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.gelu_forward(&mut d_out, &gpu.upload_as::<T>(&x)?, n)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

fn check_gelu_backward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let (x, dout) = (inp.uniform(n, 6.0, T::DTYPE), inp.uniform(n, 1.0, T::DTYPE));
    let mut dx = vec![0.0; n];
    cpu::gelu::gelu_backward(&mut dx, &x, &dout);
    let mut d_dx = poisoned::<T>(gpu, n)?;
    gpu.gelu_backward(
        &mut d_dx,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&dout)?,
        n,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR))
}

fn logits_and_targets(
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
    d: DType,
) -> (Vec<f32>, Vec<u32>) {
    let logits = inp.uniform(n * v, 4.0, d);
    // Every fifth row is not trained (a prompt token of fine-tuning data): zero loss and
    // gradient.
    let targets = (0..n)
        .map(|r| {
            let t = inp.0.below(valid as u64) as u32;
            if r % 5 == 3 {
                crate::engine::ops::IGNORE_TARGET
            } else {
                t
            }
        })
        .collect();
    (logits, targets)
}

fn check_cross_entropy_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let mut losses = vec![0.0; n];
    cpu::cross_entropy::cross_entropy_forward(&mut losses, &logits, &targets, v, valid);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let (d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_forward(
        &mut d_losses,
        &d_logits,
        &d_targets,
        LogitRows { n, v, valid },
    )?;
    Ok(rel_err(
        &gpu.download(&d_losses)?,
        &losses,
        ELEMENTWISE_FLOOR,
    ))
}

fn check_cross_entropy_fused<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let grad_scale = 1.0 / n as f32;
    let (mut losses, mut grad) = (vec![0.0; n], logits.clone());
    cpu::cross_entropy::cross_entropy_fused(&mut losses, &mut grad, &targets, v, valid, grad_scale);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let (mut d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_fused(
        &mut d_losses,
        &mut d_logits,
        &d_targets,
        LogitRows { n, v, valid },
        grad_scale,
    )?;
    // The gradient is checked row by row: each row's entries against that row's largest, so
    // the tiny probabilities of a 50k vocabulary are held to account.
    let got = gpu.download_f32(&d_logits)?;
    let grad_err = got
        .chunks(v)
        .zip(grad.chunks(v))
        .map(|(g, w)| rel_err(g, w, ELEMENTWISE_FLOOR))
        .collect::<Vec<_>>();
    Ok(worst(&[
        rel_err(&gpu.download(&d_losses)?, &losses, ELEMENTWISE_FLOOR),
        worst(&grad_err),
    ]))
}

/// The three unfused kernels against their CPU references: the log-probabilities (minus
/// infinity in the padding, which must match exactly), the losses, and the gradient row by row.
fn check_cross_entropy_unfused<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    v: usize,
    valid: usize,
) -> Check {
    use cpu::cross_entropy as ce;
    let (logits, targets) = logits_and_targets(inp, n, v, valid, T::DTYPE);
    let grad_scale = 1.0 / n as f32;
    let (mut logp, mut losses, mut grad) = (vec![0.0; n * v], vec![0.0; n], vec![0.0; n * v]);
    ce::log_softmax(&mut logp, &logits, v, valid);
    ce::nll_loss(&mut losses, &logp, &targets, v);
    ce::log_softmax_nll_backward(&mut grad, &logp, &targets, v, valid, grad_scale);
    let mut d_losses = poisoned::<f32>(gpu, n)?;
    let mut d_logp = poisoned::<f32>(gpu, n * v)?;
    let mut d_grad = poisoned::<T>(gpu, n * v)?;
    let (d_logits, d_targets) = (gpu.upload_as::<T>(&logits)?, gpu.upload(&targets)?);
    gpu.cross_entropy_unfused(
        &mut d_losses,
        &mut d_logp,
        &mut d_grad,
        &d_logits,
        &d_targets,
        LogitRows { n, v, valid },
        grad_scale,
    )?;
    let got_logp = gpu.download(&d_logp)?;
    let got_grad = gpu.download_f32(&d_grad)?;
    let rows = |got: &[f32], want: &[f32]| {
        worst(
            &got.chunks(v)
                .zip(want.chunks(v))
                .map(|(g, w)| rel_err(g, w, ELEMENTWISE_FLOOR))
                .collect::<Vec<_>>(),
        )
    };
    Ok(worst(&[
        rel_err(&gpu.download(&d_losses)?, &losses, ELEMENTWISE_FLOOR),
        rows(&got_logp, &logp),
        rows(&got_grad, &grad),
    ]))
}

/// `add` into a poisoned buffer and `add_assign` in place, against the CPU.
fn check_add<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize) -> Check {
    let a = inp.uniform(n, 2.0, T::DTYPE);
    let b = inp.uniform(n, 3.0, T::DTYPE);
    let mut want = vec![0.0; n];
    cpu::add::add(&mut want, &a, &b);
    let (mut d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    let mut d_out = poisoned::<T>(gpu, n)?;
    gpu.add(&mut d_out, &d_a, &d_b, n)?;
    gpu.add_assign(&mut d_a, &d_b, n)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &want, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_a)?, &want, ELEMENTWISE_FLOOR),
    ]))
}

/// `copy_into_at` (`n` values into a buffer of `3n` at `at`) and `add_assign_from` (`n`
/// values from `at` of that buffer added to another), against the CPU.
fn check_offsets<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize, at: usize) -> Check {
    let big = inp.uniform(3 * n, 2.0, T::DTYPE);
    let part = inp.uniform(n, 3.0, T::DTYPE);
    let dst = inp.uniform(n, 1.0, T::DTYPE);
    let mut want_big = big.clone();
    want_big[at..at + n].copy_from_slice(&part);
    let mut want_dst = dst.clone();
    cpu::add::add_assign(&mut want_dst, &want_big[at..at + n]);
    let mut d_big = gpu.upload_as::<T>(&big)?;
    let d_part = gpu.upload_as::<T>(&part)?;
    let mut d_dst = gpu.upload_as::<T>(&dst)?;
    gpu.copy_into_at(&mut d_big, at, &d_part)?;
    gpu.add_assign_from(&mut d_dst, &d_big, at, n)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_big)?, &want_big, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_dst)?, &want_dst, ELEMENTWISE_FLOOR),
    ]))
}

fn check_cols<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    row: usize,
    col0: usize,
    c: usize,
) -> Check {
    let dst = inp.uniform(n * row, 2.0, T::DTYPE);
    let src = inp.uniform(n * c, 3.0, T::DTYPE);
    let mut want_add = dst.clone();
    cpu::add::add_cols_scaled(&mut want_add, &src, row, col0, c, 0.75);
    let mut want_cols = vec![0.0; n * c];
    cpu::add::cols_scaled(&mut want_cols, &dst, row, col0, c, -1.5);
    let d_src = gpu.upload_as::<T>(&src)?;
    let mut d_dst = gpu.upload_as::<T>(&dst)?;
    let mut d_cols = poisoned::<T>(gpu, n * c)?;
    gpu.cols_scaled(&mut d_cols, &d_dst, n, row, col0, c, -1.5)?;
    gpu.add_cols_scaled(&mut d_dst, &d_src, n, row, col0, c, 0.75)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dst)?, &want_add, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_cols)?, &want_cols, ELEMENTWISE_FLOOR),
    ]))
}

fn check_embedding_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    seq: usize,
    n: usize,
    c: usize,
) -> Check {
    let (wte, wpe) = (
        inp.uniform(vocab * c, 1.0, T::DTYPE),
        inp.uniform(seq * c, 1.0, T::DTYPE),
    );
    let tokens = inp.tokens(n, vocab);
    let mut out = vec![0.0; n * c];
    cpu::embedding::embedding_forward(&mut out, &tokens, &wte, &wpe, seq, c);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let (d_wte, d_wpe) = (gpu.upload_as::<T>(&wte)?, gpu.upload_as::<T>(&wpe)?);
    gpu.embedding_forward(
        &mut d_out,
        &gpu.upload(&tokens)?,
        &d_wte,
        &d_wpe,
        n,
        vocab,
        seq,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

fn check_embedding_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    seq: usize,
    n: usize,
    c: usize,
) -> Check {
    let dout = inp.uniform(n * c, 1.0, T::DTYPE);
    let tokens = inp.tokens(n, vocab);
    let (dwte0, dwpe0) = (
        inp.uniform(vocab * c, 1.0, DType::F32),
        inp.uniform(seq * c, 1.0, DType::F32),
    );
    let (mut dwte, mut dwpe) = (dwte0.clone(), dwpe0.clone());
    cpu::embedding::embedding_backward(&mut dwte, &mut dwpe, &dout, &tokens, seq, c);
    let d_dout = gpu.upload_as::<T>(&dout)?;
    let (mut d_dwte, mut d_dwpe) = (gpu.upload(&dwte0)?, gpu.upload(&dwpe0)?);
    gpu.embedding_backward(&mut d_dwte, &mut d_dwpe, &d_dout, &tokens, vocab, seq, c)?;
    Ok(worst(&[
        rel_err(&gpu.download(&d_dwte)?, &dwte, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dwpe)?, &dwpe, ELEMENTWISE_FLOOR),
    ]))
}

/// Rows of the rotary tables in the selftest; positions are drawn below it.
const ROPE_POSITIONS: usize = 4096;

fn check_rmsnorm_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, g) = (inp.uniform(n * c, 2.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &g, c, eps);
    let mut d_out = poisoned::<T>(gpu, n * c)?;
    let mut d_rstd = poisoned::<f32>(gpu, n)?;
    let (d_x, d_g) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&g)?);
    gpu.rmsnorm_forward(&mut d_out, &mut d_rstd, &d_x, &d_g, n, c, eps)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

fn check_residual_rmsnorm<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    eps: f32,
) -> Check {
    let d = T::DTYPE;
    let (x, delta) = (inp.uniform(n * c, 2.0, d), inp.uniform(n * c, 2.0, d));
    let g = inp.uniform(c, 1.0, d);
    // In bf16 and f16 the GPU stores the sum rounded and normalises the stored value, so the
    // reference does the same.
    let (mut sum, mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n]);
    if d == DType::F32 {
        cpu::rmsnorm::residual_rmsnorm_forward(
            &mut sum, &mut out, &mut rstd, &x, &delta, &g, c, eps,
        );
    } else {
        sum = x.iter().zip(&delta).map(|(a, b)| d.round(a + b)).collect();
        cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &sum, &g, c, eps);
    }
    let (mut d_sum, mut d_out) = (poisoned::<T>(gpu, n * c)?, poisoned::<T>(gpu, n * c)?);
    let mut d_rstd = poisoned::<f32>(gpu, n)?;
    let (d_x, d_delta) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&delta)?);
    let d_g = gpu.upload_as::<T>(&g)?;
    gpu.residual_rmsnorm_forward(
        &mut d_sum,
        &mut d_out,
        &mut d_rstd,
        &d_x,
        &d_delta,
        &d_g,
        n,
        c,
        eps,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_sum)?, &sum, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_rstd)?, &rstd, ELEMENTWISE_FLOOR),
    ]))
}

fn check_rmsnorm_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, g) = (inp.uniform(n * c, 2.0, d), inp.uniform(c, 1.0, d));
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    cpu::rmsnorm::rmsnorm_forward(&mut out, &mut rstd, &x, &g, c, 1e-5);
    let dout = inp.uniform(n * c, 1.0, d);
    // Both gradients accumulate: start them from random values, not zeros.
    let (dx0, dg0) = (inp.uniform(n * c, 1.0, d), inp.uniform(c, 1.0, DType::F32));
    let (mut dx, mut dg) = (dx0.clone(), dg0.clone());
    cpu::rmsnorm::rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &g, &rstd, c);
    let (mut d_dx, mut d_dg) = (gpu.upload_as::<T>(&dx0)?, gpu.upload(&dg0)?);
    let (d_dout, d_x, d_g) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&g)?,
    );
    let d_rstd = gpu.upload(&rstd)?;
    gpu.rmsnorm_backward(
        &mut d_dx,
        Some(&mut d_dg),
        &d_dout,
        &d_x,
        &d_g,
        &d_rstd,
        n,
        c,
    )?;
    // A frozen gain: the same input gradient, no gain gradient formed.
    let mut d_dx_frozen = gpu.upload_as::<T>(&dx0)?;
    gpu.rmsnorm_backward(&mut d_dx_frozen, None, &d_dout, &d_x, &d_g, &d_rstd, n, c)?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dx)?, &dx, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dg)?, &dg, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download_f32(&d_dx_frozen)?, &dx, ELEMENTWISE_FLOOR),
    ]))
}

impl Inputs {
    fn positions(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n).map(|_| self.0.below(below as u64) as u32).collect()
    }
}

fn check_rope_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    (cos, sin): (&[f32], &[f32]),
) -> Check {
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, T::DTYPE);
    let pos = inp.positions(s.rows, ROPE_POSITIONS);
    let mut out = vec![0.0; s.rows * s.packed_width()];
    cpu::rope::rope_expand_forward(&mut out, &qkv, &pos, cos, sin, s);
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.rope_expand_forward(
        &mut d_out,
        &gpu.upload_as::<T>(&qkv)?,
        &gpu.upload(&pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

fn check_rope_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    (cos, sin): (&[f32], &[f32]),
) -> Check {
    let dpacked = inp.uniform(s.rows * s.packed_width(), 1.0, T::DTYPE);
    let pos = inp.positions(s.rows, ROPE_POSITIONS);
    let mut dqkv = vec![0.0; s.rows * s.qkv_width()];
    cpu::rope::rope_expand_backward(&mut dqkv, &dpacked, &pos, cos, sin, s);
    let mut d_dqkv = poisoned::<T>(gpu, dqkv.len())?;
    gpu.rope_expand_backward(
        &mut d_dqkv,
        &gpu.upload_as::<T>(&dpacked)?,
        &gpu.upload(&pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
    )?;
    Ok(rel_err(
        &gpu.download_f32(&d_dqkv)?,
        &dqkv,
        ELEMENTWISE_FLOOR,
    ))
}

/// Cache positions of the key/value cache checks (decode positions reach 1500).
const KV_MAX_LEN: usize = 1536;

/// The rows of a key/value cache check.
#[derive(Clone, Copy)]
enum KvCall {
    /// Decode steps of this many sequences, each in its own slot at a random position below
    /// 1500; the first at 1499 and, with more than two, the last at 2 (shorter than the
    /// number of splits, so some of its splits are empty).
    Decode(usize),
    /// A prompt of this many tokens at positions 0.. of slot 1.
    Prefill(usize),
}

impl KvCall {
    /// The cache and each row's slot and position.
    fn rows(
        self,
        inp: &mut Inputs,
        kv_heads: usize,
        head_dim: usize,
    ) -> (cpu::kv_cache::CacheShape, Vec<u32>, Vec<u32>) {
        let shape = |slots, max_len| cpu::kv_cache::CacheShape {
            slots,
            kv_heads,
            max_len,
            head_dim,
        };
        match self {
            KvCall::Decode(n) => {
                // Slots in a scrambled order (7 is coprime to any power of two).
                let slot = (0..n).map(|r| ((r * 7 + 3) % n) as u32).collect();
                let mut pos = inp.positions(n, 1500);
                pos[0] = 1499;
                if n > 2 {
                    pos[n - 1] = 2;
                }
                (shape(n, KV_MAX_LEN), slot, pos)
            }
            KvCall::Prefill(n) => (shape(2, n + 5), vec![1; n], (0..n as u32).collect()),
        }
    }
}

/// A cache of NaN except positions `0..=pos` of each row's slot, which hold random values.
fn kv_cache_input(
    inp: &mut Inputs,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    dtype: DType,
) -> Vec<f32> {
    let mut cache = vec![f32::NAN; c.len()];
    let mut longest = vec![0usize; c.slots];
    for (&s, &p) in slot.iter().zip(pos) {
        longest[s as usize] = longest[s as usize].max(p as usize + 1);
    }
    for (s, &len) in longest.iter().enumerate() {
        for h in 0..c.kv_heads {
            let at = c.at(s, h, 0);
            let n = len * c.head_dim;
            cache[at..at + n].copy_from_slice(&inp.uniform(n, 1.0, dtype));
        }
    }
    cache
}

/// The error of a cache the GPU wrote against the CPU's: where the CPU's holds NaN (never
/// written) the GPU's must too, elsewhere the relative error.
fn cache_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (&a, &b) in got.iter().zip(want) {
        if b.is_nan() {
            if !a.is_nan() {
                return f64::INFINITY;
            }
        } else {
            g.push(a);
            w.push(b);
        }
    }
    rel_err(&g, &w, ELEMENTWISE_FLOOR)
}

/// Width of the unnormalised stream behind the normed kernels' checks (SmolLM2's).
const NORMED_STREAM: usize = 576;

/// The append kernel, or with `normed` (`Some(with_bias)`) the folded decode step's append of
/// the projection of an unnormalised stream, each row scaled by its RMSNorm factor first and
/// given a bias after it when asked.
fn check_kv_append<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    (cos, sin): (&[f32], &[f32]),
    normed: Option<bool>,
) -> Check {
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, T::DTYPE);
    // A stream of a few units, as a residual stream is: factors well away from one.
    let x = normed.map(|_| inp.uniform(s.rows * NORMED_STREAM, 4.0, T::DTYPE));
    let bias = (normed == Some(true)).then(|| inp.uniform(s.qkv_width(), 0.5, T::DTYPE));
    let eps = 1e-5;
    let projected = match &x {
        Some(x) => {
            cpu::rmsnorm::normed_rows(&qkv, s.qkv_width(), x, NORMED_STREAM, eps, bias.as_deref())
        }
        None => qkv.clone(),
    };
    let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
    let (mut k, mut v) = (vec![f32::NAN; c.len()], vec![f32::NAN; c.len()]);
    cpu::kv_cache::kv_append(
        &mut q, &mut k, &mut v, &projected, slot, pos, cos, sin, s, c,
    );
    let mut d_q = poisoned::<T>(gpu, q.len())?;
    let mut d_k = poisoned::<T>(gpu, c.len())?;
    let mut d_v = poisoned::<T>(gpu, c.len())?;
    let (d_qkv, d_slot, d_pos) = (
        gpu.upload_as::<T>(&qkv)?,
        gpu.upload(slot)?,
        gpu.upload(pos)?,
    );
    let (d_cos, d_sin) = (gpu.upload(cos)?, gpu.upload(sin)?);
    match &x {
        None => gpu.kv_append(
            &mut d_q, &mut d_k, &mut d_v, &d_qkv, &d_slot, &d_pos, &d_cos, &d_sin, s, c,
        )?,
        Some(x) => {
            let d_bias = bias.as_ref().map(|b| gpu.upload_as::<T>(b)).transpose()?;
            gpu.kv_append_normed(
                &mut d_q,
                &mut d_k,
                &mut d_v,
                &d_qkv,
                &gpu.upload_as::<T>(x)?,
                NORMED_STREAM,
                eps,
                d_bias.as_ref(),
                &d_slot,
                &d_pos,
                &d_cos,
                &d_sin,
                s,
                c,
            )?
        }
    }
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_q)?, &q, ELEMENTWISE_FLOOR),
        cache_err(&gpu.download_f32(&d_k)?, &k),
        cache_err(&gpu.download_f32(&d_v)?, &v),
    ]))
}

fn check_cache_attention<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    heads: usize,
    window: usize,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
) -> Check {
    let d = T::DTYPE;
    let k = kv_cache_input(inp, c, (slot, pos), d);
    let v = kv_cache_input(inp, c, (slot, pos), d);
    // Queries three times the keys' scale: scores spread over a few units, a peaked softmax.
    let q = inp.uniform(slot.len() * heads * c.head_dim, 3.0, d);
    let mut out = vec![0.0; q.len()];
    cpu::kv_cache::cache_attention(&mut out, &q, &k, &v, slot, pos, heads, window, c);
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    gpu.cache_attention(
        &mut d_out,
        &gpu.upload_as::<T>(&q)?,
        &gpu.upload_as::<T>(&k)?,
        &gpu.upload_as::<T>(&v)?,
        &gpu.upload(slot)?,
        &gpu.upload(pos)?,
        heads,
        window,
        longest,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR))
}

/// The decode step's append and attention in one kernel against the CPU's append of the
/// normed projection and attention: the outputs and both caches.
#[allow(clippy::too_many_arguments)]
fn check_cache_attention_append<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    s: cpu::rope::RopeShape,
    c: cpu::kv_cache::CacheShape,
    (slot, pos): (&[u32], &[u32]),
    (cos, sin): (&[f32], &[f32]),
    (with_bias, window): (bool, usize),
) -> Check {
    let d = T::DTYPE;
    let mut k = kv_cache_input(inp, c, (slot, pos), d);
    let mut v = kv_cache_input(inp, c, (slot, pos), d);
    let qkv = inp.uniform(s.rows * s.qkv_width(), 1.0, d);
    let x = inp.uniform(s.rows * NORMED_STREAM, 4.0, d);
    let bias = with_bias.then(|| inp.uniform(s.qkv_width(), 0.5, d));
    let eps = 1e-5;
    let (d_k0, d_v0) = (gpu.upload_as::<T>(&k)?, gpu.upload_as::<T>(&v)?);
    let projected =
        cpu::rmsnorm::normed_rows(&qkv, s.qkv_width(), &x, NORMED_STREAM, eps, bias.as_deref());
    let mut q = vec![0.0; s.rows * s.heads * s.head_dim];
    cpu::kv_cache::kv_append(
        &mut q, &mut k, &mut v, &projected, slot, pos, cos, sin, s, c,
    );
    // The kernel attends with the queries, keys and values rounded to the cache's type, as the
    // two kernels it replaces store them: so does the reference (the attention's output moves
    // by many of the type's steps with them, far past the elementwise bound).
    for t in [&mut q, &mut k, &mut v] {
        d.round_slice(t);
    }
    let mut out = vec![0.0; q.len()];
    cpu::kv_cache::cache_attention(&mut out, &q, &k, &v, slot, pos, s.heads, window, c);
    let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
    let (mut d_k, mut d_v) = (d_k0, d_v0);
    let mut d_out = poisoned::<T>(gpu, out.len())?;
    let d_bias = bias.as_ref().map(|b| gpu.upload_as::<T>(b)).transpose()?;
    gpu.cache_attention_append(
        &mut d_out,
        &mut d_k,
        &mut d_v,
        &gpu.upload_as::<T>(&qkv)?,
        &gpu.upload_as::<T>(&x)?,
        NORMED_STREAM,
        eps,
        d_bias.as_ref(),
        &gpu.upload(slot)?,
        &gpu.upload(pos)?,
        &gpu.upload(cos)?,
        &gpu.upload(sin)?,
        s,
        window,
        longest,
        c,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
        cache_err(&gpu.download_f32(&d_k)?, &k),
        cache_err(&gpu.download_f32(&d_v)?, &v),
    ]))
}

fn check_copy_cache_slot<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    c: cpu::kv_cache::CacheShape,
) -> Check {
    let mut cache = inp.uniform(c.len(), 1.0, T::DTYPE);
    let mut d_cache = gpu.upload_as::<T>(&cache)?;
    let (from, to, len) = (2, 0, 257);
    for h in 0..c.kv_heads {
        let (src, dst) = (c.at(from, h, 0), c.at(to, h, 0));
        cache.copy_within(src..src + len * c.head_dim, dst);
    }
    gpu.copy_cache_slot(&mut d_cache, from, to, len, c)?;
    Ok(rel_err(
        &gpu.download_f32(&d_cache)?,
        &cache,
        ELEMENTWISE_FLOOR,
    ))
}

/// Rows `[gate | up]` with the gate over silu's curved range and beyond.
fn swiglu_input(inp: &mut Inputs, n: usize, f: usize, d: DType) -> Vec<f32> {
    let (gate, up) = (inp.uniform(n * f, 6.0, d), inp.uniform(n * f, 1.0, d));
    gate.chunks(f)
        .zip(up.chunks(f))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect()
}

fn check_swiglu_forward<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, n: usize, f: usize) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let mut h = vec![0.0; n * f];
    cpu::swiglu::swiglu_forward(&mut h, &gu, f);
    let mut d_h = poisoned::<T>(gpu, n * f)?;
    gpu.swiglu_forward(&mut d_h, &gpu.upload_as::<T>(&gu)?, n, f)?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &h, ELEMENTWISE_FLOOR))
}

fn check_swiglu_forward_normed<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    f: usize,
) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let x = inp.uniform(n * NORMED_STREAM, 4.0, T::DTYPE);
    let eps = 1e-5;
    let normed = cpu::rmsnorm::normed_rows(&gu, 2 * f, &x, NORMED_STREAM, eps, None);
    let mut h = vec![0.0; n * f];
    cpu::swiglu::swiglu_forward(&mut h, &normed, f);
    let mut d_h = poisoned::<T>(gpu, n * f)?;
    gpu.swiglu_forward_normed(
        &mut d_h,
        &gpu.upload_as::<T>(&gu)?,
        &gpu.upload_as::<T>(&x)?,
        n,
        f,
        NORMED_STREAM,
        eps,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &h, ELEMENTWISE_FLOOR))
}

fn check_swiglu_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    f: usize,
) -> Check {
    let gu = swiglu_input(inp, n, f, T::DTYPE);
    let dh = inp.uniform(n * f, 1.0, T::DTYPE);
    let mut dgu = vec![0.0; 2 * n * f];
    cpu::swiglu::swiglu_backward(&mut dgu, &gu, &dh, f);
    let mut d_dgu = poisoned::<T>(gpu, 2 * n * f)?;
    gpu.swiglu_backward(
        &mut d_dgu,
        &gpu.upload_as::<T>(&gu)?,
        &gpu.upload_as::<T>(&dh)?,
        n,
        f,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dgu)?, &dgu, ELEMENTWISE_FLOOR))
}

fn check_token_embedding_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    vocab: usize,
    n: usize,
    c: usize,
) -> Check {
    let dout = inp.uniform(n * c, 1.0, T::DTYPE);
    let uniform = inp.tokens(n, vocab);
    // Uniform tokens, and the same with every third position one hot token (hundreds of
    // hits in one row, many batches of loads).
    let skewed: Vec<u32> = uniform
        .iter()
        .enumerate()
        .map(|(i, &t)| if i % 3 == 1 { 7 % vocab as u32 } else { t })
        .collect();
    let dwte0 = inp.uniform(vocab * c, 1.0, DType::F32);
    let d_dout = gpu.upload_as::<T>(&dout)?;
    let mut errors = Vec::new();
    for tokens in [uniform, skewed] {
        let mut dwte = dwte0.clone();
        cpu::embedding::token_embedding_backward(&mut dwte, &dout, &tokens, c);
        let mut d_dwte = gpu.upload(&dwte0)?;
        gpu.token_embedding_backward(&mut d_dwte, &d_dout, &tokens, vocab, c)?;
        errors.push(rel_err(&gpu.download(&d_dwte)?, &dwte, ELEMENTWISE_FLOOR));
    }
    Ok(worst(&errors))
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

fn check_gather_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    src_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    let src = inp.uniform(src_rows * c, 2.0, T::DTYPE);
    let idx = inp.row_indices(rows, src_rows);
    let scale = inp.uniform(rows, 1.0, DType::F32);
    let mut out = vec![0.0; rows * c];
    cpu::rows::gather_rows(&mut out, &src, &idx, Some(&scale), c);
    let mut d_out = poisoned::<T>(gpu, rows * c)?;
    let (d_src, d_idx, d_scale) = (
        gpu.upload_as::<T>(&src)?,
        gpu.upload(&idx)?,
        gpu.upload(&scale)?,
    );
    gpu.gather_rows(
        &mut d_out,
        &d_src,
        &d_idx,
        Some(&d_scale),
        rows,
        src_rows,
        c,
    )?;
    let scaled = rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR);
    // Without a scale the rows are copied.
    cpu::rows::gather_rows(&mut out, &src, &idx, None, c);
    let mut d_out = poisoned::<T>(gpu, rows * c)?;
    gpu.gather_rows(&mut d_out, &d_src, &d_idx, None, rows, src_rows, c)?;
    Ok(worst(&[
        scaled,
        rel_err(&gpu.download_f32(&d_out)?, &out, ELEMENTWISE_FLOOR),
    ]))
}

fn check_scatter_add_rows<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    dst_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    // The destination accumulates: it starts from random values, not zeros.
    let dst0 = inp.uniform(dst_rows * c, 1.0, T::DTYPE);
    let src = inp.uniform(rows * c, 2.0, T::DTYPE);
    let idx = inp.distinct_row_indices(rows, dst_rows);
    let scale = inp.uniform(rows, 1.0, DType::F32);
    let mut dst = dst0.clone();
    cpu::rows::scatter_add_rows(&mut dst, &src, &idx, Some(&scale), c);
    let mut d_dst = gpu.upload_as::<T>(&dst0)?;
    let (d_src, d_idx, d_scale) = (
        gpu.upload_as::<T>(&src)?,
        gpu.upload(&idx)?,
        gpu.upload(&scale)?,
    );
    gpu.scatter_add_rows(
        &mut d_dst,
        &d_src,
        &d_idx,
        Some(&d_scale),
        rows,
        dst_rows,
        c,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_dst)?, &dst, ELEMENTWISE_FLOOR))
}

fn check_gathered_row_dot<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    a_rows: usize,
    rows: usize,
    c: usize,
) -> Check {
    let a = inp.uniform(a_rows * c, 1.0, T::DTYPE);
    let b = inp.uniform(rows * c, 1.0, T::DTYPE);
    let idx = inp.row_indices(rows, a_rows);
    let mut out = vec![0.0; rows];
    cpu::rows::gathered_row_dot(&mut out, &a, &idx, &b, c);
    let mut d_out = poisoned::<f32>(gpu, rows)?;
    let (d_a, d_b, d_idx) = (
        gpu.upload_as::<T>(&a)?,
        gpu.upload_as::<T>(&b)?,
        gpu.upload(&idx)?,
    );
    gpu.gathered_row_dot(&mut d_out, &d_a, &d_idx, &d_b, rows, a_rows, c)?;
    // A dot product of random signs: measured against the largest, as a GEMM's output is.
    Ok(rel_err(&gpu.download(&d_out)?, &out, GEMM_FLOOR))
}

/// `with_compute`: also write the compute copy in `C` (else `C` is unused). The fused kernel
/// and the unfused passes (`kernels`) are both held to the fused CPU reference, which the
/// unfused CPU passes equal bit for bit.
fn check_adamw<C: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    with_compute: bool,
    kernels: Kernels,
) -> Check {
    let param0 = inp.uniform(n, 1.0, DType::F32);
    let grad = inp.uniform(n, 2.0, DType::F32);
    let m0 = inp.uniform(n, 0.1, DType::F32);
    let v0 = inp.positive(n, 0.01);
    let h = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        t: 7,
        grad_scale: 0.25,
    };
    let (mut param, mut m, mut v) = (param0.clone(), m0.clone(), v0.clone());
    let mut compute = vec![0.0; n];
    let cpu_compute = with_compute.then_some((compute.as_mut_slice(), C::DTYPE));
    cpu::adamw::adamw_update(&mut param, &grad, &mut m, &mut v, cpu_compute, h);
    let (mut d_param, d_grad) = (gpu.upload(&param0)?, gpu.upload(&grad)?);
    let (mut d_m, mut d_v) = (gpu.upload(&m0)?, gpu.upload(&v0)?);
    let mut d_compute = poisoned::<C>(gpu, n)?;
    let compute_arg = with_compute.then_some(&mut d_compute);
    match kernels {
        Kernels::Fused => {
            gpu.adamw_update(&mut d_param, &d_grad, &mut d_m, &mut d_v, compute_arg, n, h)?
        }
        Kernels::Unfused => {
            let mut scratch = poisoned::<f32>(gpu, n)?;
            gpu.adamw_update_unfused(
                &mut d_param,
                &d_grad,
                &mut d_m,
                &mut d_v,
                &mut scratch,
                compute_arg,
                n,
                h,
            )?
        }
    }
    let mut errs = vec![
        rel_err(&gpu.download(&d_param)?, &param, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_m)?, &m, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_v)?, &v, ELEMENTWISE_FLOOR),
    ];
    if with_compute {
        errs.push(rel_err(
            &gpu.download_f32(&d_compute)?,
            &compute,
            ELEMENTWISE_FLOOR,
        ));
    }
    Ok(worst(&errs))
}

/// Tensors of `sizes` through one launch of the fused update, alternating weight decays,
/// each against the CPU reference run on it alone.
fn check_adamw_many<C: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    sizes: &[usize],
    with_compute: bool,
) -> Check {
    use crate::engine::cuda::AdamWSlices;
    let h = |i: usize| AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: if i.is_multiple_of(2) { 0.1 } else { 0.0 },
        t: 3,
        grad_scale: 0.5,
    };
    let mut want = Vec::new();
    let mut dev = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p0 = inp.uniform(n, 1.0, DType::F32);
        let g = inp.uniform(n, 2.0, DType::F32);
        let m0 = inp.uniform(n, 0.1, DType::F32);
        let v0 = inp.positive(n, 0.01);
        let (mut p, mut m, mut v, mut c) = (p0.clone(), m0.clone(), v0.clone(), vec![0.0; n]);
        let cpu_c = with_compute.then_some((c.as_mut_slice(), C::DTYPE));
        cpu::adamw::adamw_update(&mut p, &g, &mut m, &mut v, cpu_c, h(i));
        want.push((p, m, v, c));
        let up = gpu.upload(&p0)?;
        dev.push((
            up,
            gpu.upload(&g)?,
            gpu.upload(&m0)?,
            gpu.upload(&v0)?,
            poisoned::<C>(gpu, n)?,
        ));
    }
    let mut slices: Vec<_> = dev
        .iter_mut()
        .zip(sizes)
        .enumerate()
        .map(|(i, ((p, g, m, v, c), &n))| AdamWSlices {
            param: p,
            grad: &*g,
            m,
            v,
            compute: with_compute.then_some(c),
            n,
            weight_decay: h(i).weight_decay,
        })
        .collect();
    gpu.adamw_update_many(&mut slices, h(0))?;
    drop(slices);
    let mut errs = Vec::new();
    for ((p, _, m, v, c), (wp, wm, wv, wc)) in dev.iter().zip(&want) {
        errs.push(rel_err(&gpu.download(p)?, wp, ELEMENTWISE_FLOOR));
        errs.push(rel_err(&gpu.download(m)?, wm, ELEMENTWISE_FLOOR));
        errs.push(rel_err(&gpu.download(v)?, wv, ELEMENTWISE_FLOOR));
        if with_compute {
            errs.push(rel_err(&gpu.download_f32(c)?, wc, ELEMENTWISE_FLOOR));
        }
    }
    Ok(worst(&errs))
}

/// With `bad`, one element is replaced by it and the check is that the flag goes up (error 0
/// if it does, infinite if not); otherwise the sum is compared and the flag must stay down.
/// Several tensors (one empty) through one partial buffer, against the f64 sum on the host.
fn check_sum_squares_many(gpu: &CudaBackend, inp: &mut Inputs, sizes: &[usize]) -> Check {
    let xs: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| inp.uniform(n, 3.0, DType::F32))
        .collect();
    let want: f64 = xs.iter().flatten().map(|&v| v as f64 * v as f64).sum();
    let acc0 = inp.0.next_f64();
    let (mut d_acc, mut d_flag) = (gpu.upload(&[acc0])?, gpu.upload(&[0u32])?);
    let d_xs = xs
        .iter()
        .map(|x| gpu.upload(if x.is_empty() { &[0.0f32][..] } else { x }))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let pairs: Vec<_> = d_xs.iter().zip(sizes).map(|(d, &n)| (d, n)).collect();
    gpu.sum_squares_many(&mut d_acc, &mut d_flag, &pairs)?;
    if gpu.download(&d_flag)?[0] != 0 {
        return Ok(f64::INFINITY);
    }
    let got = gpu.download(&d_acc)?[0] - acc0;
    Ok(((got - want) / want).abs())
}

fn check_sum_squares(gpu: &CudaBackend, inp: &mut Inputs, n: usize, bad: Option<f32>) -> Check {
    let mut x = inp.uniform(n, 3.0, DType::F32);
    if let Some(bad) = bad {
        let at = inp.0.below(n as u64) as usize;
        x[at] = bad;
    }
    let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let acc0 = inp.0.next_f64();
    let (mut d_acc, mut d_flag) = (gpu.upload(&[acc0])?, gpu.upload(&[0u32])?);
    gpu.sum_squares_accumulate(&mut d_acc, &mut d_flag, &gpu.upload(&x)?, n)?;
    let flag = gpu.download(&d_flag)?[0];
    let got = gpu.download(&d_acc)?[0] - acc0;
    Ok(match bad {
        Some(_) => {
            if flag == 1 {
                0.0
            } else {
                f64::INFINITY
            }
        }
        None if flag != 0 => f64::INFINITY,
        None => ((got - want) / want).abs(),
    })
}

fn check_linear_forward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c_in: usize,
    c_out: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w, b) = (
        inp.uniform(n * c_in, 1.0, d),
        inp.uniform(c_out * c_in, 1.0, d),
        inp.uniform(c_out, 1.0, d),
    );
    let mut out = vec![0.0; n * c_out];
    cpu::gemm::linear_forward(&mut out, &x, &w, Some(&b), n, c_in, c_out);
    let mut d_out = poisoned::<T>(gpu, n * c_out)?;
    let (d_x, d_w, d_b) = (
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&w)?,
        gpu.upload_as::<T>(&b)?,
    );
    gpu.linear_forward(&mut d_out, &d_x, &d_w, Some(&d_b), n, c_in, c_out, math)?;
    Ok(rel_err(&gpu.download_f32(&d_out)?, &out, GEMM_FLOOR))
}

/// A call the few-row kernels must take: declining it fails the check.
fn few_rows_taken(op: &'static str, taken: bool) -> std::result::Result<(), CudaError> {
    if taken {
        Ok(())
    } else {
        Err(CudaError::Shape {
            op,
            detail: "the few-row kernels declined a shape they take".into(),
        })
    }
}

fn check_few_rows_product<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) -> Check {
    let d = T::DTYPE;
    let (x, w, y0) = (
        inp.uniform(rows * k, 1.0, d),
        inp.uniform(n * k, 1.0, d),
        inp.uniform(rows * n, 4.0, d),
    );
    let mut want = vec![0.0; rows * n];
    cpu::gemm::linear_forward(&mut want, &x, &w, None, rows, k, n);
    if accumulate {
        want.iter_mut().zip(&y0).for_each(|(v, y)| *v += y);
    }
    let mut d_y = if accumulate {
        gpu.upload_as::<T>(&y0)?
    } else {
        poisoned::<T>(gpu, rows * n)?
    };
    let (d_x, d_w) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&w)?);
    let taken = gpu.few_rows_product(&mut d_y, &d_x, &d_w, rows, n, k, accumulate)?;
    few_rows_taken("few_rows_product", taken)?;
    Ok(rel_err(&gpu.download_f32(&d_y)?, &want, GEMM_FLOOR))
}

/// The CPU reference of the fused gate/up kernel: `silu(r gate) * (r up)`, `[gate | up] =
/// x[rows, k] w[2f, k]^T`, `r` each row's RMSNorm factor of `x`.
fn cpu_swiglu_normed(x: &[f32], w: &[f32], rows: usize, k: usize, f: usize, eps: f32) -> Vec<f32> {
    let mut gate_up = vec![0.0; rows * 2 * f];
    cpu::gemm::linear_forward(&mut gate_up, x, w, None, rows, k, 2 * f);
    let normed = cpu::rmsnorm::normed_rows(&gate_up, 2 * f, x, k, eps, None);
    let mut h = vec![0.0; rows * f];
    cpu::swiglu::swiglu_forward(&mut h, &normed, f);
    h
}

fn check_few_rows_swiglu<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    f: usize,
) -> Check {
    let d = T::DTYPE;
    let (x, w) = (
        inp.uniform(rows * k, 1.0, d),
        inp.uniform(2 * f * k, 1.0, d),
    );
    let eps = 1e-5;
    let want = cpu_swiglu_normed(&x, &w, rows, k, f, eps);
    let mut d_h = poisoned::<T>(gpu, rows * f)?;
    let (d_x, d_w) = (gpu.upload_as::<T>(&x)?, gpu.upload_as::<T>(&w)?);
    let taken = gpu.few_rows_swiglu(&mut d_h, &d_x, &d_w, rows, f, k, eps)?;
    few_rows_taken("few_rows_swiglu", taken)?;
    Ok(rel_err(&gpu.download_f32(&d_h)?, &want, GEMM_FLOOR))
}

/// Three decode MLP layers in a row (`h = swiglu(norm(x) [gate | up])`, `x += h down^T`), each
/// kernel reading the one before's output: launched overlapped they must give the bits of plain
/// launches (an input read before the previous kernel finished would differ), and both the
/// CPU's chain, rounded to `T` where the GPU stores.
fn check_overlapped_chain<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    k: usize,
    f: usize,
) -> Check {
    const LAYERS: usize = 3;
    let d = T::DTYPE;
    let eps = 1e-5;
    let x0 = inp.uniform(rows * k, 1.0, d);
    // Weights scaled so the stream stays of order one through the layers.
    let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
        .map(|_| {
            let gate_up = inp.uniform(2 * f * k, 1.0 / (k as f32).sqrt(), d);
            let down = inp.uniform(k * f, 1.0 / (f as f32).sqrt(), d);
            (gate_up, down)
        })
        .collect();
    let mut want = x0.clone();
    for (gate_up, down) in &layers {
        let mut h = cpu_swiglu_normed(&want, gate_up, rows, k, f, eps);
        d.round_slice(&mut h);
        let mut y = vec![0.0; rows * k];
        cpu::gemm::linear_forward(&mut y, &h, down, None, rows, f, k);
        want.iter_mut()
            .zip(&y)
            .for_each(|(w, y)| *w = d.round(*w + y));
    }
    let weights = layers
        .iter()
        .map(|(gu, dn)| Ok((gpu.upload_as::<T>(gu)?, gpu.upload_as::<T>(dn)?)))
        .collect::<std::result::Result<Vec<_>, CudaError>>()?;
    let run = |overlapped: bool| -> std::result::Result<Vec<f32>, CudaError> {
        let _overlap = overlapped.then(|| gpu.overlapped());
        let mut x = gpu.upload_as::<T>(&x0)?;
        let mut h = poisoned::<T>(gpu, rows * f)?;
        for (gate_up, down) in &weights {
            let taken = gpu.few_rows_swiglu(&mut h, &x, gate_up, rows, f, k, eps)?;
            few_rows_taken("few_rows_swiglu", taken)?;
            let taken = gpu.few_rows_product(&mut x, &h, down, rows, k, f, true)?;
            few_rows_taken("few_rows_product", taken)?;
        }
        gpu.download_f32(&x)
    };
    let (plain, overlapped) = (run(false)?, run(true)?);
    if let Some(i) = (0..plain.len()).find(|&i| plain[i].to_bits() != overlapped[i].to_bits()) {
        return Err(CudaError::Shape {
            op: "few_rows chain (overlapped)",
            detail: format!(
                "overlapped launches gave {} at {i}, plain ones {}",
                overlapped[i], plain[i]
            ),
        });
    }
    Ok(rel_err(&overlapped, &want, GEMM_FLOOR))
}

fn check_linear_backward<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c_in: usize,
    c_out: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w, dout) = (
        inp.uniform(n * c_in, 1.0, d),
        inp.uniform(c_out * c_in, 1.0, d),
        inp.uniform(n * c_out, 1.0, d),
    );
    let (dw0, db0) = (
        inp.uniform(c_out * c_in, 1.0, DType::F32),
        inp.uniform(c_out, 1.0, DType::F32),
    );
    let (mut dinp, mut dw, mut db) = (vec![0.0; n * c_in], dw0.clone(), db0.clone());
    cpu::gemm::linear_backward(
        &mut dinp,
        &mut dw,
        Some(&mut db),
        &dout,
        &x,
        &w,
        n,
        c_in,
        c_out,
    );
    let mut d_dinp = poisoned::<T>(gpu, n * c_in)?;
    let (mut d_dw, mut d_db) = (gpu.upload(&dw0)?, gpu.upload(&db0)?);
    let (d_dout, d_x, d_w) = (
        gpu.upload_as::<T>(&dout)?,
        gpu.upload_as::<T>(&x)?,
        gpu.upload_as::<T>(&w)?,
    );
    gpu.linear_backward(
        &mut d_dinp,
        &mut d_dw,
        false,
        Some(&mut d_db),
        &d_dout,
        &d_x,
        &d_w,
        n,
        c_in,
        c_out,
        math,
    )?;
    // A gradient whose clear was deferred to its first writer: the product overwrites it and
    // must not read the old contents (NaN here).
    let mut dw_whole = vec![0.0; c_out * c_in];
    cpu::gemm::linear_backward(
        &mut dinp,
        &mut dw_whole,
        None,
        &dout,
        &x,
        &w,
        n,
        c_in,
        c_out,
    );
    let mut d_dw_whole = poisoned::<f32>(gpu, c_out * c_in)?;
    let mut d_dinp2 = poisoned::<T>(gpu, n * c_in)?;
    gpu.linear_backward(
        &mut d_dinp2,
        &mut d_dw_whole,
        true,
        None,
        &d_dout,
        &d_x,
        &d_w,
        n,
        c_in,
        c_out,
        math,
    )?;
    Ok(worst(&[
        rel_err(&gpu.download_f32(&d_dinp)?, &dinp, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_dw)?, &dw0, &dw, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_db)?, &db0, &db, ELEMENTWISE_FLOOR),
        rel_err(&gpu.download(&d_dw_whole)?, &dw_whole, GEMM_FLOOR),
    ]))
}

/// The error of a gradient accumulated into a buffer that started at `start` (random values,
/// which would dominate its scale): what the GPU added (`got - start`) against what the CPU
/// added (`want - start`), so that the check stays sharp.
fn accumulated_err(got: &[f32], start: &[f32], want: &[f32], floor: f64) -> f64 {
    let added = |v: &[f32]| -> Vec<f32> { v.iter().zip(start).map(|(a, s)| a - s).collect() };
    rel_err(&added(got), &added(want), floor)
}

/// The fused GELU products of an MLP against the CPU's separate kernels: `fc` with the GELU
/// in its epilogue (`pre` and `act`), then `proj`'s backward carried through the GELU (`dpre`,
/// and the accumulated `dweight` and `dbias`), `c -> hidden -> c` over `n` rows.
fn check_linear_gelu<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    n: usize,
    c: usize,
    hidden: usize,
    math: GemmMath,
) -> Check {
    let d = T::DTYPE;
    let (x, w_fc, b_fc) = (
        inp.uniform(n * c, 1.0, d),
        inp.uniform(hidden * c, 1.0, d),
        inp.uniform(hidden, 1.0, d),
    );
    let mut pre = vec![0.0; n * hidden];
    cpu::gemm::linear_forward(&mut pre, &x, &w_fc, Some(&b_fc), n, c, hidden);
    let mut act = vec![0.0; n * hidden];
    cpu::gelu::gelu_forward(&mut act, &pre);
    let (mut d_pre, mut d_act) = (
        poisoned::<T>(gpu, n * hidden)?,
        poisoned::<T>(gpu, n * hidden)?,
    );
    gpu.linear_gelu_forward(
        &mut d_pre,
        &mut d_act,
        &gpu.upload_as::<T>(&x)?,
        &gpu.upload_as::<T>(&w_fc)?,
        Some(&gpu.upload_as::<T>(&b_fc)?),
        n,
        c,
        hidden,
        math,
    )?;
    let forward = worst(&[
        rel_err(&gpu.download_f32(&d_pre)?, &pre, GEMM_FLOOR),
        rel_err(&gpu.download_f32(&d_act)?, &act, GEMM_FLOOR),
    ]);
    // The backward takes the pre-activation and the GELU output as stored in the dtype.
    let (pre, act) = (
        inp.uniform(n * hidden, 3.0, d),
        inp.uniform(n * hidden, 1.0, d),
    );
    let (w, dout) = (inp.uniform(c * hidden, 1.0, d), inp.uniform(n * c, 1.0, d));
    let (dw0, db0) = (
        inp.uniform(c * hidden, 1.0, DType::F32),
        inp.uniform(c, 1.0, DType::F32),
    );
    let (mut dpre, mut dw, mut db) = (vec![0.0; n * hidden], dw0.clone(), db0.clone());
    cpu::gemm::linear_backward(
        &mut dpre,
        &mut dw,
        Some(&mut db),
        &dout,
        &act,
        &w,
        n,
        hidden,
        c,
    );
    cpu::gelu::gelu_backward_in_place(&mut dpre, &pre);
    let mut d_dpre = poisoned::<T>(gpu, n * hidden)?;
    let (mut d_dw, mut d_db) = (gpu.upload(&dw0)?, gpu.upload(&db0)?);
    gpu.linear_gelu_backward(
        &mut d_dpre,
        Some(&mut d_dw),
        false,
        Some(&mut d_db),
        &gpu.upload_as::<T>(&dout)?,
        &gpu.upload_as::<T>(&act)?,
        &gpu.upload_as::<T>(&pre)?,
        &gpu.upload_as::<T>(&w)?,
        n,
        hidden,
        c,
        math,
    )?;
    Ok(worst(&[
        forward,
        rel_err(&gpu.download_f32(&d_dpre)?, &dpre, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_dw)?, &dw0, &dw, GEMM_FLOOR),
        accumulated_err(&gpu.download(&d_db)?, &db0, &db, ELEMENTWISE_FLOOR),
    ]))
}

/// A strided-batched product (beta 0, output poisoned) against the CPU's loop of products,
/// error relative to the largest output of the whole batch.
fn check_matmul_batched<T: Elem>(gpu: &CudaBackend, inp: &mut Inputs, g: GemmShape) -> Check {
    let a = inp.uniform(g.batch * g.m * g.k, 1.0, T::DTYPE);
    let b = inp.uniform(g.batch * g.k * g.n, 1.0, T::DTYPE);
    let mut c = vec![0.0; g.batch * g.m * g.n];
    cpu::gemm::sgemm_batched(g, 0.5, &a, &b, 0.0, &mut c);
    let mut d_c = poisoned::<T>(gpu, c.len())?;
    let (d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    gpu.matmul_batched::<T, T>(g, 0.5, &d_a, &d_b, 0.0, &mut d_c, GemmMath::Fp32)?;
    Ok(rel_err(&gpu.download_f32(&d_c)?, &c, GEMM_FLOOR))
}

/// A product whose A (when not transposed, else B) and C are column blocks starting at
/// column `off` of matrices `off + width + 5` wide, C added into (beta 1) and its other
/// columns left as they were.
fn check_matmul_view<T: Elem, TC: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    g: GemmShape,
    off: usize,
) -> Check {
    let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    let view = |cols: usize| MatrixView {
        ld: off + cols + 5,
        offset: off,
    };
    let (va, vb, vc) = (view(ac), MatrixView::packed(bc), view(g.n));
    let a = inp.uniform(ar * va.ld, 1.0, T::DTYPE);
    let b = inp.uniform(br * vb.ld, 1.0, T::DTYPE);
    let c0 = inp.uniform(g.m * vc.ld, 1.0, TC::DTYPE);
    let mut c = c0.clone();
    cpu::gemm::sgemm_strided(g, [va, vb, vc], 0.5, &a, &b, 1.0, &mut c);
    let mut d_c = gpu.upload_as::<TC>(&c0)?;
    let (d_a, d_b) = (gpu.upload_as::<T>(&a)?, gpu.upload_as::<T>(&b)?);
    gpu.matmul_view::<T, TC>(
        g,
        [va, vb, vc],
        0.5,
        &d_a,
        &d_b,
        1.0,
        &mut d_c,
        GemmMath::Fp32,
    )?;
    Ok(rel_err(&gpu.download_f32(&d_c)?, &c, GEMM_FLOOR))
}

/// The unfused attention chain (`train.fused_kernels=false`) on the GPU against the same
/// chain on the CPU, on tensors: forward output and probabilities, then dqkv. The outputs the
/// caller provides start as NaN; the probabilities and intermediates come from kernels whose
/// own checks poison them.
fn check_attention_unfused(
    gpu: &Arc<MemoryPool>,
    inp: &mut Inputs,
    s: AttnShape,
    dtype: DType,
) -> std::result::Result<(f64, f64), String> {
    let run = |pool: &Arc<MemoryPool>, qkv: &[f32], dout: &[f32]| {
        let (b, t, c) = (s.batch, s.seq, s.channels);
        let qkv = Tensor::from_vec(pool, &[b, t, 3 * c], dtype, qkv.to_vec())?;
        let dout = Tensor::from_vec(pool, &[b, t, c], dtype, dout.to_vec())?;
        let mut out = Tensor::from_vec(pool, &[b, t, c], dtype, vec![f32::NAN; b * t * c])?;
        let probs = attention::attention_forward_unfused(&mut out, &qkv, s)?;
        let mut dqkv = Tensor::from_vec(pool, qkv.shape(), dtype, vec![f32::NAN; qkv.len()])?;
        attention::attention_backward_unfused(&mut dqkv, &dout, &qkv, &probs, s)?;
        Ok::<_, crate::engine::EngineError>((out.to_vec()?, probs.to_vec()?, dqkv.to_vec()?))
    };
    let qkv = inp.uniform(s.batch * s.seq * 3 * s.channels, 2.0, dtype);
    let dout = inp.uniform(s.batch * s.seq * s.channels, 1.0, dtype);
    let cpu = MemoryPool::new(Device::Cpu);
    let (out, probs, dqkv) = run(&cpu, &qkv, &dout).map_err(|e| format!("on the CPU: {e}"))?;
    let (g_out, g_probs, g_dqkv) = run(gpu, &qkv, &dout).map_err(|e| e.to_string())?;
    // The output and dqkv are GEMM outputs of a chain whose every intermediate (S, P, dP, dS)
    // is rounded to the activation type on the GPU while the CPU keeps f32: in bf16 a small
    // output element carries an absolute error of about 0.5% of the largest one (1.6% per
    // probability from rounding S near 6, summed over a row), which is 40% of a 1%-floor
    // element -- as eager PyTorch's materialised bf16 attention has. So they are measured
    // as GEMMs are, against the largest element; the probabilities elementwise.
    Ok((
        worst(&[
            rel_err(&g_out, &out, GEMM_FLOOR),
            rel_err(&g_probs, &probs, ELEMENTWISE_FLOOR),
        ]),
        rel_err(&g_dqkv, &dqkv, GEMM_FLOOR),
    ))
}

/// The one transpose combination the linear layer does not use, through `matmul` directly.
fn check_matmul_tt(gpu: &CudaBackend, inp: &mut Inputs, m: usize, k: usize, n: usize) -> Check {
    let (a, b) = (
        inp.uniform(k * m, 1.0, DType::F32),
        inp.uniform(n * k, 1.0, DType::F32),
    );
    let c0 = inp.uniform(m * n, 1.0, DType::F32);
    let mut c = c0.clone();
    cpu::gemm::sgemm(true, true, m, n, k, 0.5, &a, &b, 2.0, &mut c);
    let mut d_c = gpu.upload(&c0)?;
    let (d_a, d_b) = (gpu.upload(&a)?, gpu.upload(&b)?);
    gpu.matmul::<f32, f32>(
        true,
        true,
        m,
        n,
        k,
        0.5,
        &d_a,
        &d_b,
        2.0,
        &mut d_c,
        None,
        GemmMath::Fp32,
    )?;
    Ok(rel_err(&gpu.download(&d_c)?, &c, GEMM_FLOOR))
}

/// A weight for the NF4 checks: uniform values whose 64-value blocks span four decades of
/// scale (so the double-quantised absmax codes spread over the dynamic map), with every 97th
/// block all zeros.
fn nf4_weight(inp: &mut Inputs, n: usize) -> Vec<f32> {
    let mut values = inp.uniform(n, 1.0, DType::F32);
    for (b, block) in values.chunks_mut(cpu::nf4::BLOCK).enumerate() {
        let scale = if b % 97 == 5 {
            0.0
        } else {
            10f32.powi((b % 5) as i32 - 3)
        };
        block.iter_mut().for_each(|v| *v *= scale);
    }
    values
}

/// NF4 weights quantised into `pool` and expanded there into NaN-poisoned f32, bf16 and f16
/// workspaces, against the CPU reference on the host's quantisation of the same values: the
/// parts must arrive unchanged and every output value must be bit-identical. Shapes:
/// SmolLM2's MLP (576 x 1536, 54 groups of 256 blocks), Llama-3.2-1B's down projection
/// (2048 x 8192), a ragged one (37 x 91: the last block padded, the last packed word
/// partial) and a single short row.
fn nf4_checks(
    pool: &Arc<MemoryPool>,
    inp: &mut Inputs,
) -> Vec<(String, std::result::Result<String, String>)> {
    let mut outcomes = Vec::new();
    for (rows, cols) in [(576, 1536), (2048, 8192), (37, 91), (1, 7)] {
        let n = rows * cols;
        let values = nf4_weight(inp, n);
        let reference = cpu::nf4::quantize(&values);
        let before = pool.stats().current;
        let weight = Nf4Weight::quantize(pool, "selftest weight", &values, rows, cols)
            .and_then(|w| Ok((w.to_host_parts()?, w)));
        let weight = match weight {
            Ok((parts, w)) if parts == reference => w,
            Ok(_) => {
                outcomes.push((
                    format!("nf4 quantize {rows}x{cols}"),
                    Err("the parts read back from the device differ from those uploaded".into()),
                ));
                continue;
            }
            Err(e) => {
                outcomes.push((format!("nf4 quantize {rows}x{cols}"), Err(e.to_string())));
                continue;
            }
        };
        let booked = pool.stats().current - before;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut want = vec![0.0; n];
            cpu::nf4::dequantize(reference.view(), &mut want, dtype);
            let got = Tensor::from_vec(pool, &[rows, cols], dtype, vec![f32::NAN; n]).and_then(
                |mut t| {
                    weight.dequantize_into(&mut t)?;
                    t.to_vec()
                },
            );
            let outcome = match got {
                Err(e) => Err(e.to_string()),
                Ok(got) => {
                    let mut differ = got
                        .iter()
                        .zip(&want)
                        .enumerate()
                        .filter(|(_, (g, w))| g.to_bits() != w.to_bits());
                    match differ.next() {
                        None => Ok(format!(
                            "{n} values bit-identical to the CPU reference (weight books {booked} bytes, {:.3} per value)",
                            booked as f64 / n as f64
                        )),
                        Some((i, (g, w))) => Err(format!(
                            "{} of {n} values differ from the CPU reference, the first at {i}: {g} vs {w}",
                            1 + differ.count()
                        )),
                    }
                }
            };
            outcomes.push((
                format!("nf4_dequantize {:?} {rows}x{cols}", dtype).to_lowercase(),
                outcome,
            ));
        }
    }
    outcomes
}

/// The pairwise diversity kernels against the CPU reference (which accumulates in f64): one
/// small set, the largest benchmarked (4096 x 1024), a batch of sets as polychromic training
/// embeds them (64 prompts x 8 replies at MiniLM's width), ragged sizes (a partial row chunk
/// and column block), and clustered sets whose small D would show cancellation. The
/// backward reads the CPU's saved sums, so it is checked on its own; `n = 1` must be refused.
fn diversity_rows(gpu: &CudaBackend, inp: &mut Inputs) -> Vec<Row> {
    use cpu::diversity::SetShape;
    let mut rows = Vec::new();
    let cases = [
        (1, 8, 64, false),
        (1, 4096, 1024, false),
        (64, 8, 384, false),
        (3, 37, 1001, false),
        (16, 16, 384, true),
    ];
    for (sets, n, d, clustered) in cases {
        let shape = SetShape { sets, n, d };
        let label = format!(
            "{sets}x{n}x{d}{}",
            if clustered { " clustered" } else { "" }
        );
        for (dtype, bound) in [("f32", BOUND_FP32), ("bf16", BOUND_BF16)] {
            let (fwd, bwd) = if dtype == "f32" {
                check_diversity::<f32>(gpu, inp, shape, clustered)
            } else {
                check_diversity::<Bf16>(gpu, inp, shape, clustered)
            };
            for (kernel, result) in [("diversity_forward", fwd), ("diversity_backward", bwd)] {
                rows.push(Row {
                    kernel: kernel.into(),
                    dtype,
                    shape: label.clone(),
                    result,
                    bound,
                });
            }
        }
    }
    let single = SetShape {
        sets: 1,
        n: 1,
        d: 64,
    };
    let refused = (|| -> Check {
        let e = gpu.upload_as::<f32>(&inp.uniform(64, 1.0, DType::F32))?;
        let (mut v, mut s, mut r) = (
            gpu.alloc::<f32>(1)?,
            gpu.alloc::<f32>(64)?,
            gpu.alloc::<f32>(1)?,
        );
        Ok(
            match gpu.diversity_forward(&mut v, &mut s, &mut r, &e, single) {
                Err(CudaError::Shape { .. }) => 0.0,
                _ => f64::INFINITY,
            },
        )
    })();
    rows.push(Row {
        kernel: "diversity_forward n=1 refused".into(),
        dtype: "f32",
        shape: "1x1x64".into(),
        result: refused,
        bound: 0.0,
    });
    rows
}

/// One shape and type: (forward: D, s and rnorm; backward: the gradient).
fn check_diversity<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    shape: cpu::diversity::SetShape,
    clustered: bool,
) -> (Check, Check) {
    let (sets, n, d) = (shape.sets, shape.n, shape.d);
    let mut e = inp.uniform(sets * n * d, 1.0, DType::F32);
    if clustered {
        // Each set: one centre plus noise a third its size (D around 0.1).
        for set in e.chunks_mut(n * d) {
            let centre = inp.uniform(d, 1.0, DType::F32);
            for row in set.chunks_mut(d) {
                for (x, c) in row.iter_mut().zip(&centre) {
                    *x = c + 0.3 * *x;
                }
            }
        }
    }
    T::DTYPE.round_slice(&mut e);
    let (mut value, mut s, mut rnorm) = (vec![0.0; sets], vec![0.0; sets * d], vec![0.0; sets * n]);
    if let Err(detail) =
        cpu::diversity::diversity_forward(&mut value, &mut s, &mut rnorm, &e, shape)
    {
        let err = || CudaError::Shape {
            op: "diversity",
            detail: detail.clone(),
        };
        return (Err(err()), Err(err()));
    }
    let fwd = (|| -> Check {
        let d_e = gpu.upload_as::<T>(&e)?;
        let (mut d_v, mut d_s, mut d_r) = (
            poisoned::<f32>(gpu, sets)?,
            poisoned::<f32>(gpu, sets * d)?,
            poisoned::<f32>(gpu, sets * n)?,
        );
        gpu.diversity_forward(&mut d_v, &mut d_s, &mut d_r, &d_e, shape)?;
        Ok(worst(&[
            rel_err(&gpu.download(&d_v)?, &value, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_s)?, &s, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_r)?, &rnorm, ELEMENTWISE_FLOOR),
        ]))
    })();
    let bwd = (|| -> Check {
        let dd = inp.uniform(sets, 2.0, DType::F32);
        let mut de = vec![0.0; e.len()];
        cpu::diversity::diversity_backward(&mut de, &dd, &e, &s, &rnorm, shape).map_err(
            |detail| CudaError::Shape {
                op: "diversity_backward",
                detail,
            },
        )?;
        let (d_e, d_dd) = (gpu.upload_as::<T>(&e)?, gpu.upload(&dd)?);
        let (d_s, d_r) = (gpu.upload(&s)?, gpu.upload(&rnorm)?);
        let mut d_de = poisoned::<T>(gpu, e.len())?;
        gpu.diversity_backward(&mut d_de, &d_dd, &d_e, &d_s, &d_r, shape)?;
        Ok(rel_err(&gpu.download_f32(&d_de)?, &de, ELEMENTWISE_FLOOR))
    })();
    (fwd, bwd)
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
        })
        .unwrap();
    }

    #[test]
    fn only_takes_known_groups() {
        assert_eq!(selected_groups(&[]).unwrap(), GROUPS.to_vec());
        let picked = selected_groups(&["nf4".into(), " kernels".into(), "nf4".into()]).unwrap();
        assert_eq!(picked, vec!["nf4", "kernels"]);
        let e = selected_groups(&["nf5".into()]).unwrap_err();
        assert!(
            e.to_string().contains("unknown group \"nf5\"") && e.exit_code() == 2,
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

//! `kiln bench`: performance measurements (benchmarks, never timed tests).

use crate::config::ResolvedConfig;
use crate::data::{self, Batch, Corpus};
use crate::error::Result;
use crate::models::Model;
use crate::train::{self, Trainer};
use clap::{Args, Subcommand};
use std::time::Instant;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Training throughput (tokens/s) of a model configuration.
    Train(BenchTrainArgs),
    /// Time of each GPU kernel at GPT-2 small sizes, against the measured memory and GEMM rates.
    Kernels(super::bench_kernels::BenchKernelsArgs),
}

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln bench train --device cpu
  kiln bench train --steps 20 model.n_layers=6 train.micro_batch=8")]
pub struct BenchTrainArgs {
    /// Device to measure on: auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Timed optimizer steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Settings file, as for `kiln train`.
    #[arg(long, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Overrides on dotted keys, as for `kiln train`.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(a) => bench_train(a),
        BenchCommand::Kernels(a) => super::bench_kernels::run(a),
    }
}

fn bench_train(a: BenchTrainArgs) -> Result<()> {
    let mut overrides = a.overrides.clone();
    overrides.push(format!("train.device={}", a.device));
    let cfg = ResolvedConfig::resolve(a.config.as_deref(), &overrides)?.config;
    let (pool, precision, notes) = train::open_device(&cfg.train.device, &cfg.train.precision)?;
    let device = pool.device();
    notes.iter().for_each(|n| println!("note: {n}"));
    let tokenizer = data::tokenizer_by_name(&cfg.data.tokenizer)?;
    let corpus = Corpus::load(train::data_spec(&cfg).corpus.as_deref())?;
    let tokens = tokenizer.encode(&corpus.text);
    data::check_train_len(&tokens, cfg.train.seq_len)?;
    let mut trainer = Trainer::new(&cfg, tokenizer.vocab_size(), &pool, precision)?;
    let (b, t, k) = (
        cfg.train.micro_batch,
        cfg.train.seq_len,
        cfg.train.grad_accum,
    );
    let global = |step: u64| -> Vec<Batch> {
        (0..k as u64)
            .map(|m| data::train_batch(&tokens, cfg.train.seed, step, m, b, t))
            .collect()
    };
    let cost = trainer.model.cost(b, t);
    let mut times = Vec::with_capacity(a.steps);
    for step in 0..(a.steps + 2) as u64 {
        let batches = global(step);
        let t0 = Instant::now();
        trainer.step(&batches)?;
        if step >= 2 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens_per_step = (b * t * k) as f64;
    let flops_per_step = (cost.flops_forward + cost.flops_backward) as f64 * k as f64;
    println!(
        "kiln bench train: {} params, d_model {}, {} layers, batch {b} x {t} x accum {k}, {precision} on {device}",
        cost.params, cfg.model.d_model, cfg.model.n_layers
    );
    println!("| metric | value |\n|---|---|");
    println!("| median step time | {:.1} ms |", median * 1e3);
    println!("| tokens/s | {:.0} |", tokens_per_step / median);
    println!(
        "| model FLOP/s | {:.2} GFLOP/s |",
        flops_per_step / median / 1e9
    );
    println!(
        "| FLOPs per token (fwd+bwd) | {:.3} M |",
        flops_per_step / tokens_per_step / 1e6
    );
    println!(
        "| peak memory | {:.1} MiB |",
        trainer.pool.stats().peak as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

//! `kiln bench`: which suite to run; the suites themselves are in [`crate::bench`].

use crate::error::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Training throughput (tokens/s, MFU, peak memory) of a model configuration, its step
    /// split into phases, beside PyTorch on the same shape when torch and a GPU are there.
    Train(crate::bench::train::BenchTrainArgs),
    /// Every CUDA kernel over a grid of row counts at GPT-2 small's width, against the memory
    /// and GEMM rates measured in the same run and the same operation in PyTorch.
    Kernels(crate::bench::kernels::BenchKernelsArgs),
    /// BK-Core forward and backward over batch x N, against the DRAM roofline, cuSPARSE's
    /// batched tridiagonal solve and a PyTorch determinant recurrence.
    Bk(crate::bench::bk::BenchBkArgs),
    /// One model trained in fp32, tf32, bf16-mixed and fp16-mixed: tokens/s, speedup, peak
    /// memory and the loss reached.
    Amp(crate::bench::amp::BenchAmpArgs),
    /// Tokens/s of reading, tokenising, batching and copying, beside a training step's rate.
    Dataloader(crate::bench::dataloader::BenchDataloaderArgs),
    /// Planned against measured pool peak across micro-batch sizes, and the out-of-memory
    /// boundary predicted against the one found by trial.
    Memory(crate::bench::memory::BenchMemoryArgs),
    /// Generation: prefill and decode tokens/s at several batch sizes against the weight-
    /// and cache-read floor, beside transformers generate on the same model.
    Generate(crate::bench::generate::BenchGenerateArgs),
    /// Fine-tuning: kiln LoRA over a bf16 base, kiln QLoRA over an NF4 base and
    /// transformers + PEFT LoRA on one shape: tokens/s, peak memory, base weight bytes, loss.
    Finetune(crate::bench::finetune::BenchFinetuneArgs),
    /// The SCU controller against fixed penalty strengths on one base and data, over seeds:
    /// held-out bits per token, the final share S against its target, lambda over steps.
    Scu(crate::bench::scu::BenchScuArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Train(a) => crate::bench::train::run(a),
        BenchCommand::Kernels(a) => crate::bench::kernels::run(a),
        BenchCommand::Bk(a) => crate::bench::bk::run(a),
        BenchCommand::Amp(a) => crate::bench::amp::run(a),
        BenchCommand::Dataloader(a) => crate::bench::dataloader::run(a),
        BenchCommand::Memory(a) => crate::bench::memory::run(a),
        BenchCommand::Generate(a) => crate::bench::generate::run(a),
        BenchCommand::Finetune(a) => crate::bench::finetune::run(a),
        BenchCommand::Scu(a) => crate::bench::scu::run(a),
    }
}

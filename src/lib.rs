//! kiln: a hardware-aware training engine.
//!
//! The library is layered; a module uses only the ones listed after it:
//! `cli` (one file per subcommand, arguments to options) -> `bench` (the `kiln bench` suites),
//! `selftest` (kernels against their CPU references) -> `report` (benchmark reports: markdown, JSON, PNG
//! plots) -> `train` (the step, precision, checkpoints, metrics) ->
//! `models` (GPT) -> `nn` (layers with explicit backward and cost) -> `optim` ->
//! `data` (corpus, tokenizers, batches) -> `config` -> `hw` (GPU, CPU and RAM detection, probes,
//! the NVML sampler) -> `engine` (devices, tensors, pools, kernels).

pub mod bench;
pub mod classify;
pub mod cli;
pub mod config;
pub mod data;
pub mod dist;
pub mod embed;
pub mod engine;
pub mod error;
pub mod eval;
pub mod generate;
pub mod hw;
pub mod models;
pub mod nn;
pub mod optim;
pub mod plan;
pub mod report;
pub mod selftest;
pub mod train;

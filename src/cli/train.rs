//! `kiln train`: resolve the configuration, train, print the summary.

use crate::error::{KilnError, Result};
use crate::train::{self, RunOptions};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  kiln train                                   train the default small GPT on the bundled corpus
  kiln train train.steps=1000 model.n_layers=6 override any key (see --print-config)
  kiln train --config my.toml --out runs/big   settings from a file, run directory chosen
  kiln train --resume runs/big train.steps=2000 continue a run from its latest checkpoint
  kiln train --init-from SmolLM2-135M-Instruct.Q4_1.gguf --config finetune.toml
                                               fine-tune a pretrained model (HF directory or GGUF)
  kiln train --resume runs/big --checkpoint step_400  continue from an earlier checkpoint
  kiln train --print-config optim.lr=1e-3      show every key, its value and where it came from
  kiln train --profile rtx4090 --print-config  what a named hardware profile would choose
  kiln train --gpus 2 --out runs/dp dist.zero=1 data-parallel on 2 GPUs, optimizer state sharded
  torchrun --nproc-per-node 8 $(which kiln) train --out runs/dp   the same under torchrun (or srun)

A run directory holds config.toml (the resolved settings), metrics.jsonl (one JSON object per
log step and eval), checkpoints/ (weights and optimizer state as safetensors, trainer state as
JSON, each with a manifest of sizes and CRC-32s that every reader checks) and summary.json.
run.lock holds the pid and host of the process training it: a second writer is refused.
Checkpoints are written by a background thread from a host copy of the state (page-locked
beside a GPU); train.checkpoint_async=false saves in line, training waiting for the write.

SIGTERM or SIGINT saves a checkpoint at the next step boundary and exits with code 75
(requeue; resume with --resume); a second SIGINT exits at once (130). SIGUSR1 saves a
checkpoint and goes on.

EXIT CODES:
  0 done   2 bad setting or argument   3 bad data   4 bad checkpoint or run directory
  5 NaN/inf loss   6 out of memory   7 unwritable output   9 run directory locked
  11 another rank of a data-parallel run failed, or the rendezvous did
  75 stopped by a signal, checkpoint saved (requeue)   130 second SIGINT   1 device failure")]
pub struct TrainArgs {
    /// TOML file with settings (sections [model], [data], [train], [optim]).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Hardware profile: auto (match the detected GPU, then derive precision, micro-batch,
    /// recomputation and offload from it), h100, a100, rtx4090, rtx3090, lowmem, cpu, a
    /// .toml file, or none.
    #[arg(long, value_name = "NAME", default_value = "auto")]
    pub profile: String,
    /// Run directory to create (default: runs/run-<UTC time>).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its latest checkpoint, with its saved config.toml as the
    /// settings file (overrides still apply).
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    pub resume: Option<PathBuf>,
    /// Start from a pretrained model: a Hugging Face directory (config.json, safetensors,
    /// tokenizer.json) or a GGUF file. Its shape, tokenizer and weights replace the model
    /// settings; model.* keys that contradict it are refused.
    #[arg(long, value_name = "PATH", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// With --resume: continue from this checkpoint (step_N or N) instead of the latest, for
    /// instance when the latest is damaged (`kiln verify DIR` lists those that verify).
    #[arg(long, value_name = "step_N", requires = "resume")]
    pub checkpoint: Option<String>,
    /// Stop after optimizer step N, keeping the LR schedule of train.steps (resume later).
    #[arg(long, value_name = "N")]
    pub stop_after: Option<u64>,
    /// Print every setting with its value and origin, then exit without training.
    #[arg(long)]
    pub print_config: bool,
    /// Device: auto (the first GPU, else the CPU), cpu, cuda or cuda:N. Same as train.device=...
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Print only the final summary.
    #[arg(long, short)]
    pub quiet: bool,
    /// Write a Chrome trace (open it in Perfetto) of the phases of the steps in
    /// --trace-steps: data wait, forward+backward, optimizer, eval, checkpoint. The device is
    /// synchronised at each phase boundary of those steps only.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Steps to trace, A..B (A to B-1) or A..=B, counted from 1.
    #[arg(long, value_name = "A..B", default_value = "2..=4", requires = "trace")]
    pub trace_steps: String,
    /// On a GPU, run only steps A..B (A to B-1) or A..=B, counted from 1, under an attached
    /// profiler's collection (cuProfilerStart before the first, cuProfilerStop after the
    /// last): `nsys profile --capture-range=cudaProfilerApi` or `ncu --profile-from-start off`
    /// then see those steps alone, without the start-up's kernels. Nothing is synchronised.
    #[arg(long, value_name = "A..B")]
    pub profile_steps: Option<String>,
    /// Train data-parallel on N GPUs of this machine (or all), one process per GPU, through
    /// NCCL. Under torchrun or srun leave it out: kiln reads RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR and MASTER_PORT (or SLURM_*) itself.
    #[arg(long, value_name = "N|all")]
    pub gpus: Option<String>,
    /// Machines in the job (with --gpus N on each; default 1).
    #[arg(long, value_name = "N")]
    pub nnodes: Option<usize>,
    /// This machine's place among --nnodes, from 0 (the one that hosts the rendezvous).
    #[arg(long, value_name = "I")]
    pub node_rank: Option<usize>,
    /// Host of the rendezvous (the machine with --node-rank 0); default MASTER_ADDR, else
    /// 127.0.0.1 on one machine.
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// TCP port of the rendezvous; default MASTER_PORT, else 29500.
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Overrides on dotted keys, e.g. train.steps=100 optim.lr=1e-3 data.tokenizer=gpt2.
    #[arg(value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
}

/// Reads the data-parallel launch from the flags and the environment; starts the ranks when
/// this process is the `--gpus N` launcher (and exits with the job's code).
fn data_parallel(a: &TrainArgs) -> Result<Option<crate::dist::World>> {
    use crate::dist::{Launch, LaunchFlags, launch, spawn};
    let flags = LaunchFlags {
        gpus: a.gpus.clone(),
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr.clone(),
        master_port: a.master_port,
    };
    let env: std::collections::HashMap<String, String> = std::env::vars().collect();
    // On the CPU, `--gpus N` starts N processes that reduce over TCP: the same launcher and
    // ranks without a GPU (how the tests run them).
    let on_cpu = a.device.as_deref() == Some("cpu")
        || a.overrides.iter().any(|o| o.trim() == "train.device=cpu");
    let gpus_here = match (&a.gpus, on_cpu) {
        (None, _) => 0,
        (Some(n), true) => n.parse::<usize>().unwrap_or(0),
        (Some(_), false) => crate::engine::cuda::device_count().unwrap_or(0),
    };
    match launch::resolve(&flags, &env, gpus_here).map_err(KilnError::Setting)? {
        Launch::Single => Ok(None),
        Launch::Rank(w) => {
            if w.world_size > 1 && a.out.is_none() && a.resume.is_none() {
                return Err(KilnError::Setting(format!(
                    "rank {} of {}: every rank must name the same run directory; add --out DIR (or --resume DIR)",
                    w.rank, w.world_size
                )));
            }
            Ok(Some(w))
        }
        Launch::Spawn {
            procs,
            nnodes,
            node_rank,
            master_addr,
            master_port,
        } => {
            let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            if a.out.is_none() && a.resume.is_none() {
                if nnodes > 1 {
                    return Err(KilnError::Setting(
                        "--nnodes: every machine must name the same run directory (on storage they share); add --out DIR".into(),
                    ));
                }
                args.push("--out".into());
                args.push(super::new_run_dir().into());
            }
            eprintln!(
                "kiln: starting {procs} rank(s) on this machine (world size {}, rendezvous {master_addr}:{master_port})",
                procs * nnodes
            );
            let code = spawn::run(&spawn::SpawnPlan {
                procs,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                args,
            })
            .map_err(KilnError::Dist)?;
            std::process::exit(code);
        }
    }
}

pub fn run(a: TrainArgs) -> Result<()> {
    let trace = match &a.trace {
        Some(path) => Some(train::trace::TraceOptions {
            path: path.clone(),
            steps: train::trace::parse_steps(&a.trace_steps).map_err(KilnError::Setting)?,
        }),
        None => None,
    };
    let profile_steps = match &a.profile_steps {
        Some(s) => Some(
            train::trace::parse_steps(s)
                .map_err(|e| KilnError::Setting(e.replace("--trace-steps", "--profile-steps")))?,
        ),
        None => None,
    };
    // A wrong --resume path is about the run directory, not about --config.
    if let Some(dir) = &a.resume
        && !dir.join("config.toml").is_file()
    {
        return Err(train::not_a_run(dir));
    }
    // clap's `requires` is not enforced next to --out, which --resume conflicts with.
    if a.checkpoint.is_some() && a.resume.is_none() {
        return Err(KilnError::Setting(
            "--checkpoint selects the checkpoint to continue from, so it needs --resume DIR".into(),
        ));
    }
    if a.stop_after == Some(0) {
        return Err(KilnError::Setting(
            "--stop-after 0 would stop before the first step; give a step of 1 or more".into(),
        ));
    }
    let world = data_parallel(&a)?;
    let file = a
        .config
        .clone()
        .or_else(|| a.resume.as_ref().map(|d| d.join("config.toml")));
    let init = match &a.init_from {
        Some(path) => {
            let mut p = crate::models::import::pretrained::open(path)?;
            p.check_overrides(&a.overrides)?;
            p.source.hash_files()?;
            Some(p)
        }
        None => None,
    };
    let mut overrides = init.as_ref().map_or_else(Vec::new, |p| p.overrides());
    overrides.extend(a.overrides.iter().cloned());
    if let Some(d) = &a.device {
        overrides.push(format!("train.device={d}"));
    }
    let settings = crate::config::settings::resolve(&a.profile, file.as_deref(), &overrides)?;
    if a.print_config {
        println!("# {}", settings.profile_note);
        print!("{}", settings.config.render());
        return Ok(());
    }
    let config = settings.config;
    let run_dir = a
        .resume
        .clone()
        .or(a.out)
        .unwrap_or_else(super::new_run_dir);
    let config_micro_batch = config.config.train.micro_batch;
    let summary = train::run(RunOptions {
        config,
        run_dir: run_dir.clone(),
        resume: a.resume.is_some(),
        checkpoint: a.checkpoint.clone(),
        stop_after: a.stop_after,
        quiet: a.quiet,
        trace,
        profile_steps,
        init,
        world: world.clone(),
    })?;
    if world.as_ref().is_some_and(|w| !w.is_root()) {
        // Rank 0 reports the run.
        return Ok(());
    }
    if run_dir.starts_with(super::RUNS_DIR) {
        super::record_latest_run(&run_dir);
    }
    println!(
        "done: {} steps, {} tokens in {:.0}s ({:.0} tok/s) on {} ({})",
        summary.steps,
        summary.tokens,
        summary.elapsed_s,
        summary.tokens_per_s,
        summary.device,
        summary.precision
    );
    println!(
        "val loss {:.4} ({:.3} bits/token) vs unigram {:.4}; train loss {:.4}",
        summary.val_loss, summary.val_bits_per_token, summary.unigram_val_loss, summary.train_loss
    );
    if let Some(e) = &summary.early_stop {
        let kept = train::checkpoint::best(&run_dir)
            .filter(|b| b.is_dir())
            .map(|b| format!("; kept in {} (--checkpoint best)", b.display()))
            .unwrap_or_default();
        println!(
            "best val loss {:.4} at step {}{kept}{}",
            e.best_val_loss,
            e.best_step,
            if e.stopped {
                "; stopped early, before train.steps"
            } else {
                ""
            }
        );
    }
    if summary.effective_micro_batch < config_micro_batch {
        println!(
            "micro-batch: {} sequences per forward/backward pass after running out of memory (train.micro_batch={config_micro_batch}; the global batch was kept)",
            summary.effective_micro_batch
        );
    }
    match &summary.checkpoint {
        Some(c) => {
            println!("checkpoint: {c}");
            println!(
                "run directory: {}   (try: kiln generate --run {})",
                run_dir.display(),
                run_dir.display()
            );
        }
        None => println!(
            "run directory: {}   (no checkpoint: train.save_final=false)",
            run_dir.display()
        ),
    }
    Ok(())
}

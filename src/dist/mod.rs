//! Data parallelism over NCCL: one process per GPU, on one machine or many.
//!
//! **Why a process per GPU, not a thread.** Launchers people already use (`torchrun`,
//! Slurm's `srun`) start one process per GPU and describe it through the environment; with
//! processes, `kiln train --gpus N` on one machine and a job of many machines are the same
//! program, every rank keeps the single-GPU engine as it is (one CUDA context, one compute
//! stream, its own memory pool and planner), one rank's crash cannot corrupt another's state,
//! and a driver lock shared by threads cannot serialise the launches of several GPUs.
//!
//! - [`launch`]: the rank, world and rendezvous address from the environment or the flags.
//! - [`control`]: the TCP rendezvous, small collectives that keep ranks in step, the failure watch.
//! - [`shard`]: the data split, the gradient buckets, ZeRO ownership and the per-GPU bytes.
//! - [`nccl`]: the communicator and the collectives on its own stream.
//! - [`ddp`]: the trainer's side: bucketed reduction overlapping backward, ZeRO-1/2.
//! - [`spawn`]: `kiln train --gpus N` starting its ranks and watching them.

pub mod control;
pub mod ddp;
pub mod launch;
pub mod nccl;
pub mod shard;
pub mod spawn;

pub use ddp::{DataParallel, DistSettings};
pub use launch::{Launch, LaunchFlags, World};
pub use shard::ZeroStage;

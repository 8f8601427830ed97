//! The error every public entry point returns, and the exit code each kind maps to.
//!
//! Each variant's message is written for the person at the terminal: what went wrong, where,
//! and what to do about it.

use crate::config::ConfigError;
use crate::data::DataError;
use crate::engine::EngineError;
use std::path::PathBuf;
use thiserror::Error;

impl From<ConfigError> for KilnError {
    fn from(e: ConfigError) -> Self {
        KilnError::Config(Box::new(e))
    }
}

#[derive(Debug, Error)]
pub enum KilnError {
    /// Boxed: config errors carry the offending key, value and origin, and would otherwise
    /// make every `Result` in the crate that large.
    #[error(transparent)]
    Config(Box<ConfigError>),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A setting that is valid on its own but impossible here (a device or mode this machine lacks).
    #[error("{0}")]
    Setting(String),
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint { path: PathBuf, reason: String },
    #[error(
        "training stopped: the {what} at step {step} is {value}; {kept}. Lower optim.lr, set optim.grad_clip, or use train.precision=fp32, then resume"
    )]
    NonFinite {
        what: &'static str,
        step: u64,
        value: f64,
        kept: String,
    },
    /// Memory ran out with one sequence per forward/backward pass: splitting the micro-batch
    /// further is impossible. The message says what was asked for, what the device or cap
    /// holds and which settings use less memory.
    #[error("out of memory: {0}")]
    DoesNotFit(String),
    /// A layer met or produced inf/NaN during a training step (a potential reaching the
    /// BK-Core, say); the layer names itself in `source`, the trainer adds the step.
    #[error(
        "training stopped at step {step}: {source}; {kept}. Lower optim.lr, set optim.grad_clip, or use train.precision=fp32, then resume"
    )]
    LayerNonFinite {
        step: u64,
        // Boxed: it would make every kiln error larger than clippy allows for a `Result`.
        source: Box<EngineError>,
        kept: String,
    },
    /// A GPU kernel disagreed with its CPU reference, or the GPU backend failed to start.
    #[error("selftest: {0}")]
    SelfTest(String),
    #[error("cannot write {}: {reason}; choose a writable --out directory", path.display())]
    Output { path: PathBuf, reason: String },
    /// A run directory that is missing or not one `kiln train` wrote (exit 4, like a bad
    /// checkpoint: the input to read is what is wrong, not a setting).
    #[error("run directory {}: {reason}", path.display())]
    RunDir { path: PathBuf, reason: String },
    /// Another live process holds the run directory's lock.
    #[error(
        "run directory {} is in use by {holder} (lock file run.lock); wait for that run to finish or stop it, or choose another --out",
        path.display()
    )]
    Locked { path: PathBuf, holder: String },
    /// `kiln verify` found nothing damaged, but checkpoints written before checkpoints carried
    /// manifests (format version 1), whose files it could not check: a code of its own, so a
    /// script can tell "unverified" from both "verified" (0) and "damaged" (4).
    #[error(
        "run directory {}: legacy (no manifest): unverified: {} (written before checkpoints carried manifests, so the files cannot be checked; nothing that can be checked is damaged). Legacy checkpoints load, with a warning; `kiln verify {} --adopt` records the checksums of their files as they are now, trusting them, after which they verify",
        path.display(),
        names.join(", "),
        path.display()
    )]
    Unverified { path: PathBuf, names: Vec<String> },
    /// A data-parallel job could not start or keep going: the rendezvous failed, or another
    /// rank failed or vanished. The message names the rank, host or address concerned.
    #[error("data-parallel run: {0}")]
    Dist(String),
    /// Training stopped on SIGTERM or SIGINT after saving a checkpoint: not a failure, but a
    /// code of its own so a scheduler can requeue the job (which then resumes).
    #[error(
        "stopped by {signal} at step {step}; checkpoint saved at {}. Continue with: kiln train --resume {}",
        checkpoint.display(),
        run_dir.display()
    )]
    Stopped {
        signal: &'static str,
        step: u64,
        checkpoint: PathBuf,
        run_dir: PathBuf,
    },
}

/// Exit code of a run stopped by a signal with its checkpoint saved: 75 is `EX_TEMPFAIL` of
/// sysexits.h ("try again later"), the code schedulers and wrappers conventionally requeue on.
pub const STOPPED_EXIT_CODE: i32 = 75;

/// Exit code of `kiln verify` for a run whose only findings are legacy checkpoints (no
/// manifest, so unverified); see [`KilnError::Unverified`].
pub const UNVERIFIED_EXIT_CODE: i32 = 10;

impl KilnError {
    /// Process exit code: 2 for bad settings (as for bad flags), then one code per kind.
    /// 1 is left for failures of the device or its libraries that none of these describe.
    pub fn exit_code(&self) -> i32 {
        match self {
            KilnError::Config(_) | KilnError::Setting(_) => 2,
            KilnError::Data(_) => 3,
            KilnError::Checkpoint { .. } | KilnError::RunDir { .. } => 4,
            KilnError::NonFinite { .. } | KilnError::LayerNonFinite { .. } => 5,
            KilnError::DoesNotFit(_) => 6,
            KilnError::Engine(e) if e.is_out_of_memory() => 6,
            KilnError::Output { .. } => 7,
            KilnError::SelfTest(_) => 8,
            KilnError::Locked { .. } => 9,
            KilnError::Unverified { .. } => UNVERIFIED_EXIT_CODE,
            KilnError::Stopped { .. } => STOPPED_EXIT_CODE,
            KilnError::Dist(_) => crate::dist::control::PEER_FAILED_EXIT_CODE,
            KilnError::Engine(_) => 1,
        }
    }

    pub(crate) fn output(path: impl Into<PathBuf>, err: impl std::fmt::Display) -> KilnError {
        KilnError::Output {
            path: path.into(),
            reason: err.to_string(),
        }
    }

    pub(crate) fn run_dir(path: impl Into<PathBuf>, reason: impl Into<String>) -> KilnError {
        KilnError::RunDir {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> KilnError {
        KilnError::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, KilnError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_non_finite_error_names_layer_and_step_and_exits_5() {
        let e = KilnError::LayerNonFinite {
            step: 42,
            source: Box::new(EngineError::NonFinite {
                layer: "bk_core layer blocks.3.bk".into(),
                detail: "the potential v is NaN at sequence 0, position 7".into(),
            }),
            kept: "no checkpoint had been written yet".into(),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("step 42") && msg.contains("blocks.3.bk"),
            "{msg}"
        );
        assert_eq!(e.exit_code(), 5);
    }
}

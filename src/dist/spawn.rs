//! `kiln train --gpus N`: starts one rank per GPU of this machine (this same program, with the
//! environment `torchrun` would give it), watches them, and ends the job as a whole: when one
//! rank fails, the others are stopped by the control plane within moments and, failing that,
//! killed here after a grace period. SIGTERM (and SIGUSR1) to this process is passed on to every
//! rank, which then saves a checkpoint at the next step boundary as a single run does; SIGINT
//! from a terminal reaches the ranks directly, as they share its process group.

use super::control::PEER_FAILED_EXIT_CODE;
use super::launch::rank_env;
use std::ffi::OsString;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// How long ranks may take to stop after one failed before they are killed.
const GRACE: Duration = Duration::from_secs(60);

pub struct SpawnPlan {
    pub procs: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The arguments every rank runs with (this process's own, plus `--out` when it chose
    /// the run directory).
    pub args: Vec<OsString>,
}

/// Runs the ranks to the end and returns the job's exit code: 0 when every rank succeeded,
/// else the code of the first rank that failed for a reason of its own (not because another
/// rank failed).
pub fn run(plan: &SpawnPlan) -> Result<i32, String> {
    // SIGTERM and SIGUSR1 to this process are passed on, not fatal to it.
    let _handlers = crate::train::signals::install();
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the kiln executable: {e}"))?;
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..plan.procs {
        let mut cmd = Command::new(&exe);
        cmd.args(&plan.args);
        for (k, v) in rank_env(
            plan.procs,
            plan.nnodes,
            plan.node_rank,
            local,
            &plan.master_addr,
            plan.master_port,
        ) {
            cmd.env(k, v);
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        let rank = plan.node_rank * plan.procs + local;
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                }
                return Err(format!("cannot start rank {rank}: {e}"));
            }
        }
    }
    let mut codes: Vec<Option<i32>> = vec![None; children.len()];
    let mut first_failure: Option<Instant> = None;
    let mut forwarded = false;
    loop {
        for (k, (_, child)) in children.iter_mut().enumerate() {
            if codes[k].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                let code = status.code().unwrap_or(1);
                codes[k] = Some(code);
                if code != 0 && first_failure.is_none() {
                    first_failure = Some(Instant::now());
                }
            }
        }
        if codes.iter().all(Option::is_some) {
            break;
        }
        if !forwarded && crate::train::signals::stop_requested() == Some("SIGTERM") {
            // SIGINT from a terminal reaches every rank already (one process group).
            for (_, c) in &children {
                // SAFETY: kill(2) on a child's pid with a valid signal number.
                unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            }
            forwarded = true;
        }
        if crate::train::signals::take_save_request() {
            for (_, c) in &children {
                // SAFETY: kill(2) on a child's pid with a valid signal number.
                unsafe { libc::kill(c.id() as i32, libc::SIGUSR1) };
            }
        }
        if first_failure.is_some_and(|t| t.elapsed() > GRACE) {
            for (k, (rank, c)) in children.iter_mut().enumerate() {
                if codes[k].is_none() {
                    eprintln!(
                        "kiln: rank {rank} did not stop within {} s of another rank's failure; killing it",
                        GRACE.as_secs()
                    );
                    let _ = c.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let codes: Vec<i32> = codes.into_iter().map(|c| c.unwrap_or(1)).collect();
    Ok(job_code(&codes))
}

/// The job's exit code from its ranks' codes (in rank order).
pub fn job_code(codes: &[i32]) -> i32 {
    if codes.iter().all(|&c| c == 0) {
        return 0;
    }
    codes
        .iter()
        .copied()
        .find(|&c| c != 0 && c != PEER_FAILED_EXIT_CODE)
        .or_else(|| codes.iter().copied().find(|&c| c != 0))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_reports_the_rank_that_failed_first_for_its_own_reason() {
        assert_eq!(job_code(&[0, 0]), 0);
        assert_eq!(job_code(&[PEER_FAILED_EXIT_CODE, 3]), 3);
        assert_eq!(job_code(&[75, 75]), 75);
        assert_eq!(
            job_code(&[PEER_FAILED_EXIT_CODE, PEER_FAILED_EXIT_CODE]),
            PEER_FAILED_EXIT_CODE
        );
        assert_eq!(job_code(&[0, 6]), 6);
    }
}

//! The run-directory lock: one writer per run directory.
//!
//! `kiln train` holds an OS advisory lock (`flock`, exclusive) on `RUN/run.lock` for the life of
//! the process, so a second `kiln train --out RUN` or a `--resume RUN` of a live run is refused
//! instead of interleaving checkpoints, `latest` and `metrics.jsonl`. The holder writes its pid,
//! host and start time into the file so the refusal can name it.
//!
//! The kernel drops a `flock` when its holder exits, however it exits (SIGKILL included), so a
//! lock file left by a dead process is not a lock: the next run takes the lock and says whose
//! it was. The file is never deleted (unlinking a locked file lets a third process lock a new
//! inode of the same name); a clean exit empties it instead, so an empty file means no holder.

use crate::error::{KilnError, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub const LOCK_FILE: &str = "run.lock";

/// The held lock; dropping it empties the file and releases the lock.
pub struct RunLock {
    file: File,
    path: PathBuf,
    /// Whether this process created the lock file (so a failed start can remove it).
    pub created: bool,
    /// The holder recorded in the file by a process that died without releasing it.
    pub stale_holder: Option<String>,
}

/// Who holds a lock, as its holder wrote it: `pid 123 on host h since 2026-...`.
fn describe(record: &str) -> Option<String> {
    let field = |key: &str| {
        record
            .lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
    };
    let pid = field("pid=")?;
    let host = field("host=").unwrap_or_else(|| "unknown".into());
    let since = field("started_unix=")
        .map(|s| format!(" since unix time {s}"))
        .unwrap_or_default();
    Some(format!("pid {pid} on host {host}{since}"))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

impl RunLock {
    /// Takes the lock of `run_dir` (which must exist) or says who holds it.
    pub fn acquire(run_dir: &Path) -> Result<RunLock> {
        let path = run_dir.join(LOCK_FILE);
        let created = !path.exists();
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| KilnError::output(&path, e))?;
        // SAFETY: flock on a descriptor this function owns; no memory is shared with the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        let mut record = String::new();
        let _ = file.read_to_string(&mut record);
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = describe(&record).unwrap_or_else(|| "another process".into());
                return Err(KilnError::Locked {
                    path: run_dir.to_path_buf(),
                    holder,
                });
            }
            return Err(KilnError::output(&path, format!("cannot lock: {err}")));
        }
        let stale_holder = describe(&record);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mine = format!(
            "pid={}\nhost={}\nstarted_unix={now}\n",
            std::process::id(),
            host_name()
        );
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(mine.as_bytes()))
            .and_then(|_| file.sync_all())
            .map_err(|e| KilnError::output(&path, e))?;
        Ok(RunLock {
            file,
            path,
            created,
            stale_holder,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Emptied while still held, so no other process sees a half-cleared record; the lock
        // itself goes with the descriptor.
        let _ = self.file.set_len(0);
    }
}

/// The live holder of `run_dir`'s lock, if any (for `kiln verify`). Takes and drops a shared
/// lock, so it never blocks and never disturbs a holder.
pub fn holder(run_dir: &Path) -> Option<String> {
    let path = run_dir.join(LOCK_FILE);
    let mut file = File::open(&path).ok()?;
    // SAFETY: as in `acquire`.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        // SAFETY: as above; releasing the shared lock taken just now.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
        return None;
    }
    let mut record = String::new();
    let _ = file.read_to_string(&mut record);
    Some(describe(&record).unwrap_or_else(|| "another process".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        assert!(first.created && first.stale_holder.is_none());
        let err = RunLock::acquire(dir.path())
            .err()
            .expect("second lock refused");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(holder(dir.path()).is_some());
        drop(first);
        assert!(holder(dir.path()).is_none());
        let again = RunLock::acquire(dir.path()).unwrap();
        assert!(!again.created && again.stale_holder.is_none());
    }

    #[test]
    fn a_record_left_by_a_dead_process_is_taken_over_and_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(LOCK_FILE),
            "pid=999999\nhost=gone\nstarted_unix=1\n",
        )
        .unwrap();
        let lock = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(
            lock.stale_holder.as_deref(),
            Some("pid 999999 on host gone since unix time 1")
        );
    }
}

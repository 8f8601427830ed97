//! Graceful stops: SIGTERM and SIGINT ask the run to save a checkpoint at the next step
//! boundary and exit with [`STOPPED_EXIT_CODE`](crate::error::STOPPED_EXIT_CODE), which
//! schedulers can requeue on; a second SIGINT exits at once (code 130, as a shell reports an
//! interrupted command); SIGUSR1 saves a checkpoint without stopping.
//!
//! The handlers only set atomics (all a signal handler may safely do, besides `_exit`); the
//! training loop polls them between steps, so a step is never cut in half and the checkpoint
//! is the same one a scheduled save would write.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

static STOP: AtomicI32 = AtomicI32::new(0);
static SAVE: AtomicBool = AtomicBool::new(false);
static INTERRUPTS: AtomicU32 = AtomicU32::new(0);

/// Exit code of a second SIGINT (128 + SIGINT, what shells report for Ctrl-C).
pub const INTERRUPTED_EXIT_CODE: i32 = 130;

extern "C" fn on_signal(sig: libc::c_int) {
    match sig {
        libc::SIGINT => {
            if INTERRUPTS.fetch_add(1, Ordering::SeqCst) >= 1 {
                // SAFETY: _exit is async-signal-safe; the user asked to stop now.
                unsafe { libc::_exit(INTERRUPTED_EXIT_CODE) };
            }
            STOP.store(sig, Ordering::SeqCst);
        }
        libc::SIGTERM => STOP.store(sig, Ordering::SeqCst),
        libc::SIGUSR1 => SAVE.store(true, Ordering::SeqCst),
        _ => {}
    }
}

const SIGNALS: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1];

/// The installed handlers; dropping this restores the ones before.
pub struct Handlers {
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

/// Installs the handlers for the life of the returned value.
pub fn install() -> Handlers {
    STOP.store(0, Ordering::SeqCst);
    SAVE.store(false, Ordering::SeqCst);
    INTERRUPTS.store(0, Ordering::SeqCst);
    let mut previous = Vec::new();
    for sig in SIGNALS {
        // SAFETY: a zeroed sigaction is valid; the handler only touches atomics (or _exits).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // SA_RESTART: reads and writes in other threads go on instead of failing EINTR.
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &action, &mut old) == 0 {
                previous.push((sig, old));
            }
        }
    }
    Handlers { previous }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        for (sig, old) in &self.previous {
            // SAFETY: restoring the action saved by `install`.
            unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
        }
    }
}

/// The signal that asked the run to stop, if one did.
pub fn stop_requested() -> Option<&'static str> {
    match STOP.load(Ordering::SeqCst) {
        libc::SIGTERM => Some("SIGTERM"),
        libc::SIGINT => Some("SIGINT"),
        _ => None,
    }
}

/// Whether SIGUSR1 asked for a checkpoint since the last call.
pub fn take_save_request() -> bool {
    SAVE.swap(false, Ordering::SeqCst)
}

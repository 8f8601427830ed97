//! The `kiln` command line: parse, call the library, map errors to exit codes.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // NCCL's NVLink multicast (NVLS) hangs or fails on some multi-GPU machines; it stays off
    // in every process kiln starts unless the user chose otherwise.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: the first statement of main, before any other thread exists.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    // In a data-parallel job every rank prints its own errors; say whose they are.
    let who = match (std::env::var("RANK"), std::env::var("WORLD_SIZE")) {
        (Ok(r), Ok(w)) if w != "1" => format!(" (rank {r})"),
        _ => String::new(),
    };
    let cli = kiln::cli::Cli::parse();
    match kiln::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A graceful stop and an unverified legacy checkpoint are not failures; their messages
            // say how to go on.
            match e {
                kiln::error::KilnError::Stopped { .. }
                | kiln::error::KilnError::Unverified { .. } => {
                    eprintln!("{e}")
                }
                _ => eprintln!("error{who}: {e}"),
            }
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

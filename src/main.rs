//! The `kiln` command line: parse, call the library, map errors to exit codes.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
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
                _ => eprintln!("error: {e}"),
            }
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

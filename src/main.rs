//! The `kiln` command line: parse, call the library, map errors to exit codes.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = kiln::cli::Cli::parse();
    match kiln::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A graceful stop is not a failure; its message says how to continue.
            match e {
                kiln::error::KilnError::Stopped { .. } => eprintln!("{e}"),
                _ => eprintln!("error: {e}"),
            }
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

//! The `allocbox` command; see [`allocbox_cli::run`].

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(allocbox_cli::run(std::env::args_os()))
}

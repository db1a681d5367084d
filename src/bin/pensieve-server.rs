//! `pensieve-server`: the OpenAI-compatible HTTP server (`pensieve::server`).

use std::process::ExitCode;

fn main() -> ExitCode {
    pensieve::server::main(std::env::args_os())
}

//! How an example reports failure: one line with the error's causes, and a non-zero exit.

use std::error::Error;
use std::process::ExitCode;

/// The exit code of an example's run: on failure, prints `error: ` and the error with each
/// cause the message does not already include, on one line.
pub fn exit_code(result: Result<(), Box<dyn Error>>) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    let mut line = format!("error: {e}");
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        cause = c.source();
    }
    eprintln!("{line}");
    ExitCode::FAILURE
}

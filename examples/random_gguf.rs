//! Writes the small gpt-oss GGUF file of seeded random weights (experts in MXFP4) that
//! `tests/llamacpp_gguf_reference.rs` writes again from the seed:
//! `scripts/reference/llamacpp_gguf_logits.py` runs llama.cpp on it.
//!
//! ```text
//! cargo run --release --example random_gguf -- SEED OUT.gguf
//! ```

use std::path::PathBuf;

use clap::Parser;

#[path = "../tests/common/gguf_writer.rs"]
mod gguf_writer;

#[derive(Parser, Debug)]
struct Args {
    /// The weights' seed.
    seed: u64,
    /// The file to write.
    out: PathBuf,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (meta, tensors) = gguf_writer::tiny_gpt_oss(args.seed);
    gguf_writer::write(&args.out, &meta, &tensors)?;
    Ok(())
}

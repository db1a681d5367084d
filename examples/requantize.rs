//! Re-quantizes a GGUF model's matrices into another GGUF type, as `llama-quantize` does (rows
//! that are not whole blocks of the type take llama.cpp's fallback type).
//!
//! ```text
//! cargo run --release --example requantize -- --to q4_k OUT.gguf [--from IN.gguf]
//! ```
//! Without `--from`, the default model (SmolLM2-135M-Instruct Q4_1) is read.

use std::path::PathBuf;

use clap::Parser;
use pensieve::model::default_model_path;

#[path = "common/requantize.rs"]
mod requantize;

#[derive(Parser, Debug)]
struct Args {
    /// The target type: q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, f16, bf16, f32.
    #[arg(long)]
    to: String,
    /// The file to read (default: the default model).
    #[arg(long)]
    from: Option<PathBuf>,
    /// The file to write.
    out: PathBuf,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let target = requantize::dtype(&args.to).ok_or_else(|| {
        let names: Vec<&str> = requantize::TYPES.iter().map(|(n, _)| *n).collect();
        format!("unknown type {} (known: {})", args.to, names.join(", "))
    })?;
    let from = args.from.unwrap_or_else(default_model_path);
    eprintln!("re-quantizing {} to {target:?} ...", from.display());
    requantize::requantize(&from, &args.out, target)?;
    println!("{}", args.out.display());
    Ok(())
}

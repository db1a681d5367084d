//! Writes a checkpoint of seeded random weights for a `config.json`, as pensieve's
//! reference tests write it: `model.safetensors` (Hugging Face names) and the config, in a
//! folder. `scripts/reference/transformers_logits.py` runs Hugging Face `transformers` on it;
//! `tests/transformers_reference.rs` writes the same weights again from the seed.
//!
//! ```text
//! cargo run --release --example random_checkpoint -- CONFIG.json SEED OUT_DIR
//! ```

use std::path::PathBuf;

use candle_core::Device;
use clap::Parser;
use pensieve::model::{ModelConfig, Transformer};

#[derive(Parser, Debug)]
struct Args {
    /// The Hugging Face `config.json` to write weights for.
    config: PathBuf,
    /// The weights' seed.
    seed: u64,
    /// The folder to write `model.safetensors` and `config.json` into.
    out: PathBuf,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let json = std::fs::read_to_string(&args.config)?;
    let config = ModelConfig::from_hf_json(&json)?;
    let tensors = Transformer::random_tensors(&config, args.seed, &Device::Cpu)?;
    std::fs::create_dir_all(&args.out)?;
    candle_core::safetensors::save(&tensors, args.out.join("model.safetensors"))?;
    std::fs::write(args.out.join("config.json"), json)?;
    Ok(())
}

//! Runs repeated prefills of one long prompt, for profiling (`perf record`).
//!
//! ```text
//! cargo run --release --example profile_prefill -- [TOKENS] [REPEATS]
//! ```

use std::time::Instant;

use pensieve::attention::KvPool;
use pensieve::model::{ForwardBatch, LoadOptions, Model, ModelSource};

#[path = "common/exit.rs"]
mod exit;

fn main() -> std::process::ExitCode {
    exit::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1024);
    let repeats: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    let model = Model::load(&ModelSource::Default, &LoadOptions::default())?;
    let pool = KvPool::new(
        model.config().kv_shape(),
        n,
        pensieve::engine::KvPrecision::default().dtype(),
        model.llama().device(),
    )?;
    let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i * 7919 % 40_000).collect();
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut batch = ForwardBatch::new();
    batch.push(&tokens, &pos, &pos, &pos, &pos, true)?;
    for _ in 0..repeats {
        let t = Instant::now();
        model.llama().forward(&batch, &pool)?;
        let s = t.elapsed().as_secs_f64();
        println!("{n} tokens in {s:.3} s: {:.0} tokens/s", n as f64 / s);
    }
    Ok(())
}

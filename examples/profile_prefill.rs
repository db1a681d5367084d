//! Runs one forward pass repeatedly, for profiling (`perf record`): a prefill of one long
//! prompt, or, with `SEQUENCES`, a decode step of that many sequences with `TOKENS` of history
//! each (one new token and one logits row per sequence). `--gguf PATH` profiles that file
//! instead of the default model.
//!
//! ```text
//! cargo run --release --example profile_prefill -- [--gguf PATH] [TOKENS] [REPEATS] [SEQUENCES]
//! ```

use std::time::Instant;

use pensieve::attention::KvPool;
use pensieve::model::{ForwardBatch, LoadOptions, Model, ModelSource};

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).peekable();
    let source = match args.next_if(|a| a == "--gguf") {
        Some(_) => ModelSource::Gguf(args.next().ok_or("--gguf takes a path")?.into()),
        None => ModelSource::Default,
    };
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1024);
    let repeats: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    let sequences: Option<usize> = args.next().map(|a| a.parse()).transpose()?;
    let model = Model::load(&source, &LoadOptions::default())?;
    let slots = sequences.map_or(n, |s| s * (n + 1));
    let pool = KvPool::new(
        model.config().kv_shape(),
        slots,
        pensieve::engine::KvPrecision::default(),
        model.transformer().device(),
    )?;
    let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i * 7919 % 40_000).collect();
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut batch = ForwardBatch::new();
    let (rows, what) = match sequences {
        None => {
            batch.push(&tokens, &pos, &pos, &pos, pos.len(), true)?;
            (n, "tokens")
        }
        Some(s) => {
            for seq in 0..s as u32 {
                let positions: Vec<u32> = (0..=n as u32).collect();
                let slots: Vec<u32> = positions.iter().map(|p| seq * (n as u32 + 1) + p).collect();
                batch.push(
                    &[100 + seq],
                    &[n as u32],
                    &slots[n..],
                    &slots,
                    positions.len(),
                    true,
                )?;
            }
            (s, "sequences")
        }
    };
    for _ in 0..repeats {
        let t = Instant::now();
        model.transformer().forward(&batch, &pool)?;
        let s = t.elapsed().as_secs_f64();
        println!("{rows} {what} in {s:.4} s: {:.0} rows/s", rows as f64 / s);
    }
    Ok(())
}

//! What a long conversation holds below the device when its model's sliding-window layers keep
//! their window (issue 74): one conversation of `--tokens` tokens (one long turn, then a short
//! one, so the chunks before the short turn's windows narrow), moved to host memory ahead of
//! time, its host bytes with every layer kept (`--swa-full`) and with narrow chunks. Prints a
//! JSON line per length.
//!
//! ```text
//! cargo run --release --example bench_narrow -- --model gemma3-270m --tokens 8000,32000
//! ```

use std::error::Error;

use clap::Parser;
use pensieve::cli::EngineArgs;
use pensieve::engine::{ConversationOptions, Engine, EngineConfig, SamplingParams, Turn};

#[derive(Parser, Debug)]
#[command(about = "A long conversation's host bytes with narrow chunks and without")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Conversation lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "8000")]
    tokens: Vec<usize>,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let model = std::sync::Arc::new(args.engine.load_model()?);
    let vocab = model.config().vocab_size as u32;
    let prompt = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 100 + (seed * 7919 + i * 104_729) % (vocab - 200))
            .collect()
    };
    for &n in &args.tokens {
        let mut held = Vec::new();
        for narrow in [false, true] {
            // Every idle chunk moves to the host ahead of time, where it has room.
            let budgets = args
                .engine
                .budgets()
                .device_tokens(n + 4096)
                .host_bytes(1 << 36);
            let config = EngineConfig::default()
                .kv_precision(args.engine.kv_precision())
                .budgets(budgets)
                .swap_out_threshold(1.0)
                .narrow_windows(narrow);
            let mut e = Engine::with_model(model.clone(), config)?;
            let c = e.open(ConversationOptions::default())?;
            let params = SamplingParams::greedy().max_tokens(1);
            for (len, seed) in [(n, 1), (16, 2)] {
                e.submit(c, Turn::Tokens(prompt(len, seed)), params.clone())?;
                while e.has_work() {
                    e.step()?;
                }
            }
            // Idle steps: ahead-of-time eviction moves the conversation's chunks.
            for _ in 0..20 {
                e.step()?;
            }
            let s = e.stats();
            eprintln!(
                "{n} tokens, narrow {narrow}: {} host bytes, {} narrow chunks, {} slots left",
                s.host_bytes_used, s.narrow_swap_outs, s.device_slots_used
            );
            held.push(s.host_bytes_used);
        }
        println!(
            "{{\"tokens\":{n},\"whole_bytes\":{},\"narrow_bytes\":{},\"ratio\":{:.3}}}",
            held[0],
            held[1],
            held[1] as f64 / held[0].max(1) as f64
        );
    }
    Ok(())
}

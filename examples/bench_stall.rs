//! What a stalled shared store costs the conversations decoding: 8 conversations decode on the
//! default model with Redis as the store; midway, Redis stalls for `--stall-s` seconds (`DEBUG
//! SLEEP`, from another connection) and a new conversation submits a turn whose prompt is
//! looked up by content in the store. Reports the decoders' inter-token time (each step's
//! wall time) before the stall, its median and worst while Redis sleeps, and when the
//! newcomer's first token came: a store lookup on the thread that drives `step()` makes every
//! decoder wait out the stall; a lookup behind it makes only the newcomer wait.
//!
//! ```text
//! scripts/bench-stall          # starts a redis-server with DEBUG allowed, runs this
//! cargo run --release --example bench_stall -- --redis redis://127.0.0.1:PORT
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pensieve::engine::{
    ConversationOptions, Engine, EngineConfig, Event, RedisConfig, SamplingParams, StoreConfig,
    Turn,
};
use pensieve::model::{LoadOptions, Model, ModelSource};

#[derive(Parser, Debug)]
struct Args {
    /// The Redis to store in (its `DEBUG` command enabled).
    #[arg(long, value_name = "URL")]
    redis: String,
    /// Conversations decoding.
    #[arg(long, default_value_t = 8, value_parser = pensieve::cli::positive)]
    running: usize,
    /// Decode steps before the stall.
    #[arg(long, default_value_t = 24, value_parser = pensieve::cli::positive)]
    before: usize,
    /// Seconds Redis sleeps.
    #[arg(long, default_value_t = 2.0)]
    stall_s: f64,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let model = Arc::new(Model::load(&ModelSource::Default, &LoadOptions::default())?);
    let prefix = format!("bench-stall-{}", std::process::id());
    let config = EngineConfig::default().store(StoreConfig::redis(
        RedisConfig::new(&args.redis).key_prefix(prefix),
    ));
    let mut engine = Engine::with_model(model.clone(), config)?;
    let vocab = model.config().vocab_size as u32;
    // Distinct prompts of a few chunks each, so every lookup asks the store.
    let prompt = |k: u32| -> Vec<u32> {
        (0..96u32)
            .map(|i| 100 + (k * 7919 + i * 104_729) % (vocab - 200))
            .collect()
    };
    let stall = Duration::from_secs_f64(args.stall_s);
    // Long enough that nobody finishes while Redis sleeps.
    let max_tokens = args.before + 64 + (stall.as_secs_f64() * 200.0) as usize;
    let params = SamplingParams::greedy().max_tokens(max_tokens);
    for k in 0..args.running {
        let conv = engine.open(ConversationOptions::default())?;
        engine.submit(conv, Turn::Tokens(prompt(k as u32)), params.clone())?;
    }
    // Until every conversation decodes.
    let mut started = std::collections::HashSet::new();
    while started.len() < args.running {
        for e in engine.step()? {
            if let Event::Token { request, .. } = e {
                started.insert(request);
            }
        }
    }
    let mut before = Vec::new();
    for _ in 0..args.before {
        let t = Instant::now();
        engine.step()?;
        before.push(t.elapsed());
    }
    // Redis sleeps; meanwhile a new turn arrives.
    let url = args.redis.clone();
    let sleeper = std::thread::spawn(move || -> Result<(), String> {
        let client = redis::Client::open(url).map_err(|e| e.to_string())?;
        let mut c = client.get_connection().map_err(|e| e.to_string())?;
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(stall.as_secs_f64())
            .query::<()>(&mut c)
            .map_err(|e| e.to_string())
    });
    std::thread::sleep(Duration::from_millis(50));
    // The decoders' tokens come out at the end of each step: the gaps between those ends.
    let stalled_at = Instant::now();
    let mut ends = vec![stalled_at];
    let newcomer = engine.open(ConversationOptions::default())?;
    let t = Instant::now();
    engine.submit(newcomer, Turn::Tokens(prompt(1000)), params.max_tokens(4))?;
    let submit = t.elapsed();
    let mut newcomer_first = None;
    while stalled_at.elapsed() < stall {
        let events = engine.step()?;
        ends.push(Instant::now());
        let token =
            |e: &Event| matches!(e, Event::Token { conversation, .. } if *conversation == newcomer);
        if newcomer_first.is_none() && events.iter().any(token) {
            newcomer_first = Some(stalled_at.elapsed());
        }
    }
    sleeper.join().map_err(|_| "the sleeper panicked")??;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    before.sort();
    let mut gaps: Vec<Duration> = ends.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort();
    let worst = gaps.last().copied().unwrap_or_default();
    let median_during = gaps.get(gaps.len() / 2).copied().unwrap_or_default();
    let row = serde_json::json!({
        "running": args.running,
        "stall_s": args.stall_s,
        "step_ms_median_before": ms(before[before.len() / 2]),
        "submit_ms": ms(submit),
        "steps_during_stall": ends.len() - 1,
        "median_gap_ms_during_stall": ms(median_during),
        "worst_gap_ms_during_stall": ms(worst),
        "newcomer_first_token_ms": newcomer_first.map(ms),
    });
    println!("{row}");
    Ok(())
}

//! What a long prefill costs a short turn that arrives while it runs (issue 74): the short
//! turn's time to first token alone, the long prefill's own, and the short turn's when it is
//! submitted after the long one's first step. The scheduler gives decode rows their tokens
//! first, then the rest of the step's budget to unfinished prefills shortest first (with
//! aging): a short turn should start within a step or two, not behind the whole prefill.
//! Prints one JSON line with the medians of `--runs` runs (distinct random prompts, so
//! nothing is shared) and the ratio the issue asks about.
//!
//! ```text
//! cargo run --release --example bench_admission -- --long 4000 --short 32 --runs 5
//! ```

use std::error::Error;
use std::time::{Duration, Instant};

use clap::Parser;
use pensieve::cli::{positive, EngineArgs};
use pensieve::engine::{ConversationOptions, Engine, EngineConfig, Event, SamplingParams, Turn};
use pensieve::ConversationId;

#[derive(Parser, Debug)]
#[command(about = "A short turn's time to first token beside a long prefill")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Tokens of the long prompt.
    #[arg(long, default_value_t = 4000, value_parser = positive)]
    long: usize,
    /// Tokens of the short prompt.
    #[arg(long, default_value_t = 32, value_parser = positive)]
    short: usize,
    /// Most tokens one step runs through the model.
    #[arg(long, default_value_t = 512, value_parser = positive)]
    token_budget: usize,
    /// Runs; the medians are reported.
    #[arg(long, default_value_t = 3, value_parser = positive)]
    runs: usize,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let model = std::sync::Arc::new(args.engine.load_model()?);
    let config = EngineConfig::default()
        .kv_precision(args.engine.kv_precision())
        .step_token_budget(args.token_budget)
        .budgets(args.engine.budgets().device_tokens(args.long * 2 + 4096));
    let mut engine = Engine::with_model(model.clone(), config)?;
    let vocab = model.config().vocab_size as u32;
    let mut seed = 0u32;
    let mut prompt = |n: usize| -> Vec<u32> {
        seed += 1;
        (0..n as u32)
            .map(|i| 100 + (seed * 7919 + i * 104_729) % (vocab - 200))
            .collect()
    };
    let params = SamplingParams::greedy().max_tokens(1);
    let (mut alone, mut long_ttft, mut beside) = (vec![], vec![], vec![]);
    for run in 0..args.runs {
        let short = engine.open(ConversationOptions::default())?;
        let t = Instant::now();
        engine.submit(short, Turn::Tokens(prompt(args.short)), params.clone())?;
        alone.push(first_token(&mut engine, &[(short, t)])?[0]);

        let long = engine.open(ConversationOptions::default())?;
        let t_long = Instant::now();
        engine.submit(long, Turn::Tokens(prompt(args.long)), params.clone())?;
        engine.step()?;
        let short = engine.open(ConversationOptions::default())?;
        let t_short = Instant::now();
        engine.submit(short, Turn::Tokens(prompt(args.short)), params.clone())?;
        let ttfts = first_token(&mut engine, &[(long, t_long), (short, t_short)])?;
        long_ttft.push(ttfts[0]);
        beside.push(ttfts[1]);
        eprintln!(
            "run {}/{}: short alone {:.3}s, long {:.3}s, short beside it {:.3}s",
            run + 1,
            args.runs,
            alone[run].as_secs_f64(),
            ttfts[0].as_secs_f64(),
            ttfts[1].as_secs_f64()
        );
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64()
    };
    let (alone, long, beside) = (
        median(&mut alone),
        median(&mut long_ttft),
        median(&mut beside),
    );
    let row = serde_json::json!({
        "model": args.engine.model,
        "long_tokens": args.long,
        "short_tokens": args.short,
        "token_budget": args.token_budget,
        "runs": args.runs,
        "short_ttft_alone_s": alone,
        "long_ttft_s": long,
        "short_ttft_beside_long_s": beside,
        "beside_over_long": beside / long,
        "beside_over_alone": beside / alone,
    });
    println!("{row}");
    Ok(())
}

/// Steps the engine until it is idle; the times from each of `turns` (conversation,
/// submitted at) to its first token, in order.
fn first_token(
    engine: &mut Engine,
    turns: &[(ConversationId, Instant)],
) -> Result<Vec<Duration>, Box<dyn Error>> {
    let mut seen: Vec<Option<Duration>> = vec![None; turns.len()];
    while engine.has_work() {
        for e in engine.step()? {
            let Event::Token { conversation, .. } = e else {
                continue;
            };
            if let Some(k) = turns.iter().position(|(c, _)| *c == conversation) {
                seen[k].get_or_insert_with(|| turns[k].1.elapsed());
            }
        }
    }
    seen.into_iter()
        .map(|t| t.ok_or_else(|| "a turn ended without a token".into()))
        .collect()
}

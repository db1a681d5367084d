//! What holding conversations costs the step loop: an engine holding N idle conversations
//! (their KV moved to the host tier) while 8 conversations decode. Reports, per N, the time of
//! `step()` outside the model's forward pass (scheduling, cache bookkeeping, commit), per
//! step, median and p90. The model is `Model::tiny` (random weights, a pass of microseconds),
//! so what is measured is the engine's own work; with a cost that does not grow with the
//! conversations held, the medians stay flat across N.
//!
//! ```text
//! cargo run --release --example bench_scale -- [--idle 100,1000,10000] [--steps 64] [--json]
//!     [--shared-prompt-words 100]
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, Engine, EngineConfig, SamplingParams, Turn,
};
use pensieve::model::Model;

#[derive(Parser, Debug)]
#[command(about = "step() cost outside the model's pass against conversations held")]
struct Args {
    /// Idle conversations held, one run each.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    idle: Vec<usize>,
    /// Decode steps measured per run.
    #[arg(long, default_value_t = 64, value_parser = pensieve::cli::positive)]
    steps: usize,
    /// Conversations decoding while the others are held.
    #[arg(long, default_value_t = 8, value_parser = pensieve::cli::positive)]
    running: usize,
    /// Every conversation opens with this many words of one system prompt, shared by content
    /// (0: none): its chunks are then held by every conversation at once.
    #[arg(long, default_value_t = 0)]
    shared_prompt_words: usize,
    /// One JSON object per run on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let model = Arc::new(Model::tiny(7)?);
    if !args.json {
        println!("| idle conversations | step outside the pass, median | p90 | host bytes held |");
        println!("|---:|---:|---:|---:|");
    }
    for &idle in &args.idle {
        let (median, p90, host) = measure(&model, idle, &args)?;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        if args.json {
            let row = serde_json::json!({"idle": idle, "running": args.running,
                "steps": args.steps, "outside_pass_us_p50": us(median),
                "outside_pass_us_p90": us(p90), "host_bytes": host});
            println!("{row}");
        } else {
            println!(
                "| {idle} | {:.0} us | {:.0} us | {host} |",
                us(median),
                us(p90)
            );
        }
    }
    Ok(())
}

/// One run: `idle` conversations filled and left, then `args.running` decoding; the median
/// and p90 time outside the forward pass per decode step, and the host tier's bytes.
fn measure(
    model: &Arc<Model>,
    idle: usize,
    args: &Args,
) -> Result<(Duration, Duration, usize), Box<dyn Error>> {
    let config = EngineConfig::default()
        .budgets(Budgets::default().device_tokens(2048).host_bytes(8 << 30))
        .mode(CacheMode::Tiered)
        .check_invariants(false);
    let mut engine = Engine::with_model(model.clone(), config)?;
    let bar = ProgressBar::new(idle as u64).with_style(ProgressStyle::with_template(
        "{msg} {bar:30} {pos}/{len} conversations [{elapsed}]",
    )?);
    bar.set_message(format!("filling {idle}"));
    let one = SamplingParams::greedy().max_tokens(1);
    let mut options = ConversationOptions::default();
    if args.shared_prompt_words > 0 {
        options = options.system(vec!["word"; args.shared_prompt_words].join(" "));
    }
    for batch in (0..idle).collect::<Vec<_>>().chunks(64) {
        for &i in batch {
            let conv = engine.open(options.clone())?;
            engine.submit(conv, Turn::user(format!("conversation {i}")), one.clone())?;
        }
        while engine.has_work() {
            engine.step()?;
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    let decode = SamplingParams::greedy()
        .max_tokens(args.steps + 1)
        .ignore_eos(true);
    for i in 0..args.running {
        let conv = engine.open(options.clone())?;
        engine.submit(conv, Turn::user(format!("running {i}")), decode.clone())?;
    }
    // The first step prefills the running turns; the rest decode.
    engine.step()?;
    let mut outside = Vec::with_capacity(args.steps);
    while engine.has_work() {
        let before = engine.stats().forward_time;
        let t = Instant::now();
        engine.step()?;
        let took = t.elapsed();
        outside.push(took.saturating_sub(engine.stats().forward_time - before));
    }
    outside.sort();
    let at = |q: f64| outside[((outside.len() - 1) as f64 * q) as usize];
    Ok((at(0.5), at(0.9), engine.stats().host_bytes_used))
}

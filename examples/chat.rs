//! Multi-turn chat on a real model through pensieve's engine, keeping the conversation's KV
//! cache across turns. The engine runs behind `pensieve::service`, as a host app on an async
//! runtime would run it: each reply streams in as its tokens come.
//!
//! ```text
//! cargo run --release --example chat                       # interactive, default SmolLM2
//! cargo run --release --example chat -- --script examples/data/chat-script.txt --json
//! cargo run --release --example chat -- --store /tmp/chats --conversation alice
//! cargo run --release --example chat -- --redis redis://127.0.0.1:6379 --conversation alice
//! ```
//! Each turn prefills only its new tokens; the history's KV stays cached. After each reply the
//! chat prints what the cache saved: tokens reused instead of recomputed (and from which tier),
//! and the time to first token of the same turn on a stateless engine (whole history
//! re-prefilled), measured side by side on the same weights (`--no-compare` skips it).
//!
//! With `--store DIR --conversation NAME` the conversation persists in the store: run the
//! program again with the same flags and it continues where it stopped, its history's KV read
//! back from disk instead of recomputed. With `--redis URL` instead, the conversation and its
//! KV live in a Redis shared by a fleet: any engine attached to it (another run of this
//! program, on another machine, or the server example) continues it.

use std::error::Error;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use pensieve::engine::{
    CacheMode, ConversationId, ConversationOptions, CostModel, CostProfile, Engine, SamplingParams,
    Turn, TurnStats,
};
use pensieve::service::{Service, ServiceConfig, TurnEvent};

use pensieve::cli::{exit_code, positive, EngineArgs, StoreArgs};

#[derive(Parser, Debug)]
#[command(about = "Multi-turn chat with a KV cache kept across turns")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// One user message per line, run as consecutive turns (instead of reading stdin).
    #[arg(long)]
    script: Option<PathBuf>,
    /// Print one JSON object per turn on stdout instead of the text.
    #[arg(long)]
    json: bool,
    /// Maximum tokens per reply.
    #[arg(long, default_value_t = 256, value_parser = positive)]
    max_tokens: usize,
    /// System prompt (the template's default when absent).
    #[arg(long)]
    system: Option<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Skip the stateless engine that measures the baseline side by side.
    #[arg(long)]
    no_compare: bool,
    #[command(flatten)]
    store: StoreArgs,
    /// Name of the conversation to continue (or start) in the store (`--store` or `--redis`).
    #[arg(long, default_value = "default")]
    conversation: String,
}

fn main() -> ExitCode {
    exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(chat(args))
}

/// The tokens `conv` holds.
async fn tokens(service: &Service, conv: ConversationId) -> pensieve::Result<Vec<u32>> {
    service
        .with_engine(move |e| e.tokens(conv).map(<[u32]>::to_vec))
        .await?
}

async fn chat(args: Args) -> Result<(), Box<dyn Error>> {
    let mode = args.engine.mode.cache_mode();
    let model = Arc::new(args.engine.load_chat_model()?);
    let config = args.engine.engine_config(&args.store);
    let engine = Engine::with_model(model.clone(), config.clone())?;
    let service = Service::spawn(engine, ServiceConfig::default())?;
    let name = args.store.any().then(|| args.conversation.clone());
    let stored = match name.as_deref() {
        Some(n) => match service.resume(n).await {
            Ok(conv) => Some(conv),
            Err(pensieve::Error::NotStored(_)) => None,
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    let conv = match stored {
        Some(conv) => {
            let history = tokens(&service, conv).await?.len();
            if !args.json {
                println!(
                    "[continuing conversation {:?}: {history} tokens of history]",
                    args.conversation
                );
            }
            conv
        }
        None => {
            service
                .open({
                    let mut options = ConversationOptions::default();
                    options.system = args.system.clone();
                    options.name = name;
                    options
                })
                .await?
        }
    };
    // The baseline: each turn's whole prompt (history and new message) prefilled by a
    // stateless engine sharing the weights. It never evicts, so it needs no measured cost
    // curve.
    let mut baseline = match (args.no_compare, mode) {
        (false, CacheMode::Tiered | CacheMode::DeviceOnly) => {
            let config = config
                .mode(CacheMode::Stateless)
                .cost_profile(CostProfile::Fixed(CostModel::new(0.0, 0.0)));
            Some(Engine::with_model(model, config)?)
        }
        _ => None,
    };
    let params = SamplingParams::greedy()
        .max_tokens(args.max_tokens)
        .temperature(args.temperature)
        .top_p(args.top_p)
        .seed(args.seed);

    let lines = input_lines(&args)?;
    let mut turn = 0;
    for line in lines {
        let line = line?;
        let user = line.trim();
        if user.is_empty() {
            if args.script.is_some() {
                continue;
            }
            break;
        }
        turn += 1;
        if !args.json && args.script.is_some() {
            println!("> {user}");
        }
        let mut stdout = std::io::stdout();
        let mut reply = String::new();
        let mut events = match service.submit(conv, Turn::user(user), params.clone()).await {
            Ok(events) => events,
            Err(e) => {
                eprintln!("turn {turn} failed: {e}");
                continue;
            }
        };
        let mut end = None;
        while let Some(event) = events.next_event().await {
            match event {
                TurnEvent::Token { text, .. } => {
                    reply.push_str(&text);
                    if !args.json {
                        print!("{text}");
                        let _ = stdout.flush();
                    }
                }
                TurnEvent::Finished(e) => end = Some(e),
                _ => {}
            }
        }
        let Some(end) = end else {
            return Err(pensieve::Error::ServiceStopped.into());
        };
        let (reason, stats) = (end.reason, end.stats);
        let stateless = match &mut baseline {
            Some(e) => {
                let tokens = tokens(&service, conv).await?;
                let prompt = tokens.len() - stats.output_tokens;
                Some(prefill_alone(e, &tokens[..prompt])?)
            }
            None => None,
        };
        report(turn, &args, &reason, &stats, &reply, stateless.as_ref());
    }
    // Writes what the store was promised and joins the engine thread.
    service.shutdown()?;
    Ok(())
}

/// The user's messages: the script's lines, or stdin's.
fn input_lines(
    args: &Args,
) -> Result<Box<dyn Iterator<Item = std::io::Result<String>>>, Box<dyn Error>> {
    Ok(match &args.script {
        Some(p) => {
            let file = std::fs::File::open(p)
                .map_err(|e| format!("cannot open script {}: {e}", p.display()))?;
            Box::new(std::io::BufReader::new(file).lines())
        }
        None => {
            eprintln!("type a message and press enter; an empty line or end of input quits");
            Box::new(std::io::stdin().lock().lines())
        }
    })
}

/// A stateless turn over `prompt` (a whole history) up to its first token.
fn prefill_alone(e: &mut Engine, prompt: &[u32]) -> pensieve::Result<TurnStats> {
    let c = e.open(ConversationOptions::default())?;
    let params = SamplingParams::greedy().max_tokens(1);
    let stats = e
        .run_turn(c, Turn::Tokens(prompt.to_vec()), params, |_| {})?
        .1;
    e.close(c)?;
    Ok(stats)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(
    turn: usize,
    args: &Args,
    reason: &pensieve::engine::FinishReason,
    s: &TurnStats,
    text: &str,
    stateless: Option<&TurnStats>,
) {
    let decode_s = (s.latency - s.ttft).as_secs_f64();
    let decode_tps = s.output_tokens.saturating_sub(1) as f64 / decode_s.max(1e-9);
    if args.json {
        let record = serde_json::json!({
            "turn": turn,
            "mode": args.engine.mode.name(),
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "host_tokens": s.reused_from_host_tokens,
            "store_tokens": s.reused_from_store_tokens,
            "recomputed_tokens": s.recomputed_tokens,
            "prefilled_tokens": s.prefilled_tokens,
            "output_tokens": s.output_tokens,
            "ttft_ms": ms(s.ttft),
            "turn_ms": ms(s.latency),
            "decode_tok_per_s": decode_tps,
            "finish": format!("{reason:?}"),
            "stateless_ttft_ms": stateless.map(|b| ms(b.ttft)),
            "stateless_prefilled_tokens": stateless.map(|b| b.prefilled_tokens),
            "text": text,
        });
        println!("{record}");
        return;
    }
    let baseline = match stateless {
        Some(b) => format!(
            "; stateless: prefilled {}, TTFT {:.0} ms",
            b.prefilled_tokens,
            ms(b.ttft)
        ),
        None => String::new(),
    };
    println!(
        "\n[turn {turn}: prefilled {} ({} new, {} recomputed), reused {} from cache ({} host, {} store); TTFT {:.0} ms{baseline}; {} tokens at {:.1} tok/s]",
        s.prefilled_tokens,
        s.prompt_tokens,
        s.recomputed_tokens,
        s.reused_tokens,
        s.reused_from_host_tokens,
        s.reused_from_store_tokens,
        ms(s.ttft),
        s.output_tokens,
        decode_tps
    );
}

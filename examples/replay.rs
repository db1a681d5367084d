//! Replays real multi-turn conversations through the engine in real time and measures what the
//! papers measure (Pensieve §6, AttentionStore §4): throughput, time to first token, and
//! normalized latency (turn latency per output token), for the stateless baseline, a device-only
//! cache and the tiered cache.
//!
//! ```text
//! cargo run --release --example replay -- --mode tiered --rate 0.5          # open loop
//! cargo run --release --example replay -- --mode stateless --concurrency 8  # closed loop
//! cargo run --release --example replay -- --sweep 0.1,0.2,0.4 --out target/replay
//! ```
//! The workload is ShareGPT (conversations with at least `--min-turns` turns, real user text,
//! each reply forced to the original reply's length in tokens) or a JSON-lines `--trace`.
//! Open loop: conversations arrive as a Poisson process and each user thinks before the next
//! turn (100 ms per output token, at least 5 s, times `--think-scale`). Closed loop: N
//! conversations in flight, each sending its next turn as soon as its reply is complete.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use common::{EngineArgs, Mode};
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::engine::{
    ConversationId, ConversationOptions, CostProfile, Engine, EngineConfig, EngineStats, Event,
    FinishReason, RequestId, SamplingParams, Turn, TurnStats,
};
use pensieve::model::{Llama, LlamaConfig, Model};
use pensieve::workload::{default_sharegpt_path, read_sharegpt, read_trace, ConversationSpec};
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

mod common;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Llama shapes for `--model-shape`: random weights, the tokenizer and template of `--model`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Shape {
    /// SmolLM2-360M: 32 layers, width 960, 15 heads over 5 kv heads.
    #[value(name = "360m")]
    M360,
    /// Llama 3.2 1B: 16 layers, width 2048, 32 heads over 8 kv heads.
    #[value(name = "1b")]
    B1,
    /// Llama 3.2 3B: 28 layers, width 3072, 24 heads over 8 kv heads of 128.
    #[value(name = "3b")]
    B3,
}

impl Shape {
    fn config(self, vocab_size: usize) -> pensieve::Result<LlamaConfig> {
        let (hidden, inter, layers, heads, kv_heads, theta) = match self {
            Shape::M360 => (960, 2560, 32, 15, 5, 100_000.0),
            Shape::B1 => (2048, 8192, 16, 32, 8, 500_000.0),
            Shape::B3 => (3072, 8192, 28, 24, 8, 500_000.0),
        };
        LlamaConfig::from_hf_json(&format!(
            r#"{{"vocab_size":{vocab_size},"hidden_size":{hidden},"intermediate_size":{inter},
                "num_hidden_layers":{layers},"num_attention_heads":{heads},
                "num_key_value_heads":{kv_heads},"rms_norm_eps":1e-5,"rope_theta":{theta},
                "max_position_embeddings":8192,"tie_word_embeddings":true}}"#
        ))
    }
}

#[derive(Parser, Debug)]
#[command(about = "Replay multi-turn conversations and measure against stateless serving")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Random weights of a larger Llama shape (tokenizer and template still from `--model`).
    #[arg(long, value_enum)]
    model_shape: Option<Shape>,
    /// ShareGPT JSON file (default: the one `scripts/fetch-assets` fetched).
    #[arg(long)]
    sharegpt: Option<PathBuf>,
    /// JSON-lines trace instead of ShareGPT.
    #[arg(long, conflicts_with = "sharegpt")]
    trace: Option<PathBuf>,
    /// Conversations to replay.
    #[arg(long, default_value_t = 16)]
    conversations: usize,
    /// ShareGPT conversations with fewer user → assistant turns are left out.
    #[arg(long, default_value_t = 5)]
    min_turns: usize,
    /// Turns replayed per conversation at most.
    #[arg(long, default_value_t = 8)]
    max_turns: usize,
    /// Cap on each reply's forced length in tokens.
    #[arg(long, default_value_t = 128)]
    max_output: usize,
    /// Cap on each user message in tokens (ShareGPT has pasted documents); 0 = no cap.
    #[arg(long, default_value_t = 512)]
    max_input: usize,
    /// Open loop: conversation arrivals per second (Poisson).
    #[arg(long, default_value_t = 0.5)]
    rate: f64,
    /// Scales the user think time (1 = the papers' 100 ms per output token, at least 5 s).
    #[arg(long, default_value_t = 1.0)]
    think_scale: f64,
    /// Closed loop with this many conversations in flight instead of the open loop.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Seed of the conversation sample and the arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Most tokens one step runs through the model.
    #[arg(long, default_value_t = 512)]
    step_tokens: usize,
    /// Print one JSON object per run on stdout.
    #[arg(long)]
    json: bool,
    /// Open-loop rates to run for all three modes; writes a CSV and a PNG plot into `--out`.
    #[arg(long, value_delimiter = ',', conflicts_with = "sweep_concurrency")]
    sweep: Option<Vec<f64>>,
    /// Closed-loop concurrencies to run for all three modes, like `--sweep`.
    #[arg(long, value_delimiter = ',')]
    sweep_concurrency: Option<Vec<usize>>,
    /// Folder for the sweep's CSV files and plot.
    #[arg(long, default_value = "target/replay")]
    out: PathBuf,
    /// Redraw `sweep.png` in this folder from its `sweep.csv` and `ttft_by_turn.csv`, then exit.
    #[arg(long)]
    replot: Option<PathBuf>,
}

/// How load is offered.
#[derive(Clone, Copy, Debug)]
enum Load {
    /// Poisson arrivals at `rate` per second, think time scaled by `think_scale`.
    Open { rate: f64, think_scale: f64 },
    /// `concurrency` conversations in flight, no think time.
    Closed { concurrency: usize },
}

impl Load {
    fn label(self) -> String {
        match self {
            Load::Open { rate, .. } => format!("rate {rate}/s"),
            Load::Closed { concurrency } => format!("{concurrency} in flight"),
        }
    }
}

/// One run's results; `--json` prints it.
#[derive(Debug, Serialize)]
struct Summary {
    mode: &'static str,
    load: String,
    rate: Option<f64>,
    concurrency: Option<usize>,
    conversations: usize,
    turns: usize,
    failed_turns: usize,
    wall_s: f64,
    turns_per_s: f64,
    output_tok_per_s: f64,
    ttft_ms_p50: f64,
    ttft_ms_p90: f64,
    norm_latency_ms_p50: f64,
    norm_latency_ms_p90: f64,
    ttft_ms_by_turn: Vec<f64>,
    prefilled_tokens: u64,
    reused_tokens: u64,
    recomputed_tokens: u64,
    generated_tokens: u64,
    hit_rate_device: f64,
    hit_rate_host: f64,
    bytes_swapped_in: u64,
    bytes_swapped_out: u64,
    chunks_dropped: u64,
    suspensions: u64,
    steps: u64,
    /// Where `step()` time went, in seconds.
    schedule_s: f64,
    transfer_s: f64,
    forward_s: f64,
    commit_s: f64,
}

fn main() -> AnyResult<()> {
    let args = Args::parse();
    if let Some(dir) = &args.replot {
        plot(&dir.join("sweep.png"), &read_points(dir)?)?;
        eprintln!("wrote {}/sweep.png", dir.display());
        return Ok(());
    }
    let model = load_model(&args)?;
    let workload = load_workload(&args, &model)?;
    if workload.is_empty() {
        return Err("the workload has no conversations".into());
    }
    let turns: usize = workload.iter().map(|c| c.turns.len()).sum();
    eprintln!(
        "{} conversations, {turns} turns, {} output tokens",
        workload.len(),
        workload
            .iter()
            .flat_map(|c| &c.turns)
            .map(|t| t.output_tokens)
            .sum::<usize>()
    );
    // The value policy's cost curve is measured once and shared by every run.
    let probe = Engine::with_model(model.clone(), engine_config(&args, Mode::Tiered, None))?;
    let cost = probe.stats().cost_model.map(CostProfile::Fixed);
    drop(probe);

    let points: Vec<(Mode, Load)> = match (&args.sweep, &args.sweep_concurrency) {
        (Some(rates), _) => Mode::ALL
            .iter()
            .flat_map(|&m| {
                rates.iter().map(move |&rate| {
                    (
                        m,
                        Load::Open {
                            rate,
                            think_scale: args.think_scale,
                        },
                    )
                })
            })
            .collect(),
        (None, Some(ns)) => Mode::ALL
            .iter()
            .flat_map(|&m| {
                ns.iter()
                    .map(move |&concurrency| (m, Load::Closed { concurrency }))
            })
            .collect(),
        (None, None) => vec![(
            args.engine.mode,
            match args.concurrency {
                Some(concurrency) => Load::Closed { concurrency },
                None => Load::Open {
                    rate: args.rate,
                    think_scale: args.think_scale,
                },
            },
        )],
    };
    let mut summaries = Vec::new();
    for (mode, load) in points {
        let mut engine = Engine::with_model(model.clone(), engine_config(&args, mode, cost))?;
        let arrivals = arrivals(&workload, load, args.seed);
        let progress = ProgressBar::new(turns as u64).with_style(ProgressStyle::with_template(
            "{prefix:>24} [{elapsed_precise}] {wide_bar} {pos}/{len} turns {msg}",
        )?);
        progress.set_prefix(format!("{} {}", mode.name(), load.label()));
        let run = replay(&mut engine, &workload, &arrivals, load, &progress)?;
        progress.finish_and_clear();
        let summary = summarize(mode, load, &run, &engine.stats());
        if args.json {
            println!("{}", serde_json::to_string(&summary)?);
        }
        summaries.push(summary);
    }
    print_table(&summaries);
    if args.sweep.is_some() || args.sweep_concurrency.is_some() {
        std::fs::create_dir_all(&args.out)?;
        write_csv(&args.out, &summaries)?;
        let points: Vec<PlotPoint> = summaries.iter().map(PlotPoint::from).collect();
        plot(&args.out.join("sweep.png"), &points)?;
        eprintln!(
            "wrote {0}/sweep.csv, {0}/ttft_by_turn.csv and {0}/sweep.png",
            args.out.display()
        );
    }
    Ok(())
}

fn load_model(args: &Args) -> AnyResult<Arc<Model>> {
    let mut model = args.engine.load_model()?;
    if let Some(shape) = args.model_shape {
        let config = shape.config(model.tokenizer.get_vocab_size(true))?;
        eprintln!("random weights of shape {shape:?}: {config:?}");
        let options = args.engine.load_options();
        model.llama = Llama::random(config, args.seed, options.format, &options.device)?;
    }
    Ok(Arc::new(model))
}

fn load_workload(args: &Args, model: &Model) -> AnyResult<Vec<ConversationSpec>> {
    let count = |text: &str| Ok(model.encode(text)?.len());
    let mut convs = match &args.trace {
        Some(path) => {
            let mut convs = read_trace(path)?;
            convs.truncate(args.conversations);
            for conv in &mut convs {
                conv.turns.truncate(args.max_turns);
                for turn in &mut conv.turns {
                    turn.output_tokens = turn.output_tokens.min(args.max_output.max(1));
                }
            }
            convs
        }
        None => {
            let path = args.sharegpt.clone().unwrap_or_else(default_sharegpt_path);
            let found = read_sharegpt(&path, args.min_turns)?;
            eprintln!(
                "{}: {} records{}, {} with {}+ turns",
                path.display(),
                found.records,
                if found.truncated {
                    " (file cut short; records before the cut kept)"
                } else {
                    ""
                },
                found.conversations.len(),
                args.min_turns
            );
            let mut all = found.conversations;
            all.shuffle(&mut StdRng::seed_from_u64(args.seed));
            all.truncate(args.conversations);
            all.iter()
                .map(|c| c.to_spec(args.max_turns, args.max_output, count))
                .collect::<pensieve::Result<_>>()?
        }
    };
    if args.max_input > 0 {
        for turn in convs.iter_mut().flat_map(|c| &mut c.turns) {
            let ids = model.encode(&turn.user)?;
            if ids.len() > args.max_input {
                turn.user = model.decode(&ids[..args.max_input])?;
            }
        }
    }
    Ok(convs)
}

fn engine_config(args: &Args, mode: Mode, cost: Option<CostProfile>) -> EngineConfig {
    EngineConfig {
        budgets: args.engine.budgets(),
        step_token_budget: args.step_tokens,
        mode: mode.cache_mode(),
        cost_profile: cost.unwrap_or_default(),
        ..EngineConfig::default()
    }
}

/// Start times in seconds: the trace's own, else Poisson arrivals at the load's rate (closed
/// loop starts conversations as others end, so its times are unused).
fn arrivals(workload: &[ConversationSpec], load: Load, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let rate = match load {
        Load::Open { rate, .. } => rate.max(1e-9),
        Load::Closed { .. } => 1.0,
    };
    let mut t = 0.0;
    workload
        .iter()
        .map(|c| {
            let poisson = t;
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            c.arrival_s.unwrap_or(poisson)
        })
        .collect()
}

/// A finished turn.
struct TurnRecord {
    turn_index: usize,
    stats: TurnStats,
}

/// What one replay produced.
struct Run {
    records: Vec<TurnRecord>,
    failed: usize,
    conversations: usize,
    wall: Duration,
}

/// A conversation's place in the replay.
struct Progress {
    conv: Option<ConversationId>,
    next_turn: usize,
}

/// Drives the engine in real time: submits each turn when it is due, steps while there is
/// work, sleeps until the next turn is due otherwise.
fn replay(
    engine: &mut Engine,
    workload: &[ConversationSpec],
    arrivals: &[f64],
    load: Load,
    bar: &ProgressBar,
) -> AnyResult<Run> {
    let window = engine.model().llama.config().max_position_embeddings;
    let start = Instant::now();
    // Due times in nanoseconds from the start, with the conversation index.
    let mut due: BinaryHeap<Reverse<(u128, usize)>> = BinaryHeap::new();
    let mut next_new = match load {
        Load::Open { .. } => {
            for (i, &a) in arrivals.iter().enumerate() {
                due.push(Reverse(((a * 1e9) as u128, i)));
            }
            workload.len()
        }
        Load::Closed { concurrency } => {
            let n = concurrency.clamp(1, workload.len());
            for i in 0..n {
                due.push(Reverse((0, i)));
            }
            n
        }
    };
    let mut state: Vec<Progress> = workload
        .iter()
        .map(|_| Progress {
            conv: None,
            next_turn: 0,
        })
        .collect();
    let mut live: HashMap<RequestId, usize> = HashMap::new();
    let mut run = Run {
        records: Vec::new(),
        failed: 0,
        conversations: 0,
        wall: Duration::ZERO,
    };
    loop {
        let now = start.elapsed().as_nanos();
        while let Some(&Reverse((t, i))) = due.peek() {
            if t > now {
                break;
            }
            due.pop();
            match submit_next(engine, &workload[i], &mut state[i], window)? {
                Some(id) => {
                    live.insert(id, i);
                }
                None => {
                    bar.inc((workload[i].turns.len() - state[i].next_turn) as u64);
                    end_conversation(engine, &mut state[i], &mut run)?;
                    start_next(load, &mut next_new, workload.len(), now, &mut due);
                }
            }
        }
        if engine.has_work() {
            for event in engine.step()? {
                let Event::Finished {
                    request,
                    reason,
                    stats,
                    ..
                } = event
                else {
                    continue;
                };
                let Some(i) = live.remove(&request) else {
                    continue;
                };
                bar.inc(1);
                let p = &mut state[i];
                let ok = matches!(reason, FinishReason::Length | FinishReason::Stop);
                if ok {
                    let think = match load {
                        Load::Open { think_scale, .. } => {
                            (0.1 * stats.output_tokens as f64).max(5.0) * think_scale
                        }
                        Load::Closed { .. } => 0.0,
                    };
                    run.records.push(TurnRecord {
                        turn_index: p.next_turn,
                        stats,
                    });
                    run.wall = start.elapsed();
                    p.next_turn += 1;
                    if p.next_turn < workload[i].turns.len() {
                        let at = start.elapsed().as_nanos() + (think * 1e9) as u128;
                        due.push(Reverse((at, i)));
                        continue;
                    }
                } else {
                    eprintln!(
                        "conversation {} turn {}: {reason:?}",
                        workload[i].id,
                        p.next_turn + 1
                    );
                    run.failed += 1;
                    bar.inc((workload[i].turns.len() - p.next_turn - 1) as u64);
                }
                end_conversation(engine, p, &mut run)?;
                let now = start.elapsed().as_nanos();
                start_next(load, &mut next_new, workload.len(), now, &mut due);
            }
        } else if let Some(&Reverse((t, _))) = due.peek() {
            let now = start.elapsed().as_nanos();
            std::thread::sleep(Duration::from_nanos(t.saturating_sub(now) as u64));
        } else {
            break;
        }
    }
    Ok(run)
}

/// Submits the conversation's next turn; `None` when it would not fit the context window (the
/// conversation ends there) or the engine refuses it.
fn submit_next(
    engine: &mut Engine,
    spec: &ConversationSpec,
    p: &mut Progress,
    window: usize,
) -> AnyResult<Option<RequestId>> {
    let conv = match p.conv {
        Some(c) => c,
        None => {
            let c = engine.open(ConversationOptions::default())?;
            p.conv = Some(c);
            c
        }
    };
    let turn = &spec.turns[p.next_turn];
    // The template adds a few tokens around the message; 16 is ample for ChatML.
    let needed = engine.tokens(conv)?.len()
        + engine.model().encode(&turn.user)?.len()
        + 16
        + turn.output_tokens;
    if needed >= window {
        return Ok(None);
    }
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy().with_max_tokens(turn.output_tokens)
    };
    match engine.submit(conv, Turn::user(turn.user.clone()), params) {
        Ok(id) => Ok(Some(id)),
        Err(e) => {
            eprintln!("conversation {} turn {}: {e}", spec.id, p.next_turn + 1);
            Ok(None)
        }
    }
}

fn end_conversation(engine: &mut Engine, p: &mut Progress, run: &mut Run) -> AnyResult<()> {
    if let Some(c) = p.conv.take() {
        engine.close(c)?;
        run.conversations += 1;
    }
    Ok(())
}

/// Closed loop: a new conversation takes the place of one that ended.
fn start_next(
    load: Load,
    next_new: &mut usize,
    total: usize,
    now: u128,
    due: &mut BinaryHeap<Reverse<(u128, usize)>>,
) {
    if matches!(load, Load::Closed { .. }) && *next_new < total {
        due.push(Reverse((now, *next_new)));
        *next_new += 1;
    }
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

fn summarize(mode: Mode, load: Load, run: &Run, stats: &EngineStats) -> Summary {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft: Vec<f64> = run.records.iter().map(|r| ms(r.stats.ttft)).collect();
    let norm: Vec<f64> = run
        .records
        .iter()
        .map(|r| ms(r.stats.latency) / r.stats.output_tokens.max(1) as f64)
        .collect();
    let turns_seen = run.records.iter().map(|r| r.turn_index + 1).max();
    let ttft_ms_by_turn = (0..turns_seen.unwrap_or(0))
        .map(|k| {
            let v: Vec<f64> = run
                .records
                .iter()
                .filter(|r| r.turn_index == k)
                .map(|r| ms(r.stats.ttft))
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        })
        .collect();
    let wall_s = run.wall.as_secs_f64().max(1e-9);
    let output: usize = run.records.iter().map(|r| r.stats.output_tokens).sum();
    let (rate, concurrency) = match load {
        Load::Open { rate, .. } => (Some(rate), None),
        Load::Closed { concurrency } => (None, Some(concurrency)),
    };
    Summary {
        mode: mode.name(),
        load: load.label(),
        rate,
        concurrency,
        conversations: run.conversations,
        turns: run.records.len(),
        failed_turns: run.failed,
        wall_s,
        turns_per_s: run.records.len() as f64 / wall_s,
        output_tok_per_s: output as f64 / wall_s,
        ttft_ms_p50: percentile(&ttft, 50.0),
        ttft_ms_p90: percentile(&ttft, 90.0),
        norm_latency_ms_p50: percentile(&norm, 50.0),
        norm_latency_ms_p90: percentile(&norm, 90.0),
        ttft_ms_by_turn,
        prefilled_tokens: stats.prefilled_tokens,
        reused_tokens: stats.reused_device_tokens + stats.reused_host_tokens,
        recomputed_tokens: stats.recomputed_tokens,
        generated_tokens: stats.generated_tokens,
        hit_rate_device: stats.hit_rate_device(),
        hit_rate_host: stats.hit_rate_host(),
        bytes_swapped_in: stats.bytes_swapped_in,
        bytes_swapped_out: stats.bytes_swapped_out,
        chunks_dropped: stats.chunks_dropped_from_device + stats.chunks_dropped_from_host,
        suspensions: stats.suspensions,
        steps: stats.steps,
        schedule_s: stats.schedule_time.as_secs_f64(),
        transfer_s: stats.transfer_time.as_secs_f64(),
        forward_s: stats.forward_time.as_secs_f64(),
        commit_s: stats.commit_time.as_secs_f64(),
    }
}

fn print_table(summaries: &[Summary]) {
    eprintln!(
        "{:<12} {:>16} {:>6} {:>8} {:>8} {:>10} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9} {:>7} {:>7}",
        "mode",
        "load",
        "turns",
        "wall s",
        "turns/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p90",
        "norm p50",
        "norm p90",
        "prefill",
        "reused",
        "hit dev",
        "hit host"
    );
    for s in summaries {
        eprintln!(
            "{:<12} {:>16} {:>6} {:>8.1} {:>8.3} {:>10.1} {:>7.0}ms {:>7.0}ms {:>7.1}ms/t {:>7.1}ms/t {:>9} {:>9} {:>7.2} {:>7.2}",
            s.mode,
            s.load,
            s.turns,
            s.wall_s,
            s.turns_per_s,
            s.output_tok_per_s,
            s.ttft_ms_p50,
            s.ttft_ms_p90,
            s.norm_latency_ms_p50,
            s.norm_latency_ms_p90,
            s.prefilled_tokens,
            s.reused_tokens,
            s.hit_rate_device,
            s.hit_rate_host
        );
    }
    if let Some(by_turn) = summaries.first().map(|s| s.ttft_ms_by_turn.len()) {
        let header: Vec<String> = (1..=by_turn).map(|k| format!("{k:>7}")).collect();
        eprintln!(
            "\nmean TTFT (ms) by turn index\n{:<30}{}",
            "",
            header.join("")
        );
        for s in summaries {
            let row: Vec<String> = s
                .ttft_ms_by_turn
                .iter()
                .map(|v| format!("{v:>7.0}"))
                .collect();
            eprintln!("{:<30}{}", format!("{} {}", s.mode, s.load), row.join(""));
        }
    }
}

/// Columns of `sweep.csv`, named as the `--json` fields.
const CSV_COLUMNS: [&str; 20] = [
    "mode",
    "rate",
    "concurrency",
    "turns",
    "wall_s",
    "turns_per_s",
    "output_tok_per_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "norm_latency_ms_p50",
    "norm_latency_ms_p90",
    "prefilled_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "hit_rate_device",
    "hit_rate_host",
    "bytes_swapped_in",
    "bytes_swapped_out",
    "forward_s",
    "transfer_s",
];

fn write_csv(dir: &Path, summaries: &[Summary]) -> AnyResult<()> {
    let cell = |v: &serde_json::Value| match v {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut sweep = CSV_COLUMNS.join(",") + "\n";
    let mut by_turn = String::from("mode,rate,concurrency,turn,ttft_ms_mean\n");
    for s in summaries {
        let v = serde_json::to_value(s)?;
        let row: Vec<String> = CSV_COLUMNS.iter().map(|c| cell(&v[*c])).collect();
        sweep.push_str(&(row.join(",") + "\n"));
        for (k, t) in s.ttft_ms_by_turn.iter().enumerate() {
            by_turn.push_str(&format!("{},{},{t:.1}\n", row[..3].join(","), k + 1));
        }
    }
    std::fs::write(dir.join("sweep.csv"), sweep)?;
    std::fs::write(dir.join("ttft_by_turn.csv"), by_turn)?;
    Ok(())
}

/// What the plot needs of one run; from a [`Summary`] or read back from the CSV files.
struct PlotPoint {
    mode: String,
    turns_per_s: f64,
    norm_latency_ms_p90: f64,
    ttft_ms_by_turn: Vec<f64>,
}

impl From<&Summary> for PlotPoint {
    fn from(s: &Summary) -> Self {
        Self {
            mode: s.mode.to_string(),
            turns_per_s: s.turns_per_s,
            norm_latency_ms_p90: s.norm_latency_ms_p90,
            ttft_ms_by_turn: s.ttft_ms_by_turn.clone(),
        }
    }
}

/// Reads `sweep.csv` and `ttft_by_turn.csv` from `dir` (as [`write_csv`] writes them).
fn read_points(dir: &Path) -> AnyResult<Vec<PlotPoint>> {
    let read = |name: &str| -> AnyResult<Vec<Vec<String>>> {
        let text = std::fs::read_to_string(dir.join(name))?;
        Ok(text
            .lines()
            .skip(1)
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split(',').map(str::to_string).collect())
            .collect())
    };
    let column = |name: &str| CSV_COLUMNS.iter().position(|c| *c == name);
    let (Some(turns_per_s), Some(norm)) = (column("turns_per_s"), column("norm_latency_ms_p90"))
    else {
        return Err("sweep.csv columns changed".into());
    };
    let by_turn = read("ttft_by_turn.csv")?;
    let mut points = Vec::new();
    for row in read("sweep.csv")? {
        let field = |i: usize| row.get(i).cloned().unwrap_or_default();
        points.push(PlotPoint {
            mode: field(0),
            turns_per_s: field(turns_per_s).parse()?,
            norm_latency_ms_p90: field(norm).parse()?,
            ttft_ms_by_turn: Vec::new(),
        });
        let key = row.get(..3).unwrap_or_default().to_vec();
        for t in &by_turn {
            if t.get(..3) == Some(&key[..]) {
                if let (Some(p), Some(v)) = (points.last_mut(), t.get(4)) {
                    p.ttft_ms_by_turn.push(v.parse()?);
                }
            }
        }
    }
    Ok(points)
}

/// Plot colour of a mode: red, orange, blue as in the papers' figures.
fn color(mode: &str) -> RGBColor {
    match mode {
        "stateless" => RGBColor(214, 39, 40),
        "device-only" => RGBColor(255, 127, 14),
        _ => RGBColor(31, 119, 180),
    }
}

/// Left: p90 normalized latency against throughput per mode (the papers' Figure 8). Right:
/// mean TTFT by turn index per mode at the lightest load.
fn plot(path: &Path, summaries: &[PlotPoint]) -> AnyResult<()> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(700);
    let finite = |v: f64| v.is_finite() && v > 0.0;
    let x_max = summaries.iter().map(|s| s.turns_per_s).fold(0.0, f64::max) * 1.1;
    let y_max = summaries
        .iter()
        .map(|s| s.norm_latency_ms_p90)
        .filter(|&v| finite(v))
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&left)
        .caption("p90 normalized latency vs throughput", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max.max(1e-3), 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("throughput (turns/s)")
        .y_desc("p90 latency per output token (ms)")
        .draw()?;
    for mode in Mode::ALL {
        let pts: Vec<(f64, f64)> = summaries
            .iter()
            .filter(|s| s.mode == mode.name() && finite(s.norm_latency_ms_p90))
            .map(|s| (s.turns_per_s, s.norm_latency_ms_p90))
            .collect();
        draw_mode(&mut chart, mode.name(), pts)?;
    }
    draw_legend(&mut chart)?;

    let lightest: Vec<&PlotPoint> = Mode::ALL
        .iter()
        .filter_map(|m| {
            summaries
                .iter()
                .filter(|s| s.mode == m.name())
                .min_by(|a, b| a.turns_per_s.total_cmp(&b.turns_per_s))
        })
        .collect();
    let turns = lightest
        .iter()
        .map(|s| s.ttft_ms_by_turn.len())
        .max()
        .unwrap_or(1);
    let t_max = lightest
        .iter()
        .flat_map(|s| s.ttft_ms_by_turn.iter().copied())
        .fold(1.0, f64::max)
        * 1.1;
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "mean TTFT by turn index (lightest load)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.5..turns as f64 + 0.5, 0.0..t_max)?;
    chart
        .configure_mesh()
        .x_desc("turn index")
        .y_desc("mean TTFT (ms)")
        .draw()?;
    for s in &lightest {
        let pts: Vec<(f64, f64)> = s
            .ttft_ms_by_turn
            .iter()
            .enumerate()
            .map(|(k, &v)| ((k + 1) as f64, v))
            .collect();
        draw_mode(&mut chart, &s.mode, pts)?;
    }
    draw_legend(&mut chart)?;
    root.present()?;
    Ok(())
}

type Chart<'a, 'b, X, Y> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<X, Y>>;

/// One mode's line with its points, in the mode's colour, labelled for the legend.
fn draw_mode<X, Y>(
    chart: &mut Chart<'_, '_, X, Y>,
    mode: &str,
    pts: Vec<(f64, f64)>,
) -> AnyResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let color = color(mode);
    chart
        .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
        .label(mode.to_string())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    Ok(())
}

fn draw_legend<'a, X, Y>(chart: &mut Chart<'a, 'a, X, Y>) -> AnyResult<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

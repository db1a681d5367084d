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

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::cli::{exit_code, gib_bytes, positive, positive_f64, EngineArgs, Mode};
use pensieve::engine::{CostProfile, Engine, EngineConfig, StoreConfig};
use pensieve::model::{
    tokenizer_from_file, tokenizer_from_gguf, GgufHeader, Model, ModelConfig, Transformer,
};
use pensieve::workload::{
    default_sharegpt_path, read_sharegpt, read_trace, write_trace, ConversationSpec,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

mod driver;
mod plot;
mod report;

use report::Summary;

pub(crate) type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

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
    /// Llama 3 8B: 32 layers, width 4096, 32 heads over 8 kv heads of 128.
    #[value(name = "8b")]
    B8,
}

impl Shape {
    fn config(self, vocab_size: usize) -> pensieve::Result<ModelConfig> {
        let (hidden, inter, layers, heads, kv_heads, theta) = match self {
            Shape::M360 => (960, 2560, 32, 15, 5, 100_000.0),
            Shape::B1 => (2048, 8192, 16, 32, 8, 500_000.0),
            Shape::B3 => (3072, 8192, 28, 24, 8, 500_000.0),
            Shape::B8 => (4096, 14336, 32, 32, 8, 500_000.0),
        };
        ModelConfig::from_hf_json(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"vocab_size":{vocab_size},"hidden_size":{hidden},"intermediate_size":{inter},
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
    /// Random weights of a larger Llama shape (tokenizer and template still from `--model`;
    /// with `--model tiny`, the vocabulary of `--tokenizer`, a `tokenizer.json` or a GGUF
    /// file's, with the Llama 3 template where it has its tokens, else ChatML: no weights are
    /// read).
    #[arg(long, value_enum)]
    model_shape: Option<Shape>,
    /// ShareGPT JSON file (default: the one `scripts/fetch-assets --tests` fetched).
    #[arg(long)]
    sharegpt: Option<PathBuf>,
    /// JSON-lines trace instead of ShareGPT.
    #[arg(long, conflicts_with = "sharegpt")]
    trace: Option<PathBuf>,
    /// Conversations to replay: sampled from ShareGPT (default 16), or the first N of a
    /// `--trace` (default: all of it).
    #[arg(long, value_parser = positive)]
    conversations: Option<usize>,
    /// ShareGPT conversations with fewer user → assistant turns are left out.
    #[arg(long, default_value_t = 5)]
    min_turns: usize,
    /// Turns replayed per conversation at most.
    #[arg(long, default_value_t = 8, value_parser = positive)]
    max_turns: usize,
    /// Cap on each reply's forced length in tokens.
    #[arg(long, default_value_t = 128, value_parser = positive)]
    max_output: usize,
    /// Cap on each user message in tokens (ShareGPT has pasted documents); 0 = no cap.
    #[arg(long, default_value_t = 512)]
    max_input: usize,
    /// Open loop: conversation arrivals per second (Poisson).
    #[arg(long, default_value_t = 0.5, value_parser = positive_f64)]
    rate: f64,
    /// Scales the user think time (1 = the papers' 100 ms per output token, at least 5 s).
    #[arg(long, default_value_t = 1.0)]
    think_scale: f64,
    /// Closed loop with this many conversations in flight instead of the open loop.
    #[arg(long, value_parser = positive)]
    concurrency: Option<usize>,
    /// Replies end at the model's end of turn, capped at the trace's length (by default they
    /// run to it, the model's end of turn masked, so every engine generates the same count).
    #[arg(long)]
    stop_at_eos: bool,
    /// Seed of the conversation sample and the arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Most tokens one step runs through the model.
    #[arg(long, default_value_t = 512, value_parser = positive)]
    step_tokens: usize,
    /// Disk tier budget in GiB for `--mode tiered-store` (its folder is emptied first).
    #[arg(long, default_value_t = 8.0)]
    store_gib: f64,
    /// Folder of the store for `--mode tiered-store` (default: `<out>/disk-tier`).
    #[arg(long)]
    store: Option<PathBuf>,
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
    /// Write the workload (turns and forced reply lengths, after every cap, and the arrival
    /// times unless `--concurrency` is given) as a JSON-lines trace to this file, then exit:
    /// the same turns for another engine's client (`scripts/peers`).
    #[arg(long)]
    write_trace: Option<PathBuf>,
}

/// How load is offered.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Load {
    /// Poisson arrivals at `rate` per second, think time scaled by `think_scale`.
    Open { rate: f64, think_scale: f64 },
    /// `concurrency` conversations in flight, no think time.
    Closed { concurrency: usize },
}

impl Load {
    pub(crate) fn label(self) -> String {
        match self {
            Load::Open { rate, .. } => format!("rate {}/s", (rate * 1e3).round() / 1e3),
            Load::Closed { concurrency } => format!("{concurrency} in flight"),
        }
    }
}

fn main() -> ExitCode {
    exit_code(run(Args::parse()))
}

fn run(args: Args) -> AnyResult<()> {
    if let Some(dir) = &args.replot {
        plot::plot(&dir.join("sweep.png"), &plot::read_points(dir)?)?;
        eprintln!("wrote {}/sweep.png", dir.display());
        return Ok(());
    }
    let model = load_model(&args)?;
    let mut workload = load_workload(&args, &model)?;
    if workload.is_empty() {
        return Err("the workload has no conversations".into());
    }
    if let Some(path) = &args.write_trace {
        if args.concurrency.is_none() {
            // Open loop: the arrivals go into the trace, so a peer's client replays the same.
            let load = Load::Open {
                rate: args.rate,
                think_scale: args.think_scale,
            };
            let arrivals = driver::arrivals(&workload, load, args.seed);
            for (c, a) in workload.iter_mut().zip(arrivals) {
                c.arrival_s = Some(a);
            }
        }
        write_trace(path, &workload)?;
        eprintln!(
            "wrote {} conversations to {}",
            workload.len(),
            path.display()
        );
        return Ok(());
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
    let mut summaries = Vec::new();
    for (mode, load) in points(&args, &workload) {
        let mut engine = Engine::with_model(model.clone(), engine_config(&args, mode, cost))?;
        let arrivals = driver::arrivals(&workload, load, args.seed);
        let progress = ProgressBar::new(turns as u64).with_style(ProgressStyle::with_template(
            "{prefix:>24} [{elapsed_precise}] {wide_bar} {pos}/{len} turns {msg}",
        )?);
        progress.set_prefix(format!("{} {}", mode.name(), load.label()));
        let run = driver::replay(
            &mut engine,
            &workload,
            &arrivals,
            (load, args.stop_at_eos),
            &progress,
        )?;
        progress.finish_and_clear();
        let summary = report::summarize(mode, load, &run, &engine.stats());
        if args.json {
            println!("{}", serde_json::to_string(&summary)?);
        }
        summaries.push(summary);
    }
    report::print_table(&summaries);
    if args.sweep.is_some() || args.sweep_concurrency.is_some() {
        write_sweep(&args, &summaries)?;
    }
    Ok(())
}

/// The runs to do: every mode at each sweep point, or the one mode and load of the flags. An
/// open loop over a trace that carries its arrival times runs at those times, and reports
/// their mean rate.
fn points(args: &Args, workload: &[ConversationSpec]) -> Vec<(Mode, Load)> {
    let arrivals: Option<Vec<f64>> = workload.iter().map(|c| c.arrival_s).collect();
    let trace_rate = arrivals
        .and_then(|a| Some((a.len() - 1) as f64 / a.into_iter().reduce(f64::max)?))
        .filter(|r| r.is_finite() && *r > 0.0);
    let open = |rate| Load::Open {
        rate,
        think_scale: args.think_scale,
    };
    let loads: Vec<Load> = match (&args.sweep, &args.sweep_concurrency) {
        (Some(rates), _) => rates.iter().map(|&r| open(r)).collect(),
        (None, Some(ns)) => ns
            .iter()
            .map(|&concurrency| Load::Closed { concurrency })
            .collect(),
        (None, None) => {
            let load = match args.concurrency {
                Some(concurrency) => Load::Closed { concurrency },
                None => open(trace_rate.unwrap_or(args.rate)),
            };
            return vec![(args.engine.mode, load)];
        }
    };
    Mode::ALL
        .iter()
        .flat_map(|&m| loads.iter().map(move |&l| (m, l)))
        .collect()
}

fn write_sweep(args: &Args, summaries: &[Summary]) -> AnyResult<()> {
    std::fs::create_dir_all(&args.out)?;
    report::write_csv(&args.out, summaries)?;
    eprintln!(
        "wrote {0}/sweep.csv and {0}/ttft_by_turn.csv",
        args.out.display()
    );
    let points: Vec<plot::PlotPoint> = summaries.iter().map(plot::PlotPoint::from).collect();
    // The measurements are written: a machine without fonts loses the picture, not the run
    // (`--replot` draws it again elsewhere).
    match plot::plot(&args.out.join("sweep.png"), &points) {
        Ok(()) => eprintln!("wrote {}/sweep.png", args.out.display()),
        Err(e) => eprintln!("warning: no plot ({e}); `--replot` draws it from the CSV files"),
    }
    Ok(())
}

fn load_model(args: &Args) -> AnyResult<Arc<Model>> {
    let vocabulary = match (&args.engine.tokenizer, args.engine.model.as_str()) {
        (Some(path), "tiny") if args.model_shape.is_some() => Some(read_vocabulary(path)?),
        _ => None,
    };
    // The vocabulary alone where one is given: no weights are read.
    let (model, tokenizer) = match vocabulary {
        Some(t) => (None, t),
        None => {
            let model = args.engine.load_model()?;
            let t = model.tokenizer().clone();
            (Some(model), t)
        }
    };
    let Some(shape) = args.model_shape else {
        return Ok(Arc::new(model.ok_or("no model")?));
    };
    let config = shape.config(tokenizer.get_vocab_size(true))?;
    eprintln!("random weights of shape {shape:?}: {config:?}");
    let options = args.engine.load_options();
    let llama = Transformer::random(config, args.seed, options.format, &options.device)?;
    Ok(Arc::new(match model {
        Some(model) => model.with_transformer(llama),
        None => {
            let eos = ["<|eot_id|>", "<|im_end|>", "<|endoftext|>"]
                .iter()
                .filter_map(|t| tokenizer.token_to_id(t))
                .take(1)
                .collect();
            let template = match tokenizer.token_to_id("<|start_header_id|>") {
                Some(_) => "llama3",
                None => "chatml",
            };
            Model::new(llama, tokenizer, None, eos).with_builtin_template(template)?
        }
    }))
}

/// The tokenizer of a `tokenizer.json` or of a GGUF file (llama.cpp's vocabulary files hold
/// only that).
fn read_vocabulary(path: &std::path::Path) -> AnyResult<pensieve::model::Tokenizer> {
    if path.extension().is_some_and(|e| e == "gguf") {
        let header = GgufHeader::read(&mut std::fs::File::open(path)?)?;
        return Ok(tokenizer_from_gguf(&header.content)?);
    }
    Ok(tokenizer_from_file(path)?)
}

fn load_workload(args: &Args, model: &Model) -> AnyResult<Vec<ConversationSpec>> {
    let count = |text: &str| Ok(model.encode(text)?.len());
    let mut convs = match &args.trace {
        Some(path) => {
            let mut convs = read_trace(path)?;
            convs.truncate(args.conversations.unwrap_or(usize::MAX));
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
            all.truncate(args.conversations.unwrap_or(16));
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
    let store = (mode == Mode::TieredStore).then(|| {
        let dir = args
            .store
            .clone()
            .unwrap_or_else(|| args.out.join("store-tier"));
        // Every run starts from an empty tier; a missing folder is fine.
        let _ = std::fs::remove_dir_all(&dir);
        StoreConfig::new(dir).budget_bytes(gib_bytes(args.store_gib))
    });
    EngineConfig::default()
        .budgets(args.engine.budgets())
        .step_token_budget(args.step_tokens)
        .mode(mode.cache_mode())
        .cost_profile(cost.unwrap_or_default())
        .kv_precision(args.engine.kv_precision())
        .overflow(args.engine.overflow_policy())
        .max_context_tokens(args.engine.max_context)
        .prefix_sharing(!args.engine.no_prefix_sharing)
        .speculation(args.engine.speculation())
        .store(store)
}

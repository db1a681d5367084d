//! Multi-turn chat on a real model, keeping the conversation's KV cache across turns.
//!
//! ```text
//! cargo run --release --example chat                       # interactive, default SmolLM2
//! cargo run --release --example chat -- --script turns.txt --json
//! ```
//! Each turn prefills only its new tokens; the history's KV stays in the pool. After each
//! reply the chat prints what the cache saved: tokens reused instead of recomputed, and the
//! prefill time a stateless server would have spent on them at this turn's measured rate.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use clap::Parser;
use pensieve::kv::KvPool;
use pensieve::model::{
    ForwardBatch, IncrementalDecoder, LoadOptions, Message, Model, ModelSource, WeightFormat,
};

#[derive(Parser, Debug)]
#[command(about = "Multi-turn chat with a KV cache kept across turns")]
struct Args {
    /// Model: `default`, a .gguf file, a safetensors folder, or an `org/name` hub repo.
    #[arg(long, default_value = "default")]
    model: String,
    /// One user message per line, run as consecutive turns (instead of reading stdin).
    #[arg(long)]
    script: Option<PathBuf>,
    /// Print one JSON object per turn on stdout instead of the text.
    #[arg(long)]
    json: bool,
    /// Maximum tokens per reply.
    #[arg(long, default_value_t = 256)]
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
    /// KV pool size in tokens (the longest conversation this chat can hold).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Weight format: f32, f16 or quantized.
    #[arg(long, default_value = "f32")]
    format: String,
    /// Skip measuring what a stateless server would spend (re-prefilling the whole history).
    #[arg(long)]
    no_compare: bool,
}

/// One conversation: its token history and KV in slots `0..history.len()` of the pool.
struct Chat {
    model: Model,
    pool: KvPool,
    history: Vec<u32>,
    /// What the model has seen, as text: the template's continuations plus the replies.
    seen_text: String,
    messages: Vec<Message>,
    sampler: LogitsProcessor,
    /// Scratch pool for measuring the stateless baseline; `None` when not comparing.
    scratch: Option<KvPool>,
}

struct TurnStats {
    prompt_tokens: usize,
    reused_tokens: usize,
    output_tokens: usize,
    ttft_ms: f64,
    /// Measured time to first token if the whole history were prefilled again.
    stateless_ttft_ms: Option<f64>,
    turn_ms: f64,
    text: String,
}

impl Chat {
    /// Runs the model over `tokens` at the end of the history; returns the last row's logits.
    fn feed(&mut self, tokens: &[u32]) -> pensieve::Result<Tensor> {
        let start = self.history.len();
        self.history.extend_from_slice(tokens);
        prefill(&self.model, &self.pool, &self.history, start)
    }

    /// What a stateless server does for this turn: prefill the whole history from scratch.
    fn measure_stateless(&self) -> pensieve::Result<Option<f64>> {
        let Some(scratch) = &self.scratch else {
            return Ok(None);
        };
        let started = Instant::now();
        prefill(&self.model, scratch, &self.history, 0)?;
        Ok(Some(started.elapsed().as_secs_f64() * 1e3))
    }

    fn turn(
        &mut self,
        user: &str,
        max_tokens: usize,
        out: &mut dyn FnMut(&str),
    ) -> pensieve::Result<TurnStats> {
        let started = Instant::now();
        self.messages.push(Message::new("user", user));
        let new_text = match &self.model.template {
            Some(t) => t.continuation(&self.messages, &self.seen_text)?,
            None => user.to_string(),
        };
        let new_tokens = self.model.encode(&new_text)?;
        let reused = self.history.len();
        if reused + new_tokens.len() + max_tokens > self.pool.num_slots() {
            self.messages.pop();
            return Err(pensieve::Error::ContextOverflow {
                position: reused + new_tokens.len() + max_tokens,
                window: self.pool.num_slots(),
            });
        }
        self.seen_text.push_str(&new_text);
        let mut logits = self.feed(&new_tokens)?;
        let ttft = started.elapsed();
        let stateless_ttft_ms = self.measure_stateless()?;
        let resumed = Instant::now();
        let mut decoder = IncrementalDecoder::new();
        let mut reply = String::new();
        let mut generated = Vec::new();
        while generated.len() < max_tokens {
            let next = self.sampler.sample(&logits)?;
            generated.push(next);
            if self.model.eos_token_ids.contains(&next) {
                self.seen_text.push_str(&self.model.decode(&[next])?);
                self.history.push(next);
                break;
            }
            let delta = decoder.push(&self.model.tokenizer, next)?;
            out(&delta);
            reply.push_str(&delta);
            self.seen_text.push_str(&delta);
            logits = self.feed(&[next])?;
        }
        self.messages.push(Message::new("assistant", reply.clone()));
        Ok(TurnStats {
            prompt_tokens: new_tokens.len(),
            reused_tokens: reused,
            output_tokens: generated.len(),
            ttft_ms: ttft.as_secs_f64() * 1e3,
            stateless_ttft_ms,
            turn_ms: (ttft + resumed.elapsed()).as_secs_f64() * 1e3,
            text: reply,
        })
    }
}

/// Runs `history[start..]` through the model with KV in slots equal to positions; returns the
/// last row's logits.
fn prefill(
    model: &Model,
    pool: &KvPool,
    history: &[u32],
    start: usize,
) -> pensieve::Result<Tensor> {
    let positions: Vec<u32> = (start as u32..history.len() as u32).collect();
    let context: Vec<u32> = (0..history.len() as u32).collect();
    let mut batch = ForwardBatch::new();
    batch.push(
        &history[start..],
        &positions,
        &positions,
        &context,
        &context,
        true,
    )?;
    Ok(model.llama.forward(&batch, pool)?.squeeze(0)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let format = match args.format.as_str() {
        "f32" => WeightFormat::F32,
        "f16" => WeightFormat::F16,
        "quantized" => WeightFormat::Quantized,
        other => return Err(format!("unknown --format {other}").into()),
    };
    let source: ModelSource = args.model.parse()?;
    eprintln!("loading {} ...", args.model);
    let model = Model::load(
        &source,
        &LoadOptions {
            format,
            ..LoadOptions::default()
        },
    )?;
    let new_pool = || {
        KvPool::new(
            model.llama.config(),
            args.context,
            DType::F32,
            model.llama.device(),
        )
    };
    let pool = new_pool()?;
    let scratch = if args.no_compare {
        None
    } else {
        Some(new_pool()?)
    };
    let sampling = match (args.temperature, args.top_p) {
        (t, _) if t <= 0.0 => Sampling::ArgMax,
        (temperature, Some(p)) => Sampling::TopP { p, temperature },
        (temperature, None) => Sampling::All { temperature },
    };
    let mut chat = Chat {
        model,
        pool,
        history: Vec::new(),
        seen_text: String::new(),
        messages: args
            .system
            .iter()
            .map(|s| Message::new("system", s.as_str()))
            .collect(),
        sampler: LogitsProcessor::from_sampling(args.seed, sampling),
        scratch,
    };

    let lines: Box<dyn Iterator<Item = std::io::Result<String>>> = match &args.script {
        Some(p) => Box::new(std::io::BufReader::new(std::fs::File::open(p)?).lines()),
        None => {
            eprintln!("type a message and press enter; an empty line or end of input quits");
            Box::new(std::io::stdin().lock().lines())
        }
    };
    let interactive = args.script.is_none() && !args.json;
    for (turn, line) in lines.enumerate() {
        let line = line?;
        let user = line.trim();
        if user.is_empty() {
            if args.script.is_some() {
                continue;
            }
            break;
        }
        if !args.json && !interactive {
            println!("> {user}");
        }
        let mut stdout = std::io::stdout();
        let mut print = |s: &str| {
            if !args.json {
                print!("{s}");
                let _ = stdout.flush();
            }
        };
        let stats = match chat.turn(user, args.max_tokens, &mut print) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("turn {} failed: {e}", turn + 1);
                continue;
            }
        };
        let decode_tps = stats.output_tokens.saturating_sub(1) as f64 * 1e3
            / (stats.turn_ms - stats.ttft_ms).max(1e-9);
        if args.json {
            let record = serde_json::json!({
                "turn": turn + 1,
                "prompt_tokens": stats.prompt_tokens,
                "reused_tokens": stats.reused_tokens,
                "prefilled_tokens": stats.prompt_tokens,
                "recomputed_tokens": 0,
                "output_tokens": stats.output_tokens,
                "ttft_ms": stats.ttft_ms,
                "stateless_ttft_ms": stats.stateless_ttft_ms,
                "turn_ms": stats.turn_ms,
                "decode_tok_per_s": decode_tps,
                "text": stats.text,
            });
            println!("{record}");
        } else {
            let baseline = match stats.stateless_ttft_ms {
                Some(ms) => format!(", stateless TTFT {ms:.0} ms"),
                None => String::new(),
            };
            println!(
                "\n[turn {}: {} new prompt tokens prefilled, {} reused from cache (stateless would \
                 prefill {}); TTFT {:.0} ms{baseline}; {} tokens at {:.1} tok/s]",
                turn + 1,
                stats.prompt_tokens,
                stats.reused_tokens,
                stats.prompt_tokens + stats.reused_tokens,
                stats.ttft_ms,
                stats.output_tokens,
                decode_tps
            );
        }
    }
    Ok(())
}

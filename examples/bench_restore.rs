//! The layer-pipelined restore from the store, measured. A conversation with a long history
//! is stored; fresh engines over the same folder then resume it, alternately with the restore
//! pipelined (the reader thread hands each layer over as it is read and checked; the pass
//! starts on layer 0 meanwhile) and serial (the whole history read and checked before the
//! pass). Before each resume the chunk files are dropped from the page cache
//! (`posix_fadvise(DONTNEED)`), so reads come from the storage device, as after a restart.
//!
//! ```text
//! cargo run --release --example bench_restore -- [--history 2048] [--repeats 7]
//! ```
//! Reports medians of the resumed turn's TTFT, the time the serial restore spent reading
//! (`transfer_time`) and the time the pipelined pass still waited for reads
//! (`restore_wait_time`): the overlap is the share of the read the pipeline hid.
//!
//! `--kv q8|q4` keeps the KV in 8 or 4 bits (the bytes stored per turn are reported).
//!
//! With `--redis URL` the store is that Redis instead (the fleet's shared tier): the same
//! resumes read the history's chunks over the network, and the report adds what one chunk
//! costs to fetch and check (the serial read divided by the chunks) and to store (the time
//! the writer took to empty its queue after the turn, per chunk).

use std::error::Error;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::engine::{
    Budgets, ConversationOptions, CostModel, CostProfile, Engine, EngineConfig, KvPrecision,
    RedisConfig, SamplingParams, StoreConfig, Turn,
};
use pensieve::model::{LoadOptions, Model, ModelSource};

#[derive(Parser, Debug)]
struct Args {
    /// Tokens of stored history the resumed turn reads back.
    #[arg(long, default_value_t = 2048)]
    history: usize,
    /// Resumes per mode; medians are reported.
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// Keep the files in the page cache (reads from memory instead of the device).
    #[arg(long)]
    warm_cache: bool,
    /// Store in this Redis instead of a folder.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// The KV's precision in every tier.
    #[arg(long, value_enum, default_value = "f16")]
    kv: pensieve::cli::Kv,
}

/// Where one repeat stores its chunks: a folder of its own, or its own key prefix in Redis.
fn store(dir: &Path, redis: Option<&str>) -> StoreConfig {
    match redis {
        Some(url) => StoreConfig::redis(
            RedisConfig::new(url).key_prefix(format!("bench-restore-{}", dir.display())),
        ),
        None => StoreConfig::new(dir),
    }
}

fn config(store: StoreConfig, pipelined: bool, kv: KvPrecision) -> EngineConfig {
    EngineConfig::default()
        .kv_precision(kv)
        .budgets(Budgets::default().device_tokens(8192))
        .step_token_budget(4096)
        // Every chunk is worth saving: recomputing costs more than reading it back.
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(store)
        .pipelined_restore(pipelined)
}

/// Drops every file under `dir` from the page cache.
fn evict_page_cache(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            evict_page_cache(&path)?;
        } else {
            let file = std::fs::File::open(&path)?;
            // SAFETY: `file` is an open descriptor for the duration of the call; the advice
            // only drops clean cached pages.
            unsafe {
                use std::os::fd::AsRawFd;
                libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
        }
    }
    Ok(())
}

/// One resume: (TTFT, time reading in the step's transfer, time the pass waited for reads).
fn resume(
    model: &Arc<Model>,
    store: StoreConfig,
    pipelined: bool,
    turn: &[u32],
    kv: KvPrecision,
) -> Result<(Duration, Duration, Duration), Box<dyn Error>> {
    let mut engine = Engine::with_model(model.clone(), config(store, pipelined, kv))?;
    let conv = engine.resume("bench")?;
    let params = SamplingParams::greedy().max_tokens(1);
    let (_, stats) = engine.run_turn(conv, Turn::Tokens(turn.to_vec()), params, |_| {})?;
    if stats.reused_from_store_tokens == 0 {
        return Err("the resumed turn read nothing from store".into());
    }
    let s = engine.stats();
    Ok((stats.ttft, s.transfer_time, s.restore_wait_time))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let model = Arc::new(Model::load(&ModelSource::Default, &LoadOptions::default())?);
    let root = tempfile::tempdir()?;
    let vocab = model.config().vocab_size as u32;
    let history: Vec<u32> = (0..args.history as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 200))
        .collect();
    let turn: Vec<u32> = history[..16].to_vec();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            let line = c.lines().find(|l| l.starts_with("model name"))?.to_string();
            Some(line.split(':').nth(1)?.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kv = KvPrecision::from(args.kv);
    println!("{cpu}; history {} tokens, KV {kv:?}", args.history);
    let bar = ProgressBar::new(2 * args.repeats as u64).with_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} resumes",
    )?);
    let mut serial = (Vec::new(), Vec::new());
    let mut pipelined = (Vec::new(), Vec::new());
    let mut writes = Vec::new();
    let mut stored = 0;
    for _ in 0..args.repeats {
        for pipe in [false, true] {
            // A fresh store each time: every resume reads the same files, once.
            let dir = root.path().join(format!("store-{}", bar.position()));
            let store = store(&dir, args.redis.as_deref());
            let mut engine = Engine::with_model(model.clone(), config(store.clone(), pipe, kv))?;
            let conv = engine.open(ConversationOptions::default().name("bench"))?;
            let params = SamplingParams::greedy().max_tokens(1);
            engine.run_turn(conv, Turn::Tokens(history.clone()), params, |_| {})?;
            let start = Instant::now();
            engine.flush();
            writes.push(start.elapsed());
            stored = engine.stats().store.map_or(0, |s| s.bytes_written);
            drop(engine);
            if !args.warm_cache && args.redis.is_none() {
                evict_page_cache(&dir)?;
            }
            let (ttft, transfer, waited) = resume(&model, store, pipe, &turn, kv)?;
            let out = if pipe { &mut pipelined } else { &mut serial };
            out.0.push(ttft);
            out.1.push(if pipe { waited } else { transfer });
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let (st, sr) = (median(serial.0), median(serial.1));
    let (pt, pw) = (median(pipelined.0), median(pipelined.1));
    println!(
        "serial:    TTFT {:.1} ms, of which reading the history {:.1} ms",
        ms(st),
        ms(sr)
    );
    println!(
        "pipelined: TTFT {:.1} ms, of which waiting for reads {:.1} ms",
        ms(pt),
        ms(pw)
    );
    println!(
        "TTFT ratio pipelined/serial {:.2}; share of the read hidden {:.0}%",
        pt.as_secs_f64() / st.as_secs_f64(),
        100.0 * (1.0 - pw.as_secs_f64() / sr.as_secs_f64().max(1e-9))
    );
    println!(
        "stored: {stored} bytes of KV for the turn's {} tokens",
        args.history
    );
    let chunks = args.history.div_ceil(EngineConfig::default().chunk_size) as f64;
    println!(
        "per chunk: fetch and check {:.2} ms; store (writer emptying its queue) {:.2} ms",
        ms(sr) / chunks,
        ms(median(writes)) / chunks
    );
    Ok(())
}

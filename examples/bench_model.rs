//! Prefill and decode throughput of our model against candle-transformers' `quantized_llama`
//! on the same GGUF file, side by side in one run, medians of repeated measurements.
//!
//! ```text
//! cargo run --release --example bench_model -- [--repeats 3] [--quick]
//! ```
//! Prefill: one prompt of N tokens, tokens/s. Decode: one sequence with C tokens of context,
//! 16 greedy steps, tokens/s. Decode steps of 1 and 8 rows against the time to stream the
//! weights once at the measured copy bandwidth. `--gguf FILE,...` adds other files (formats)
//! in the packed format. Also prints the machine's f32 GEMM rate on a model-shaped matmul,
//! the yardstick for prefill efficiency.

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Module, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::attention::KvPool;
use pensieve::engine::KvPrecision;
use pensieve::model::{
    default_model_path, ForwardBatch, LoadOptions, Model, ModelSource, WeightFormat,
};

#[derive(Parser, Debug)]
struct Args {
    /// Measurements per cell; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Only the short prompt and context (smoke run).
    #[arg(long)]
    quick: bool,
    /// Skip candle's scalar Q4_1 matmul on long prompts (slow: ~14 tokens/s).
    #[arg(long)]
    skip_slow: bool,
    /// Our weight formats to measure.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,packed,q4_1")]
    formats: Vec<String>,
    /// Leave out candle-transformers' model.
    #[arg(long)]
    no_candle: bool,
    /// Other GGUF files to measure in the packed format (e.g. the default model re-quantized
    /// by `examples/requantize.rs`, or Gemma 3), named by file name.
    #[arg(long, value_delimiter = ',')]
    gguf: Vec<std::path::PathBuf>,
    /// Only the decode-step table (skip prefill and single-sequence decode).
    #[arg(long)]
    steps_only: bool,
    /// KV precisions of the decode-step table (f16, f32, q8, q4), measured one after another
    /// for each shape.
    #[arg(long, value_delimiter = ',', default_value = "f16")]
    kv: Vec<String>,
    /// Decode-step shapes, `ROWSxCONTEXT`.
    #[arg(long, value_delimiter = ',', default_value = "1x64,8x64,8x512")]
    steps: Vec<String>,
}

const DECODE_STEPS: usize = 16;

fn tokens(n: usize) -> Vec<u32> {
    // Ordinary vocabulary ids (the special tokens sit below 17).
    (0..n).map(|i| 100 + (i as u32 * 7919) % 40_000).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The engine's KV precision, which every pool here uses.
fn kv() -> KvPrecision {
    KvPrecision::default()
}

/// Our model: time to prefill `prompt`, and time of `DECODE_STEPS` decode steps after it.
fn ours(model: &Model, prompt: &[u32], decode: bool) -> pensieve::Result<f64> {
    let n = prompt.len();
    let pool = KvPool::new(
        model.config().kv_shape(),
        n + DECODE_STEPS + 1,
        kv(),
        model.transformer().device(),
    )?;
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut batch = ForwardBatch::new();
    batch.push(prompt, &pos, &pos, &pos, pos.len(), true)?;
    let started = Instant::now();
    let logits = model.transformer().forward(&batch, &pool)?;
    let mut next = argmax(&logits)?;
    if !decode {
        return Ok(started.elapsed().as_secs_f64());
    }
    let started = Instant::now();
    for step in 0..DECODE_STEPS {
        let p = (n + step) as u32;
        let ctx: Vec<u32> = (0..=p).collect();
        let mut batch = ForwardBatch::new();
        batch.push(&[next], &[p], &[p], &ctx, ctx.len(), true)?;
        next = argmax(&model.transformer().forward(&batch, &pool)?)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Seconds of one decode step of `rows` sequences, each with `ctx` tokens of history with KV
/// at `kv` (median of `repeats`), after one warm-up step.
fn decode_step(
    model: &Model,
    (rows, ctx): (usize, usize),
    kv: KvPrecision,
    repeats: usize,
) -> pensieve::Result<f64> {
    let pool = KvPool::new(
        model.config().kv_shape(),
        rows * (ctx + 1),
        kv,
        model.transformer().device(),
    )?;
    let mut batch = ForwardBatch::new();
    for r in 0..rows {
        let base = (r * (ctx + 1)) as u32;
        let positions: Vec<u32> = (0..=ctx as u32).collect();
        let slots: Vec<u32> = positions.iter().map(|p| base + p).collect();
        batch.push(
            &[100 + r as u32],
            &[ctx as u32],
            &slots[ctx..],
            &slots,
            positions.len(),
            true,
        )?;
    }
    model.transformer().forward(&batch, &pool)?;
    let mut times = Vec::new();
    for _ in 0..repeats {
        let started = Instant::now();
        model.transformer().forward(&batch, &pool)?;
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// Copy bandwidth in GB/s: bytes read plus bytes written by copying 256 MiB (median of 5).
fn copy_gbps() -> f64 {
    let src = vec![1u8; 256 << 20];
    let mut dst = vec![0u8; 256 << 20];
    let mut times = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        dst.copy_from_slice(&src);
        times.push(started.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    2.0 * src.len() as f64 / median(times) / 1e9
}

/// candle's `quantized_llama`: the same two timings.
fn candle(model: &mut ModelWeights, prompt: &[u32], decode: bool) -> candle_core::Result<f64> {
    model.clear_kv_cache();
    let x = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let started = Instant::now();
    let logits = model.forward(&x, 0)?;
    let mut next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    if !decode {
        return Ok(started.elapsed().as_secs_f64());
    }
    let started = Instant::now();
    for step in 0..DECODE_STEPS {
        let x = Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?;
        next = model
            .forward(&x, prompt.len() + step)?
            .squeeze(0)?
            .argmax(0)?
            .to_scalar::<u32>()?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Loads candle's model in a fresh thread, where its once-per-thread read of
/// `CANDLE_DEQUANTIZE_ALL` sees `dequantize`; the returned model keeps its weights.
fn load_candle(dequantize: bool) -> Result<ModelWeights, String> {
    std::thread::spawn(move || {
        // The variable is read during this thread's first QMatMul construction only.
        // SAFETY: the only other thread of ours, the main one, waits in `join` meanwhile.
        unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", if dequantize { "1" } else { "0" }) };
        let path = default_model_path();
        let mut f = std::fs::File::open(&path).map_err(|e| e.to_string())?;
        let c = gguf_file::Content::read(&mut f).map_err(|e| e.to_string())?;
        ModelWeights::from_gguf(c, &mut f, &Device::Cpu).map_err(|e| e.to_string())
    })
    .join()
    .map_err(|_| "loader thread panicked".to_string())?
}

/// f32 GEMM rate of `[m, 576] x [576, 1536]`, the model's MLP up-projection shape.
fn gemm_gflops(m: usize) -> candle_core::Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (m, 576), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (1536, 576), &Device::Cpu)?;
    let lin = candle_nn::Linear::new(b, None);
    let mut times = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        lin.forward(&a)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * m as f64 * 576.0 * 1536.0 / median(times) / 1e9)
}

/// The most likely token of the first row of `logits`.
fn argmax(logits: &Tensor) -> candle_core::Result<u32> {
    logits
        .get(0)?
        .argmax(candle_core::D::Minus1)?
        .to_scalar::<u32>()
}

/// The CPU's model name and the matmul's vector path, for the tables.
fn isa_name() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let path = pensieve::model::matmul_path();
    format!("{cpu}, matmul path {path}")
}

/// Our model in each of `formats`, with its row name.
fn load_ours(formats: &[String]) -> Result<Vec<(String, Model)>, Box<dyn std::error::Error>> {
    let mut models = Vec::new();
    for f in formats {
        let (name, format) = match f.as_str() {
            "f32" => ("pensieve f32", WeightFormat::F32),
            "f16" => ("pensieve f16", WeightFormat::F16),
            "packed" => ("pensieve packed (default)", WeightFormat::Packed),
            "q4_1" => ("pensieve Q4_1", WeightFormat::Quantized),
            other => return Err(format!("unknown format {other}").into()),
        };
        let options = LoadOptions::default().format(format);
        models.push((
            name.to_string(),
            Model::load(&ModelSource::Default, &options)?,
        ));
    }
    Ok(models)
}

/// The results as a Markdown table.
fn print_rows(prefill_lens: &[usize], decode_ctx: &[usize], rows: Vec<(String, Vec<Option<f64>>)>) {
    let mut header = String::from("| implementation |");
    for n in prefill_lens {
        header.push_str(&format!(" prefill {n} tok/s |"));
    }
    for c in decode_ctx {
        header.push_str(&format!(" decode @ctx {c} tok/s |"));
    }
    println!("{header}");
    println!(
        "|{}",
        "---|".repeat(1 + prefill_lens.len() + decode_ctx.len())
    );
    for (name, row) in rows {
        let cells: Vec<String> = row
            .iter()
            .map(|v| v.map_or("skipped".into(), |v| format!("{v:.1}")))
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
}

fn main() -> std::process::ExitCode {
    pensieve::cli::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let prefill_lens: &[usize] = if args.quick { &[32] } else { &[32, 256, 1024] };
    let decode_ctx: &[usize] = if args.quick { &[64] } else { &[64, 1024] };

    eprintln!("loading models ...");
    let mut ours_models = load_ours(&args.formats)?;
    for path in &args.gguf {
        let name = path
            .file_name()
            .map_or("gguf".into(), |n| n.to_string_lossy().into_owned());
        let before = resident_bytes();
        let model = Model::load(&ModelSource::Gguf(path.clone()), &LoadOptions::default())?;
        if let (Some(before), Some(after)) = (before, resident_bytes()) {
            let file = std::fs::metadata(path)?.len();
            let held = after.saturating_sub(before);
            eprintln!(
                "{name}: {:.0} MB resident after loading a {:.0} MB file ({:.3}x)",
                held as f64 / 1e6,
                file as f64 / 1e6,
                held as f64 / file as f64
            );
        }
        ours_models.push((name, model));
    }
    let (prefill_lens, decode_ctx) = if args.steps_only {
        (&[][..], &[][..])
    } else {
        (prefill_lens, decode_ctx)
    };
    let mut candle_models = if args.no_candle {
        Vec::new()
    } else {
        vec![
            (
                "candle quantized_llama f32 (dequantized)",
                load_candle(true)?,
            ),
            ("candle quantized_llama Q4_1", load_candle(false)?),
        ]
    };

    let cells = (ours_models.len() + candle_models.len()) * (prefill_lens.len() + decode_ctx.len());
    let bar = ProgressBar::new((cells * args.repeats) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} {msg} [{elapsed}]",
    )?);

    let mut rows: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    let measure = |f: &mut dyn FnMut() -> Result<f64, Box<dyn std::error::Error>>,
                   work: usize|
     -> Result<f64, Box<dyn std::error::Error>> {
        let mut t = Vec::new();
        for _ in 0..args.repeats {
            t.push(f()?);
            bar.inc(1);
        }
        Ok(work as f64 / median(t))
    };
    for (name, m) in &ours_models {
        bar.set_message(name.to_string());
        let mut row = Vec::new();
        for &n in prefill_lens {
            let p = tokens(n);
            row.push(Some(measure(&mut || Ok(ours(m, &p, false)?), n)?));
        }
        for &c in decode_ctx {
            let p = tokens(c);
            row.push(Some(measure(&mut || Ok(ours(m, &p, true)?), DECODE_STEPS)?));
        }
        rows.push((name.clone(), row));
    }
    for (name, m) in &mut candle_models {
        bar.set_message(name.to_string());
        let slow = name.ends_with("Q4_1") && args.skip_slow;
        let mut row = Vec::new();
        for &n in prefill_lens {
            let p = tokens(n);
            if slow && n > 32 {
                bar.inc(args.repeats as u64);
                row.push(None);
                continue;
            }
            row.push(Some(measure(&mut || Ok(candle(m, &p, false)?), n)?));
        }
        for &c in decode_ctx {
            let p = tokens(c);
            row.push(Some(measure(
                &mut || Ok(candle(m, &p, true)?),
                DECODE_STEPS,
            )?));
        }
        rows.push((name.to_string(), row));
    }
    bar.finish_and_clear();

    if !args.steps_only {
        print_rows(prefill_lens, decode_ctx, rows);
        println!();
    }
    let gbps = copy_gbps();
    println!(
        "Decode steps (median of {}); copy bandwidth {gbps:.1} GB/s (read + write); {}:",
        args.repeats.max(3),
        isa_name()
    );
    println!("| model | rows | context | KV | step ms | weight bytes | bytes / bandwidth ms | ratio | KV bytes read | weights + KV / bandwidth ms | ratio to weights + KV |");
    println!("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let shapes = (args.steps.iter())
        .map(|s| {
            let (rows, ctx) = s.split_once('x').ok_or("a step shape is ROWSxCONTEXT")?;
            Ok((rows.parse()?, ctx.parse()?))
        })
        .collect::<Result<Vec<(usize, usize)>, Box<dyn std::error::Error>>>()?;
    let precisions = (args.kv.iter())
        .map(|k| match k.as_str() {
            "f16" => Ok(KvPrecision::F16),
            "f32" => Ok(KvPrecision::F32),
            "q8" => Ok(KvPrecision::Q8),
            "q4" => Ok(KvPrecision::Q4),
            other => Err(format!("no KV precision {other:?} (f16, f32, q8, q4)")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    for (name, m) in &ours_models {
        for &(rows, ctx) in &shapes {
            for &kv in &precisions {
                let step = decode_step(m, (rows, ctx), kv, args.repeats.max(3))?;
                let bytes = m.transformer().weight_bytes();
                let kv_bytes = rows * (ctx + 1) * m.config().kv_shape().token_bytes(kv);
                // Streaming bytes once reads them: half the copy traffic per byte.
                let ms = |b: usize| b as f64 / (gbps / 2.0 * 1e9) * 1e3;
                println!(
                    "| {name} | {rows} | {ctx} | {kv:?} | {:.2} | {:.0} MB | {:.2} | {:.2} | {:.1} MB | {:.2} | {:.2} |",
                    step * 1e3,
                    bytes as f64 / 1e6,
                    ms(bytes),
                    step * 1e3 / ms(bytes),
                    kv_bytes as f64 / 1e6,
                    ms(bytes + kv_bytes),
                    step * 1e3 / ms(bytes + kv_bytes),
                );
            }
        }
    }
    println!();
    println!(
        "f32 GEMM [m x 576] x [576 x 1536]: m=32 {:.1} GFLOP/s, m=256 {:.1} GFLOP/s, m=1024 {:.1} GFLOP/s ({} rayon threads)",
        gemm_gflops(32)?,
        gemm_gflops(256)?,
        gemm_gflops(1024)?,
        rayon::current_num_threads()
    );
    Ok(())
}

/// The process's resident memory (Linux's `VmRSS`), to tell what loading a model holds.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

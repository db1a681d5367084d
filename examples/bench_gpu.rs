//! The CUDA path's measurements (build with `--features cuda`; needs a GPU):
//!
//! 1. **Attention** in the Pensieve paper's Figure 10 setting: 32 sequences, 1-16 queries
//!    each (and 64, a prefill chunk), contexts 256-8192, head dim 128 (`--head-dim`: 64 or
//!    256, Gemma's) with 32 query heads over 8 KV heads, f16 KV (`--kv bf16`: bf16). Our kernel
//!    over interleaved (non-contiguous) slots, the same with the tensor-core kernel off
//!    (`PENSIEVE_CUDA_MMA=0`: every item on the kernel of one query per warp), our kernel over
//!    contiguous slots, the gather path (context copied out, then candle ops), and candle's
//!    attention over contiguous per-sequence K/V (matmul, mask, softmax, matmul in the KV
//!    type), the contiguous kernel our target compares against.
//! 2. **Pipelined restore**: one decode step of a random-weight Llama 3.2 1B shape (32 rows
//!    at context 1024) after swapping in `--chunks` chunks, with the copies serial (the step
//!    waits for the whole restore) or pipelined (layer `l` waits for layer `l`'s copies),
//!    and the share of the copy time the pipeline hides.
//! 3. **The decode step against the memory bound**: the same model's step of 1, 8, 32 and 64
//!    rows at context 1024, against the time to read its weights and the rows' KV once at
//!    the bandwidth a device-to-device copy reaches (bytes read and written), the host's
//!    time to issue the step, and the same step through candle's ops instead of the fused
//!    kernels (`unfused`), then also with cudarc's per-buffer event tracking on (`before`: as
//!    every step ran before the pool turned it off).
//!
//! Medians of `--repeats` synchronized runs.
//!
//! ```text
//! cargo run --release --features cuda --example bench_gpu -- [--repeats 20] [--chunks 64] [--kv bf16]
//! ```

use std::error::Error;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use pensieve::attention::{attention, attention_gather, Attend, AttentionBatch, KvPool, Span};
use pensieve::model::{ForwardBatch, Model, ModelConfig, Transformer, WeightFormat};

type AnyResult<T> = Result<T, Box<dyn Error>>;

#[derive(Parser, Debug)]
#[command(about = "Measure the CUDA attention kernel and the pipelined restore")]
struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = pensieve::cli::positive)]
    repeats: usize,
    /// Chunks of 32 tokens swapped in before the measured decode step.
    #[arg(long, default_value_t = 64, value_parser = pensieve::cli::positive)]
    chunks: usize,
    /// The KV precision of the attention table (bf16 runs the tensor-core kernel with three
    /// parts of Q and P instead of two).
    #[arg(long, value_enum, default_value = "f16")]
    kv: Kv,
    /// The head dim of the attention table: 64, 128 or 256.
    #[arg(long, default_value_t = 128, value_parser = head_dim)]
    head_dim: usize,
    /// The measurements to run, of `attention`, `restore` and `step` (default: all).
    #[arg(long, value_delimiter = ',', default_values_t = [Part::Attention, Part::Restore, Part::Step])]
    parts: Vec<Part>,
}

/// A head dim the CUDA kernels are built for.
fn head_dim(s: &str) -> Result<usize, String> {
    match s.parse() {
        Ok(d @ (64 | 128 | 256)) => Ok(d),
        _ => Err(format!("{s}: the kernels take head dim 64, 128 or 256")),
    }
}

/// One of the measurements.
#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
enum Part {
    Attention,
    Restore,
    Step,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", format!("{self:?}").to_lowercase())
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Kv {
    F16,
    Bf16,
}

impl Kv {
    fn dtype(self) -> DType {
        match self {
            Kv::F16 => DType::F16,
            Kv::Bf16 => DType::BF16,
        }
    }
}

const SEQS: usize = 32;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;

/// Median seconds of `repeats` runs of `f`, each ended by a device synchronization (after
/// two unmeasured runs).
fn median(dev: &Device, repeats: usize, mut f: impl FnMut() -> AnyResult<()>) -> AnyResult<f64> {
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let mut t = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// `nq` queries at the end of each sequence's `ctx` tokens; slots interleaved across
/// sequences or one run per sequence.
fn batch(ctx: usize, nq: usize, interleaved: bool) -> AnyResult<AttentionBatch> {
    let mut b = AttentionBatch::new(1);
    for s in 0..SEQS {
        let slots: Vec<u32> = (0..ctx)
            .map(|p| if interleaved { p * SEQS + s } else { s * ctx + p } as u32)
            .collect();
        let positions: Vec<u32> = (0..ctx as u32).collect();
        b.push_sequence(&positions[ctx - nq..], &slots, ctx)?;
    }
    Ok(b)
}

/// candle's attention over contiguous `[SEQS, KV_HEADS, ctx, d]` K/V, causal for the last
/// `nq` positions: the contiguous-KV kernel a paged layout is measured against.
fn contiguous(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> AnyResult<Tensor> {
    let dtype = k.dtype();
    let rep = HEADS / KV_HEADS;
    let k = candle_transformers::utils::repeat_kv(k.clone(), rep)?;
    let v = candle_transformers::utils::repeat_kv(v.clone(), rep)?;
    let scores = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(mask)?)?;
    Ok(p.to_dtype(dtype)?.matmul(&v)?)
}

fn attention_table(gpu: &Device, args: &Args) -> AnyResult<()> {
    let contexts = [256, 1024, 4096, 8192];
    let queries = [1, 4, 16, 64];
    let bar = ProgressBar::new((contexts.len() * queries.len()) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} {msg} [{elapsed}]",
    )?);
    let d = args.head_dim;
    let scale = 1.0 / (d as f64).sqrt();
    let mut lines = Vec::new();
    for &ctx in &contexts {
        let pool = |mean: f32| -> AnyResult<Tensor> {
            let t = Tensor::randn(mean, 1.0f32, (SEQS * ctx, KV_HEADS, d), gpu)?;
            Ok(t.to_dtype(args.kv.dtype())?)
        };
        let (k, v) = (pool(0.0)?, pool(0.1)?);
        // The same values per sequence, contiguous: [SEQS, KV_HEADS, ctx, d].
        let per_seq = |t: &Tensor| -> AnyResult<Tensor> {
            let t = t.reshape((ctx, SEQS, KV_HEADS, d))?.permute((1, 2, 0, 3))?;
            Ok(t.contiguous()?)
        };
        let (kc, vc) = (per_seq(&k)?, per_seq(&v)?);
        for &nq in &queries {
            bar.set_message(format!("context {ctx}, {nq} queries"));
            let q = Tensor::randn(0f32, 1.0, (SEQS * nq, HEADS, d), gpu)?;
            let ours = batch(ctx, nq, true)?;
            let ideal = batch(ctx, nq, false)?;
            let (kd, vd) = (k.clone(), v.clone());
            let t_ours = median(gpu, args.repeats, || {
                attention(&q, &kd, &vd, &ours, scale as f32)?;
                Ok(())
            })?;
            // SAFETY: the benchmark runs on this one thread; no other reads the environment.
            unsafe { std::env::set_var("PENSIEVE_CUDA_MMA", "0") };
            let t_scalar = median(gpu, args.repeats, || {
                attention(&q, &kd, &vd, &ours, scale as f32)?;
                Ok(())
            });
            // SAFETY: the benchmark runs on this one thread; no other reads the environment.
            unsafe { std::env::remove_var("PENSIEVE_CUDA_MMA") };
            let t_scalar = t_scalar?;
            let t_ideal = median(gpu, args.repeats, || {
                attention(&q, &kd, &vd, &ideal, scale as f32)?;
                Ok(())
            })?;
            let t_gather = median(gpu, args.repeats, || {
                attention_gather(&q, &kd, &vd, Attend::new(&ours, scale as f32))?;
                Ok(())
            })?;
            let qc = q
                .reshape((SEQS, nq, HEADS, d))?
                .transpose(1, 2)?
                .contiguous()?
                .to_dtype(args.kv.dtype())?;
            let mask: Vec<f32> = (0..nq)
                .flat_map(|j| {
                    (0..ctx).map(move |p| {
                        if p <= ctx - nq + j {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (nq, ctx), gpu)?;
            let t_candle = median(gpu, args.repeats, || {
                contiguous(&qc, &kc, &vc, &mask, scale)?;
                Ok(())
            })?;
            lines.push(format!(
                "{ctx:>7} {nq:>3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>9.2}x {:>9.2}x",
                t_ours * 1e3,
                t_scalar * 1e3,
                t_ideal * 1e3,
                t_gather * 1e3,
                t_candle * 1e3,
                t_ours / t_candle,
                t_gather / t_ours,
            ));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    println!(
        "attention, {SEQS} sequences, {HEADS} heads over {KV_HEADS} KV heads of {d}, {:?} KV; median ms",
        args.kv
    );
    println!(
        "{:>7} {:>3} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "context",
        "q",
        "pensieve",
        "no MMA",
        "contig.",
        "gather",
        "candle",
        "ours/cndl",
        "gath/ours"
    );
    for l in lines {
        println!("{l}");
    }
    Ok(())
}

/// Llama 3.2 1B's shape with random f16 weights, a byte vocabulary.
fn model_1b(gpu: &Device) -> AnyResult<Model> {
    let config = ModelConfig::from_hf_json(
        r#"{"architectures":["LlamaForCausalLM"],"vocab_size":259,"hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,
            "num_attention_heads":32,"num_key_value_heads":8,"rms_norm_eps":1e-5,
            "rope_theta":500000.0,"max_position_embeddings":8192,"tie_word_embeddings":true}"#,
    )?;
    let llama = Transformer::random(config, 5, WeightFormat::F16, gpu)?;
    Ok(Model::tiny(7)?.with_transformer(llama))
}

/// One decode row for each of `rows` sequences, each the last of `ctx` positions in its own
/// run of slots (`[s * ctx, (s + 1) * ctx)`).
fn decode_rows(rows: usize, ctx: usize) -> AnyResult<ForwardBatch> {
    let mut fb = ForwardBatch::new();
    for s in 0..rows {
        let ctx_slots: Vec<u32> = (0..ctx).map(|p| (s * ctx + p) as u32).collect();
        let last = ctx - 1;
        fb.push(
            &[(s % 200) as u32],
            &[last as u32],
            &[ctx_slots[last]],
            &ctx_slots,
            ctx,
            true,
        )?;
    }
    Ok(fb)
}

fn restore_overlap(gpu: &Device, args: &Args) -> AnyResult<()> {
    const CTX: usize = 1024;
    const CHUNK: usize = 32;
    let model = model_1b(gpu)?;
    let llama = model.transformer();
    // Contexts in slots [0, SEQS * CTX); restored chunks land after them, and copies out of
    // the same region supply the bytes.
    let restored = SEQS * CTX;
    let slots = restored + args.chunks * CHUNK + SEQS;
    let pool = KvPool::new(
        llama.config().kv_shape(),
        slots,
        pensieve::engine::KvPrecision::F16,
        gpu,
    )?;
    let fb = decode_rows(SEQS, CTX)?;
    let outs: Vec<Span> = (0..args.chunks)
        .map(|i| Span::whole(i * CHUNK, CHUNK))
        .collect();
    let fresh = || -> AnyResult<Vec<(Span, std::sync::Arc<pensieve::kv::ChunkBytes>)>> {
        let bytes = pool.copy_chunks(&outs, Vec::new(), false)?;
        for b in &bytes {
            b.bytes()?;
        }
        Ok(bytes
            .into_iter()
            .enumerate()
            .map(|(i, b)| {
                (
                    Span::whole(restored + i * CHUNK, CHUNK),
                    std::sync::Arc::new(b),
                )
            })
            .collect())
    };
    let step = || -> AnyResult<()> {
        llama.forward(&fb, &pool)?.to_device(&Device::Cpu)?;
        Ok(())
    };
    let timed = |pipelined: Option<bool>| -> AnyResult<f64> {
        let mut t = Vec::new();
        for _ in 0..args.repeats + 2 {
            let ins = fresh()?;
            gpu.synchronize()?;
            let start = Instant::now();
            match pipelined {
                Some(p) => {
                    pool.copy_chunks(&[], ins, p)?;
                    step()?;
                }
                None => {
                    pool.copy_chunks(&[], ins, false)?;
                }
            }
            gpu.synchronize()?;
            t.push(start.elapsed().as_secs_f64());
        }
        t.drain(..2);
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    };
    let t_step = median(gpu, args.repeats, step)?;
    let t_copy = timed(None)?;
    let t_serial = timed(Some(false))?;
    let t_pipe = timed(Some(true))?;
    let mib = (args.chunks
        * CHUNK
        * llama
            .config()
            .kv_shape()
            .token_bytes(pensieve::engine::KvPrecision::F16))
        >> 20;
    println!(
        "\nrestore, Transformer 3.2 1B shape, {SEQS} decode rows at context {CTX}, {} chunks ({mib} MiB) swapped in; median ms",
        args.chunks
    );
    println!(
        "step alone {:.3}, copies alone {:.3}, serial {:.3}, pipelined {:.3}",
        t_step * 1e3,
        t_copy * 1e3,
        t_serial * 1e3,
        t_pipe * 1e3
    );
    println!(
        "copy time hidden by the pipeline: {:.0}% (of the copies' {:.3} ms; the most it could hide is min(step, copies))",
        100.0 * (t_serial - t_pipe) / t_copy,
        t_copy * 1e3
    );
    Ok(())
}

/// Bytes a second the copy engine moves on `gpu` (1 GiB read and 1 GiB written).
#[cfg(feature = "cuda")]
fn copy_bandwidth(gpu: &Device, repeats: usize) -> AnyResult<f64> {
    let Device::Cuda(cuda) = gpu else {
        return Err("not a CUDA device".into());
    };
    let stream = cuda.cuda_stream();
    let src = stream.alloc_zeros::<u8>(1 << 30)?;
    let mut dst = stream.alloc_zeros::<u8>(1 << 30)?;
    let t = median(gpu, repeats, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * (1u64 << 30) as f64 / t)
}

#[cfg(not(feature = "cuda"))]
fn copy_bandwidth(_: &Device, _: usize) -> AnyResult<f64> {
    Err("built without the cuda feature".into())
}

/// The decode step of the 1B shape against reading its weights and KV once.
fn step_against_bound(gpu: &Device, args: &Args) -> AnyResult<()> {
    const CTX: usize = 1024;
    let bandwidth = copy_bandwidth(gpu, args.repeats)?;
    let model = model_1b(gpu)?;
    let llama = model.transformer();
    let token_bytes = llama
        .config()
        .kv_shape()
        .token_bytes(pensieve::engine::KvPrecision::F16);
    println!(
        "\ndecode step, Llama 3.2 1B shape (f16 weights {:.0} MiB), context {CTX}, f16 KV; copy bandwidth {:.0} GB/s; median ms",
        llama.weight_bytes() as f64 / (1 << 20) as f64,
        bandwidth / 1e9
    );
    println!(
        "{:>5} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9}",
        "rows", "step", "bound", "ratio", "issued", "unfused", "before"
    );
    for rows in [1usize, 8, 32, 64] {
        let pool = KvPool::new(
            llama.config().kv_shape(),
            rows * CTX,
            pensieve::engine::KvPrecision::F16,
            gpu,
        )?;
        let fb = decode_rows(rows, CTX)?;
        let (t, issued) = time_step(gpu, args.repeats, llama, &fb, &pool)?;
        // The same step through candle's ops (`PENSIEVE_CUDA_FUSED=0`), then also with cudarc's
        // event tracking on, as every step ran before: what the fused kernels and the
        // tracking cost.
        // SAFETY: no other thread reads the environment while the bench sets it.
        unsafe { std::env::set_var("PENSIEVE_CUDA_FUSED", "0") };
        let unfused = time_step(gpu, args.repeats, llama, &fb, &pool);
        let tracked =
            track_events(gpu, true).and_then(|()| time_step(gpu, args.repeats, llama, &fb, &pool));
        track_events(gpu, false)?;
        // SAFETY: as above.
        unsafe { std::env::remove_var("PENSIEVE_CUDA_FUSED") };
        let bound = (llama.weight_bytes() + rows * CTX * token_bytes) as f64 / bandwidth;
        println!(
            "{rows:>5} {:>9.3} {:>9.3} {:>6.2}x {:>9.3} {:>9.3} {:>9.3}",
            t * 1e3,
            bound * 1e3,
            t / bound,
            issued * 1e3,
            unfused?.0 * 1e3,
            tracked?.0 * 1e3
        );
    }
    Ok(())
}

/// Median seconds of `fb`'s step (logits on the host), and of the host's time to issue it,
/// apart from the wait for its logits: where that is most of the step, the host bounds it,
/// not the GPU.
fn time_step(
    gpu: &Device,
    repeats: usize,
    llama: &Transformer,
    fb: &ForwardBatch,
    pool: &KvPool,
) -> AnyResult<(f64, f64)> {
    let mut issued = Vec::new();
    let t = median(gpu, repeats, || {
        let start = Instant::now();
        let logits = llama.forward(fb, pool)?;
        issued.push(start.elapsed().as_secs_f64());
        logits.to_device(&Device::Cpu)?;
        Ok(())
    })?;
    issued.sort_by(f64::total_cmp);
    Ok((t, issued[issued.len() / 2]))
}

/// Turns cudarc's per-buffer event tracking on `gpu` on or off (buffers made from then on).
#[cfg(feature = "cuda")]
fn track_events(gpu: &Device, on: bool) -> AnyResult<()> {
    let Device::Cuda(cuda) = gpu else {
        return Err("not a CUDA device".into());
    };
    let ctx = cuda.cuda_stream().context().clone();
    // SAFETY: only the bench's own single-stream steps run while it is on.
    unsafe {
        match on {
            true => ctx.enable_event_tracking(),
            false => ctx.disable_event_tracking(),
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn track_events(_: &Device, _: bool) -> AnyResult<()> {
    Err("built without the cuda feature".into())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let run = || -> AnyResult<()> {
        let gpu = pensieve::cli::device(&format!("cuda:{}", args.gpu))?;
        if args.parts.contains(&Part::Attention) {
            attention_table(&gpu, &args)?;
        }
        if args.parts.contains(&Part::Restore) {
            restore_overlap(&gpu, &args)?;
        }
        if args.parts.contains(&Part::Step) {
            step_against_bound(&gpu, &args)?;
        }
        Ok(())
    };
    pensieve::cli::exit_code(run())
}

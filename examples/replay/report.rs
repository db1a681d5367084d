//! The numbers of a replay run: the summary `--json` prints, the table, the sweep's CSV files.

use std::path::Path;
use std::time::Duration;

use pensieve::engine::EngineStats;
use serde::Serialize;

use crate::driver::Run;
use crate::{AnyResult, Load};
use pensieve::cli::Mode;

/// One run's results; `--json` prints it.
#[derive(Debug, Serialize)]
pub(crate) struct Summary {
    pub(crate) mode: &'static str,
    pub(crate) load: String,
    pub(crate) rate: Option<f64>,
    pub(crate) concurrency: Option<usize>,
    pub(crate) conversations: usize,
    pub(crate) turns: usize,
    pub(crate) failed_turns: usize,
    pub(crate) wall_s: f64,
    pub(crate) turns_per_s: f64,
    pub(crate) output_tok_per_s: f64,
    pub(crate) ttft_ms_p50: f64,
    pub(crate) ttft_ms_p90: f64,
    pub(crate) norm_latency_ms_p50: f64,
    pub(crate) norm_latency_ms_p90: f64,
    pub(crate) ttft_ms_by_turn: Vec<f64>,
    pub(crate) prefilled_tokens: u64,
    pub(crate) reused_tokens: u64,
    pub(crate) recomputed_tokens: u64,
    /// History tokens taken back because the template renders them otherwise (a thought it
    /// drops, a reply it trims), and computed again as it renders them.
    pub(crate) rewound_tokens: u64,
    pub(crate) generated_tokens: u64,
    /// Tokens drafted from conversations' histories and verified, and those taken.
    pub(crate) drafted_tokens: u64,
    pub(crate) accepted_tokens: u64,
    pub(crate) hit_rate_device: f64,
    pub(crate) hit_rate_host: f64,
    pub(crate) hit_rate_store: f64,
    /// TTFT of turns after a conversation's first (those that resume cached KV).
    pub(crate) resumed_ttft_ms_p50: f64,
    pub(crate) store_bytes_written: u64,
    pub(crate) store_bytes_read: u64,
    /// Chunks read from disk ahead of their turn / all chunks read from disk.
    pub(crate) prefetch_hit_rate: f64,
    pub(crate) bytes_swapped_in: u64,
    pub(crate) bytes_swapped_out: u64,
    pub(crate) chunks_dropped: u64,
    pub(crate) suspensions: u64,
    pub(crate) steps: u64,
    /// Where `step()` time went, in seconds.
    pub(crate) schedule_s: f64,
    pub(crate) transfer_s: f64,
    pub(crate) forward_s: f64,
    pub(crate) commit_s: f64,
}

pub(crate) fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

pub(crate) fn summarize(mode: Mode, load: Load, run: &Run, stats: &EngineStats) -> Summary {
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
    let resumed: Vec<f64> = run
        .records
        .iter()
        .filter(|r| r.turn_index > 0)
        .map(|r| ms(r.stats.ttft))
        .collect();
    let store = stats.store.unwrap_or_default();
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
        reused_tokens: stats.reused_device_tokens
            + stats.reused_host_tokens
            + stats.reused_store_tokens,
        recomputed_tokens: stats.recomputed_tokens,
        rewound_tokens: stats.rewound_tokens,
        generated_tokens: stats.generated_tokens,
        drafted_tokens: stats.drafted_tokens,
        accepted_tokens: stats.accepted_tokens,
        hit_rate_device: stats.hit_rate_device(),
        hit_rate_host: stats.hit_rate_host(),
        hit_rate_store: stats.hit_rate_store(),
        resumed_ttft_ms_p50: percentile(&resumed, 50.0),
        store_bytes_written: store.bytes_written,
        store_bytes_read: store.bytes_read,
        prefetch_hit_rate: store.chunks_prefetched as f64
            / (store.chunks_prefetched + store.chunks_read).max(1) as f64,
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

pub(crate) fn print_table(summaries: &[Summary]) {
    eprintln!(
        "{:<12} {:>16} {:>6} {:>8} {:>8} {:>10} {:>9} {:>9} {:>11} {:>11} {:>9} {:>9} {:>7} {:>7} {:>7}",
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
        "hit host",
        "hit store"
    );
    for s in summaries {
        eprintln!(
            "{:<12} {:>16} {:>6} {:>8.1} {:>8.3} {:>10.1} {:>7.0}ms {:>7.0}ms {:>7.1}ms/t {:>7.1}ms/t {:>9} {:>9} {:>7.2} {:>7.2} {:>7.2}",
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
            s.hit_rate_host,
            s.hit_rate_store
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
pub(crate) const CSV_COLUMNS: [&str; 20] = [
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

pub(crate) fn write_csv(dir: &Path, summaries: &[Summary]) -> AnyResult<()> {
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

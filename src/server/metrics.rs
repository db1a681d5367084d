//! `/metrics` in the Prometheus text format, from two registries (pensieve's names, vLLM's)
//! that live as long as the server. The engine thread observes each turn into histograms and counters as it runs (a
//! [`Recorder`] is the service's observer); the engine's own totals and gauges are read from
//! the service's latest stats at each scrape.
//!
//! Every name carries the `pensieve_` prefix, and the measurements vLLM has are served under
//! its names too (`vllm.rs`, labelled `model_name`), so that what is built for vLLM reads
//! them unchanged:
//!
//! | pensieve | vLLM |
//! |---|---|
//! | `time_to_first_token_seconds` (histogram) | `vllm:time_to_first_token_seconds` |
//! | `inter_token_latency_seconds` (histogram) | `vllm:inter_token_latency_seconds` |
//! | `e2e_request_latency_seconds` (histogram) | `vllm:e2e_request_latency_seconds` |
//! | `request_queue_time_seconds` (histogram) | `vllm:request_queue_time_seconds` |
//! | `prompt_tokens_total` | `vllm:prompt_tokens_total` |
//! | `generation_tokens_total` | `vllm:generation_tokens_total` |
//! | `request_success_total{finished_reason}` | `vllm:request_success_total{finished_reason}` |
//! | `history_tokens_total` | `vllm:prefix_cache_queries_total` |
//! | `reused_{device,host,store}_tokens_total` | `vllm:prefix_cache_hits_total` (one tier) |
//! | `kv_cache_usage_perc` | `vllm:kv_cache_usage_perc` |
//! | `num_requests_running`, `num_requests_waiting` | the same names |
//! | `drafted_tokens_total`, `accepted_tokens_total` | `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` |
//! | (vLLM's alone) | `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds` (histograms), `vllm:num_preemptions_total` (turns suspended for lack of device slots) |
//!
//! A hit rate is a ratio of two counters over a window
//! (`rate(pensieve_reused_device_tokens_total[5m]) / rate(pensieve_history_tokens_total[5m])`),
//! not a gauge averaged since the start.

use std::time::Duration;

use crate::engine::{FinishReason, TurnStats};
use crate::kv::StoreStats;
use crate::service::{Observer, Service, ServiceStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// vLLM's buckets, so that the same dashboards read the same resolution.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TOKEN_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets of token counts (1, 2, 5 for each power of ten to 100k).
const LENGTH_BUCKETS: [f64; 16] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5,
];
const REQUEST_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// The histograms and counters the engine thread fills as turns run.
#[derive(Debug)]
pub struct Recorder {
    ttft: Histogram,
    inter_token: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prompt_tokens: Counter,
    generation_tokens: Counter,
    finished: Family<Vec<(&'static str, &'static str)>, Counter>,
    /// Per request: its whole prompt's tokens (history included) and its reply's, and the
    /// time it spent in prefill (queue to first token) and in decode (first token to end),
    /// as vLLM's histograms of these names measure them.
    request_prompt: Histogram,
    request_generation: Histogram,
    prefill_time: Histogram,
    decode_time: Histogram,
}

impl Default for Recorder {
    fn default() -> Self {
        let histogram = |b: &[f64]| Histogram::new(b.iter().copied());
        Self {
            ttft: histogram(&TTFT_BUCKETS),
            inter_token: histogram(&TOKEN_BUCKETS),
            e2e: histogram(&REQUEST_BUCKETS),
            queue: histogram(&REQUEST_BUCKETS),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Family::default(),
            request_prompt: histogram(&LENGTH_BUCKETS),
            request_generation: histogram(&LENGTH_BUCKETS),
            prefill_time: histogram(&REQUEST_BUCKETS),
            decode_time: histogram(&REQUEST_BUCKETS),
        }
    }
}

impl Observer for Recorder {
    fn token(&self, gap: Duration) {
        self.inter_token.observe(gap.as_secs_f64());
    }

    fn finished(&self, reason: &FinishReason, stats: &TurnStats) {
        if stats.output_tokens > 0 {
            self.ttft.observe(stats.ttft.as_secs_f64());
        }
        self.e2e.observe(stats.latency.as_secs_f64());
        self.queue.observe(stats.queue_time.as_secs_f64());
        self.prompt_tokens.inc_by(stats.prompt_tokens as u64);
        self.generation_tokens.inc_by(stats.output_tokens as u64);
        let whole_prompt = stats.prompt_tokens + stats.reused_tokens + stats.recomputed_tokens;
        self.request_prompt.observe(whole_prompt as f64);
        self.request_generation.observe(stats.output_tokens as f64);
        if stats.output_tokens > 0 {
            let prefill = stats.ttft.saturating_sub(stats.queue_time);
            self.prefill_time.observe(prefill.as_secs_f64());
            self.decode_time
                .observe(stats.latency.saturating_sub(stats.ttft).as_secs_f64());
        }
        self.finished
            .get_or_create(&vec![("finished_reason", finished_reason(reason))])
            .inc();
    }
}

mod vllm;

impl Recorder {
    /// Registers the recorder's metrics in `r` under `names` (with their help), in order: the
    /// histograms of time to first token, between tokens, end to end and in the queue, the
    /// counters of prompt and generated tokens, and the finished turns by reason. The
    /// registered metrics are the recorder's own (shared), whatever the names.
    fn register(&self, r: &mut Registry, names: [(&'static str, &'static str); 7]) {
        let [ttft, inter, e2e, queue, prompt, generation, success] = names;
        let histograms = [
            (ttft, &self.ttft),
            (inter, &self.inter_token),
            (e2e, &self.e2e),
            (queue, &self.queue),
        ];
        for ((name, help), h) in histograms {
            r.register(name, help, h.clone());
        }
        for ((name, help), c) in [
            (prompt, &self.prompt_tokens),
            (generation, &self.generation_tokens),
        ] {
            r.register(name, help, c.clone());
        }
        r.register(success.0, success.1, self.finished.clone());
    }
}

/// The server's metrics, under its own names and under vLLM's.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    vllm: Registry,
}

impl Metrics {
    /// The registry of `m`'s metrics, reading the engine's totals from `service` at each
    /// scrape; under vLLM's names, labelled with the served `model`'s name.
    pub fn new(m: &Recorder, service: Service, model: &str) -> Self {
        let vllm = vllm::registry(m, service.clone(), model);
        let mut r = Registry::with_prefix("pensieve");
        m.register(
            &mut r,
            [
                (
                    "time_to_first_token_seconds",
                    "From a turn's submission to its first token",
                ),
                (
                    "inter_token_latency_seconds",
                    "Between two tokens of a turn",
                ),
                (
                    "e2e_request_latency_seconds",
                    "From a turn's submission to its end",
                ),
                (
                    "request_queue_time_seconds",
                    "From a turn's submission to the first step that ran it",
                ),
                (
                    "prompt_tokens",
                    "Tokens of finished turns' prompts (the new turn as templated)",
                ),
                ("generation_tokens", "Tokens finished turns generated"),
                (
                    "request_success",
                    "Turns finished, by reason (stop, length, abort, error)",
                ),
            ],
        );
        r.register_collector(Box::new(Totals { service }));
        Self { registry: r, vllm }
    }

    /// The text a scrape gets.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        encode_registry(&mut out, &self.registry)?;
        encode_registry(&mut out, &self.vllm)?;
        encode_eof(&mut out)?;
        Ok(out)
    }
}

/// vLLM's `finished_reason` label of a turn's end.
fn finished_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop | FinishReason::StopString => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::Cancelled => "abort",
        FinishReason::Failed(_) => "error",
    }
}

/// The engine's totals and gauges, as of its latest step.
#[derive(Debug)]
struct Totals {
    service: Service,
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for Totals {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = self.service.stats();
        let st = &s.engine;
        for (name, help, v) in engine_counters(&s) {
            counter(&mut e, name, help, v)?;
        }
        let step = ConstCounter::new(s.step_seconds);
        step.encode(e.encode_descriptor(
            "step_seconds",
            "Seconds spent in step()",
            None,
            step.metric_type(),
        )?)?;
        // The tier below host (a folder, or the fleet's Redis), when there is one.
        if let Some(d) = &st.store {
            for (name, help, v) in store_counters(d) {
                counter(&mut e, name, help, v)?;
            }
        }
        for (name, help, v) in gauges(&s) {
            gauge(&mut e, name, help, v)?;
        }
        Ok(())
    }
}

/// The engine's and the server's counters: (name, help, value).
fn engine_counters(s: &ServiceStats) -> [(&'static str, &'static str, u64); 19] {
    let st = &s.engine;
    [
        ("steps", "Engine steps that ran a batch", st.steps),
        ("engine_steps", "step() calls the server timed", s.steps),
        ("turns", "Turns finished", st.turns_finished),
        (
            "prefilled_tokens",
            "Tokens run through the model other than decode steps",
            st.prefilled_tokens,
        ),
        (
            "history_tokens",
            "History tokens admitted turns looked up (reused from a tier or recomputed)",
            st.history_tokens(),
        ),
        (
            "reused_device_tokens",
            "History tokens reused from the device tier",
            st.reused_device_tokens,
        ),
        (
            "reused_host_tokens",
            "History tokens reused from the host tier",
            st.reused_host_tokens,
        ),
        (
            "reused_store_tokens",
            "History tokens reused from the store below host",
            st.reused_store_tokens,
        ),
        (
            "shared_tokens",
            "Prompt tokens whose KV was shared by content",
            st.shared_tokens,
        ),
        (
            "recomputed_tokens",
            "History tokens recomputed after a drop",
            st.recomputed_tokens,
        ),
        ("generated_tokens", "Tokens generated", st.generated_tokens),
        (
            "drafted_tokens",
            "Tokens drafted from conversations' histories and verified",
            st.drafted_tokens,
        ),
        (
            "accepted_tokens",
            "Drafted tokens the sampler agreed with (generated without a step of their own)",
            st.accepted_tokens,
        ),
        (
            "swapped_out_bytes",
            "Bytes copied device to host",
            st.bytes_swapped_out,
        ),
        (
            "swapped_in_bytes",
            "Bytes copied host to device",
            st.bytes_swapped_in,
        ),
        (
            "suspensions",
            "Running turns suspended for lack of device slots",
            st.suspensions,
        ),
        (
            "requests_rejected",
            "Requests refused with 429 (queue full)",
            s.rejected,
        ),
        (
            "store_turn_failures",
            "Named turns generated but not stored (answered with an error)",
            s.store_failures,
        ),
        (
            "store_turn_conflicts",
            "Named turns not stored: another server stored the conversation meanwhile (409)",
            s.store_conflicts,
        ),
    ]
}

/// The store's counters (a folder, or the fleet's Redis).
fn store_counters(d: &StoreStats) -> [(&'static str, &'static str, u64); 6] {
    [
        ("store_bytes_written", "Chunk bytes stored", d.bytes_written),
        (
            "store_bytes_read",
            "Chunk bytes read back (on demand and ahead)",
            d.bytes_read,
        ),
        (
            "store_chunks_discovered",
            "Chunks found that other engines stored",
            d.chunks_discovered,
        ),
        (
            "store_faults",
            "Chunks refused (missing, damaged, foreign, unreadable) and recomputed",
            d.faults.total(),
        ),
        (
            "store_save_failures",
            "Chunk writes the store failed",
            d.save_failures,
        ),
        (
            "store_connects",
            "Connections opened to a shared store",
            d.connects,
        ),
    ]
}

/// The gauges: (name, help, value).
fn gauges(s: &ServiceStats) -> [(&'static str, &'static str, f64); 9] {
    let st = &s.engine;
    let usage = st.device_slots_used as f64 / st.device_slots_total.max(1) as f64;
    [
        (
            "num_requests_running",
            "Turns running in the engine",
            st.requests_running as f64,
        ),
        (
            "num_requests_waiting",
            "Turns waiting for the engine to admit them",
            st.requests_waiting as f64,
        ),
        (
            "queue_depth",
            "Requests accepted and not answered (queued, running, or waiting for the store)",
            s.in_flight as f64,
        ),
        (
            "conversations",
            "Conversations open",
            s.conversations as f64,
        ),
        (
            "kv_cache_usage_perc",
            "Fraction of the device KV slots in use",
            usage,
        ),
        (
            "device_slots_used",
            "Device KV slots in use",
            st.device_slots_used as f64,
        ),
        (
            "device_slots_total",
            "Device KV slots in all",
            st.device_slots_total as f64,
        ),
        (
            "host_bytes_used",
            "Host tier bytes in use",
            st.host_bytes_used as f64,
        ),
        (
            "shared_bytes_saved",
            "KV bytes that prefix sharing saves now",
            st.shared_bytes_saved as f64,
        ),
    ]
}

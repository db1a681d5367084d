//! The same measurements under vLLM's names (`vllm:*`, labelled `model_name`), so that
//! dashboards, autoscalers and routers built for vLLM (llm-d, the production stack) read a
//! pensieve server as they read vLLM's. The histograms and counters are the ones the server's
//! own names show (shared, not copied); the engine's totals are read at each scrape.

use std::borrow::Cow;

use crate::service::Service;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;

use super::{counter, gauge, Recorder};

/// A registry of vLLM's names for `m`'s metrics and `service`'s totals, each labelled with
/// the served model's name.
pub(super) fn registry(m: &Recorder, service: Service, model: &str) -> Registry {
    let label = (Cow::Borrowed("model_name"), Cow::Owned(model.to_string()));
    let mut r = Registry::with_labels(std::iter::once(label));
    m.register(
        &mut r,
        [
            ("vllm:time_to_first_token_seconds", "Time to first token"),
            ("vllm:inter_token_latency_seconds", "Time between tokens"),
            (
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency",
            ),
            (
                "vllm:request_queue_time_seconds",
                "Time waiting in the queue",
            ),
            ("vllm:prompt_tokens", "Prefill tokens processed"),
            ("vllm:generation_tokens", "Generation tokens processed"),
            (
                "vllm:request_success",
                "Requests finished, by finished_reason",
            ),
        ],
    );
    // vLLM's older name for the time between tokens, which dashboards still read.
    r.register(
        "vllm:time_per_output_token_seconds",
        "Time per output token",
        m.inter_token.clone(),
    );
    for (name, help, h) in [
        (
            "vllm:request_prompt_tokens",
            "Prompt tokens per request, its history included",
            &m.request_prompt,
        ),
        (
            "vllm:request_generation_tokens",
            "Generated tokens per request",
            &m.request_generation,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Time from the first step that ran a request to its first token",
            &m.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Time from a request's first token to its end",
            &m.decode_time,
        ),
    ] {
        r.register(name, help, h.clone());
    }
    r.register_collector(Box::new(Totals { service }));
    r
}

/// The engine's totals and gauges under vLLM's names.
#[derive(Debug)]
struct Totals {
    service: Service,
}

impl Collector for Totals {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = self.service.stats();
        let st = &s.engine;
        let usage = st.device_slots_used as f64 / st.device_slots_total.max(1) as f64;
        for (name, help, v) in [
            (
                "vllm:num_requests_running",
                "Requests running",
                st.requests_running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting",
                st.requests_waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage (1 = full)",
                usage,
            ),
            // vLLM's older name for the same gauge.
            (
                "vllm:gpu_cache_usage_perc",
                "KV cache usage (1 = full)",
                usage,
            ),
        ] {
            gauge(&mut e, name, help, v)?;
        }
        let reused = st.reused_device_tokens + st.reused_host_tokens + st.reused_store_tokens;
        for (name, help, v) in [
            (
                "vllm:prefix_cache_queries",
                "History tokens looked up in the cache",
                st.history_tokens(),
            ),
            (
                "vllm:prefix_cache_hits",
                "History tokens found in the cache (any tier)",
                reused,
            ),
            (
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens verified",
                st.drafted_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
                st.accepted_tokens,
            ),
            (
                "vllm:num_preemptions",
                "Running requests suspended for lack of device slots",
                st.suspensions,
            ),
        ] {
            counter(&mut e, name, help, v)?;
        }
        Ok(())
    }
}

//! `/metrics` in the Prometheus text format, from the engine thread's latest snapshot:
//! history hit rates per tier, tokens reused / prefilled / shared / recomputed, queue depth,
//! memory, step time, and the store below host (bytes written and read, chunks found from
//! other engines, refusals).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::driver::Snapshot;

/// The snapshot as Prometheus text.
pub fn render(s: &Snapshot) -> Result<String, std::fmt::Error> {
    let st = &s.stats;
    let mut r = Registry::with_prefix("pensieve");
    let counters: [(&str, &str, u64); 14] = [
        ("steps", "Engine steps that ran a batch", st.steps),
        ("turns", "Turns finished", st.turns_finished),
        (
            "prefilled_tokens",
            "Tokens run through the model other than decode steps",
            st.prefilled_tokens,
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
            "reused_disk_tokens",
            "History tokens reused from the disk tier",
            st.reused_disk_tokens,
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
        ("engine_steps", "step() calls the server timed", s.steps),
        (
            "requests_rejected",
            "Requests refused with 429 (queue full)",
            s.requests_rejected,
        ),
    ];
    for (name, help, v) in counters {
        r.register(name, help, ConstCounter::new(v));
    }
    // The tier below host (a folder, or the fleet's Redis), when there is one.
    if let Some(d) = &st.disk {
        let store: [(&str, &str, u64); 6] = [
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
        ];
        for (name, help, v) in store {
            r.register(name, help, ConstCounter::new(v));
        }
    }
    let gauges: [(&str, &str, f64); 12] = [
        (
            "hit_rate_device",
            "Fraction of history tokens found on the device",
            st.hit_rate_device(),
        ),
        (
            "hit_rate_host",
            "Fraction of history tokens found in host memory",
            st.hit_rate_host(),
        ),
        (
            "hit_rate_disk",
            "Fraction of history tokens found in the disk tier",
            st.hit_rate_disk(),
        ),
        (
            "queue_depth",
            "Requests queued or running",
            s.in_flight as f64,
        ),
        (
            "conversations",
            "Conversations open",
            s.conversations as f64,
        ),
        (
            "store_turn_failures",
            "Named turns generated but not stored (answered with an error)",
            s.store_failures as f64,
        ),
        (
            "store_turn_conflicts",
            "Named turns generated but not stored: another server stored the conversation meanwhile (answered 409)",
            s.store_conflicts as f64,
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
        (
            "step_seconds_total",
            "Seconds spent in step()",
            s.step_seconds,
        ),
    ];
    for (name, help, v) in gauges {
        r.register(name, help, ConstGauge::new(v));
    }
    let mut out = String::new();
    encode(&mut out, &r)?;
    Ok(out)
}

//! Soak of the tiers on the tiny model: 1,000 conversations (`PENSIEVE_SOAK_CONVERSATIONS` to
//! change), 32 in flight, two turns each, whose KV is 40x the device and host budgets together
//! and 4x the disk budget, so every tier evicts all the time. Half the conversations are named
//! (they stay, and go down to disk); half are closed after their turns. Checked after every
//! step: the cache invariants (no slot, host byte or file reference leaked; budgets held).
//! At the end: the bytes of chunk files in the folder equal what the store books; once every
//! conversation is closed, no slot, host byte or file is left. Peak resident memory is
//! reported and bounded.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::Path;

use pensieve::engine::{
    Budgets, ConversationOptions, CostModel, CostProfile, Engine, EngineConfig, Event,
    SamplingParams, StoreConfig, Turn,
};
use pensieve::model::Model;
use rand::{Rng, SeedableRng};

/// Peak resident set of this process, in bytes (Linux; 0 elsewhere).
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Bytes of chunk files under `dir`.
fn file_bytes(dir: &Path) -> usize {
    let mut total = 0;
    // One folder per model fingerprint holds chunks (the store's `names` folder does not).
    let folders = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path().join("chunks"));
    for chunks in folders.filter(|p| p.is_dir()) {
        for f in std::fs::read_dir(chunks).unwrap() {
            total += f.unwrap().metadata().unwrap().len() as usize;
        }
    }
    total
}

#[test]
fn a_thousand_conversations_through_every_tier_leak_nothing() {
    let n: usize = std::env::var("PENSIEVE_SOAK_CONVERSATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::tempdir().unwrap();
    // The tiny model's KV-token is 128 bytes in f16: a conversation of ~100 tokens holds
    // ~13 KB, so 1,000 of them ~13 MB, against 64 KB of device, 256 KB of host, 3 MB of disk.
    let config = EngineConfig::default()
        .budgets(Budgets::default().device_tokens(512).host_bytes(256 << 10))
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(StoreConfig::new(dir.path()).budget_bytes(3 << 20))
        .check_invariants(true);
    let mut e = Engine::with_model(Model::tiny(7).unwrap(), config).unwrap();
    let rss_before = peak_rss();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let params = SamplingParams::greedy().max_tokens(4).ignore_eos(true);
    // conversation -> turns left
    let mut live: HashMap<pensieve::engine::ConversationId, usize> = HashMap::new();
    let mut kept = Vec::new();
    let mut opened = 0;
    let mut finished = 0;
    while finished < n {
        while live.len() < 32 && opened < n {
            let name = (opened % 2 == 0).then(|| format!("soak {opened}"));
            let mut options = ConversationOptions::default();
            options.name = name.clone();
            let c = e.open(options).unwrap();
            opened += 1;
            live.insert(c, 2);
            if name.is_some() {
                kept.push(c);
            }
            let len = rng.random_range(20..60);
            let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..250)).collect();
            e.submit(c, Turn::Tokens(tokens), params.clone()).unwrap();
        }
        for ev in e.step().unwrap() {
            let Event::Finished {
                conversation,
                reason,
                ..
            } = ev
            else {
                continue;
            };
            assert!(
                !matches!(reason, pensieve::engine::FinishReason::Failed(_)),
                "{reason:?}"
            );
            let left = live.get_mut(&conversation).unwrap();
            *left -= 1;
            if *left == 0 {
                live.remove(&conversation);
                finished += 1;
                if !kept.contains(&conversation) {
                    e.close(conversation).unwrap();
                }
            } else {
                let len = rng.random_range(5..30);
                let tokens: Vec<u32> = (0..len).map(|_| rng.random_range(0..250)).collect();
                e.submit(conversation, Turn::Tokens(tokens), params.clone())
                    .unwrap();
            }
        }
    }
    e.flush();
    e.check_invariants().unwrap();
    let s = e.stats();
    let d = s.store.unwrap();
    assert_eq!(file_bytes(dir.path()), d.bytes_used, "{d:?}");
    assert!(d.bytes_used <= d.budget_bytes, "{d:?}");
    assert!(d.chunks_written > 0 && s.chunks_to_store > 0, "{s:?}");
    assert!(d.files_removed > 0, "the store never evicted: {d:?}");
    for c in kept {
        e.close(c).unwrap();
    }
    e.flush();
    e.check_invariants().unwrap();
    let s = e.stats();
    let d = s.store.unwrap();
    assert_eq!(
        (s.device_slots_used, s.host_bytes_used, d.bytes_used),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(file_bytes(dir.path()), 0);
    let growth = peak_rss().saturating_sub(rss_before);
    println!(
        "soak: {n} conversations, peak resident growth {:.1} MiB, {} chunk files written, {} removed",
        growth as f64 / (1 << 20) as f64,
        d.chunks_written,
        d.files_removed
    );
    assert!(growth < 256 << 20, "resident memory grew by {growth} bytes");
}

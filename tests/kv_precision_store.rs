//! KV in 8 and 4 bits through the tiers below host: the bytes a chunk file or a Redis key
//! holds are the quantized bytes (53% and 28% of f16's payload), a restarted engine or another
//! member of a fleet resumes them as if it never stopped (its next turn equals a stateless
//! engine's at the same precision, nothing recomputed), and an engine of another precision
//! never reads them: it is told the name is kept by another layout.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::sync::Arc;

use common::redis_server::{store_config, tutor, Server, QUESTIONS};
use pensieve::engine::{
    Budgets, CacheMode, ConversationId, CostModel, CostProfile, Engine, EngineConfig, KvPrecision,
    RedisConfig, SamplingParams, StoreConfig, Turn, TurnStats,
};
use pensieve::model::{Model, WeightFormat};
use pensieve::Error;

fn model() -> Arc<Model> {
    Arc::new(common::real_model(WeightFormat::default()))
}

fn config(kv: KvPrecision, mode: CacheMode, dir: Option<&Path>) -> EngineConfig {
    EngineConfig::default()
        .mode(mode)
        .kv_precision(kv)
        .budgets(Budgets::default().device_tokens(2048).host_bytes(1 << 30))
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(dir.map(|d| StoreConfig::new(d).read_bytes_per_s(1e12)))
        .check_invariants(true)
}

fn turn(e: &mut Engine, conv: ConversationId, q: usize) -> (Vec<u32>, TurnStats) {
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let r = common::run_turn(e, conv, Turn::user(QUESTIONS[q]), params);
    (r.tokens, r.stats)
}

/// Each turn's tokens of one tutor conversation on a stateless engine at `kv`.
fn stateless(model: &Arc<Model>, kv: KvPrecision, turns: usize) -> Vec<Vec<u32>> {
    let mut e = Engine::with_model(model.clone(), config(kv, CacheMode::Stateless, None)).unwrap();
    let c = e.open(tutor(None)).unwrap();
    (0..turns).map(|q| turn(&mut e, c, q).0).collect()
}

/// Two turns of a conversation named `name` at `kv`, stored in `dir`; the bytes its chunk
/// files hold.
fn stored_turns(model: &Arc<Model>, kv: KvPrecision, dir: &Path, name: &str) -> u64 {
    let mut e =
        Engine::with_model(model.clone(), config(kv, CacheMode::Tiered, Some(dir))).unwrap();
    let c = e.open(tutor(Some(name))).unwrap();
    turn(&mut e, c, 0);
    turn(&mut e, c, 1);
    e.flush();
    e.stats().store.unwrap().bytes_written
}

#[test]
fn quantized_chunk_files_are_resumed_after_a_restart_and_refused_at_another_precision() {
    let model = model();
    let f16_dir = tempfile::tempdir().unwrap();
    let f16_bytes = stored_turns(&model, KvPrecision::F16, f16_dir.path(), "f16");
    for (kv, share) in [
        (KvPrecision::Q8, 34.0 / 64.0),
        (KvPrecision::Q4, 18.0 / 64.0),
    ] {
        let reference = stateless(&model, kv, 3);
        let dir = tempfile::tempdir().unwrap();
        let bytes = stored_turns(&model, kv, dir.path(), "quantized");
        let ratio = bytes as f64 / f16_bytes as f64;
        eprintln!("{kv:?}: {bytes} bytes of chunk payload where f16 wrote {f16_bytes}");
        assert!((ratio - share).abs() < 1e-9, "{kv:?}: {ratio}");

        let resumed = config(kv, CacheMode::Tiered, Some(dir.path()));
        let mut e = Engine::with_model(model.clone(), resumed).unwrap();
        let c = e.find("quantized").unwrap();
        let (tokens, stats) = turn(&mut e, c, 2);
        assert_eq!(tokens, reference[2], "{kv:?}");
        assert_eq!(stats.recomputed_tokens, 0, "{kv:?}: {stats:?}");
        assert!(stats.reused_from_store_tokens > 0, "{kv:?}: {stats:?}");
        drop(e);

        // An engine of another precision over the same folder reads none of it.
        let f16 = config(KvPrecision::F16, CacheMode::Tiered, Some(dir.path()));
        let mut other = Engine::with_model(model.clone(), f16).unwrap();
        match other.resume("quantized") {
            Err(Error::StoredElsewhere { owner, .. }) => {
                assert!(owner.contains(&format!("KV {kv:?}")), "{owner}")
            }
            other => panic!("{kv:?}: {other:?}"),
        }
    }
}

#[test]
fn quantized_kv_in_redis_is_resumed_by_another_member_and_refused_at_another_precision() {
    let server = Server::start(None);
    let model = model();
    let member = |kv: KvPrecision| {
        let redis = RedisConfig::new(server.url()).key_prefix("kv-precision");
        let config = store_config(CacheMode::Tiered, Some(redis)).kv_precision(kv);
        Engine::with_model(model.clone(), config).unwrap()
    };
    let reference = stateless(&model, KvPrecision::Q8, 2);
    let mut a = member(KvPrecision::Q8);
    let c = a.open(tutor(Some("alice"))).unwrap();
    assert_eq!(turn(&mut a, c, 0).0, reference[0]);
    a.flush();
    let mut b = member(KvPrecision::Q8);
    let c = b.resume("alice").unwrap();
    let (tokens, stats) = turn(&mut b, c, 1);
    assert_eq!(tokens, reference[1]);
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    assert!(stats.reused_from_store_tokens > 0, "{stats:?}");
    let mut other = member(KvPrecision::F16);
    assert!(
        matches!(other.resume("alice"), Err(Error::StoredElsewhere { .. })),
        "an f16 member resumed a conversation stored in 8 bits"
    );
}

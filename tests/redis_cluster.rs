//! The shared store on a Redis Cluster (three primaries the test starts), on the real SmolLM2
//! weights: chunks spread over the shards by content address, a conversation's manifest and
//! its name's registration kept together on one; a conversation served by one engine continues
//! on another; the stored names are listed across the shards; a shard that is down costs the
//! recompute of the chunks it held, never a wrong output. Every output equals a `Stateless`
//! engine's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::redis_cluster::Cluster;
use common::redis_server::store_config as config;
use common::redis_server::{tutor, QUESTIONS};
use pensieve::engine::{
    CacheMode, ConversationId, Engine, RedisConfig, SamplingParams, Turn, TurnStats,
};
use pensieve::model::{Model, WeightFormat};

fn member(model: &Arc<Model>, cluster: &Cluster) -> Engine {
    let r = RedisConfig::new(cluster.url())
        .key_prefix("fleet")
        .cluster(true);
    Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(r))).unwrap()
}

fn turn(e: &mut Engine, conv: ConversationId, q: usize) -> (Vec<u32>, TurnStats) {
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let r = common::run_turn(e, conv, Turn::user(QUESTIONS[q]), params);
    (r.tokens, r.stats)
}

#[test]
fn a_fleet_on_a_cluster_spreads_kv_over_its_shards_and_survives_one_down() {
    let mut cluster = Cluster::start();
    let model = Arc::new(common::real_model(WeightFormat::F32));
    let want: Vec<Vec<u32>> = {
        let mut e = Engine::with_model(model.clone(), config(CacheMode::Stateless, None)).unwrap();
        let c = e.open(tutor(None)).unwrap();
        (0..4).map(|q| turn(&mut e, c, q).0).collect()
    };

    let mut a = member(&model, &cluster);
    let c = a.open(tutor(Some("alice"))).unwrap();
    for (q, want) in want.iter().enumerate().take(2) {
        assert_eq!(&turn(&mut a, c, q).0, want);
    }
    a.flush();
    let keys: Vec<Vec<String>> = (0..3).map(|i| cluster.keys(i)).collect();
    let chunks = |i: usize| keys[i].iter().filter(|k| k.contains(":chunk:")).count();
    assert!(
        (0..3).filter(|&i| chunks(i) > 0).count() > 1,
        "chunks on one shard: {keys:?}"
    );
    let holder = (0..3)
        .find(|&i| keys[i].iter().any(|k| k.contains(":conv:")))
        .unwrap();
    assert!(
        keys[holder].iter().any(|k| k.starts_with("fleet:name:")),
        "{keys:?}"
    );
    // The shard to stop later: the one, besides the manifest's, with the most chunks.
    let down = (0..3)
        .filter(|&i| i != holder)
        .max_by_key(|&i| chunks(i))
        .unwrap();
    assert!(chunks(down) > 0, "{keys:?}");

    // Another engine continues alice from the cluster, with her KV read back.
    let mut b = member(&model, &cluster);
    assert_eq!(b.stored_conversations(), vec!["alice".to_string()]);
    let c = b.resume("alice").unwrap();
    let (out, stats) = turn(&mut b, c, 2);
    assert_eq!(out, want[2]);
    assert!(stats.reused_from_store_tokens > 0, "{stats:?}");
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    b.flush();

    // A shard other than the manifest's goes down: its chunks are recomputed.
    cluster.stop(down);
    let mut d = member(&model, &cluster);
    let c = d.resume("alice").unwrap();
    let (out, stats) = turn(&mut d, c, 3);
    assert_eq!(out, want[3]);
    assert!(stats.recomputed_tokens > 0, "{stats:?}");
    assert!(stats.reused_from_store_tokens > 0, "{stats:?}");
}

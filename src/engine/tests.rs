//! Failed tier copies on the tiny model: the turns involved still produce the outputs of a
//! stateless run, by recomputing what the failed copy lost, and the stats count the failures.
//! And a KV precision the model's heads cannot take, refused.

use super::*;

fn engine(mode: CacheMode, device_tokens: usize, host_bytes: usize, kv: KvPrecision) -> Engine {
    let config = EngineConfig {
        kv_precision: kv,
        budgets: Budgets {
            device_tokens,
            device_bytes: None,
            host_bytes,
        },
        mode,
        chunk_size: 8,
        step_token_budget: 64,
        cost_profile: CostProfile::Fixed(CostModel {
            per_token_s: 1e-4,
            per_token_per_position_s: 1e-7,
        }),
        check_invariants: true,
        ..EngineConfig::default()
    };
    Engine::with_model(Model::tiny(7).unwrap(), config).unwrap()
}

fn params() -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy().max_tokens(6)
    }
}

/// Two turns each of six conversations, one at a time, with `faults` armed before the
/// second round; returns every conversation's tokens and the stats.
fn run(mode: CacheMode, faults: Faults) -> (Vec<Vec<u32>>, EngineStats) {
    run_with(mode, faults, KvPrecision::default())
}

fn run_with(mode: CacheMode, mut faults: Faults, kv: KvPrecision) -> (Vec<Vec<u32>>, EngineStats) {
    // 30 blocks of 8 on the device: the six conversations (~130 tokens each after two turns)
    // do not all fit.
    let mut e = engine(mode, 240, 1 << 20, kv);
    let convs: Vec<_> = (0..6)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    for round in 0..2 {
        if round == 1 {
            e.faults = std::mem::take(&mut faults);
        }
        for (i, &c) in convs.iter().enumerate() {
            let text = format!("round {round}, conversation {i}, some words");
            let (reason, _) = e.run_turn(c, Turn::user(text), params(), |_| {}).unwrap();
            assert_eq!(reason, FinishReason::Length);
        }
    }
    let tokens = convs
        .iter()
        .map(|&c| e.tokens(c).unwrap().to_vec())
        .collect();
    (tokens, e.stats())
}

/// Chunks of either precision go to the host tier and come back as the same values: Tiered
/// equals Stateless at f32 as at f16 (the default, which the other tests run).
#[test]
fn f32_kv_swaps_through_the_host_and_matches_stateless() {
    let (stateless, _) = run_with(CacheMode::Stateless, Faults::default(), KvPrecision::F32);
    let (tiered, stats) = run_with(CacheMode::Tiered, Faults::default(), KvPrecision::F32);
    assert!(stats.bytes_swapped_in > 0, "{stats:?}");
    assert_eq!(tiered, stateless);
}

/// Defect 2: a failed swap-in must not let the step read the block it released.
#[test]
fn a_failed_swap_in_is_recomputed_not_read() {
    let (stateless, _) = run(CacheMode::Stateless, Faults::default());
    let (clean, clean_stats) = run(CacheMode::Tiered, Faults::default());
    assert!(clean_stats.bytes_swapped_in > 0, "{clean_stats:?}");
    let faults = Faults {
        swap_in: 2,
        swap_out: 0,
    };
    let (faulty, stats) = run(CacheMode::Tiered, faults);
    assert_eq!(clean, stateless);
    assert_eq!(faulty, stateless);
    assert_eq!(stats.swap_in_failures, 2, "{stats:?}");
    assert!(
        stats.recomputed_tokens > clean_stats.recomputed_tokens,
        "{stats:?}"
    );
}

/// Defect 6: a failed swap-out drops the chunk visibly (counted) and outputs stay equal.
#[test]
fn a_failed_swap_out_is_counted_and_recomputed() {
    let (stateless, _) = run(CacheMode::Stateless, Faults::default());
    let faults = Faults {
        swap_in: 0,
        swap_out: 3,
    };
    let (faulty, stats) = run(CacheMode::Tiered, faults);
    assert_eq!(faulty, stateless);
    assert_eq!(stats.swap_out_failures, 3, "{stats:?}");
}

/// KV in 8 or 4 bits needs heads in blocks of 32 values; the tiny model's hold 8, and the
/// engine refuses to start with a typed error naming why.
#[test]
fn kv_codes_on_heads_they_do_not_fit_are_refused_with_a_typed_error() {
    for kv in [KvPrecision::Q8, KvPrecision::Q4] {
        let config = EngineConfig {
            kv_precision: kv,
            ..EngineConfig::default()
        };
        match Engine::with_model(Model::tiny(7).unwrap(), config) {
            Err(Error::Unsupported(why)) => assert!(why.contains("blocks of 32"), "{why}"),
            other => panic!("{kv:?}: {:?}", other.map(|_| ())),
        }
    }
}

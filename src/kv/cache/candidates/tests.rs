//! The ordered candidates against a scan of every table (what eviction did before them), over
//! random sequences of growth, sharing, eviction, restores, hints and closes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::kv::cache::{CacheManager, Eviction, Moves};
use crate::kv::{Address, CostModel, ValuePolicy};

const CHUNK: usize = 4;
const CONVS: u64 = 6;

#[derive(Clone, Debug)]
enum Op {
    Open(u64),
    Compute(u64, usize),
    Adopt(u64, usize),
    Touch(u64),
    Resume(u64, u64),
    Evict(u8),
    Restore(u64),
    Close(u64),
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let conv = 1..=CONVS;
    prop_oneof![
        conv.clone().prop_map(Op::Open),
        (conv.clone(), 1..10usize).prop_map(|(c, n)| Op::Compute(c, n)),
        (conv.clone(), 1..4usize).prop_map(|(c, n)| Op::Adopt(c, n)),
        conv.clone().prop_map(Op::Touch),
        (conv.clone(), 0..400u64).prop_map(|(c, ms)| Op::Resume(c, ms)),
        any::<u8>().prop_map(Op::Evict),
        conv.clone().prop_map(Op::Restore),
        conv.prop_map(Op::Close),
        (0..300u64).prop_map(Op::Wait),
    ]
}

/// Every conversation's history is the same token sequence, so equal lengths share by content.
fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

fn apply(m: &mut CacheManager, op: &Op, now: &mut Instant) {
    let id = |c: &u64| ConversationId(*c);
    match op {
        Op::Open(c) if m.table(id(c)).is_none() => m.open(id(c), *now),
        Op::Open(_) => {}
        Op::Compute(c, n) => {
            let mut moves = Moves::default();
            if m.restore(id(c), &mut moves).is_none() {
                return;
            }
            finish(m, &moves);
            for _ in 0..*n {
                let Some(t) = m.table(id(c)) else { return };
                let computed = t.computed();
                if computed == t.len() * CHUNK && !m.grow(id(c)) {
                    break;
                }
                m.mark_computed(id(c), computed + 1);
            }
            m.settle(id(c), usize::MAX);
            let computed = m.table(id(c)).map_or(0, |t| t.computed());
            m.index_chunks(id(c), &tokens(computed));
        }
        Op::Adopt(c, n) => {
            if m.table(id(c)).is_none() {
                m.open(id(c), *now);
            }
            let Some(t) = m.table(id(c)) else { return };
            let have = t.len();
            let addrs = Address::of_chunks(&tokens((have + n) * CHUNK), CHUNK);
            m.adopt_resident(id(c), &addrs[have..]);
        }
        Op::Touch(c) => m.touch(id(c), *now),
        Op::Resume(c, ms) => _ = m.expect_resume(id(c), *now + Duration::from_millis(*ms)),
        Op::Evict(mask) => {
            let mut moves = Moves::default();
            let protect = |c: ConversationId| mask & (1 << c.0) != 0;
            m.evict_device(
                &protect,
                m.num_blocks(),
                Eviction::OnDemand,
                *now,
                &mut moves,
            );
            finish(m, &moves);
        }
        Op::Restore(c) => {
            let mut moves = Moves::default();
            if m.restore(id(c), &mut moves).is_some() {
                finish(m, &moves);
                m.settle(id(c), 0);
            }
        }
        Op::Close(c) => m.close(id(c)),
        Op::Wait(ms) => *now += Duration::from_millis(*ms),
    }
}

/// Completes the planned copies (with stand-in bytes).
fn finish(m: &mut CacheManager, moves: &Moves) {
    for s in &moves.swap_out {
        m.complete_swap_out(s, Arc::new(vec![0; s.len * 2].into()));
    }
    for s in &moves.swap_in {
        if m.take_swap_in(s, false).is_some() {
            m.complete_swap_in(s);
        } else {
            m.abort_swap_in(s);
        }
    }
}

/// What `m`'s candidates read of it.
fn view(m: &CacheManager) -> View<'_> {
    View {
        tables: &m.tables,
        arena: &m.arena,
        policy: &*m.policy,
        chunk: m.chunk_size(),
    }
}

/// The lowest candidate, as a scan of every table finds it: each unprotected conversation's
/// first chunk in the tier that it alone holds, and each shared chunk in the tier that no
/// protected conversation holds, valued for all of its holders.
fn scan(
    m: &CacheManager,
    tier: Tier,
    protect: &dyn Fn(ConversationId) -> bool,
    now: Instant,
) -> Option<Found> {
    let mut best = None;
    let mut offer = |found: Found| {
        if better(found, best) {
            best = Some(found);
        }
    };
    for (&c, t) in &m.tables {
        let mut own = !protect(c);
        for i in 0..t.computed_chunks(CHUNK) {
            let rec = t.records()[i];
            if !tier.holds(m.arena.loc(rec), t.file(i).is_some()) {
                continue;
            }
            let holders = m.arena.holders(rec);
            if holders.len() > 1 {
                if !holders.iter().any(|&h| protect(h)) && holders.iter().min() == Some(&c) {
                    offer((view(m).shared_value(rec, i, now), c, i));
                }
                continue;
            }
            if own {
                let len = t.chunk_len(i, CHUNK);
                let idle_s = t.until_next_use(now).as_secs_f64();
                let start = i * CHUNK;
                offer((m.policy.value(&Candidate { start, len, idle_s }), c, i));
                own = false;
            }
        }
    }
    best
}

/// Every listed shared chunk's bound is a lower bound on its holders' since-keys.
fn bounds_hold(m: &CacheManager, now: Instant) -> bool {
    (m.candidates.tiers.iter())
        .flat_map(|t| t.records.iter())
        .all(|(&rec, &(_, bound))| bound <= m.candidates.least_key(&view(m), rec, now))
}

#[test]
fn a_record_taken_again_is_listed_at_its_new_index() {
    let policy = ValuePolicy {
        cost: CostModel {
            per_token_s: 1.0,
            per_token_per_position_s: 0.05,
        },
    };
    let mut m = CacheManager::new(10, CHUNK, 5 * CHUNK * 2, Box::new(policy), 2);
    let now = Instant::now();
    let [a, b, c, d] = [1, 2, 3, 4].map(ConversationId);
    let none = |_: ConversationId| false;
    // `b` shares both of `a`'s chunks; a decision lists them.
    m.open(a, now);
    m.open(b, now);
    assert!(m.grow(a) && m.grow(a));
    m.mark_computed(a, 8);
    m.index_chunks(a, &tokens(8));
    assert_eq!(
        m.adopt_resident(b, &Address::of_chunks(&tokens(8), CHUNK)),
        2
    );
    assert_eq!(
        m.lowest(Tier::Device, &none, now),
        scan(&m, Tier::Device, &none, now)
    );
    // Both close; `c` takes the record that was chunk 1 for its chunk 0, and `d` shares it.
    m.close(a);
    m.close(b);
    let other: Vec<u32> = (100..104).collect();
    m.open(c, now);
    assert!(m.grow(c));
    m.mark_computed(c, 4);
    m.index_chunks(c, &other);
    m.open(d, now);
    assert_eq!(m.adopt_resident(d, &Address::of_chunks(&other, CHUNK)), 1);
    let got = m.lowest(Tier::Device, &none, now);
    assert_eq!(got.map(|f| f.2), Some(0));
    assert_eq!(got, scan(&m, Tier::Device, &none, now));
}

#[test]
fn a_resume_hinted_centuries_ahead_keeps_the_bound_below_its_holders() {
    let mut m = CacheManager::new(10, CHUNK, 5 * CHUNK * 2, Box::new(crate::kv::LruPolicy), 2);
    let mut now = Instant::now();
    let [a, b, c] = [1, 2, 3].map(ConversationId);
    let none = |_: ConversationId| false;
    // `c` idle for 110 s; `a` and `b` share a chunk and are idle for 10 s.
    m.open(c, now);
    assert!(m.grow(c));
    m.mark_computed(c, 4);
    now += Duration::from_secs(100);
    m.open(a, now);
    m.open(b, now);
    assert!(m.grow(a));
    m.mark_computed(a, 4);
    m.index_chunks(a, &tokens(4));
    assert_eq!(
        m.adopt_resident(b, &Address::of_chunks(&tokens(4), CHUNK)),
        1
    );
    now += Duration::from_secs(10);
    assert_eq!(
        m.lowest(Tier::Device, &none, now),
        scan(&m, Tier::Device, &none, now)
    );
    // About 317 years: more nanoseconds than an i64 holds. The shared chunk's value is now
    // far below `c`'s, and its bound must say so.
    let Some(far) = now.checked_add(Duration::from_secs(10_000_000_000)) else {
        return;
    };
    assert!(m.expect_resume(b, far));
    let got = m.lowest(Tier::Device, &none, now);
    assert!(bounds_hold(&m, now));
    assert_eq!(got, scan(&m, Tier::Device, &none, now));
    assert_eq!(
        got.map(|f| (f.1, f.2)),
        Some((a, 0)),
        "the shared chunk, valued for `b` too"
    );
}

#[test]
fn a_decision_at_an_earlier_instant_is_made_as_at_the_latest() {
    let mut m = CacheManager::new(10, CHUNK, 5 * CHUNK * 2, Box::new(crate::kv::LruPolicy), 2);
    let start = Instant::now();
    let [a, b, c] = [1, 2, 3].map(ConversationId);
    let none = |_: ConversationId| false;
    for id in [a, b, c] {
        m.open(id, start);
    }
    assert!(m.grow(a) && m.grow(c));
    m.mark_computed(a, 4);
    m.mark_computed(c, 4);
    m.index_chunks(a, &tokens(4));
    assert_eq!(
        m.adopt_resident(b, &Address::of_chunks(&tokens(4), CHUNK)),
        1
    );
    // `b` is expected back 100 s after a decision at 50 s; a decision then comes at 10 s.
    let later = start + Duration::from_secs(50);
    assert!(m.expect_resume(b, later + Duration::from_secs(100)));
    assert_eq!(
        m.lowest(Tier::Device, &none, later),
        scan(&m, Tier::Device, &none, later)
    );
    let got = m.lowest(Tier::Device, &none, start + Duration::from_secs(10));
    assert!(bounds_hold(&m, later));
    assert_eq!(got, scan(&m, Tier::Device, &none, later));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]
    #[test]
    fn the_ordered_victim_is_the_lowest_value_a_scan_finds(
        ops in prop::collection::vec(op(), 1..60),
        masks in prop::collection::vec(any::<u8>(), 3),
        sparse in prop::collection::vec(any::<u8>(), 3),
        lru in any::<bool>(),
    ) {
        let policy: Box<dyn crate::kv::EvictionPolicy> = match lru {
            true => Box::new(crate::kv::LruPolicy),
            false => Box::new(ValuePolicy {
                cost: CostModel { per_token_s: 1.0, per_token_per_position_s: 0.05 },
            }),
        };
        // 10 blocks of 4 tokens, 2 bytes a token: a host tier of 5 chunks.
        let mut m = CacheManager::new(10, CHUNK, 5 * CHUNK * 2, policy, 2);
        let mut now = Instant::now();
        for op in &ops {
            apply(&mut m, op, &mut now);
            prop_assert!(m.check().is_ok(), "{:?} after {op:?}", m.check());
            for tier in [Tier::Device, Tier::Host] {
                // Protected with odds of one in two, and of one in four.
                for mask in masks.iter().chain(&sparse).zip(masks.iter().chain(&[u8::MAX; 3])).map(|(a, b)| a & b) {
                    let protect = |c: ConversationId| mask & (1 << c.0) != 0;
                    let want = scan(&m, tier, &protect, now);
                    let got = m.lowest(tier, &protect, now);
                    prop_assert_eq!(got, want, "{:?} after {:?}", tier, op);
                    prop_assert!(bounds_hold(&m, now), "a bound above its holders after {op:?}");
                }
            }
        }
    }
}

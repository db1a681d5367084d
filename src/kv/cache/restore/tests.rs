//! Narrow chunks: which leave the device narrow, what the host holds of them, and what a turn
//! recomputes where a sliding window would read them.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use super::super::{CacheManager, Moves, Narrowing};
use crate::ids::ConversationId;
use crate::kv::{ChunkLoc, LruPolicy};

const CHUNK: usize = 4;
/// Host bytes of a KV-token, whole and narrow.
const WHOLE: usize = 6;
const NARROW: usize = 2;

/// A manager of 8 blocks of 4 tokens whose model has a window of 6, and a conversation of 24
/// computed tokens whose latest turn began at `turn_start`, swapped out whole to the host.
fn swapped_out(turn_start: usize) -> (CacheManager, ConversationId, Vec<bool>) {
    let mut m = CacheManager::new(8, CHUNK, 1 << 20, Box::new(LruPolicy), WHOLE);
    m.set_narrowing(Narrowing {
        window: 6,
        token_bytes: Some(NARROW),
    });
    let a = ConversationId(1);
    let now = Instant::now();
    m.open(a, now);
    for _ in 0..6 {
        assert!(m.grow(a));
    }
    m.mark_computed(a, turn_start);
    m.settle(a, turn_start);
    // The turn that began at `turn_start` computes the rest.
    let mut moves = Moves::default();
    m.restore(a, &mut moves).unwrap();
    for _ in m.table(a).unwrap().len()..6 {
        assert!(m.grow(a));
    }
    m.mark_computed(a, 24);
    m.check().unwrap();
    let mut moves = Moves::default();
    m.evict_conversation(a, &|_| false, now, &mut moves);
    let narrow: Vec<bool> = moves.swap_out.iter().map(|s| s.narrow).collect();
    for s in &moves.swap_out {
        let per = if s.narrow { NARROW } else { WHOLE };
        m.complete_swap_out(s, Arc::new(vec![0; s.len * per].into()));
    }
    m.check().unwrap();
    (m, a, narrow)
}

#[test]
fn chunks_no_window_reads_from_the_turns_start_leave_narrow() {
    // From position 20 on, a window of 6 reads positions 15 and later: chunks 0-2 end before.
    let (m, _, narrow) = swapped_out(20);
    assert_eq!(narrow, [true, true, true, false, false, false]);
    assert_eq!(m.host_used_bytes(), 3 * CHUNK * NARROW + 3 * CHUNK * WHOLE);
    // A turn that began at 0 may be retried from there: every chunk stays whole.
    let (m, _, narrow) = swapped_out(0);
    assert_eq!(narrow, [false; 6]);
    assert_eq!(m.host_used_bytes(), 6 * CHUNK * WHOLE);
}

#[test]
fn the_next_turn_reads_its_narrow_chunks_back_narrow_and_recomputes_nothing() {
    let (mut m, a, _) = swapped_out(20);
    let mut moves = Moves::default();
    let r = m.restore(a, &mut moves).unwrap();
    assert!(r.recompute.is_empty());
    assert_eq!(r.from_host, 24);
    let narrow: Vec<bool> = moves.swap_in.iter().map(|s| s.narrow).collect();
    assert_eq!(narrow, [true, true, true, false, false, false]);
    for s in &moves.swap_in {
        assert_eq!(
            m.take_swap_in(s, false).unwrap().len(),
            s.len * if s.narrow { NARROW } else { WHOLE }
        );
        m.complete_swap_in(s);
    }
    m.check().unwrap();
    // This turn began at 24: from there a window reads 19 on, so chunk 3 leaves narrow too
    // when the turn is done.
    m.settle(a, 24);
    let mut moves = Moves::default();
    m.evict_conversation(a, &|_| false, Instant::now(), &mut moves);
    let narrow: Vec<bool> = moves.swap_out.iter().map(|s| s.narrow).collect();
    assert_eq!(narrow, [true, true, true, true, false, false]);
}

#[test]
fn a_rewind_recomputes_back_to_where_no_window_reads_a_narrow_chunk() {
    let (mut m, a, _) = swapped_out(20);
    // A rewind to 16: a window reads positions 11-15 from there; chunk 2 (8-11) is narrow,
    // so it is recomputed, which reads 3-7 through the window: chunks 0 and 1 too.
    m.truncate(a, 16);
    let mut moves = Moves::default();
    let r = m.restore(a, &mut moves).unwrap();
    assert_eq!(r.recompute, vec![(0..12)]);
    assert_eq!(r.from_host, 4);
    assert_eq!(moves.swap_in.len(), 1);
    assert!(matches!(
        m.locs(a)[..3],
        [
            ChunkLoc::Recomputing(_),
            ChunkLoc::Recomputing(_),
            ChunkLoc::Recomputing(_)
        ]
    ));
    m.check().unwrap();
}

#[test]
fn a_rewind_past_the_narrow_chunks_windows_recomputes_nothing() {
    // From 20 a window reads 15 on: chunk 3 (12-15) is whole, chunks 0-2 are not read.
    let (mut m, a, _) = swapped_out(20);
    m.truncate(a, 20);
    let mut moves = Moves::default();
    let r = m.restore(a, &mut moves).unwrap();
    assert!(r.recompute.is_empty());
    assert_eq!(r.from_host, 20);
}

//! Eviction candidates kept in order, updated as conversations change rather than found by
//! a scan over every table at each decision.
//!
//! A tier's candidates are, for each conversation, its first chunk there that no one else
//! holds, and each chunk there that several conversations share (valued for all of its
//! holders together: losing it costs each of them). A chunk a protected conversation holds
//! stays.
//!
//! A policy's value falls as the idle time grows for a chunk of the same position and length
//! (what [`crate::kv::EvictionPolicy`] requires), so a conversation's own candidates are
//! grouped by (chunk index, tokens) and, in each group, ordered by idle time: the first
//! unprotected member of a group is that group's lowest value, and a decision reads one member
//! per group (plus the protected ones it passes over). Idle time runs two ways: since the last
//! activity (or an overdue expected resume), growing; or until an expected resume, shrinking.
//! Each group keeps one order per way, and a resume that falls due moves its conversation from
//! one to the other.
//!
//! A shared chunk's value is a sum over its holders, which no one clock orders. Each shared
//! chunk keeps a bound instead: an instant no holder has been idle since (an expected resume
//! counts by the idle time it can have at most). Its value is at least its holders' number
//! times the value of the bound's idle time, so shared chunks are grouped by (chunk index,
//! holders) and ordered by bound, and a decision sums a chunk's holders only while that lower
//! value could still beat the best found. A summed chunk's bound is tightened to its holders'
//! least; a holder's change only ever lowers it (its own clock), never rescans the others.
//!
//! The index learns what changed from the arena (own chunks moved, shared chunks moved or
//! changed hands) and from the manager (activity, hints, files, computed tokens): those
//! conversations are re-read before the next decision, each in `O(its chunks)`, and those
//! shared chunks in `O(log)`; no change reads every holder of a chunk.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::arena::{Arena, ChunkId};
use super::ChunkTable;
use crate::ids::ConversationId;
use crate::kv::policy::Candidate;
use crate::kv::{ChunkLoc, EvictionPolicy};

/// A tier eviction takes chunks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    /// Chunks in the device pool.
    Device,
    /// Chunks in the host tier.
    Host,
    /// Chunks with a file in the store (wherever else they are).
    Stored,
}

impl Tier {
    const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Stored];

    fn holds(self, loc: ChunkLoc, saved: bool) -> bool {
        match self {
            Tier::Device => matches!(loc, ChunkLoc::Device(_)),
            Tier::Host => matches!(loc, ChunkLoc::Host(_)),
            Tier::Stored => saved,
        }
    }
}

/// How a conversation's idle time runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clock {
    /// Since this instant: it grows.
    Since(Instant),
    /// Until an expected resume at this instant: it shrinks.
    Until(Instant),
}

impl ChunkTable {
    fn clock(&self, now: Instant) -> Clock {
        match self.idle_since(now) {
            Err(at) => Clock::Until(at),
            Ok(since) => Clock::Since(since),
        }
    }
}

/// A conversation's own candidate in one tier: its group, (chunk index, tokens), and clock.
type Own = ((usize, usize), Clock);

/// One group's members, most idle first in each order.
#[derive(Debug, Default)]
struct Group {
    since: BTreeSet<(Instant, ConversationId)>,
    until: BTreeSet<(Reverse<Instant>, ConversationId)>,
}

/// A shared chunk's group, (chunk index, holders), and bound (see [`Candidates::key`]).
type Shared = ((usize, usize), i64);

#[derive(Debug, Default)]
struct TierIndex {
    groups: BTreeMap<(usize, usize), Group>,
    entries: HashMap<ConversationId, Own>,
    /// Shared chunks in the tier by group, lowest bound (longest idle) first.
    shared: BTreeMap<(usize, usize), BTreeSet<(i64, ChunkId)>>,
    records: HashMap<ChunkId, Shared>,
}

impl TierIndex {
    fn set(&mut self, id: ConversationId, entry: Option<Own>) {
        let old = match entry {
            Some(e) => self.entries.insert(id, e),
            None => self.entries.remove(&id),
        };
        if old == entry {
            return;
        }
        if let Some((g, clock)) = old
            && let Some(group) = self.groups.get_mut(&g)
        {
            match clock {
                Clock::Since(t) => group.since.remove(&(t, id)),
                Clock::Until(t) => group.until.remove(&(Reverse(t), id)),
            };
            if group.since.is_empty() && group.until.is_empty() {
                self.groups.remove(&g);
            }
        }
        if let Some((g, clock)) = entry {
            let group = self.groups.entry(g).or_default();
            match clock {
                Clock::Since(t) => group.since.insert((t, id)),
                Clock::Until(t) => group.until.insert((Reverse(t), id)),
            };
        }
    }

    fn set_shared(&mut self, rec: ChunkId, entry: Option<Shared>) {
        let old = match entry {
            Some(e) => self.records.insert(rec, e),
            None => self.records.remove(&rec),
        };
        if old == entry {
            return;
        }
        if let Some((g, bound)) = old
            && let Some(set) = self.shared.get_mut(&g)
        {
            set.remove(&(bound, rec));
            if set.is_empty() {
                self.shared.remove(&g);
            }
        }
        if let Some((g, bound)) = entry {
            self.shared.entry(g).or_default().insert((bound, rec));
        }
    }
}

/// The candidates of every tier, and what changed since they were last brought up to date.
#[derive(Debug, Default)]
pub(super) struct Candidates {
    tiers: [TierIndex; 3],
    /// Conversations to re-read (besides those the arena reports).
    changed: Vec<ConversationId>,
    /// Expected resumes still ahead, by time: at each one, its conversation's clock turns.
    due: BTreeSet<(Instant, ConversationId)>,
    /// Each shared chunk's bound: no holder has been idle longer than since it.
    bounds: HashMap<ChunkId, i64>,
    /// The instant keys count from (the first decision's).
    base: Option<Instant>,
    /// The latest decision's instant: an earlier one is taken as it (the bounds and resumes
    /// due hold only as time goes forward).
    latest: Option<Instant>,
}

impl Candidates {
    /// `id` changed in a way the arena does not see (activity, a hint, a file, its tokens).
    pub fn mark(&mut self, id: ConversationId) {
        self.changed.push(id);
    }

    /// `t` in signed nanoseconds from the base: a bound may lie before any instant.
    fn key(&self, t: Instant) -> i64 {
        let base = self.base.unwrap_or(t);
        match t.checked_duration_since(base) {
            Some(d) => nanos(d),
            None => -nanos(base - t),
        }
    }

    /// The key no earlier than which the clock's idle time can start, from `now` on: its
    /// start, or for an expected resume an instant as far before `now` as the resume is ahead
    /// (the idle time it has at most, and only shrinks).
    fn since_key(&self, clock: Clock, now: Instant) -> i64 {
        match clock {
            Clock::Since(t) => self.key(t),
            Clock::Until(at) => self.key(now).saturating_sub(nanos(at - now)),
        }
    }
}

/// `d` in nanoseconds, at most `i64::MAX` (a resume hinted centuries ahead stays a bound).
fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// A candidate found: its value (lower goes first), conversation and chunk index.
pub(super) type Found = (f64, ConversationId, usize);

/// Whether `a` goes before `b`: lower value, then conversation, then chunk (a conversation's
/// own chunk and one it shares may tie).
fn better(a: Found, b: Option<Found>) -> bool {
    b.is_none_or(|b| (a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))).is_lt())
}

/// Whether a lower bound `lb` on a value cannot beat `best` (with room for the rounding of a
/// sum, which may fall a hair below the bound's product).
fn beyond(lb: f64, best: Option<Found>) -> bool {
    best.is_some_and(|b| lb - lb.abs() * 1e-9 > b.0)
}

/// What a decision reads of the cache it ranks: the tables, the chunk records and the policy.
pub(super) struct View<'a> {
    pub tables: &'a BTreeMap<ConversationId, ChunkTable>,
    pub arena: &'a Arena,
    pub policy: &'a dyn EvictionPolicy,
    pub chunk: usize,
}

impl View<'_> {
    /// What losing chunk `i`, shared record `rec`, costs all of its holders.
    pub fn shared_value(&self, rec: ChunkId, i: usize, now: Instant) -> f64 {
        (self.arena.holders(rec).iter())
            .filter_map(|c| self.tables.get(c))
            .map(|t| {
                self.policy.value(&Candidate {
                    start: i * self.chunk,
                    len: t.chunk_len(i, self.chunk),
                    idle_s: t.until_next_use(now).as_secs_f64(),
                })
            })
            .sum()
    }
}

impl Candidates {
    /// Brings the candidates up to date with every change since the last decision: the
    /// arena's (`changed`: conversations whose own chunks moved, shared records that moved or
    /// changed hands), those marked, and the expected resumes fallen due.
    fn refresh(&mut self, v: &View, changed: (Vec<ConversationId>, Vec<ChunkId>), now: Instant) {
        self.base.get_or_insert(now);
        let (mut changed, mut shared) = changed;
        changed.append(&mut self.changed);
        while let Some(&(at, id)) = self.due.first() {
            if at > now {
                break;
            }
            self.due.pop_first();
            changed.push(id);
        }
        changed.sort_unstable();
        changed.dedup();
        for id in changed {
            self.refresh_own(v, id, now, &mut shared);
        }
        shared.sort_unstable();
        shared.dedup();
        for rec in shared {
            self.refresh_shared(v, rec, now);
        }
    }

    /// Re-reads `id`: its own candidate in each tier, and its clock in the bounds of the
    /// shared chunks it holds (those lowered go to `shared`, to be re-listed).
    fn refresh_own(
        &mut self,
        v: &View,
        id: ConversationId,
        now: Instant,
        shared: &mut Vec<ChunkId>,
    ) {
        let chunk = v.chunk;
        let table = v.tables.get(&id);
        for (k, tier) in Tier::ALL.into_iter().enumerate() {
            // A file is each holder's own (the store counts references per holder).
            let entry = table.and_then(|t| {
                let i = (0..t.computed_chunks(chunk)).find(|&i| {
                    let rec = t.records()[i];
                    tier.holds(v.arena.loc(rec), t.file(i).is_some())
                        && (tier == Tier::Stored || !v.arena.is_shared(rec))
                })?;
                Some(((i, t.chunk_len(i, chunk)), t.clock(now)))
            });
            self.tiers[k].set(id, entry);
        }
        let Some(t) = table else {
            return;
        };
        let clock = t.clock(now);
        if let Clock::Until(at) = clock {
            self.due.insert((at, id));
        }
        let key = self.since_key(clock, now);
        for &rec in &t.records()[..t.computed_chunks(chunk)] {
            if !v.arena.is_shared(rec) {
                continue;
            }
            match self.bounds.get(&rec) {
                Some(&bound) if bound <= key => {}
                Some(_) => {
                    self.bounds.insert(rec, key);
                    shared.push(rec);
                }
                // Newly shared: listing it reads all of its holders.
                None => shared.push(rec),
            }
        }
    }

    /// Re-lists shared chunk `rec` in the tier it is in (none if it is not shared or not in
    /// memory).
    fn refresh_shared(&mut self, v: &View, rec: ChunkId, now: Instant) {
        let r = v.arena.get(rec);
        let tier = match r.loc {
            ChunkLoc::Device(_) => Some(0),
            ChunkLoc::Host(_) => Some(1),
            _ => None,
        };
        let n = r.holders.len();
        if n < 2 {
            self.bounds.remove(&rec);
        }
        let entry = tier
            .filter(|_| n > 1)
            .and_then(|_| self.shared_entry(v, rec, now));
        for k in [0, 1] {
            self.tiers[k].set_shared(rec, entry.filter(|_| tier == Some(k)));
        }
    }

    /// Shared chunk `rec`'s place in an index: its group and bound.
    fn shared_entry(&mut self, v: &View, rec: ChunkId, now: Instant) -> Option<Shared> {
        // Read from a holder's table, not from the index: a record freed and taken again
        // since the last decision may sit at another index. Shared chunks are mostly a prefix
        // others computed, near the front, so the search is short.
        let h = v.arena.holders(rec).first()?;
        let i = v.tables.get(h)?.records().iter().position(|&r| r == rec)?;
        let bound = match self.bounds.get(&rec) {
            Some(&b) => b,
            None => {
                let least = self.least_key(v, rec, now);
                self.bounds.insert(rec, least);
                least
            }
        };
        Some(((i, v.arena.holders(rec).len()), bound))
    }

    /// The least since-key of `rec`'s holders now.
    fn least_key(&self, v: &View, rec: ChunkId, now: Instant) -> i64 {
        (v.arena.holders(rec).iter())
            .filter_map(|h| v.tables.get(h))
            .map(|t| self.since_key(t.clock(now), now))
            .min()
            .unwrap_or(i64::MAX)
    }

    /// The lowest-value candidate in `tier` that `protect` leaves, as at `now` or the latest
    /// decision's instant if that is later, after the changes since the last decision
    /// (`changed`, the arena's).
    pub fn lowest(
        &mut self,
        v: &View,
        changed: (Vec<ConversationId>, Vec<ChunkId>),
        tier: Tier,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<Found> {
        let now = *self.latest.insert(self.latest.map_or(now, |l| l.max(now)));
        self.refresh(v, changed, now);
        let k = Tier::ALL.iter().position(|&t| t == tier)?;
        let best = self.lowest_own(v, k, protect, now);
        let (best, tighter) = self.lowest_shared(v, k, protect, now, best);
        for (rec, bound) in tighter {
            self.bounds.insert(rec, bound);
            for index in &mut self.tiers {
                if let Some(&(g, _)) = index.records.get(&rec) {
                    index.set_shared(rec, Some((g, bound)));
                }
            }
        }
        best
    }

    /// The lowest own candidate of tier `k` that `protect` leaves.
    fn lowest_own(
        &self,
        v: &View,
        k: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<Found> {
        let mut best: Option<Found> = None;
        for (&(i, len), group) in &self.tiers[k].groups {
            let value = |idle: std::time::Duration| {
                v.policy.value(&Candidate {
                    start: i * v.chunk,
                    len,
                    idle_s: idle.as_secs_f64(),
                })
            };
            // Along each order values only rise: the walk stops at the first above the best
            // (an equal one may still win on its id).
            let since = (group.since.iter()).map(|&(t, id)| (id, now.saturating_duration_since(t)));
            let until = (group.until.iter()).map(|&(Reverse(t), id)| (id, t - now));
            for members in [
                &mut since.into_iter() as &mut dyn Iterator<Item = _>,
                &mut until.into_iter(),
            ] {
                for (id, idle) in members {
                    if protect(id) {
                        continue;
                    }
                    let found = (value(idle), id, i);
                    if best.is_some_and(|b| found.0 > b.0) {
                        break;
                    }
                    if better(found, best) {
                        best = Some(found);
                    }
                }
            }
        }
        best
    }

    /// The lowest of `best` and tier `k`'s shared candidates that `protect` leaves, with the
    /// tighter bounds of the chunks summed on the way.
    fn lowest_shared(
        &self,
        v: &View,
        k: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
        mut best: Option<Found>,
    ) -> (Option<Found>, Vec<(ChunkId, i64)>) {
        let now_key = self.key(now);
        let mut tighter = Vec::new();
        for (&(i, n), set) in &self.tiers[k].shared {
            for &(bound, rec) in set {
                let idle = Duration::from_nanos(now_key.saturating_sub(bound).max(0) as u64);
                let lb = n as f64
                    * v.policy.value(&Candidate {
                        start: i * v.chunk,
                        len: v.chunk,
                        idle_s: idle.as_secs_f64(),
                    });
                if beyond(lb, best) {
                    break;
                }
                let holders = v.arena.holders(rec);
                // The latest holders are the likeliest to be running.
                if holders.iter().rev().any(|&c| protect(c)) {
                    continue;
                }
                let least = self.least_key(v, rec, now);
                if least > bound {
                    tighter.push((rec, least));
                }
                let first = holders.iter().copied().min();
                if let Some(found) = first.map(|c| (v.shared_value(rec, i, now), c, i))
                    && better(found, best)
                {
                    best = Some(found);
                }
            }
        }
        (best, tighter)
    }
}

#[cfg(test)]
mod tests;

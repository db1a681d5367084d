//! Eviction candidates kept in order, updated as conversations change rather than found by
//! a scan over every table at each decision.
//!
//! A tier's candidate from a conversation is its leading chunk in that tier. A policy's value
//! falls as the idle time grows for a chunk of the same position and length (what
//! [`crate::kv::EvictionPolicy`] requires), so candidates are grouped by (chunk index, tokens)
//! and, in each group, ordered by idle time: the first unprotected member of a group is that
//! group's lowest value, and a decision reads one member per group (plus the protected ones it
//! passes over). Idle time runs two ways: since the last activity (or an overdue expected
//! resume), growing; or until an expected resume, shrinking. Each group keeps one order per
//! way, and a resume that falls due moves its conversation from one to the other.
//!
//! A conversation whose leading chunk in the tier is shared is kept apart and valued in full
//! at each decision (the chunk's value is its holders' together, and a chunk shared with a
//! running conversation passes the offer to the next one): their number is that of the
//! conversations whose front is shared in that tier, not of all conversations.
//!
//! The index learns what changed from the arena (chunks moved or changing hands) and from the
//! manager (activity, hints, files, computed tokens): those conversations are re-read before
//! the next decision, each in `O(its chunks)`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use super::arena::ChunkId;
use super::{CacheManager, ChunkTable};
use crate::ids::ConversationId;
use crate::kv::policy::Candidate;
use crate::kv::ChunkLoc;

/// A tier eviction takes chunks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tier {
    /// Chunks in the device pool.
    Device,
    /// Chunks in the host tier.
    Host,
    /// Chunks with a file in the store (wherever else they are).
    Saved,
}

impl Tier {
    const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Saved];

    fn holds(self, loc: ChunkLoc, saved: bool) -> bool {
        match self {
            Tier::Device => matches!(loc, ChunkLoc::Device(_)),
            Tier::Host => matches!(loc, ChunkLoc::Host(_)),
            Tier::Saved => saved,
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
        match self.resume_at {
            Some(at) if at > now => Clock::Until(at),
            Some(at) => Clock::Since(at.max(self.last_active)),
            None => Clock::Since(self.last_active),
        }
    }
}

/// Where a conversation is listed in one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// Its leading chunk there is its own: in a group, by (chunk index, tokens).
    Own((usize, usize), Clock),
    /// Its leading chunk there is shared.
    Shared,
}

/// One group's members, most idle first in each order.
#[derive(Debug, Default)]
struct Group {
    since: BTreeSet<(Instant, ConversationId)>,
    until: BTreeSet<(Reverse<Instant>, ConversationId)>,
}

#[derive(Debug, Default)]
struct TierIndex {
    groups: BTreeMap<(usize, usize), Group>,
    shared: BTreeSet<ConversationId>,
    entries: HashMap<ConversationId, Entry>,
}

impl TierIndex {
    fn set(&mut self, id: ConversationId, entry: Option<Entry>) {
        let old = match entry {
            Some(e) => self.entries.insert(id, e),
            None => self.entries.remove(&id),
        };
        if old == entry {
            return;
        }
        match old {
            Some(Entry::Own(g, clock)) => {
                if let Some(group) = self.groups.get_mut(&g) {
                    match clock {
                        Clock::Since(t) => group.since.remove(&(t, id)),
                        Clock::Until(t) => group.until.remove(&(Reverse(t), id)),
                    };
                    if group.since.is_empty() && group.until.is_empty() {
                        self.groups.remove(&g);
                    }
                }
            }
            Some(Entry::Shared) => _ = self.shared.remove(&id),
            None => {}
        }
        match entry {
            Some(Entry::Own(g, clock)) => {
                let group = self.groups.entry(g).or_default();
                match clock {
                    Clock::Since(t) => group.since.insert((t, id)),
                    Clock::Until(t) => group.until.insert((Reverse(t), id)),
                };
            }
            Some(Entry::Shared) => _ = self.shared.insert(id),
            None => {}
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
}

impl Candidates {
    /// `id` changed in a way the arena does not see (activity, a hint, a file, its tokens).
    pub fn mark(&mut self, id: ConversationId) {
        self.changed.push(id);
    }
}

/// A candidate found: its value (lower goes first), conversation and chunk index.
type Found = (f64, ConversationId, usize);

fn better(a: Found, b: Option<Found>) -> bool {
    b.is_none_or(|b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).is_lt())
}

impl CacheManager {
    /// Brings the candidates up to date with every change since the last decision.
    fn refresh_candidates(&mut self, now: Instant) {
        let mut changed = self.arena.take_changed();
        changed.append(&mut self.candidates.changed);
        while let Some(&(at, id)) = self.candidates.due.first() {
            if at > now {
                break;
            }
            self.candidates.due.pop_first();
            changed.push(id);
        }
        changed.sort_unstable();
        changed.dedup();
        let chunk = self.chunk_size();
        for id in changed {
            let table = self.tables.get(&id);
            for (k, tier) in Tier::ALL.into_iter().enumerate() {
                let entry = table.and_then(|t| {
                    let i = (0..t.computed_chunks(chunk))
                        .find(|&i| tier.holds(self.arena.loc(t.chunks[i]), t.saved[i].is_some()))?;
                    Some(match self.arena.is_shared(t.chunks[i]) {
                        true => Entry::Shared,
                        false => Entry::Own((i, t.chunk_len(i, chunk)), t.clock(now)),
                    })
                });
                self.candidates.tiers[k].set(id, entry);
            }
            if let Some(Clock::Until(at)) = table.map(|t| t.clock(now)) {
                self.candidates.due.insert((at, id));
            }
        }
    }

    /// The lowest-value leading chunk in `tier` among conversations `protect` does not cover
    /// (a chunk shared with a protected conversation stays, and the next one is offered).
    pub(super) fn victim(
        &mut self,
        tier: Tier,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<(ConversationId, usize)> {
        self.refresh_candidates(now);
        let k = Tier::ALL.iter().position(|&t| t == tier)?;
        let index = &self.candidates.tiers[k];
        let chunk = self.chunk_size();
        let mut best: Option<Found> = None;
        for (&(i, len), group) in &index.groups {
            let value = |idle: std::time::Duration| {
                self.policy.value(&Candidate {
                    start: i * chunk,
                    len,
                    idle_s: idle.as_secs_f64(),
                })
            };
            // Along each order values only rise: the walk stops at the first above the best.
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
                    if !better(found, best) {
                        break;
                    }
                    best = Some(found);
                }
            }
        }
        // A shared chunk's verdict (kept for a protected holder, or its value over all its
        // holders) is the same for each holder: worked out once per decision.
        let mut shared = HashMap::new();
        for &id in &index.shared {
            if protect(id) {
                continue;
            }
            if let Some(found) = self.offer(tier, id, protect, now, &mut shared) {
                if better(found, best) {
                    best = Some(found);
                }
            }
        }
        best.map(|(_, id, i)| (id, i))
    }

    /// `id`'s offer in `tier`: its first chunk there not shared with a protected conversation,
    /// valued for all of its holders (`verdicts`: those of the chunks weighed so far).
    fn offer(
        &self,
        tier: Tier,
        id: ConversationId,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
        verdicts: &mut HashMap<ChunkId, Option<f64>>,
    ) -> Option<Found> {
        let chunk = self.chunk_size();
        let t = self.tables.get(&id)?;
        (0..t.computed_chunks(chunk))
            .filter(|&i| tier.holds(self.arena.loc(t.chunks[i]), t.saved[i].is_some()))
            .find_map(|i| {
                let verdict = *(verdicts.entry(t.chunks[i]))
                    .or_insert_with(|| self.verdict(t.chunks[i], i, protect, now));
                verdict.map(|value| (value, id, i))
            })
    }

    /// Chunk `i` of its holders, `record`: kept (`None`) if a protected conversation holds it
    /// (the holder asking is never protected), or what losing it costs them all.
    fn verdict(
        &self,
        record: ChunkId,
        i: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<f64> {
        let holders = self.arena.holders(record);
        if holders.iter().any(|&c| protect(c)) {
            return None;
        }
        let chunk = self.chunk_size();
        // Losing a shared chunk costs each of its holders.
        let value = (holders.iter())
            .filter_map(|c| self.tables.get(c))
            .map(|t| {
                self.policy.value(&Candidate {
                    start: i * chunk,
                    len: t.chunk_len(i, chunk),
                    idle_s: t.until_next_use(now).as_secs_f64(),
                })
            })
            .sum();
        Some(value)
    }
}

#[cfg(test)]
mod tests;

//! Chunks with an identity, in the manner of vLLM's block pool: every chunk of KV the cache
//! holds is one record in an arena (where it lives, who holds it, its content address), and a
//! conversation's table is a list of record handles. A chunk shared by content is one record
//! with several holders, so moving it, counting its references or finding who holds it reads
//! the record: nothing scans the other tables.
//!
//! Only chunks in memory (the device pool, the host tier, or a copy between them) are shared;
//! a chunk that falls to the store or is dropped becomes each holder's own again (its file,
//! if any, is referenced per holder by the store).

use std::collections::HashMap;

use super::super::{Address, ChunkLoc};
use crate::ids::ConversationId;

/// A handle to one chunk record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ChunkId(u32);

/// One chunk of KV.
#[derive(Debug)]
pub(super) struct Record {
    /// Where its KV lives.
    pub loc: ChunkLoc,
    /// The conversations whose tables name it, each at the same index (empty while free).
    pub holders: Vec<ConversationId>,
    /// Its content address, while the prefix index lists it (full chunks only).
    pub addr: Option<Address>,
    /// Whether the KV where it lives holds only the narrow layers (those without a sliding
    /// window): in the device pool the other layers' slots hold nothing of its own.
    pub narrow: bool,
}

/// The records, with free entries reused.
#[derive(Debug, Default)]
pub(super) struct Arena {
    records: Vec<Record>,
    free: Vec<u32>,
    /// Holders past the first, over every record: what sharing saves, in chunks.
    extra_holders: usize,
    /// The content index: records by their content address (several records may have equal
    /// contents, computed apart before either was indexed).
    index: HashMap<Address, Vec<ChunkId>>,
    /// Conversations whose own chunks (those no one else holds) moved, came or went since the
    /// eviction candidates last read them.
    changed: Vec<ConversationId>,
    /// Shared records that moved or changed hands since then: their holders are not listed
    /// (a chunk shared by every conversation would list them all).
    changed_shared: Vec<ChunkId>,
}

impl Arena {
    /// A new record of `holder`'s at `loc`.
    pub fn insert(&mut self, loc: ChunkLoc, holder: ConversationId) -> ChunkId {
        self.changed.push(holder);
        let record = Record {
            loc,
            holders: vec![holder],
            addr: None,
            narrow: false,
        };
        match self.free.pop() {
            Some(i) => {
                self.records[i as usize] = record;
                ChunkId(i)
            }
            None => {
                self.records.push(record);
                ChunkId((self.records.len() - 1) as u32)
            }
        }
    }

    pub fn get(&self, id: ChunkId) -> &Record {
        &self.records[id.0 as usize]
    }

    pub fn loc(&self, id: ChunkId) -> ChunkLoc {
        self.get(id).loc
    }

    /// Moves the chunk (for all of its holders).
    pub fn set_loc(&mut self, id: ChunkId, loc: ChunkLoc) {
        self.records[id.0 as usize].loc = loc;
        self.note(id);
    }

    /// Whether its KV holds only the narrow layers.
    pub fn narrow(&self, id: ChunkId) -> bool {
        self.get(id).narrow
    }

    /// Its KV holds only the narrow layers, or (recomputed, read whole) every layer.
    pub fn set_narrow(&mut self, id: ChunkId, narrow: bool) {
        self.records[id.0 as usize].narrow = narrow;
    }

    /// The record changed: listed as shared, or by its one holder.
    fn note(&mut self, id: ChunkId) {
        match self.records[id.0 as usize].holders.as_slice() {
            [] => {}
            [one] => self.changed.push(*one),
            _ => self.changed_shared.push(id),
        }
    }

    pub fn holders(&self, id: ChunkId) -> &[ConversationId] {
        &self.get(id).holders
    }

    pub fn is_shared(&self, id: ChunkId) -> bool {
        self.get(id).holders.len() > 1
    }

    /// Lists the chunk in the content index under `addr` (or takes it out, for `None`).
    pub fn set_addr(&mut self, id: ChunkId, addr: Option<Address>) {
        let old = std::mem::replace(&mut self.records[id.0 as usize].addr, addr);
        if old == addr {
            return;
        }
        if let Some(a) = old {
            self.unindex(id, &a);
        }
        if let Some(a) = addr {
            self.index.entry(a).or_default().push(id);
        }
    }

    fn unindex(&mut self, id: ChunkId, a: &Address) {
        if let Some(ids) = self.index.get_mut(a) {
            ids.retain(|&r| r != id);
            if ids.is_empty() {
                self.index.remove(a);
            }
        }
    }

    /// A chunk in memory (the device pool or the host tier) whose content address is `a`.
    pub fn resident(&self, a: &Address) -> Option<ChunkId> {
        (self.index.get(a)?.iter().copied())
            .find(|&id| matches!(self.loc(id), ChunkLoc::Device(_) | ChunkLoc::Host(_)))
    }

    /// Whether nothing is indexed.
    #[cfg(test)]
    pub fn index_is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// `conv` holds the chunk too.
    pub fn add_holder(&mut self, id: ChunkId, conv: ConversationId) {
        let r = &mut self.records[id.0 as usize];
        // A chunk that was its holder's own is shared now: that holder's own chunks changed.
        if let [one] = r.holders.as_slice() {
            self.changed.push(*one);
        }
        r.holders.push(conv);
        self.changed.push(conv);
        self.changed_shared.push(id);
        self.extra_holders += 1;
    }

    /// `conv` no longer holds the shared chunk (listed as changed; the one holder left, if
    /// only one is, owns it now).
    fn leave(&mut self, id: ChunkId, conv: ConversationId) {
        let r = &mut self.records[id.0 as usize];
        r.holders.retain(|&c| c != conv);
        self.changed.push(conv);
        self.changed_shared.push(id);
        if let [one] = r.holders.as_slice() {
            self.changed.push(*one);
        }
    }

    /// `conv` lets go of the chunk. When it was the last holder the record is freed and its
    /// location returned, for the caller to release what it names.
    pub fn remove_holder(&mut self, id: ChunkId, conv: ConversationId) -> Option<ChunkLoc> {
        let r = &self.records[id.0 as usize];
        if !r.holders.contains(&conv) {
            return None;
        }
        self.leave(id, conv);
        let r = &mut self.records[id.0 as usize];
        if !r.holders.is_empty() {
            self.extra_holders -= 1;
            return None;
        }
        let loc = r.loc;
        r.loc = ChunkLoc::Dropped;
        self.set_addr(id, None);
        self.free.push(id.0);
        Some(loc)
    }

    /// Makes the chunk `conv`'s own at `loc`: its own record if the chunk is shared (the
    /// others keep theirs), else the same record moved. Returns the record `conv` now names.
    pub fn detach(&mut self, id: ChunkId, conv: ConversationId, loc: ChunkLoc) -> ChunkId {
        if !self.is_shared(id) {
            self.set_loc(id, loc);
            return id;
        }
        self.leave(id, conv);
        let (addr, narrow) = (self.get(id).addr, self.get(id).narrow);
        self.extra_holders -= 1;
        let own = self.insert(loc, conv);
        self.set_addr(own, addr);
        self.set_narrow(own, narrow);
        own
    }

    /// The conversations whose own chunks changed, and the shared records that changed,
    /// since the last call.
    pub fn take_changed(&mut self) -> (Vec<ConversationId>, Vec<ChunkId>) {
        (
            std::mem::take(&mut self.changed),
            std::mem::take(&mut self.changed_shared),
        )
    }

    /// Holders past the first, over every record.
    pub fn extra_holders(&self) -> usize {
        self.extra_holders
    }
}

//! One conversation's chunk table: the chunk records holding its KV, the store file of each,
//! how far its KV has been computed, and its session hints.
//!
//! The fields are private to this module so that its invariant holds by construction: a
//! table has exactly one file entry per chunk (`chunks` and `files` grow, shrink and are cut
//! together). What covers what (a table's chunks cover its computed tokens) depends on the
//! chunk size and the arena, and is checked by [`super::CacheManager::check`].

use std::time::{Duration, Instant};

use super::arena::ChunkId;
use crate::kv::Address;

/// One conversation's KV: where each chunk lives and how far the KV has been computed.
#[derive(Debug)]
pub(crate) struct ChunkTable {
    chunks: Vec<ChunkId>,
    /// Per chunk, the address of its file in the store, when one holds this chunk's KV
    /// (whatever tier also holds it).
    files: Vec<Option<Address>>,
    /// Tokens `[0, computed)` have had their KV computed (it may since have been dropped).
    computed: usize,
    /// When the conversation last ran; eviction's idle time counts from here.
    last_active: Instant,
    /// Never evicted below the host tier (a session hint).
    pinned: bool,
    /// When its next turn is expected (a session hint).
    resume_at: Option<Instant>,
    /// Where its latest turn began computing: a retry or an edit of that turn resumes at or
    /// after it, so the chunks a sliding window reads from there stay whole.
    turn_start: usize,
}

/// The chunks cut from a table's tail: the records to let go of and the files to release.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Cut {
    pub records: Vec<ChunkId>,
    pub files: Vec<Address>,
}

impl ChunkTable {
    /// An empty table, last active at `now`.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            chunks: Vec::new(),
            files: Vec::new(),
            computed: 0,
            last_active: now,
            pinned: false,
            resume_at: None,
            turn_start: 0,
        }
    }

    /// Chunks in the table (computed, or reserved for tokens being computed).
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Tokens whose KV has been computed.
    pub fn computed(&self) -> usize {
        self.computed
    }

    /// Leading chunks that hold computed tokens.
    pub(super) fn computed_chunks(&self, chunk: usize) -> usize {
        self.computed.div_ceil(chunk).min(self.chunks.len())
    }

    /// Computed tokens in chunk `i`.
    pub(super) fn chunk_len(&self, i: usize, chunk: usize) -> usize {
        self.computed.saturating_sub(i * chunk).min(chunk)
    }

    /// The record of chunk `i`.
    pub(super) fn record(&self, i: usize) -> Option<ChunkId> {
        self.chunks.get(i).copied()
    }

    /// Every chunk's record, in order.
    pub(super) fn records(&self) -> &[ChunkId] {
        &self.chunks
    }

    /// The store file of chunk `i`, if it has one.
    pub(super) fn file(&self, i: usize) -> Option<Address> {
        self.files.get(i).copied().flatten()
    }

    /// Every chunk's store file, in order (`None` where a chunk has none).
    pub(super) fn files(&self) -> &[Option<Address>] {
        &self.files
    }

    pub(super) fn pinned(&self) -> bool {
        self.pinned
    }

    pub(super) fn resume_at(&self) -> Option<Instant> {
        self.resume_at
    }

    /// The instant idle time counts from: the later of its last run and an expected resume
    /// already passed; `Err` with the expected resume when it is still ahead of `now`.
    pub(super) fn idle_since(&self, now: Instant) -> Result<Instant, Instant> {
        match self.resume_at {
            Some(at) if at > now => Err(at),
            Some(at) => Ok(at.max(self.last_active)),
            None => Ok(self.last_active),
        }
    }

    /// How far its next use is, as eviction sees it: the time until an expected resume, else
    /// the time since it last ran (the longer a conversation has been idle, the later it is
    /// likely to come back). An overdue resume counts as idle since the expected time.
    pub(super) fn until_next_use(&self, now: Instant) -> Duration {
        match self.idle_since(now) {
            Err(at) => at - now,
            Ok(since) => now.saturating_duration_since(since),
        }
    }

    /// Appends a chunk with its file.
    pub(super) fn push(&mut self, record: ChunkId, file: Option<Address>) {
        self.chunks.push(record);
        self.files.push(file);
    }

    /// Cuts the chunks from `from` on, with their files (computed tokens are the caller's to
    /// set: a cut below them is followed by [`Self::set_computed`]).
    pub(super) fn cut(&mut self, from: usize) -> Cut {
        let from = from.min(self.chunks.len());
        Cut {
            records: self.chunks.split_off(from),
            files: self.files.split_off(from).into_iter().flatten().collect(),
        }
    }

    /// Chunk `i` names `record` instead (a shared record became this holder's own).
    pub(super) fn set_record(&mut self, i: usize, record: ChunkId) {
        if let Some(slot) = self.chunks.get_mut(i) {
            *slot = record;
        }
    }

    /// Chunk `i`'s file becomes `file`; returns the one it had.
    pub(super) fn set_file(&mut self, i: usize, file: Option<Address>) -> Option<Address> {
        let slot = self.files.get_mut(i)?;
        std::mem::replace(slot, file)
    }

    /// Where its latest turn began computing.
    pub(super) fn turn_start(&self) -> usize {
        self.turn_start
    }

    pub(super) fn set_turn_start(&mut self, at: usize) {
        self.turn_start = at;
    }

    pub(super) fn set_computed(&mut self, computed: usize) {
        self.computed = computed;
    }

    pub(super) fn touch(&mut self, now: Instant) {
        self.last_active = now;
    }

    pub(super) fn set_pinned(&mut self, pinned: bool) {
        self.pinned = pinned;
    }

    /// Sets the expected resume; returns the previous one.
    pub(super) fn expect_resume(&mut self, at: Option<Instant>) -> Option<Instant> {
        std::mem::replace(&mut self.resume_at, at)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    //! The table's mutators at random against a model that keeps each chunk's record and
    //! file as one pair.

    use proptest::prelude::*;

    use super::*;
    use crate::ids::ConversationId;
    use crate::kv::cache::arena::Arena;
    use crate::kv::ChunkLoc;

    #[derive(Clone, Debug)]
    enum Op {
        Push(bool),
        Cut(usize),
        SetRecord(usize),
        SetFile(usize, bool),
        Computed(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<bool>().prop_map(Op::Push),
            (0..12usize).prop_map(Op::Cut),
            (0..12usize).prop_map(Op::SetRecord),
            (0..12usize, any::<bool>()).prop_map(|(i, f)| Op::SetFile(i, f)),
            (0..48usize).prop_map(Op::Computed),
        ]
    }

    fn address(n: usize) -> Address {
        Address::of_chunks(&[n as u32], 1)[0]
    }

    proptest! {
        #[test]
        fn records_and_files_stay_paired(ops in prop::collection::vec(op(), 1..80)) {
            let mut arena = Arena::default();
            let mut table = ChunkTable::new(Instant::now());
            let mut model: Vec<(ChunkId, Option<Address>)> = Vec::new();
            let mut computed = 0;
            for (n, op) in ops.iter().enumerate() {
                let fresh = arena.insert(ChunkLoc::Dropped, ConversationId(1));
                match *op {
                    Op::Push(with_file) => {
                        let file = with_file.then(|| address(n));
                        table.push(fresh, file);
                        model.push((fresh, file));
                    }
                    Op::Cut(from) => {
                        let cut = table.cut(from);
                        let gone = model.split_off(from.min(model.len()));
                        prop_assert_eq!(cut.records, gone.iter().map(|g| g.0).collect::<Vec<_>>());
                        prop_assert_eq!(cut.files, gone.iter().filter_map(|g| g.1).collect::<Vec<_>>());
                    }
                    Op::SetRecord(i) => {
                        table.set_record(i, fresh);
                        if let Some(m) = model.get_mut(i) {
                            m.0 = fresh;
                        }
                    }
                    Op::SetFile(i, with_file) => {
                        let file = with_file.then(|| address(n));
                        let old = table.set_file(i, file);
                        let expected = model.get_mut(i).and_then(|m| std::mem::replace(&mut m.1, file));
                        prop_assert_eq!(old, expected);
                    }
                    Op::Computed(c) => {
                        table.set_computed(c);
                        computed = c;
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert_eq!(table.files().len(), table.records().len());
                prop_assert_eq!(table.computed(), computed);
                for (i, &(record, file)) in model.iter().enumerate() {
                    prop_assert_eq!(table.record(i), Some(record));
                    prop_assert_eq!(table.file(i), file);
                }
                prop_assert_eq!(table.record(model.len()), None);
                prop_assert_eq!(table.file(model.len()), None);
            }
        }
    }
}

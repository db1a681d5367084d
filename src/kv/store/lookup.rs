//! Finding chunks by content in a store other engines write too: which of a turn's next
//! chunks are stored already. The step thread never waits for the answer: the question goes to
//! the reader thread ([`Store::look_up`]) and the answer is indexed when
//! [`Store::poll`] takes it; a conversation resumed by name was asked about before, with
//! its manifest, by a [`super::StoreReader`] (its answer indexed by
//! [`Store::index_found`]).

use super::worker::Job;
use super::{Address, Entry, State, Store};

impl Store {
    /// The chunks of `chunks` (address, KV-tokens) this store knows nothing of: neither
    /// indexed nor refused.
    fn unknown(&self, chunks: &[(Address, usize)]) -> Vec<(Address, usize)> {
        (chunks.iter())
            .filter(|(a, _)| !self.entries.contains_key(a) && !self.refused.contains(a))
            .copied()
            .collect()
    }

    /// In a shared store, asks behind (on the reader thread) which of `chunks` other engines
    /// have stored; [`Store::poll`] indexes the answer. Returns the lookup's number, for
    /// [`Store::looked`]; `None` when there is nothing to ask.
    pub fn look_up(&mut self, chunks: &[(Address, usize)]) -> Option<u64> {
        // A medium only this store writes was indexed whole when it opened: nothing to ask.
        self.medium.shared()?;
        let unknown = self.unknown(chunks);
        if unknown.is_empty() {
            return None;
        }
        self.next_lookup += 1;
        let lookup = self.next_lookup;
        let job = Job::Lookup {
            lookup,
            chunks: unknown,
        };
        self.reader.send(job).then(|| self.lookups.insert(lookup))?;
        Some(lookup)
    }

    /// Whether lookup `lookup` was answered (and its answer indexed).
    pub fn looked(&self, lookup: u64) -> bool {
        !self.lookups.contains(&lookup)
    }

    /// Indexes chunks another engine stored; returns how many.
    pub fn index_found(&mut self, found: &[(Address, usize)]) -> usize {
        let mut n = 0;
        for &(a, tokens) in found {
            if self.entries.contains_key(&a) || self.refused.contains(&a) {
                continue;
            }
            let entry = Entry {
                bytes: self.file_bytes(&a, tokens),
                refs: 0,
                state: State::Stored,
                owned: false,
            };
            self.entries.insert(a, entry);
            n += 1;
        }
        self.stats.chunks_discovered += n as u64;
        n
    }
}

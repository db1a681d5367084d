//! What the store (or a fleet's shared store) did: counters the engine reports.

use super::format::Fault;

/// Counts of refused chunk files, by why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultCounts {
    /// Files that were expected but absent.
    pub missing: u64,
    /// Files shorter or longer than their header says.
    pub truncated: u64,
    /// Files with a damaged or unknown header.
    pub bad_header: u64,
    /// Files of another model or KV layout.
    pub foreign: u64,
    /// Files holding other tokens' KV than their name says.
    pub wrong_content: u64,
    /// Files whose payload checksum failed.
    pub corrupt: u64,
    /// Files the file system failed to read.
    pub io: u64,
}

impl FaultCounts {
    pub(super) fn count(&mut self, fault: Fault) {
        *match fault {
            Fault::Missing => &mut self.missing,
            Fault::Truncated => &mut self.truncated,
            Fault::BadHeader => &mut self.bad_header,
            Fault::Foreign => &mut self.foreign,
            Fault::WrongContent => &mut self.wrong_content,
            Fault::Corrupt => &mut self.corrupt,
            Fault::Io(_) => &mut self.io,
        } += 1;
    }

    /// Every refused file.
    pub fn total(&self) -> u64 {
        self.missing
            + self.truncated
            + self.bad_header
            + self.foreign
            + self.wrong_content
            + self.corrupt
            + self.io
    }
}

/// What the store did since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Chunk files written (whole, renamed into place).
    pub chunks_written: u64,
    /// Bytes of those files' payloads.
    pub bytes_written: u64,
    /// Chunks read back on demand, when their turn was admitted (a prefetch miss); each is
    /// verified before use, and one refused is counted in `faults` too.
    pub chunks_read: u64,
    /// Bytes of payloads read back (or asked for: a refused read counts), on demand and
    /// ahead.
    pub bytes_read: u64,
    /// Chunks read ahead of their turn into the host tier (the look-ahead window).
    pub chunks_prefetched: u64,
    /// Saves that found a file of the same content already stored or queued (shared).
    pub saves_shared: u64,
    /// Saves refused: no room under the budget, even after eviction.
    pub saves_refused: u64,
    /// Saves the file system failed (full disk, I/O error); the chunk stays where it was.
    pub save_failures: u64,
    /// Chunk files deleted because no conversation needs them any more (evicted, or stale).
    pub files_removed: u64,
    /// Files refused when read or scanned, by why; their chunks are recomputed.
    pub faults: FaultCounts,
    /// Bytes of chunk files stored or queued now.
    pub bytes_used: usize,
    /// The byte budget.
    pub budget_bytes: usize,
    /// Chunks found by address in a shared store, written by other engines.
    pub chunks_discovered: u64,
    /// Connections opened to a shared store (more than one: it reconnected).
    pub connects: u64,
    /// Conversations a folder store removed because they went unused past
    /// [`crate::engine::StoreConfig::expire_after`].
    pub conversations_expired: u64,
}

//! The cache manager: plans KV moves between tiers (Pensieve §4.3, thesis §3.4.3).
//!
//! It owns the device block allocator, the host pool and the eviction policy, and edits
//! conversations' chunk tables. Moves are two-phase: planning marks a chunk `SwappingOut` /
//! `SwappingIn` and books the destination; the executor copies the bytes; `complete_*` frees
//! the source. Drops take effect at once (nothing to copy). Eviction picks, among the leading
//! chunk of each unprotected conversation in a tier, the lowest value under the policy.
//!
//! Cost: one eviction scans the conversations, `O(conversations + chunks)`.

use std::time::Instant;

use super::{BlockAllocator, BlockId, Candidate, ChunkLoc, EvictionPolicy, HostChunkId, HostPool};
use crate::conversation::{ConversationId, Conversations};

/// A planned device → host copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SwapOut {
    pub conv: ConversationId,
    pub chunk: usize,
    pub block: BlockId,
    pub host: HostChunkId,
    pub len: usize,
}

/// A planned host → device copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SwapIn {
    pub conv: ConversationId,
    pub chunk: usize,
    pub host: HostChunkId,
    pub block: BlockId,
    pub len: usize,
}

/// Counters the engine reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Bytes copied device → host.
    pub bytes_swapped_out: u64,
    /// Bytes copied host → device.
    pub bytes_swapped_in: u64,
    /// Chunks dropped from the device tier (no host room or no host tier).
    pub chunks_dropped_from_device: u64,
    /// Chunks dropped from the host tier.
    pub chunks_dropped_from_host: u64,
}

/// Which tier an eviction takes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Device,
    Host,
}

#[derive(Debug)]
pub(crate) struct CacheManager {
    pub blocks: BlockAllocator,
    pub host: HostPool,
    policy: Box<dyn EvictionPolicy>,
    /// Host bytes of one KV-token.
    token_bytes: usize,
    pub counters: CacheCounters,
}

impl CacheManager {
    pub fn new(
        blocks: BlockAllocator,
        host: HostPool,
        policy: Box<dyn EvictionPolicy>,
        token_bytes: usize,
    ) -> Self {
        Self {
            blocks,
            host,
            policy,
            token_bytes,
            counters: CacheCounters::default(),
        }
    }

    pub fn chunk_size(&self) -> usize {
        self.blocks.chunk_size()
    }

    /// Host bytes of `len` KV-tokens.
    pub fn bytes_of(&self, len: usize) -> usize {
        len * self.token_bytes
    }

    /// The lowest-value leading chunk in `tier` among conversations `protect` does not cover.
    fn victim(
        &self,
        convs: &Conversations,
        tier: Tier,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<(ConversationId, usize)> {
        let chunk = self.chunk_size();
        let mut best: Option<(f64, ConversationId, usize)> = None;
        for (&id, conv) in convs {
            if protect(id) {
                continue;
            }
            let computed = conv.computed_chunks(chunk).min(conv.chunks.len());
            let lead = conv.chunks[..computed].iter().position(|loc| match tier {
                Tier::Device => matches!(loc, ChunkLoc::Device(_)),
                Tier::Host => matches!(loc, ChunkLoc::Host(_)),
            });
            let Some(i) = lead else { continue };
            let idle_s = now
                .saturating_duration_since(conv.last_active)
                .as_secs_f64();
            let c = Candidate {
                start: i * chunk,
                len: conv.chunk_len(i, chunk),
                idle_s,
            };
            let value = self.policy.value(&c);
            if best.is_none_or(|(v, _, _)| value < v) {
                best = Some((value, id, i));
            }
        }
        best.map(|(_, id, i)| (id, i))
    }

    /// Evicts leading device chunks of unprotected conversations until `free + pending` device
    /// blocks reach `target_free`, swapping to the host tier when it has (or can make) room and
    /// dropping otherwise. Swap-outs free their blocks at commit; they are counted as pending.
    pub fn evict_device(
        &mut self,
        convs: &mut Conversations,
        protect: &dyn Fn(ConversationId) -> bool,
        target_free: usize,
        now: Instant,
        swaps: &mut Vec<SwapOut>,
    ) {
        while self.blocks.num_free() + swaps.len() < target_free {
            let Some((id, i)) = self.victim(convs, Tier::Device, protect, now) else {
                break;
            };
            if !self.evict_chunk(convs, id, i, protect, now, swaps) {
                break;
            }
        }
    }

    /// Evicts every device chunk of `id`, leading first (suspension of a running turn).
    pub fn evict_conversation(
        &mut self,
        convs: &mut Conversations,
        id: ConversationId,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
        swaps: &mut Vec<SwapOut>,
    ) {
        let n = convs.get(&id).map_or(0, |c| c.chunks.len());
        for i in 0..n {
            self.evict_chunk(convs, id, i, protect, now, swaps);
        }
    }

    /// Moves chunk `i` of `id` off the device: to the host tier if it has or can make room
    /// (dropping host chunks of conversations `protect` does not cover), else dropped.
    /// `false` if the chunk was not on the device.
    fn evict_chunk(
        &mut self,
        convs: &mut Conversations,
        id: ConversationId,
        i: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
        swaps: &mut Vec<SwapOut>,
    ) -> bool {
        let chunk = self.chunk_size();
        let Some(len) = convs.get(&id).and_then(|c| match c.chunks.get(i) {
            Some(ChunkLoc::Device(_)) => Some(c.chunk_len(i, chunk)),
            _ => None,
        }) else {
            return false;
        };
        let bytes = self.bytes_of(len);
        let host = match self.host.reserve(bytes) {
            Some(h) => Some(h),
            None if bytes <= self.host.budget_bytes() => {
                let spare = |c: ConversationId| c == id || protect(c);
                self.make_host_room(convs, bytes, &spare, now);
                self.host.reserve(bytes)
            }
            None => None,
        };
        let Some(conv) = convs.get_mut(&id) else {
            return false;
        };
        let ChunkLoc::Device(block) = conv.chunks[i] else {
            return false;
        };
        match host {
            Some(host) => {
                conv.chunks[i] = ChunkLoc::SwappingOut { block, host };
                swaps.push(SwapOut {
                    conv: id,
                    chunk: i,
                    block,
                    host,
                    len,
                });
            }
            None => {
                conv.chunks[i] = ChunkLoc::Dropped;
                self.blocks.release(block);
                self.counters.chunks_dropped_from_device += 1;
            }
        }
        true
    }

    /// Drops leading host chunks of unprotected conversations, lowest value first, until
    /// `bytes` fit in the host pool (or nothing more can be dropped).
    fn make_host_room(
        &mut self,
        convs: &mut Conversations,
        bytes: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) {
        while self.host.free_bytes() < bytes {
            let Some((id, i)) = self.victim(convs, Tier::Host, protect, now) else {
                return;
            };
            let Some(conv) = convs.get_mut(&id) else {
                return;
            };
            if let ChunkLoc::Host(h) = conv.chunks[i] {
                self.host.release(h);
                conv.chunks[i] = ChunkLoc::Dropped;
                self.counters.chunks_dropped_from_host += 1;
            }
        }
    }

    /// Device blocks needed to bring `id` fully back: one per host or dropped chunk.
    pub fn blocks_to_restore(convs: &Conversations, id: ConversationId) -> usize {
        convs.get(&id).map_or(0, |c| {
            c.chunks
                .iter()
                .filter(|l| matches!(l, ChunkLoc::Host(_) | ChunkLoc::Dropped))
                .count()
        })
    }

    /// Plans the restore of conversation `id`: host chunks swapped in, dropped chunks given a
    /// block to be recomputed into. Returns the recompute runs `[start, end)` in position
    /// order, or `None` (and plans nothing) when the device lacks free blocks.
    pub fn restore(
        &mut self,
        convs: &mut Conversations,
        id: ConversationId,
        swaps: &mut Vec<SwapIn>,
    ) -> Option<Vec<std::ops::Range<usize>>> {
        if Self::blocks_to_restore(convs, id) > self.blocks.num_free() {
            return None;
        }
        let chunk = self.chunk_size();
        let conv = convs.get_mut(&id)?;
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..conv.chunks.len() {
            let len = conv.chunk_len(i, chunk);
            match conv.chunks[i] {
                ChunkLoc::Host(host) => {
                    let block = self.blocks.allocate()?;
                    conv.chunks[i] = ChunkLoc::SwappingIn { host, block };
                    swaps.push(SwapIn {
                        conv: id,
                        chunk: i,
                        host,
                        block,
                        len,
                    });
                }
                ChunkLoc::Dropped => {
                    let block = self.blocks.allocate()?;
                    conv.chunks[i] = ChunkLoc::Recomputing(block);
                    let (s, e) = (i * chunk, i * chunk + len);
                    match runs.last_mut() {
                        Some(r) if r.end == s => r.end = e,
                        _ => runs.push(s..e),
                    }
                }
                _ => {}
            }
        }
        Some(runs)
    }

    /// Marks a swap-out done: the block returns to the free list, the chunk is on the host.
    pub fn complete_swap_out(&mut self, convs: &mut Conversations, s: &SwapOut) {
        self.blocks.release(s.block);
        self.counters.bytes_swapped_out += self.bytes_of(s.len) as u64;
        if let Some(conv) = convs.get_mut(&s.conv) {
            conv.chunks[s.chunk] = ChunkLoc::Host(s.host);
        }
    }

    /// Marks a swap-in done: the chunk is on the device.
    pub fn complete_swap_in(&mut self, convs: &mut Conversations, s: &SwapIn) {
        self.counters.bytes_swapped_in += self.bytes_of(s.len) as u64;
        if let Some(conv) = convs.get_mut(&s.conv) {
            conv.chunks[s.chunk] = ChunkLoc::Device(s.block);
        }
    }

    /// A swap whose copy failed: the chunk is dropped (its raw tokens rebuild it).
    pub fn abort_swap(&mut self, convs: &mut Conversations, conv: ConversationId, chunk: usize) {
        let Some(c) = convs.get_mut(&conv) else {
            return;
        };
        match c.chunks[chunk] {
            ChunkLoc::SwappingOut { block, host } | ChunkLoc::SwappingIn { host, block } => {
                self.blocks.release(block);
                self.host.release(host);
                c.chunks[chunk] = ChunkLoc::Dropped;
            }
            _ => {}
        }
    }

    /// Gives a block to chunk `i` of `id` for tokens about to be computed; `None` if the
    /// device is full.
    pub fn grow(&mut self, convs: &mut Conversations, id: ConversationId) -> Option<BlockId> {
        let block = self.blocks.allocate()?;
        match convs.get_mut(&id) {
            Some(conv) => {
                conv.chunks.push(ChunkLoc::Device(block));
                Some(block)
            }
            None => {
                self.blocks.release(block);
                None
            }
        }
    }

    /// After a turn ends: recomputations that did not finish go back to `Dropped`, and blocks
    /// reserved past the computed tokens are released.
    pub fn settle(
        &mut self,
        convs: &mut Conversations,
        id: ConversationId,
        recomputed_upto: usize,
    ) {
        let chunk = self.chunk_size();
        let Some(conv) = convs.get_mut(&id) else {
            return;
        };
        for i in 0..conv.chunks.len() {
            if let ChunkLoc::Recomputing(block) = conv.chunks[i] {
                let end = i * chunk + conv.chunk_len(i, chunk);
                conv.chunks[i] = if end <= recomputed_upto {
                    ChunkLoc::Device(block)
                } else {
                    self.blocks.release(block);
                    ChunkLoc::Dropped
                };
            }
        }
        let keep = conv.computed_chunks(chunk);
        for loc in conv.chunks.drain(keep.min(conv.chunks.len())..) {
            if let ChunkLoc::Device(b) = loc {
                self.blocks.release(b);
            }
        }
    }

    /// Releases every block and host chunk of `id` (stateless mode after a turn, or close).
    /// With `forget`, the chunk table is cleared; otherwise every chunk becomes `Dropped`.
    pub fn release_all(&mut self, convs: &mut Conversations, id: ConversationId, forget: bool) {
        let Some(conv) = convs.get_mut(&id) else {
            return;
        };
        for loc in conv.chunks.iter_mut() {
            match *loc {
                ChunkLoc::Device(b) | ChunkLoc::Recomputing(b) => {
                    self.blocks.release(b);
                }
                ChunkLoc::Host(h) => self.host.release(h),
                ChunkLoc::SwappingOut { block, host } | ChunkLoc::SwappingIn { host, block } => {
                    self.blocks.release(block);
                    self.host.release(host);
                }
                ChunkLoc::Dropped => {}
            }
            *loc = ChunkLoc::Dropped;
        }
        if forget {
            conv.chunks.clear();
        }
    }

    /// Checks the invariants against the conversation table: every allocated block and host
    /// chunk belongs to exactly one chunk, budgets hold. Returns a description of the first
    /// violation.
    pub fn check(&self, convs: &Conversations) -> Result<(), String> {
        let mut blocks = vec![0u32; self.blocks.num_blocks()];
        let mut host_chunks = 0usize;
        for (id, conv) in convs {
            if conv.chunks.len() * self.chunk_size() < conv.kv_len {
                return Err(format!(
                    "{id}: chunk table shorter than its {} tokens",
                    conv.kv_len
                ));
            }
            for loc in &conv.chunks {
                let (b, h) = match *loc {
                    ChunkLoc::Device(b) | ChunkLoc::Recomputing(b) => (Some(b), false),
                    ChunkLoc::Host(_) => (None, true),
                    ChunkLoc::SwappingOut { block, .. } | ChunkLoc::SwappingIn { block, .. } => {
                        (Some(block), true)
                    }
                    ChunkLoc::Dropped => (None, false),
                };
                if let Some(b) = b {
                    if !self.blocks.is_allocated(b) {
                        return Err(format!("{id}: {b} used but free"));
                    }
                    blocks[b.0 as usize] += 1;
                }
                host_chunks += usize::from(h);
            }
        }
        if let Some(b) = blocks.iter().position(|&n| n > 1) {
            return Err(format!("block {b} owned by {} chunks", blocks[b]));
        }
        let owned = blocks.iter().filter(|&&n| n == 1).count();
        if owned + self.blocks.num_free() != self.blocks.num_blocks() {
            return Err(format!(
                "slot leak: {owned} owned + {} free != {} blocks",
                self.blocks.num_free(),
                self.blocks.num_blocks()
            ));
        }
        if host_chunks != self.host.len() {
            return Err(format!(
                "host holds {} chunks, tables name {host_chunks}",
                self.host.len()
            ));
        }
        if self.host.used_bytes() > self.host.budget_bytes() {
            return Err("host budget exceeded".into());
        }
        Ok(())
    }
}

//! KV bookkeeping (Pensieve §4.3, AttentionStore §3.2–3.4): the block allocator over the
//! device pool, the host tier, the eviction policies and the cache manager that owns every
//! conversation's chunk table and plans moves between tiers.
//!
//! Nothing here touches tensors or knows the model: this layer moves ids, and
//! the KV pool (`attention::KvPool`) moves the bytes the executor asks it to. So the bookkeeping
//! unit-tests without a model (and `tests/layering.rs` keeps it that way).

mod allocator;
mod cache;
mod host;
mod policy;
mod store;

pub(crate) use allocator::{BlockAllocator, BlockId};
pub(crate) use cache::{CacheManager, Eviction, Held, Moves, Narrowing, StoreTier};
#[cfg(feature = "cuda")]
pub(crate) use host::HostBuffer;
pub(crate) use host::{Arrived, HostChunkId, HostPool, LayerCells};
pub use host::{ChunkBytes, ChunkUnavailable};
pub use policy::CostModel;
pub(crate) use policy::{EvictionPolicy, LruPolicy, ValuePolicy};
pub(crate) use store::format::hex;
pub(crate) use store::is_tombstone;
pub use store::{Address, Fault, FaultCounts, RedisConfig, RedisFailure, StoreError, StoreStats};
pub(crate) use store::{
    BuildManifest, ChunkFormat, ManifestStore, Owner, Refused, Saved, Store, StoreReader, Waker,
};

use crate::ids::ConversationId;

/// Where one chunk of a conversation's KV lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ChunkLoc {
    /// In the device pool, readable by attention.
    Device(BlockId),
    /// Being copied device → host this step (both copies booked until the step commits).
    SwappingOut {
        /// Source block.
        block: BlockId,
        /// Destination.
        host: HostChunkId,
    },
    /// In host memory.
    Host(HostChunkId),
    /// Being copied host → device this step.
    SwappingIn {
        /// Source.
        host: HostChunkId,
        /// Destination block.
        block: BlockId,
    },
    /// Only in the store (the chunk table names its file).
    Stored,
    /// Being read from disk into `block` this step.
    Loading(BlockId),
    /// Dropped from every tier; rebuilt from the raw tokens when needed.
    Dropped,
    /// Dropped and being recomputed into `block` by the running turn.
    Recomputing(BlockId),
}

impl ChunkLoc {
    /// The device block attention may read this step, if any.
    pub(crate) fn readable_block(self) -> Option<BlockId> {
        match self {
            ChunkLoc::Device(b)
            | ChunkLoc::Recomputing(b)
            | ChunkLoc::SwappingIn { block: b, .. }
            | ChunkLoc::Loading(b) => Some(b),
            ChunkLoc::SwappingOut { .. }
            | ChunkLoc::Host(_)
            | ChunkLoc::Stored
            | ChunkLoc::Dropped => None,
        }
    }

    /// The device block this chunk holds a reference to, if any (readable or not).
    pub(crate) fn named_block(self) -> Option<BlockId> {
        match self {
            ChunkLoc::SwappingOut { block, .. } => Some(block),
            other => other.readable_block(),
        }
    }
}

/// A broken cache invariant: a bookkeeping bug, never a caller's mistake.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A conversation's chunk table covers fewer tokens than it has computed.
    #[error("{conversation}: chunk table of {chunks} chunks is shorter than its {computed} computed tokens")]
    ShortChunkTable {
        /// The conversation.
        conversation: ConversationId,
        /// Chunks in its table.
        chunks: usize,
        /// Tokens it has computed.
        computed: usize,
    },
    /// A chunk names a block the allocator holds as free.
    #[error("{conversation}: chunk {chunk} uses free block {block}")]
    FreeBlockInUse {
        /// The conversation.
        conversation: ConversationId,
        /// Its chunk index.
        chunk: usize,
        /// The block.
        block: u32,
    },
    /// A block named by a different number of chunk records than it has references (one:
    /// a shared chunk is one record).
    #[error("block {block} is named by {owners} chunks but has {refs} references")]
    SharedBlock {
        /// The block.
        block: u32,
        /// How many chunks name it.
        owners: usize,
        /// References the allocator counts.
        refs: usize,
    },
    /// Allocated blocks that no chunk names.
    #[error("slot leak: {owned} owned + {free} free blocks != {total}")]
    LeakedBlocks {
        /// Blocks named by chunks.
        owned: usize,
        /// Blocks on the free list.
        free: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// The host pool's references differ from the chunks the tables place on the host.
    #[error("host pool holds {held} references but the chunk tables name {named}")]
    HostMismatch {
        /// References to chunks the host pool holds or has booked.
        held: usize,
        /// Chunks the tables place on the host.
        named: usize,
    },
    /// The store's references differ from the chunks the tables say are saved.
    #[error("the store holds {held} references but the chunk tables name {named} saved chunks")]
    StoreMismatch {
        /// References the store counts.
        held: usize,
        /// Saved chunks in the tables.
        named: usize,
    },
    /// A chunk record not held as its table says: the table's conversation is not among its
    /// holders, a holder names it at another index, or a shared record left memory.
    #[error("{conversation}: chunk {chunk} names a record held otherwise")]
    StrayRecord {
        /// The conversation.
        conversation: ConversationId,
        /// Its chunk index.
        chunk: usize,
    },
    /// A chunk is placed only on disk but names no file.
    #[error("{conversation}: chunk {chunk} is on store without a file")]
    StoredWithoutAddress {
        /// The conversation.
        conversation: ConversationId,
        /// Its chunk index.
        chunk: usize,
    },
    /// A tier holds more than its budget.
    #[error("{tier} tier uses {used} bytes of a {budget}-byte budget")]
    OverBudget {
        /// "host" or "store".
        tier: &'static str,
        /// Bytes in use.
        used: usize,
        /// The budget.
        budget: usize,
    },
    /// A row of a step needs a position whose KV is not readable on the device.
    #[error("{conversation}: position {position} has no device slot")]
    MissingSlot {
        /// The conversation.
        conversation: ConversationId,
        /// The position.
        position: usize,
    },
    /// A turn is in the turn table but in neither queue, or in a queue but not in the table.
    #[error("{0} is not consistently queued")]
    LostRequest(crate::ids::RequestId),
}

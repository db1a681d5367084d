//! KV storage and bookkeeping (Pensieve §4.3, AttentionStore §3.2–3.4): the device pool of
//! slots that attention reads, the block allocator over it, the host tier, the eviction
//! policies and the cache manager that plans moves between tiers.
//!
//! Only [`KvPool`] touches tensors; everything else moves ids, so the bookkeeping unit-tests
//! without a model.

mod allocator;
pub(crate) mod cache;
mod host;
mod policy;
mod pool;

pub use allocator::{BlockAllocator, BlockId};
pub use host::{HostChunkId, HostPool};
pub use policy::{Candidate, CostModel, EvictionPolicy, LruPolicy, ValuePolicy};
pub use pool::KvPool;

/// Where one chunk of a conversation's KV lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkLoc {
    /// In the device pool, readable by attention.
    Device(BlockId),
    /// Being copied device → host this step (both copies pinned until the step commits).
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
    /// Dropped from every tier; rebuilt from the raw tokens when needed.
    Dropped,
    /// Dropped and being recomputed into `block` by the running turn.
    Recomputing(BlockId),
}

//! Slot allocation over the fixed device pool, in blocks of `chunk_size` consecutive slots
//! (Pensieve §4.3: the chunk is the unit of allocation, eviction and swap).
//!
//! A block belongs to one chunk record of the cache manager; a chunk several conversations
//! share is one record with several holders, so the block is held once.
//!
//! Invariants: every block is either free (in the free list exactly once, no reference) or
//! allocated (one reference); the number of free blocks plus allocated blocks equals the
//! pool's block count. `allocate` and `release` are O(1).

use std::fmt;

/// Index of a block of `chunk_size` slots in the device pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

/// Free-list allocator of device blocks.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    chunk_size: usize,
    free: Vec<BlockId>,
    /// References per block; 0 when free.
    refs: Vec<u32>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `chunk_size` slots, all free.
    pub fn new(num_blocks: usize, chunk_size: usize) -> Self {
        // Handing out low ids first keeps small workloads in the front of the pool.
        let free = (0..num_blocks as u32).rev().map(BlockId).collect();
        Self {
            chunk_size,
            free,
            refs: vec![0; num_blocks],
        }
    }

    /// Slots per block.
    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks currently free.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes a free block (one reference), or `None` when the pool is exhausted.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop()?;
        self.refs[b.0 as usize] = 1;
        Some(b)
    }

    /// Drops one reference to `block`, returning it to the free list with the last. Releasing
    /// a free or unknown block is a bookkeeping bug; it is ignored (and reported as `false`)
    /// rather than corrupting the free list.
    pub fn release(&mut self, block: BlockId) -> bool {
        match self.refs.get_mut(block.0 as usize) {
            Some(r) if *r > 0 => {
                *r -= 1;
                if *r == 0 {
                    self.free.push(block);
                }
                true
            }
            _ => false,
        }
    }

    /// References to `block` (0 when free).
    pub fn refs(&self, block: BlockId) -> usize {
        self.refs.get(block.0 as usize).map_or(0, |&r| r as usize)
    }

    /// The slot of offset `i` inside `block`.
    pub fn slot(&self, block: BlockId, i: usize) -> u32 {
        (block.0 as usize * self.chunk_size + i) as u32
    }

    /// Whether `block` is allocated.
    pub fn is_allocated(&self, block: BlockId) -> bool {
        self.refs(block) > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn never_double_allocates(ops in prop::collection::vec(any::<(bool, u8)>(), 0..200)) {
            let mut a = BlockAllocator::new(16, 32);
            let mut held: Vec<BlockId> = Vec::new();
            for (alloc, pick) in ops {
                if alloc {
                    if let Some(b) = a.allocate() {
                        prop_assert!(!held.contains(&b));
                        held.push(b);
                    } else {
                        prop_assert_eq!(held.len(), 16);
                    }
                } else if !held.is_empty() {
                    let b = held.swap_remove(pick as usize % held.len());
                    prop_assert!(a.release(b));
                    prop_assert!(!a.release(b));
                }
                prop_assert_eq!(a.num_free() + held.len(), 16);
            }
        }
    }

    #[test]
    fn slots_of_a_block_are_consecutive() {
        let mut a = BlockAllocator::new(4, 32);
        let b = a.allocate().unwrap();
        assert_eq!(a.slot(b, 5), b.0 * 32 + 5);
    }
}

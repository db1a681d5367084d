//! [`CacheManager::check`]: the invariants of the cache manager's module header, checked after
//! every step when the engine asks for it.

use super::{CacheManager, ChunkTable};
use crate::ids::ConversationId;
use crate::kv::{BlockId, ChunkLoc, Violation};

/// What the tables name, counted while their chunks are checked.
struct Named {
    /// Records naming each block.
    owners: Vec<usize>,
    /// Records on the host (or being copied to or from it).
    host: usize,
    /// Saved chunks (each table's own file reference).
    store: usize,
}

impl CacheManager {
    /// Checks the invariants of the module header.
    ///
    /// # Errors
    /// The first [`Violation`] found.
    pub fn check(&self) -> Result<(), Violation> {
        let mut named = Named {
            owners: vec![0; self.blocks.num_blocks()],
            host: 0,
            store: 0,
        };
        for (&conversation, table) in &self.tables {
            self.check_table(conversation, table, &mut named)?;
        }
        self.check_blocks(&named.owners)?;
        self.check_tiers(&named)
    }

    /// One table: long enough, its chunks' records held as it says, their blocks allocated.
    fn check_table(
        &self,
        conversation: ConversationId,
        table: &ChunkTable,
        named: &mut Named,
    ) -> Result<(), Violation> {
        if table.len() * self.chunk_size() < table.computed() {
            return Err(Violation::ShortChunkTable {
                conversation,
                chunks: table.len(),
                computed: table.computed(),
            });
        }
        named.store += table.files().iter().flatten().count();
        for (chunk, &rec) in table.records().iter().enumerate() {
            let loc = self.arena.loc(rec);
            if loc == ChunkLoc::Stored && table.file(chunk).is_none() {
                return Err(Violation::StoredWithoutAddress {
                    conversation,
                    chunk,
                });
            }
            let holders = self.arena.holders(rec);
            if !holders.contains(&conversation) || self.sharing_moved(rec, chunk) {
                return Err(Violation::StrayRecord {
                    conversation,
                    chunk,
                });
            }
            // A shared record counts once, at its first holder.
            if holders.first() != Some(&conversation) {
                continue;
            }
            let on_host = matches!(
                loc,
                ChunkLoc::Host(_) | ChunkLoc::SwappingOut { .. } | ChunkLoc::SwappingIn { .. }
            );
            named.host += usize::from(on_host);
            if let Some(b) = loc.named_block() {
                if !self.blocks.is_allocated(b) {
                    return Err(Violation::FreeBlockInUse {
                        conversation,
                        chunk,
                        block: b.0,
                    });
                }
                named.owners[b.0 as usize] += 1;
            }
        }
        Ok(())
    }

    /// Every block named by as many records as it has references, and none leaked.
    fn check_blocks(&self, owners: &[usize]) -> Result<(), Violation> {
        if let Some(b) =
            (0..owners.len()).find(|&b| owners[b] != self.blocks.refs(BlockId(b as u32)))
        {
            return Err(Violation::SharedBlock {
                block: b as u32,
                owners: owners[b],
                refs: self.blocks.refs(BlockId(b as u32)),
            });
        }
        let owned = owners.iter().filter(|&&n| n > 0).count();
        if owned + self.blocks.num_free() != self.blocks.num_blocks() {
            return Err(Violation::LeakedBlocks {
                owned,
                free: self.blocks.num_free(),
                total: self.blocks.num_blocks(),
            });
        }
        Ok(())
    }

    /// The host pool and the store hold what the tables name, within their budgets.
    fn check_tiers(&self, named: &Named) -> Result<(), Violation> {
        if named.host != self.host.references() {
            return Err(Violation::HostMismatch {
                held: self.host.references(),
                named: named.host,
            });
        }
        if self.host.used_bytes() > self.host.budget_bytes() {
            return Err(Violation::OverBudget {
                tier: "host",
                used: self.host.used_bytes(),
                budget: self.host.budget_bytes(),
            });
        }
        if let Some(store) = self.store.as_ref().map(|d| &d.store) {
            if store.references() != named.store {
                return Err(Violation::StoreMismatch {
                    held: store.references(),
                    named: named.store,
                });
            }
            if store.used_bytes() > store.budget_bytes() {
                return Err(Violation::OverBudget {
                    tier: "store",
                    used: store.used_bytes(),
                    budget: store.budget_bytes(),
                });
            }
        }
        Ok(())
    }

    /// Whether a shared record left memory, or a holder names it at another index than `i`.
    fn sharing_moved(&self, rec: super::ChunkId, i: usize) -> bool {
        let holders = self.arena.holders(rec);
        let in_memory = !matches!(self.arena.loc(rec), ChunkLoc::Stored | ChunkLoc::Dropped);
        (holders.len() > 1 && !in_memory)
            || holders
                .iter()
                .any(|h| self.tables.get(h).and_then(|t| t.record(i)) != Some(rec))
    }
}

//! The host tier: chunks of KV held in RAM under a byte budget (Pensieve §4.3's CPU cache).
//!
//! Bookkeeping is two-phase: `reserve` books the bytes (at plan time, so the budget is never
//! exceeded by what is in flight) and `store` fills them in when the executor has copied the
//! data; `get` hands the data out (a swap-in, a save); `release` frees it. A chunk several
//! conversations share (prefix sharing) is one record of the cache manager's, held once.
//! Invariant: `used_bytes <= budget_bytes`, and `used_bytes` is the sum of the reserved sizes.

use std::sync::{Arc, OnceLock};

use super::Fault;

/// Why a chunk's bytes are not there.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkUnavailable {
    /// The copy off the device failed.
    #[error("the copy off the device failed: {0}")]
    Copy(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The store refused the chunk's file (`at`: its path or key).
    #[error("{at}: {fault}")]
    Refused {
        at: String,
        #[source]
        fault: Fault,
    },
    /// A layer the chunk does not have was asked for.
    #[error("no layer {layer} in a chunk of {layers}")]
    NoLayer { layer: usize, layers: usize },
}

/// A chunk's bytes, or why they are not there.
pub(crate) type Arrived = Result<Vec<u8>, ChunkUnavailable>;

/// Memory for a chunk's bytes that a device copies into asynchronously (pinned host memory
/// on a GPU), owned by the device layer; this layer only holds and hands it back.
#[cfg(feature = "cuda")]
pub(crate) trait HostBuffer: Send + Sync + std::fmt::Debug {
    /// The chunk's bytes, once every copy into them has finished (waits for it).
    ///
    /// # Errors
    /// [`ChunkUnavailable::Copy`] with the device's error.
    fn bytes(&self) -> Result<&[u8], ChunkUnavailable>;

    /// Number of bytes.
    fn len(&self) -> usize;
}

/// A chunk's KV as little-endian bytes in host memory: the unit every tier below the device
/// stores. On a GPU the bytes sit in pinned memory that a copy may still be filling; reading
/// them waits for it.
#[derive(Debug)]
pub struct ChunkBytes(Repr);

#[derive(Debug)]
enum Repr {
    /// Ordinary memory, filled synchronously.
    Heap(Vec<u8>),
    /// Being read from the store by its reader thread: `len` bytes once checked, or why
    /// the file was refused.
    Reading {
        len: usize,
        cell: Arc<OnceLock<Arrived>>,
    },
    /// Being read from the store layer by layer: each layer's bytes once checked (or why
    /// the file was refused), and the whole, joined when first asked for.
    Layers {
        len: usize,
        layers: Arc<LayerCells>,
        whole: OnceLock<Arrived>,
    },
    /// Device-registered memory a copy may still be filling.
    #[cfg(feature = "cuda")]
    Device(Box<dyn HostBuffer>),
}

/// One cell per layer that a reader thread fills with the layer's checked bytes, or why the
/// file was refused.
pub(crate) type LayerCells = Vec<OnceLock<Arrived>>;

impl ChunkBytes {
    /// Bytes in device-registered memory.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(buffer: Box<dyn HostBuffer>) -> Self {
        ChunkBytes(Repr::Device(buffer))
    }

    /// Bytes a reader thread will put in `cell` (`len` of them, if the read succeeds).
    pub(crate) fn reading(len: usize, cell: Arc<OnceLock<Arrived>>) -> Self {
        ChunkBytes(Repr::Reading { len, cell })
    }

    /// Bytes a reader thread will put in `layers`, layer by layer (`len` in all).
    pub(crate) fn layered(len: usize, layers: Arc<LayerCells>) -> Self {
        ChunkBytes(Repr::Layers {
            len,
            layers,
            whole: OnceLock::new(),
        })
    }

    /// Whether the bytes arrive layer by layer ([`Self::layer`] waits for one layer only).
    pub fn is_layered(&self) -> bool {
        matches!(self.0, Repr::Layers { .. })
    }

    /// Layer `i` of `n_layers`, waiting for that layer only when the bytes arrive layer by
    /// layer.
    ///
    /// # Errors
    /// As [`Self::bytes`]; a layer the chunk does not have.
    pub fn layer(&self, i: usize, n_layers: usize) -> Result<&[u8], ChunkUnavailable> {
        if let Repr::Layers { layers, .. } = &self.0 {
            return match layers.get(i) {
                Some(cell) => cell.wait().as_deref().map_err(Clone::clone),
                None => Err(ChunkUnavailable::NoLayer {
                    layer: i,
                    layers: layers.len(),
                }),
            };
        }
        let per = self.len() / n_layers.max(1);
        (self.bytes()?.get(i * per..(i + 1) * per)).ok_or(ChunkUnavailable::NoLayer {
            layer: i,
            layers: n_layers,
        })
    }

    /// The bytes, waiting for a copy or read still in flight.
    ///
    /// # Errors
    /// [`ChunkUnavailable`]: a device copy that failed, or a file the store refused.
    pub fn bytes(&self) -> Result<&[u8], ChunkUnavailable> {
        match &self.0 {
            Repr::Heap(v) => Ok(v),
            Repr::Reading { cell, .. } => cell.wait().as_deref().map_err(Clone::clone),
            Repr::Layers { len, layers, whole } => whole
                .get_or_init(|| {
                    let mut out = Vec::with_capacity(*len);
                    for cell in layers.iter() {
                        out.extend_from_slice(cell.wait().as_deref().map_err(Clone::clone)?);
                    }
                    Ok(out)
                })
                .as_deref()
                .map_err(Clone::clone),
            #[cfg(feature = "cuda")]
            Repr::Device(b) => b.bytes(),
        }
    }

    /// Number of bytes (known before a copy finishes).
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Heap(v) => v.len(),
            Repr::Reading { len, .. } | Repr::Layers { len, .. } => *len,
            #[cfg(feature = "cuda")]
            Repr::Device(b) => b.len(),
        }
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<u8>> for ChunkBytes {
    fn from(v: Vec<u8>) -> Self {
        ChunkBytes(Repr::Heap(v))
    }
}

/// Index of a chunk held by the host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostChunkId(pub u32);

#[derive(Debug)]
struct Entry {
    bytes: usize,
    data: Option<Arc<ChunkBytes>>,
    refs: u32,
}

/// KV chunks in host memory.
#[derive(Debug, Default)]
pub struct HostPool {
    budget_bytes: usize,
    used_bytes: usize,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<u32>,
}

impl HostPool {
    /// An empty pool that may hold up to `budget_bytes`.
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            ..Self::default()
        }
    }

    /// The byte budget.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Bytes booked by held and in-flight chunks.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Bytes still free.
    pub fn free_bytes(&self) -> usize {
        self.budget_bytes - self.used_bytes
    }

    /// Books `bytes` for a chunk about to be swapped out; `None` if they do not fit.
    pub fn reserve(&mut self, bytes: usize) -> Option<HostChunkId> {
        if bytes > self.free_bytes() {
            return None;
        }
        self.used_bytes += bytes;
        let entry = Some(Entry {
            bytes,
            data: None,
            refs: 1,
        });
        let id = match self.free_ids.pop() {
            Some(i) => {
                self.entries[i as usize] = entry;
                i
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        Some(HostChunkId(id))
    }

    /// Fills a reserved chunk with its data. Returns `false` for an unknown id.
    pub fn store(&mut self, id: HostChunkId, data: Arc<ChunkBytes>) -> bool {
        match self.entries.get_mut(id.0 as usize) {
            Some(Some(e)) => {
                e.data = Some(data);
                true
            }
            _ => false,
        }
    }

    /// A held chunk's data, shared (a save to the store reads it).
    pub fn get(&self, id: HostChunkId) -> Option<Arc<ChunkBytes>> {
        self.entries.get(id.0 as usize)?.as_ref()?.data.clone()
    }

    /// Drops one reference to a chunk (eviction to the next tier or to nothing, a swap-in
    /// done), freeing its bytes with the last.
    pub fn release(&mut self, id: HostChunkId) {
        let Some(slot) = self.entries.get_mut(id.0 as usize) else {
            return;
        };
        let Some(e) = slot else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            self.used_bytes -= e.bytes;
            *slot = None;
            self.free_ids.push(id.0);
        }
    }

    /// References to every chunk held or in flight.
    pub fn references(&self) -> usize {
        self.entries.iter().flatten().map(|e| e.refs as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_a_hard_cap() {
        let mut h = HostPool::new(100);
        let a = h.reserve(60).unwrap();
        assert!(h.reserve(60).is_none());
        assert!(h.store(a, Arc::new(vec![1; 15].into())));
        let b = h.reserve(40).unwrap();
        assert_eq!(h.used_bytes(), 100);
        assert_eq!(h.get(a).unwrap().bytes().unwrap(), &[1; 15]);
        h.release(a);
        h.release(b);
        assert_eq!((h.used_bytes(), h.references()), (0, 0));
        assert!(h.get(a).is_none());
    }
}

//! The device KV pool: per layer, a K and a V tensor of `[n_slots, n_kv_heads, head_dim]`.
//!
//! Slot `s` addresses the same token in every layer. Writes go in place (candle's
//! `scatter_set`, which every backend implements), so a step costs `O(new tokens)` copies, not
//! `O(pool)`. Which slot belongs to whom is decided elsewhere; this type only stores bytes.

use candle_core::{DType, Device, Tensor};

use crate::model::LlamaConfig;
use crate::{Error, Result};

/// Per-layer K and V tensors of a fixed number of slots.
#[derive(Debug)]
pub struct KvPool {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    n_slots: usize,
    row: usize,
}

impl KvPool {
    /// A zeroed pool of `n_slots` slots for `config`'s shape, in `dtype` on `device`.
    ///
    /// # Errors
    /// [`Error::Candle`] when the device cannot allocate it.
    pub fn new(
        config: &LlamaConfig,
        n_slots: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let shape = (n_slots, config.num_kv_heads, config.head_dim);
        let mut k = Vec::with_capacity(config.num_layers);
        let mut v = Vec::with_capacity(config.num_layers);
        for _ in 0..config.num_layers {
            k.push(Tensor::zeros(shape, dtype, device)?);
            v.push(Tensor::zeros(shape, dtype, device)?);
        }
        Ok(Self {
            k,
            v,
            n_slots,
            row: config.num_kv_heads * config.head_dim,
        })
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.n_slots
    }

    /// Layer `layer`'s `(k_pool, v_pool)`.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] for a layer the pool does not have.
    pub fn layer(&self, layer: usize) -> Result<(&Tensor, &Tensor)> {
        match (self.k.get(layer), self.v.get(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(Error::InvalidBatch(format!(
                "layer {layer} not in a pool of {}",
                self.k.len()
            ))),
        }
    }

    /// Index tensor for [`Self::write`]: each of `slots` repeated over a KV row, so one
    /// `scatter_set` per layer writes all new tokens. Build once per step, use for every layer.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if a slot is outside the pool.
    pub fn write_index(&self, slots: &[u32], device: &Device) -> Result<Tensor> {
        if let Some(s) = slots.iter().find(|&&s| s as usize >= self.n_slots) {
            return Err(Error::InvalidBatch(format!(
                "slot {s} outside a pool of {}",
                self.n_slots
            )));
        }
        let idx = Tensor::from_slice(slots, (slots.len(), 1), device)?;
        Ok(idx.broadcast_as((slots.len(), self.row))?.contiguous()?)
    }

    /// Writes new tokens' `k`, `v` (`[tokens, n_kv_heads, head_dim]`) into their slots of
    /// `layer`, using an index from [`Self::write_index`].
    ///
    /// # Errors
    /// [`Error::Candle`] on shape or device mismatch.
    pub fn write(&self, layer: usize, index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kp, vp) = self.layer(layer)?;
        let tokens = index.dim(0)?;
        let flat = |pool: &Tensor| pool.reshape((self.n_slots, self.row));
        let k = k.to_dtype(kp.dtype())?.reshape((tokens, self.row))?;
        let v = v.to_dtype(vp.dtype())?.reshape((tokens, self.row))?;
        flat(kp)?.scatter_set(index, &k, 0)?;
        flat(vp)?.scatter_set(index, &v, 0)?;
        Ok(())
    }
}

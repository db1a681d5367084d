//! The device KV pool that attention reads: per layer, a K and a V tensor of
//! `[n_slots, n_kv_heads, head_dim]` values (f32, f16, bf16) or, at 8 and 4 bits, a `U8`
//! tensor of `[n_slots, n_kv_heads, row bytes]` blocks of codes (quantized as tokens are
//! written, see `attention/codes.rs`), and the copies of whole chunks to and from host memory.
//!
//! Slot `s` addresses the same token in every layer. Writes go in place (candle's
//! `scatter_set`, which every backend implements), so a step costs `O(new tokens)` copies, not
//! `O(pool)`. Which slot belongs to whom is decided by the cache manager (`crate::kv`), which
//! moves ids only; this type is the one that moves KV bytes.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(test)]
mod ordering_tests;
mod shift;

pub use shift::KeyRotation;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use parking_lot::Mutex;

use super::codes::{turn_heads, turned, Codes, QK};
use super::KvPrecision;
use crate::kv::ChunkBytes;
use crate::{Error, Result};

/// The shape of one KV-token: what the pool needs to know about a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Decoder layers.
    pub num_layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
}

impl KvShape {
    /// Bytes of one KV-token (K and V of every layer) at precision `kv`.
    pub fn token_bytes(&self, kv: KvPrecision) -> usize {
        2 * self.num_layers * self.num_kv_heads * kv.head_row_bytes(self.head_dim)
    }
}

/// Chunk copies that run beside the compute (a GPU's copy stream), so that the pool must wait
/// for a layer's copies before it touches that layer.
pub(crate) trait Copier: Send + Sync + std::fmt::Debug {
    /// Starts one step's copies (as [`KvPool::copy_chunks`] describes them); `row_bytes` is one
    /// slot's row in one layer's K or V.
    fn copy(
        &self,
        k: &[Tensor],
        v: &[Tensor],
        row_bytes: usize,
        outs: &[(usize, usize)],
        ins: Vec<(usize, Arc<ChunkBytes>)>,
        pipelined: bool,
    ) -> Result<Vec<ChunkBytes>>;

    /// Orders everything that follows on `layer` (whose tensors are `k` and `v`) after this
    /// step's copies of it.
    fn await_layer(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()>;
}

/// Where one chunk's copy goes or comes from: its first slot and tokens, and whether its
/// bytes are narrow (only the layers that attend to the whole history).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// First slot.
    pub start: usize,
    /// Tokens.
    pub len: usize,
    /// Whether the bytes hold only the narrow layers.
    pub narrow: bool,
}

impl Span {
    /// A whole chunk's span: every layer's KV.
    #[cfg(any(test, feature = "internals"))]
    pub fn whole(start: usize, len: usize) -> Self {
        Self {
            start,
            len,
            narrow: false,
        }
    }
}

/// Per-layer K and V tensors of a fixed number of slots.
#[derive(Debug)]
pub struct KvPool {
    /// On a GPU: the copy stream that moves chunks while the compute stream runs. Declared
    /// first so that it drops first: its drop waits for the copy stream, whose transfers may
    /// still use the K/V memory freed when `k` and `v` drop.
    copier: Option<Box<dyn Copier>>,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    n_slots: usize,
    /// Tensor elements per slot and layer (values; bytes in a `U8` pool).
    row: usize,
    /// Values per slot and layer (`n_kv_heads * head_dim`).
    values: usize,
    /// The blocks of codes it holds, if it quantizes.
    codes: Option<Codes>,
    /// Whether its heads are stored turned (codes of heads of a multiple of 64 values).
    turned: bool,
    /// On the CPU: restores whose bytes arrive layer by layer from the store, written into
    /// each layer when a pass first asks for it ([`Self::layer`]).
    restoring: Mutex<Restoring>,
    /// The layers a narrow chunk holds (see [`Self::set_narrow_layers`]), in order.
    narrow_layers: Vec<usize>,
}

impl KvPool {
    /// A zeroed pool of `n_slots` slots of `shape` at precision `kv`, on `device` (8 and 4
    /// bits: for head dimensions in blocks of 32).
    ///
    /// # Errors
    /// [`Error::Candle`] when the device cannot allocate it; [`Error::Unsupported`] for codes
    /// of another head dimension.
    pub fn new(shape: KvShape, n_slots: usize, kv: KvPrecision, device: &Device) -> Result<Self> {
        if kv.codes().is_some() && !Codes::fits(shape.head_dim) {
            return Err(Error::Unsupported(format!(
                "KV in {kv:?} needs heads in blocks of {QK}; this model's heads hold {}",
                shape.head_dim
            )));
        }
        let (dtype, width) = (kv.dtype(), kv.head_row_bytes(shape.head_dim));
        let width = width / dtype.size_in_bytes();
        let dims = (n_slots, shape.num_kv_heads, width);
        let mut k = Vec::with_capacity(shape.num_layers);
        let mut v = Vec::with_capacity(shape.num_layers);
        let copier: Option<Box<dyn Copier>> = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                if crate::kernels::own_stream(dev) {
                    cuda::untrack(dev);
                } else {
                    tracing::warn!(
                        "the CUDA device issues ops on each thread's default stream (candle's \
                         Device::new_cuda), so cudarc's per-op events stay on and the fused \
                         kernels off: a decode step costs up to 1.7x; build the device with \
                         pensieve::model::cuda_device"
                    );
                }
                Some(Box::new(cuda::Mover::new(dev, shape.num_layers)?))
            }
            _ => None,
        };
        for _ in 0..shape.num_layers {
            k.push(Tensor::zeros(dims, dtype, device)?);
            v.push(Tensor::zeros(dims, dtype, device)?);
        }
        Ok(Self {
            copier,
            k,
            v,
            n_slots,
            row: shape.num_kv_heads * width,
            values: shape.num_kv_heads * shape.head_dim,
            codes: kv.codes(),
            turned: kv.codes().is_some() && turned(shape.head_dim),
            restoring: Mutex::new(Restoring::default()),
            narrow_layers: (0..shape.num_layers).collect(),
        })
    }

    /// The layers a narrow chunk's bytes hold: those that attend to the whole history. A chunk
    /// that no sliding-window layer will read again leaves the device without the other
    /// layers' KV, and comes back with their slots left as they were (never read).
    /// Every layer until set.
    pub(crate) fn set_narrow_layers(&mut self, layers: Vec<usize>) {
        self.narrow_layers = layers;
    }

    /// Whether chunks can leave the pool narrow ([`Self::copy_chunks`]): on the CPU; a GPU's
    /// copy stream moves whole chunks.
    pub(crate) fn copies_narrow(&self) -> bool {
        self.copier.is_none() && self.narrow_layers.len() < self.k.len()
    }

    /// The pool's layers a chunk's bytes hold, in their order.
    fn layers_of(&self, narrow: bool) -> Vec<usize> {
        match narrow {
            true => self.narrow_layers.clone(),
            false => (0..self.k.len()).collect(),
        }
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.n_slots
    }

    /// Layer `layer`'s `(k_pool, v_pool)`, ready for the compute that follows: on a GPU the
    /// compute stream first waits for this step's copies of that layer (and only that layer).
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] for a layer the pool does not have; [`Error::Transfer`] if the
    /// device cannot order the wait.
    pub fn layer(&self, layer: usize) -> Result<(&Tensor, &Tensor)> {
        self.await_copies(layer)?;
        self.restore_upto(layer + 1);
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
        let idx = self.slot_tensor(slots, device)?.reshape((slots.len(), 1))?;
        Ok(idx.broadcast_as((slots.len(), self.row))?.contiguous()?)
    }

    /// `slots` as a u32 tensor on `device`, each checked against the pool: the index a fused
    /// kernel writes new tokens' K and V through (the GPU's fused pass writes them itself,
    /// after [`Self::layer`]).
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if a slot is outside the pool.
    pub fn slot_tensor(&self, slots: &[u32], device: &Device) -> Result<Tensor> {
        if let Some(s) = slots.iter().find(|&&s| s as usize >= self.n_slots) {
            return Err(Error::InvalidBatch(format!(
                "slot {s} outside a pool of {}",
                self.n_slots
            )));
        }
        Ok(Tensor::from_slice(slots, slots.len(), device)?)
    }

    /// Writes new tokens' `k`, `v` (`[tokens, n_kv_heads, head_dim]`) into their slots of
    /// `layer`, using an index from [`Self::write_index`]; on a GPU after this step's copies
    /// of the layer ([`Self::layer`]).
    ///
    /// # Errors
    /// [`Error::Candle`] on shape or device mismatch.
    pub fn write(&self, layer: usize, index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kp, vp) = self.layer(layer)?;
        #[cfg(feature = "cuda")]
        if let Some(c) = self.codes
            && cuda::write_codes((k, v), index, (kp, vp), c, self.turned)?
        {
            return Ok(());
        }
        let tokens = index.dim(0)?;
        let flat = |pool: &Tensor| pool.reshape((self.n_slots, self.row));
        // Codes are of the turned heads.
        let rows = |x: &Tensor| -> Result<Tensor> {
            let Some(c) = self.codes else {
                return Ok(x.to_dtype(kp.dtype())?.reshape((tokens, self.row))?);
            };
            let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if self.turned {
                turn_heads(&mut values);
            }
            let mut codes = Vec::with_capacity(tokens * self.row);
            c.quantize(&values, &mut codes);
            Ok(Tensor::from_vec(codes, (tokens, self.row), kp.device())?)
        };
        flat(kp)?.scatter_set(index, &rows(k)?, 0)?;
        flat(vp)?.scatter_set(index, &rows(v)?, 0)?;
        Ok(())
    }
}

impl KvPool {
    /// One step's chunk copies: `outs` leave the pool as host bytes laid out as
    /// [`Self::read_slots`] returns them (of the narrow layers only, for a narrow span), then
    /// `ins` are written into their slots. On the CPU this is done on return, except, with `pipelined`,
    /// for bytes arriving layer by layer from the store: each of their layers is written
    /// when a pass first asks for that layer ([`Self::layer`]; [`Self::finish_restore`] ends
    /// them). On a GPU the copies run
    /// on their own stream in layer order, each layer's behind one event that
    /// [`Self::layer`] makes the compute wait for (with `pipelined`; otherwise on return),
    /// so layer 0 of the next pass starts while later layers are still in flight; the
    /// returned bytes wait for their copy when read.
    ///
    /// # Errors
    /// As [`Self::read_slots`] and [`Self::write_slots`]; [`Error::Transfer`] when the
    /// device fails a copy or a chunk's bytes are unreadable. A failed batch may have copied
    /// part of its chunks: the caller treats every chunk of it as lost.
    pub fn copy_chunks(
        &self,
        outs: &[Span],
        ins: Vec<(Span, Arc<ChunkBytes>)>,
        pipelined: bool,
    ) -> Result<Vec<ChunkBytes>> {
        for out in outs {
            self.check_range(out.start, out.len)?;
        }
        if let Some(m) = &self.copier {
            if outs.iter().any(|o| o.narrow) {
                return Err(Error::InvalidBatch(
                    "a GPU's copies take whole chunks, not narrow ones".into(),
                ));
            }
            let outs: Vec<(usize, usize)> = outs.iter().map(|o| (o.start, o.len)).collect();
            let ins = (ins.into_iter())
                .map(|(span, data)| Ok((span.start, self.widened(span, data)?)))
                .collect::<Result<Vec<_>>>()?;
            let per = self.token_bytes().max(1);
            for (start, data) in &ins {
                if !data.len().is_multiple_of(per) {
                    return Err(Error::InvalidBatch(format!(
                        "{} bytes are not whole KV-tokens",
                        data.len()
                    )));
                }
                self.check_range(*start, data.len() / per)?;
            }
            return m.copy(&self.k, &self.v, self.row_bytes(), &outs, ins, pipelined);
        }
        let out = outs
            .iter()
            .map(|o| {
                self.read_layers(o.start, o.len, o.narrow)
                    .map(ChunkBytes::from)
            })
            .collect::<Result<Vec<_>>>()?;
        for (span, data) in ins {
            if pipelined && data.is_layered() {
                self.restoring.lock().chunks.push(Layered {
                    start: span.start,
                    layers: self.layers_of(span.narrow),
                    data,
                    next: 0,
                    failed: false,
                });
            } else {
                self.write_layers(span.start, data.bytes()?, span.narrow)?;
            }
        }
        Ok(out)
    }

    /// A narrow chunk's bytes as a whole chunk's, for a copier that takes whole chunks: the
    /// other layers' KV zeroed (never read: no window reaches the chunk).
    fn widened(&self, span: Span, data: Arc<ChunkBytes>) -> Result<Arc<ChunkBytes>> {
        if !span.narrow || self.narrow_layers.len() == self.k.len() {
            return Ok(data);
        }
        let layer = 2 * span.len * self.row_bytes();
        let bytes = data.bytes()?;
        if bytes.len() != layer * self.narrow_layers.len() {
            return Err(Error::InvalidBatch(format!(
                "{} bytes are not a narrow chunk of {} tokens",
                bytes.len(),
                span.len
            )));
        }
        let mut whole = vec![0u8; layer * self.k.len()];
        for (part, &l) in bytes.chunks_exact(layer.max(1)).zip(&self.narrow_layers) {
            whole[l * layer..(l + 1) * layer].copy_from_slice(part);
        }
        Ok(Arc::new(ChunkBytes::from(whole)))
    }

    /// Whether [`Self::copy_chunks`] takes bytes arriving layer by layer without waiting for
    /// them whole (on the CPU; a GPU's copy stream takes whole chunks).
    pub fn restores_by_layer(&self) -> bool {
        self.copier.is_none()
    }

    /// Writes the layers below `upto` of every restore arriving layer by layer, waiting for
    /// each layer's read; a layer that cannot be read or written marks its chunk failed.
    fn restore_upto(&self, upto: usize) {
        let mut r = self.restoring.lock();
        let Restoring { chunks, waited } = &mut *r;
        for c in chunks.iter_mut() {
            // `next` counts the chunk's own layers, in the pool's order.
            while let Some(&layer) = c.layers.get(c.next).filter(|&&l| l < upto) {
                let started = Instant::now();
                let bytes = c.data.layer(c.next, c.layers.len());
                *waited += started.elapsed();
                c.failed |= match bytes {
                    Ok(b) if !c.failed => self.write_layer(layer, c.start, b).is_err(),
                    _ => true,
                };
                c.next += 1;
            }
        }
    }

    /// Completes every restore still arriving layer by layer (a pass that stopped early
    /// leaves some layers unwritten). Returns the first slots of the chunks whose file was
    /// refused partway, which the caller must treat as lost, and the time spent waiting for
    /// layers since the last call.
    pub fn finish_restore(&self) -> (Vec<usize>, Duration) {
        self.restore_upto(self.k.len());
        let mut r = self.restoring.lock();
        let failed = r.chunks.drain(..).filter(|c| c.failed).map(|c| c.start);
        let failed = failed.collect();
        (failed, std::mem::take(&mut r.waited))
    }

    /// On a GPU, makes the compute stream (which every candle op on the pool uses) wait for
    /// this step's copies of `layer`, in both directions: a swap-out still reading the layer,
    /// a swap-in still writing it. Nothing to wait for on the CPU.
    fn await_copies(&self, layer: usize) -> Result<()> {
        match (&self.copier, self.k.get(layer), self.v.get(layer)) {
            (Some(m), Some(k), Some(v)) => m.await_layer(layer, k, v),
            _ => Ok(()),
        }
    }

    /// Bytes of one slot's row in one layer's K (or V).
    fn row_bytes(&self) -> usize {
        self.row * self.dtype().size_in_bytes()
    }

    /// Bytes of one KV-token across the pool's layers.
    fn token_bytes(&self) -> usize {
        2 * self.k.len() * self.row_bytes()
    }

    /// Copies the KV of slots `[start, start + len)` out of every layer, as
    /// `[layer][k, v][len][n_kv_heads * head_dim]` values of the pool's type, little-endian
    /// bytes (a chunk on its way to a lower tier; the bytes are what a tier stores).
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] for a range outside the pool or a pool type other than f32,
    /// f16, bf16 and codes; [`Error::Candle`] on device errors.
    pub fn read_slots(&self, start: usize, len: usize) -> Result<Vec<u8>> {
        self.read_layers(start, len, false)
    }

    /// [`Self::read_slots`] of a chunk's layers: every layer, or with `narrow` those
    /// [`Self::set_narrow_layers`] names.
    fn read_layers(&self, start: usize, len: usize, narrow: bool) -> Result<Vec<u8>> {
        self.check_range(start, len)?;
        let width = self.dtype().size_in_bytes();
        let layers = self.layers_of(narrow);
        let mut out = Vec::with_capacity(layers.len() * 2 * len * self.row * width);
        for layer in layers {
            let (k, v) = (&self.k[layer], &self.v[layer]);
            self.await_copies(layer)?;
            for pool in [k, v] {
                let rows = pool.narrow(0, start, len)?.flatten_all()?;
                match rows.dtype() {
                    DType::F32 => {
                        out.extend(rows.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()))
                    }
                    DType::F16 => {
                        out.extend(rows.to_vec1::<f16>()?.iter().flat_map(|x| x.to_le_bytes()))
                    }
                    DType::BF16 => {
                        out.extend(rows.to_vec1::<bf16>()?.iter().flat_map(|x| x.to_le_bytes()))
                    }
                    DType::U8 => out.extend(rows.to_vec1::<u8>()?),
                    other => return Err(unsupported(other)),
                }
            }
        }
        Ok(out)
    }

    /// Writes data laid out as [`Self::read_slots`] returns it into slots
    /// `[start, start + len)` of every layer (a chunk coming back from a lower tier).
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if `data` is not whole KV-tokens or the range lies outside the
    /// pool; [`Error::Candle`] on device errors.
    pub fn write_slots(&self, start: usize, data: &[u8]) -> Result<()> {
        self.write_layers(start, data, false)
    }

    /// [`Self::write_slots`] of a chunk's layers, as [`Self::read_layers`] lays them out.
    fn write_layers(&self, start: usize, data: &[u8], narrow: bool) -> Result<()> {
        let layers = self.layers_of(narrow);
        let per = 2 * layers.len() * self.row_bytes();
        if per == 0 || !data.len().is_multiple_of(per) {
            return Err(Error::InvalidBatch(format!(
                "{} bytes are not whole KV-tokens",
                data.len()
            )));
        }
        let layer_bytes = data.len() / layers.len();
        for (&layer, part) in layers.iter().zip(data.chunks_exact(layer_bytes.max(1))) {
            self.write_layer(layer, start, part)?;
        }
        Ok(())
    }

    /// Writes one layer's K and V bytes of tokens from slot `start` (the layer's part of the
    /// [`Self::read_slots`] layout).
    fn write_layer(&self, layer: usize, start: usize, data: &[u8]) -> Result<()> {
        let part_bytes = self.row_bytes();
        let len = data.len() / (2 * part_bytes).max(1);
        if len * 2 * part_bytes != data.len() {
            return Err(Error::InvalidBatch(format!(
                "{} bytes are not whole KV-tokens of a layer",
                data.len()
            )));
        }
        self.check_range(start, len)?;
        let (Some(k), Some(v)) = (self.k.get(layer), self.v.get(layer)) else {
            return Err(Error::InvalidBatch(format!("no layer {layer}")));
        };
        self.await_copies(layer)?;
        for (pool, part) in [k, v].into_iter().zip(data.chunks_exact(len * part_bytes)) {
            let shape = (len, self.row);
            let device = pool.device();
            let src = match pool.dtype() {
                DType::F32 => Tensor::from_vec(decode(part, f32::from_le_bytes), shape, device)?,
                DType::F16 => Tensor::from_vec(decode(part, f16::from_le_bytes), shape, device)?,
                DType::BF16 => Tensor::from_vec(decode(part, bf16::from_le_bytes), shape, device)?,
                DType::U8 => Tensor::from_slice(part, shape, device)?,
                other => return Err(unsupported(other)),
            };
            pool.reshape((self.n_slots, self.row))?
                .slice_set(&src, 0, start)?;
        }
        Ok(())
    }

    /// The type of the pool's values.
    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, Tensor::dtype)
    }

    fn check_range(&self, start: usize, len: usize) -> Result<()> {
        if start + len > self.n_slots {
            return Err(Error::InvalidBatch(format!(
                "slots {start}..{} outside a pool of {}",
                start + len,
                self.n_slots
            )));
        }
        Ok(())
    }
}

/// Restores arriving layer by layer (CPU), and the time passes waited for their reads.
#[derive(Debug, Default)]
struct Restoring {
    chunks: Vec<Layered>,
    waited: Duration,
}

/// One chunk's restore arriving layer by layer.
#[derive(Debug)]
struct Layered {
    start: usize,
    /// The pool's layers its bytes hold, in order (fewer for a narrow chunk).
    layers: Vec<usize>,
    data: Arc<ChunkBytes>,
    /// The next layer to write.
    next: usize,
    failed: bool,
}

/// Values from little-endian bytes (`N` bytes each).
fn decode<T, const N: usize>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|b| from(b.try_into().unwrap_or([0; N])))
        .collect()
}

fn unsupported(dtype: DType) -> Error {
    Error::InvalidBatch(format!("KV pools of {dtype:?} cannot move between tiers"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: KvShape = KvShape {
        num_layers: 2,
        num_kv_heads: 3,
        head_dim: 4,
    };

    #[test]
    fn chunks_round_trip_through_bytes_in_both_precisions() {
        for kv in [KvPrecision::F32, KvPrecision::F16] {
            let pool = KvPool::new(SHAPE, 10, kv, &Device::Cpu).unwrap();
            let row = 12;
            let k = Tensor::arange(0f32, (3 * row) as f32, &Device::Cpu).unwrap();
            let k = k.reshape((3, 3, 4)).unwrap();
            let v = (&k * -0.5).unwrap();
            let index = pool.write_index(&[4, 5, 6], &Device::Cpu).unwrap();
            for layer in 0..2 {
                pool.write(layer, &index, &k, &v).unwrap();
            }
            let bytes = pool.read_slots(4, 3).unwrap();
            assert_eq!(bytes.len(), 3 * SHAPE.token_bytes(kv));
            // Into other slots, then out again: the same bytes, and the values written.
            pool.write_slots(0, &bytes).unwrap();
            assert_eq!(pool.read_slots(0, 3).unwrap(), bytes);
            let (kp, vp) = pool.layer(1).unwrap();
            let got = |p: &Tensor| {
                let t = p.narrow(0, 0, 3).unwrap().to_dtype(DType::F32).unwrap();
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            assert_eq!(got(kp), k.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            assert_eq!(got(vp), v.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            assert!(pool.write_slots(0, &bytes[1..]).is_err());
            assert!(pool.write_slots(8, &bytes).is_err());
        }
    }

    #[test]
    fn layered_restores_are_written_as_each_layer_is_asked_for_and_fail_alone() {
        use std::sync::OnceLock;
        let pool = KvPool::new(SHAPE, 10, KvPrecision::F32, &Device::Cpu).unwrap();
        let source = KvPool::new(SHAPE, 10, KvPrecision::F32, &Device::Cpu).unwrap();
        let k = Tensor::arange(0f32, 36.0, &Device::Cpu).unwrap();
        let k = k.reshape((3, 3, 4)).unwrap();
        let index = source.write_index(&[0, 1, 2], &Device::Cpu).unwrap();
        for layer in 0..2 {
            source
                .write(layer, &index, &(&k + layer as f64).unwrap(), &k)
                .unwrap();
        }
        let bytes = source.read_slots(0, 3).unwrap();
        let half = bytes.len() / 2;
        // Two chunks arriving layer by layer: the first whole, the second refused at layer 1.
        let cells = |second: crate::kv::Arrived| {
            let c: crate::kv::LayerCells = vec![OnceLock::new(), OnceLock::new()];
            let _ = c[0].set(Ok(bytes[..half].to_vec()));
            let _ = c[1].set(second);
            Arc::new(ChunkBytes::layered(bytes.len(), Arc::new(c)))
        };
        let good = cells(Ok(bytes[half..].to_vec()));
        let bad = cells(Err(crate::kv::ChunkUnavailable::NoLayer {
            layer: 1,
            layers: 2,
        }));
        let ins = vec![(Span::whole(0, 3), good), (Span::whole(4, 3), bad)];
        pool.copy_chunks(&[], ins, true).unwrap();
        // Layer 0 is written when asked for, before layer 1 is.
        pool.layer(0).unwrap();
        assert_eq!(pool.read_slots(4, 3).unwrap()[..half], bytes[..half]);
        let (failed, _) = pool.finish_restore();
        assert_eq!(failed, vec![4]);
        assert_eq!(pool.read_slots(0, 3).unwrap(), bytes);
        // Nothing is left pending.
        assert_eq!(pool.finish_restore().0, Vec::<usize>::new());
    }

    #[test]
    fn narrow_chunks_carry_only_the_narrow_layers_there_and_back() {
        let mut source = KvPool::new(SHAPE, 10, KvPrecision::F32, &Device::Cpu).unwrap();
        source.set_narrow_layers(vec![1]);
        let k = Tensor::arange(0f32, 36.0, &Device::Cpu).unwrap();
        let k = k.reshape((3, 3, 4)).unwrap();
        let index = source.write_index(&[0, 1, 2], &Device::Cpu).unwrap();
        for layer in 0..2 {
            let k = (&k + 100.0 * layer as f64).unwrap();
            source.write(layer, &index, &k, &k).unwrap();
        }
        let whole = source.read_slots(0, 3).unwrap();
        let half = whole.len() / 2;
        let narrow = Span {
            start: 0,
            len: 3,
            narrow: true,
        };
        let out = source.copy_chunks(&[narrow], Vec::new(), false).unwrap();
        assert_eq!(out[0].bytes().unwrap(), &whole[half..], "layer 1 alone");

        let mut pool = KvPool::new(SHAPE, 10, KvPrecision::F32, &Device::Cpu).unwrap();
        pool.set_narrow_layers(vec![1]);
        let before = pool.read_slots(4, 3).unwrap();
        let back = Span { start: 4, ..narrow };
        let bytes = Arc::new(ChunkBytes::from(whole[half..].to_vec()));
        pool.copy_chunks(&[], vec![(back, bytes)], false).unwrap();
        let after = pool.read_slots(4, 3).unwrap();
        assert_eq!(after[half..], whole[half..]);
        assert_eq!(after[..half], before[..half], "layer 0 left as it was");

        // Arriving layer by layer: the one layer it has, into layer 1.
        let cells: crate::kv::LayerCells = vec![std::sync::OnceLock::new()];
        let _ = cells[0].set(Ok(whole[half..].to_vec()));
        let layered = Arc::new(ChunkBytes::layered(half, Arc::new(cells)));
        let at = Span { start: 7, ..narrow };
        pool.copy_chunks(&[], vec![(at, layered)], true).unwrap();
        pool.layer(1).unwrap();
        assert!(pool.finish_restore().0.is_empty());
        assert_eq!(pool.read_slots(7, 3).unwrap()[half..], whole[half..]);
    }
}

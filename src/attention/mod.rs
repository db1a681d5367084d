//! The multi-query attention op over non-contiguous KV slots (Pensieve §4.4, "multi-token
//! attention with a non-contiguous cache").
//!
//! One call computes attention for a whole batch that mixes sequences with one query (decode)
//! and many (prefill, or a resumed conversation recomputing dropped tokens). Inputs for one
//! layer:
//! - `q`: `[tokens, n_heads, head_dim]`, the queries of all sequences concatenated, each
//!   sequence's rows contiguous and in [`AttentionBatch`] order;
//! - `k_pool`, `v_pool`: `[n_slots, n_kv_heads, head_dim]`, the layer's KV pool;
//! - the [`AttentionBatch`]: per sequence the positions of its query rows and its context as
//!   a block table (positions `0..ctx_len`, in blocks of the pool).
//!
//! **Rule.** A query at position `p` attends to exactly the context entries whose position is
//! `<= p` and, on a layer with a sliding window of `w` (Gemma 3's local layers, Mistral),
//! `> p - w` (the last `w` positions, its own included); query head `h` reads kv head
//! `h / (n_heads / n_kv_heads)` (GQA). The new tokens' K/V
//! must already be written to their slots and covered by the context. Because the rule is
//! positional, a sequence's query rows may form several disjoint position runs (recomputed
//! leading tokens plus a new prompt) over one context, whose blocks may lie in any order in the
//! pool.
//!
//! Implementations behind [`attention`]: a tiled online-softmax kernel on the CPU (`cpu`: no
//! score matrix is materialised, work is spread over cores by rayon), a gather-then-matmul path
//! built from candle ops that runs on any device ([`attention_gather`]; the CUDA kernel of
//! `kernels/` replaces it on GPUs), and the naive [`attention_reference`] (f64 accumulation)
//! that every fast path is tested against.

mod codes;
mod cpu;
#[cfg(any(feature = "cuda", feature = "cuda-emulator", test))]
mod cuda;
mod gather;
mod pool;
mod precision;
#[cfg(feature = "internals")]
mod reference;

use candle_core::{DType, Device, Tensor};

#[cfg(feature = "internals")]
pub use gather::attention_gather;
pub use pool::{KeyRotation, KvPool, KvShape, Span};
pub use precision::KvPrecision;
#[cfg(feature = "internals")]
pub use reference::attention_reference;

/// The CUDA kernel run on the CPU (see `kernels/README.md`): how the tests check it without a
/// GPU.
#[cfg(feature = "cuda-emulator")]
pub use cuda::emulator;

use crate::{Error, Result};

/// Plain-data description of one attention batch: which query rows belong to which sequence,
/// their positions, and each sequence's context as a block table over the pool (paged KV, as
/// vLLM and FlashInfer lay it out).
///
/// A sequence's context holds positions `0..ctx_len`; position `p` lies in slot
/// `blocks[p / block_size] * block_size + p % block_size`, so the table names one block per
/// `block_size` positions (the engine's chunks) and its blocks may lie anywhere in the pool.
/// With a block size of 1 the table lists every context slot. Built once per step and shared
/// by every layer (the slots are the same in all layers).
#[derive(Clone, Debug)]
pub struct AttentionBatch {
    /// Slots per block.
    block_size: usize,
    /// `n_seqs + 1` offsets into the query rows.
    q_offsets: Vec<usize>,
    q_positions: Vec<u32>,
    /// `n_seqs + 1` offsets into `blocks`.
    block_offsets: Vec<usize>,
    blocks: Vec<u32>,
    /// Context entries of each sequence.
    ctx_lens: Vec<usize>,
    /// The CUDA kernel's plan for this batch, uploaded once for every layer.
    #[cfg(feature = "cuda")]
    device_plan: cuda::PlanCache,
}

/// One sequence of an [`AttentionBatch`], borrowed.
#[derive(Clone, Copy, Debug)]
pub struct SequenceView<'a> {
    /// First query row of this sequence in `q`.
    pub first_row: usize,
    /// Position of each query row.
    pub q_positions: &'a [u32],
    /// The block holding each `block_size` positions of the context.
    pub blocks: &'a [u32],
    /// Slots per block.
    pub block_size: usize,
    /// Context entries: positions `0..ctx_len`.
    pub ctx_len: usize,
}

impl SequenceView<'_> {
    /// The pool slot of context position `p` (`p < ctx_len`).
    pub fn slot(&self, p: usize) -> u32 {
        let bs = self.block_size;
        self.blocks[p / bs] * bs as u32 + (p % bs) as u32
    }

    /// The pool slot of every context position, in order.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.ctx_len).map(|p| self.slot(p))
    }
}

impl AttentionBatch {
    /// An empty batch over a pool cut into blocks of `block_size` slots.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            q_offsets: vec![0],
            q_positions: Vec::new(),
            block_offsets: vec![0],
            blocks: Vec::new(),
            ctx_lens: Vec::new(),
            #[cfg(feature = "cuda")]
            device_plan: cuda::PlanCache::default(),
        }
    }

    /// Appends a sequence whose query rows follow the previous sequence's in `q`: queries at
    /// `q_positions` over a context of `ctx_len` positions held by `blocks`.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if the sequence has no query, the block size is 0, or `blocks`
    /// is not one block per `block_size` positions of the context.
    pub fn push_sequence(
        &mut self,
        q_positions: &[u32],
        blocks: &[u32],
        ctx_len: usize,
    ) -> Result<()> {
        if q_positions.is_empty() {
            return Err(Error::InvalidBatch(
                "a sequence needs at least one query".into(),
            ));
        }
        if self.block_size == 0 {
            return Err(Error::InvalidBatch("blocks of 0 slots".into()));
        }
        if blocks.len() != ctx_len.div_ceil(self.block_size) {
            return Err(Error::InvalidBatch(format!(
                "{} blocks of {} slots for a context of {ctx_len}",
                blocks.len(),
                self.block_size
            )));
        }
        self.q_positions.extend_from_slice(q_positions);
        self.blocks.extend_from_slice(blocks);
        self.q_offsets.push(self.q_positions.len());
        self.block_offsets.push(self.blocks.len());
        self.ctx_lens.push(ctx_len);
        #[cfg(feature = "cuda")]
        {
            // A plan cut for the sequences before is not this batch's (nor a clone's).
            self.device_plan = cuda::PlanCache::default();
        }
        Ok(())
    }

    /// Slots per block.
    #[cfg(feature = "internals")]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.q_offsets.len() - 1
    }

    /// Number of query rows over all sequences (the `tokens` dimension of `q`).
    pub fn num_queries(&self) -> usize {
        self.q_positions.len()
    }

    /// Total context entries over all sequences.
    #[cfg(feature = "internals")]
    pub fn num_context_entries(&self) -> usize {
        self.ctx_lens.iter().sum()
    }

    /// Sequence `i`; callers iterate `0..num_sequences()`, so the offsets exist.
    fn sequence(&self, i: usize) -> SequenceView<'_> {
        let (q0, q1) = (self.q_offsets[i], self.q_offsets[i + 1]);
        let (b0, b1) = (self.block_offsets[i], self.block_offsets[i + 1]);
        SequenceView {
            first_row: q0,
            q_positions: &self.q_positions[q0..q1],
            blocks: &self.blocks[b0..b1],
            block_size: self.block_size,
            ctx_len: self.ctx_lens[i],
        }
    }

    /// All sequences in order.
    pub fn sequences(&self) -> impl Iterator<Item = SequenceView<'_>> + '_ {
        (0..self.num_sequences()).map(|i| self.sequence(i))
    }

    /// Checks that every block lies wholly inside a pool of `n_slots`.
    fn check_slots(&self, n_slots: usize) -> Result<()> {
        let fits = |&&b: &&u32| (b as usize + 1) * self.block_size <= n_slots;
        match self.blocks.iter().find(|b| !fits(b)) {
            Some(b) => Err(Error::InvalidBatch(format!(
                "block {b} of {} slots outside a pool of {n_slots}",
                self.block_size
            ))),
            None => Ok(()),
        }
    }
}

/// Shapes of one attention call, checked against the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub tokens: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_slots: usize,
    /// The blocks of codes a `U8` pool holds (told apart by their row's bytes).
    pub codes: Option<codes::Codes>,
}

impl Dims {
    pub(crate) fn check(
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        batch: &AttentionBatch,
    ) -> Result<Self> {
        let (tokens, n_heads, head_dim) = q.dims3()?;
        let (n_slots, n_kv_heads, kd) = k_pool.dims3()?;
        // A `U8` pool holds blocks of codes: its rows are bytes, not values.
        let codes = match k_pool.dtype() {
            DType::U8 => codes::Codes::of_row(head_dim, kd),
            _ => None,
        };
        let row_fits = codes.is_some() || (k_pool.dtype() != DType::U8 && kd == head_dim);
        if v_pool.dims() != k_pool.dims() || v_pool.dtype() != k_pool.dtype() || !row_fits {
            return Err(Error::InvalidBatch(format!(
                "q {:?}, k_pool {:?}, v_pool {:?} do not agree",
                q.dims(),
                k_pool.dims(),
                v_pool.dims()
            )));
        }
        // The kernels take head dimensions in pairs (as RoPE does).
        if head_dim % 2 != 0 {
            return Err(Error::UnsupportedHeadDim { head_dim });
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(Error::InvalidBatch(format!(
                "{n_heads} query heads are not a multiple of {n_kv_heads} kv heads"
            )));
        }
        if tokens != batch.num_queries() {
            return Err(Error::InvalidBatch(format!(
                "q has {tokens} rows but the batch describes {}",
                batch.num_queries()
            )));
        }
        batch.check_slots(n_slots)?;
        Ok(Self {
            tokens,
            n_heads,
            n_kv_heads,
            head_dim,
            n_slots,
            codes,
        })
    }
}

/// Whether a query at position `query` sees the context entry at position `key` (see the
/// module's rule): `key <= query`, and within `window` positions when there is one.
pub fn visible(query: u32, key: u32, window: Option<u32>) -> bool {
    key <= query && window.is_none_or(|w| query - key < w)
}

/// Attention of every query row of `batch` over its sequence's context.
///
/// `q`: `[tokens, n_heads, head_dim]`; `k_pool`, `v_pool`: `[n_slots, n_kv_heads, head_dim]`;
/// returns `[tokens, n_heads, head_dim]` in `q`'s dtype. `scale` multiplies the scores
/// (usually `1/sqrt(head_dim)`). A query with no visible context entry yields zeros.
///
/// # Errors
/// [`Error::InvalidBatch`] when shapes and batch disagree or a slot is out of the pool;
/// [`Error::UnsupportedHeadDim`] for an odd head dimension; [`Error::Candle`] for device
/// failures.
#[cfg(feature = "internals")]
pub fn attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    batch: &AttentionBatch,
    scale: f32,
) -> Result<Tensor> {
    attention_in_window(q, k_pool, v_pool, Attend::new(batch, scale))
}

/// What one call of the op attends with beside its tensors: the batch, the scale of the
/// scores, the window and the sinks. Every entry of the op ([`attention_in_window`], the
/// gather path, the reference, the CUDA kernel's emulation) takes one.
#[derive(Clone, Copy, Debug)]
pub struct Attend<'a> {
    /// Which rows belong to which sequence, and each sequence's context.
    pub batch: &'a AttentionBatch,
    /// Multiplies the scores (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Positions a query sees back from its own, its own included (a sliding window, as
    /// Gemma 3's local layers); `None`: the whole causal context.
    pub window: Option<u32>,
    /// Per query head, a learned score that joins the softmax's sum and attends to no value
    /// (gpt-oss's attention sinks), so a head may attend to little; `None`: no sinks.
    pub sinks: Option<&'a [f32]>,
}

impl<'a> Attend<'a> {
    /// The whole causal context of `batch`, scores scaled by `scale`, no sinks.
    pub fn new(batch: &'a AttentionBatch, scale: f32) -> Self {
        Self {
            batch,
            scale,
            window: None,
            sinks: None,
        }
    }

    /// The same within a sliding window of `window` positions (`None`: none).
    pub fn window(self, window: Option<u32>) -> Self {
        Self { window, ..self }
    }

    /// The same with attention sinks, one per query head (`None`: none).
    pub fn sinks(self, sinks: Option<&'a [f32]>) -> Self {
        Self { sinks, ..self }
    }
}

/// [`attention`] as `how` describes it: a sliding window, attention sinks (on CUDA, sinks
/// take the gather path for now).
///
/// # Errors
/// As [`attention`]; [`Error::InvalidBatch`] for a sink list of another length than the
/// query heads.
pub fn attention_in_window(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
) -> Result<Tensor> {
    let (batch, scale, window, sinks) = (how.batch, how.scale, how.window, how.sinks);
    let dims = Dims::check(q, k_pool, v_pool, batch)?;
    check_sinks(sinks, dims)?;
    // Codes in rotated heads: the queries turned the keys' way, the output turned back. The
    // CPU kernel quantizes the queries itself; the other paths read them so quantized.
    codes::rotated(q, dims, |q| match q.device() {
        #[cfg(feature = "cuda-emulator")]
        Device::Cpu
            if sinks.is_none() && emulator::replaces_the_cpu_op(dims.head_dim, k_pool.dtype()) =>
        {
            let emulation = emulator::Emulation {
                sms: 1,
                ..Default::default()
            };
            let (q, how) = codes::scored_as_codes(q, dims, how)?;
            let out = emulator::kernel(&q, k_pool, v_pool, how, emulation)
                .map_err(|e| Error::Candle(candle_core::Error::Msg(e.to_string())))?;
            Ok(out.to_dtype(q.dtype())?)
        }
        Device::Cpu => {
            let in_dtype = q.dtype();
            let q = q.to_dtype(DType::F32)?.contiguous()?;
            // The kernel reads f32, f16 and code pools as they are; other types are converted.
            let kv = |pool: &Tensor| match pool.dtype() {
                DType::F32 | DType::F16 | DType::U8 => Ok(pool.clone()),
                _ => pool.to_dtype(DType::F32),
            };
            let (k, v) = (kv(k_pool)?, kv(v_pool)?);
            let op = cpu::PagedAttention {
                batch,
                dims,
                scale,
                window: window.unwrap_or(u32::MAX),
                sinks,
            };
            Ok(q.apply_op3_no_bwd(&k, &v, &op)?.to_dtype(in_dtype)?)
        }
        // The kernel is built for head dims 64, 128 and 256 and f32, f16, bf16 and code pools;
        // the rest take the gather path.
        #[cfg(feature = "cuda")]
        Device::Cuda(_)
            if sinks.is_none()
                && matches!(dims.head_dim, 64 | 128 | 256)
                && matches!(
                    k_pool.dtype(),
                    DType::F32 | DType::F16 | DType::BF16 | DType::U8
                ) =>
        {
            let in_dtype = q.dtype();
            let (q, how) = codes::scored_as_codes(q, dims, how)?;
            let q = q.to_dtype(DType::F32)?.contiguous()?;
            let (k, v) = (k_pool.contiguous()?, v_pool.contiguous()?);
            let op = cuda::CudaAttention {
                batch,
                dims,
                scale: how.scale,
                window,
            };
            Ok(q.apply_op3_no_bwd(&k, &v, &op)?.to_dtype(in_dtype)?)
        }
        // Other devices run the device-agnostic gather path (a pool of codes widened first).
        _ => {
            let (q, how) = codes::scored_as_codes(q, dims, how)?;
            gather::attention_gather(
                &q,
                &codes::readable(k_pool, dims.codes, dims.head_dim)?,
                &codes::readable(v_pool, dims.codes, dims.head_dim)?,
                how,
            )
        }
    })
}

/// The entry of the paths that read pools of values (the gather path, the reference): `how`
/// checked against the tensors, a pool of codes widened (`d · q`, exact in f32, as the
/// kernels widen it), and `attend` run on the queries turned as its keys are stored and
/// quantized as the CPU kernel quantizes them ([`codes::scored_as_codes`]), its output turned
/// back.
fn over_values(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
    attend: fn(&Tensor, &Tensor, &Tensor, Attend<'_>, Dims) -> Result<Tensor>,
) -> Result<Tensor> {
    let dims = Dims::check(q, k_pool, v_pool, how.batch)?;
    check_sinks(how.sinks, dims)?;
    let widen = |pool| codes::readable(pool, dims.codes, dims.head_dim);
    let (k_pool, v_pool) = (&widen(k_pool)?, &widen(v_pool)?);
    codes::rotated(q, dims, |q| {
        let (q, how) = codes::scored_as_codes(q, dims, how)?;
        attend(&q, k_pool, v_pool, how, dims)
    })
}

/// Refuses a sink list that is not one value per query head.
fn check_sinks(sinks: Option<&[f32]>, dims: Dims) -> Result<()> {
    match sinks {
        Some(s) if s.len() != dims.n_heads => Err(Error::InvalidBatch(format!(
            "{} attention sinks for {} query heads",
            s.len(),
            dims.n_heads
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_sequence_rejects_mismatched_context() {
        let mut b = AttentionBatch::new(4);
        assert!(b.push_sequence(&[0], &[0, 1], 4).is_err());
        assert!(b.push_sequence(&[0], &[0], 5).is_err());
        assert!(b.push_sequence(&[], &[0], 1).is_err());
        assert!(b.push_sequence(&[6], &[3, 1], 7).is_ok());
        assert_eq!(b.num_sequences(), 1);
        let view = b.sequences().next().unwrap();
        assert_eq!(view.slots().collect::<Vec<_>>(), [12, 13, 14, 15, 4, 5, 6]);
        assert!(b.check_slots(15).is_err());
        assert!(b.check_slots(16).is_ok());
        assert!(AttentionBatch::new(0).push_sequence(&[0], &[], 0).is_err());
    }
}

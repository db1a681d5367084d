//! The decoder on candle, one graph for every [`super::arch::Architecture`] (the optional
//! parts, biases, Q/K norms, norms after attention and MLP, sliding windows, are present or
//! not per layer), with attention through [`crate::attention`] over a [`KvPool`].
//!
//! One forward pass takes a [`ForwardBatch`]: the tokens of many sequences concatenated (a
//! decoding sequence contributes one token, a prefilling one many), each token's position and
//! destination slot, and each sequence's context. K/V of the new tokens are written to their
//! slots before attention reads the context, so prefill and decode share one pass. Logits are
//! computed only for the rows asked for (the output projection is the largest matmul).
//!
//! Weights come from a GGUF file or safetensors, held in the [`WeightFormat`] chosen at load:
//! by default packed for pensieve's own batch-invariant matmul (`packed.rs`), or as candle
//! `QMatMul`s for comparison.

use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::config::{ModelConfig, RopeVariant};
use super::packed::{Isa, PackedLinear};
use crate::attention::{attention_in_window, Attend, AttentionBatch, KvPool};
use crate::{Error, Result};

mod awake;
mod device;
mod ffn;
mod gguf;
mod gpt_oss;
#[cfg(feature = "cuda")]
mod gpu;
mod load;
mod names;
mod random;

use ffn::Ffn;

/// How linear-layer weights are held in memory and multiplied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WeightFormat {
    /// The default: pensieve's packed weights and its own matmul, one path for every pass
    /// size, so a row's logits do not depend on the rest of its batch. GGUF quantizations
    /// (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`) keep their codes and
    /// scales (about the file's bytes) and multiply activations quantized to 8 bits per 32
    /// values with integer dot products (AVX-512 VNNI or AVX2, chosen at run time); float
    /// weights keep their type (f32, f16, bf16); `Q2_K`/`Q3_K` are held as f32. On a GPU each
    /// tensor also keeps its own codes, on candle's kernels there: GGUF quantizations on its
    /// quantized matmul and row lookup, float weights in their type (the activations run in
    /// f16 or bf16 where every matrix is one); a type no kernel there reads (MXFP4, `Q8_K`)
    /// is converted to f16 with a warning naming it.
    #[default]
    Packed,
    /// Dequantized to f32 on candle's GEMM: 4 bytes per weight. The reference the packed
    /// path is checked against.
    F32,
    /// Dequantized to f16 on candle's matmul: half the bytes of f32. On a GPU the
    /// activations between the matmuls (residual stream, norms, RoPE) are f16 too; on the CPU
    /// they stay f32 (candle's CPU f16 element-wise ops are slow).
    F16,
    /// Kept in the file's quantized format on candle's quantized matmul (safetensors weights
    /// are quantized to Q8_0); candle quantizes activations too.
    Quantized,
    /// Converted to bf16 on candle's matmul: the bytes of f16 with f32's range. On a GPU the
    /// activations are bf16 too; on the CPU they stay f32.
    Bf16,
}

/// A linear layer's weights and the kernel that multiplies them.
#[derive(Debug)]
enum Linear {
    Candle(QMatMul),
    Packed(PackedLinear, Isa),
}

impl Linear {
    /// Bytes of the weights, read once per pass.
    fn bytes(&self) -> usize {
        match self {
            Linear::Candle(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
            Linear::Packed(p, _) => p.bytes(),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Candle(q) => device::forward(q, x),
            Linear::Packed(p, isa) => p.forward(x, None, *isa),
        }
    }

    /// `x · Wᵢᵀ` for each of `linears`: in one parallel region when all are packed for the
    /// same instructions.
    fn forward_many<const N: usize>(linears: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        let packed: Vec<(&PackedLinear, Isa)> = linears
            .iter()
            .filter_map(|l| match l {
                Linear::Packed(p, isa) => Some((p, *isa)),
                Linear::Candle(_) => None,
            })
            .collect();
        let outs = match packed.first() {
            Some(&(_, isa)) if packed.len() == N && packed.iter().all(|p| p.1 == isa) => {
                let ps: Vec<&PackedLinear> = packed.iter().map(|p| p.0).collect();
                PackedLinear::forward_many(&ps, x, isa)?
            }
            _ => linears
                .iter()
                .map(|l| l.forward(x))
                .collect::<Result<Vec<_>>>()?,
        };
        outs.try_into()
            .map_err(|_| Error::invalid_model("linear layers", "outputs lost"))
    }

    /// `residual + x · Wᵀ`, in one pass where the kernel can add it.
    fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Candle(q) => Ok((residual + device::forward(q, x)?)?),
            Linear::Packed(p, isa) => p.forward(x, Some(residual), *isa),
        }
    }
}

/// One decoder layer's weights, and how it attends.
#[derive(Debug)]
struct Layer {
    attn_norm: Tensor,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    /// Q, K and V biases (Qwen2, gpt-oss).
    qkv_bias: Option<[Tensor; 3]>,
    /// The attention output's bias (gpt-oss).
    o_bias: Option<Tensor>,
    /// Each query head's attention sink (gpt-oss).
    sinks: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and K (Qwen3, Gemma 3).
    qk_norm: Option<[Tensor; 2]>,
    /// Norm of the attention output before the residual add (Gemma 3).
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    ffn: Ffn,
    /// Norm of the MLP output before the residual add (Gemma 3).
    post_ffn_norm: Option<Tensor>,
    /// The attention window, if the layer attends within one.
    window: Option<u32>,
    /// Which of the model's rotary frequencies the layer uses.
    rope: usize,
}

impl Layer {
    /// The vectors activations meet (norms and biases).
    fn vectors(&self) -> impl Iterator<Item = &Tensor> {
        [&self.attn_norm, &self.ffn_norm]
            .into_iter()
            .chain(self.qkv_bias.iter().flatten())
            .chain(self.qk_norm.iter().flatten())
            .chain(self.post_attn_norm.as_ref())
            .chain(self.post_ffn_norm.as_ref())
            .chain(self.o_bias.as_ref())
            .chain(self.ffn.vectors())
    }

    /// [`Self::vectors`], to convert with the activations.
    fn vectors_mut(&mut self) -> impl Iterator<Item = &mut Tensor> {
        [&mut self.attn_norm, &mut self.ffn_norm]
            .into_iter()
            .chain(self.qkv_bias.iter_mut().flatten())
            .chain(self.qk_norm.iter_mut().flatten())
            .chain(self.post_attn_norm.as_mut())
            .chain(self.post_ffn_norm.as_mut())
            .chain(self.o_bias.as_mut())
            .chain(self.ffn.vectors_mut())
    }
}

/// The token embedding table.
#[derive(Debug)]
enum Embedding {
    /// A dense table in the activation type (the candle formats).
    Table(Tensor),
    /// Rows dequantized from packed weights as tokens are looked up, so the table takes no
    /// second copy in f32: its own, or the output projection's where the two are tied.
    Packed(Option<PackedLinear>),
    /// A quantized table on a GPU, its rows dequantized there as tokens are looked up (the
    /// output projection's own tensor where the two are tied).
    Codes(Arc<QTensor>),
}

/// A loaded Llama-family model.
#[derive(Debug)]
pub struct Transformer {
    config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// `[1, head_dim / 2]` rotary frequencies (f32): the global layers' first, then the
    /// sliding-window layers' where their base differs. The angles of a pass's positions are
    /// computed from them (a table over every position would take as much memory as a small
    /// model's weights).
    inv_freqs: Vec<Tensor>,
    device: Device,
    /// The type of activations between the matmuls (and of the embeddings, norms and rotary
    /// angles they meet).
    act: DType,
    /// How the linear weights are held.
    format: WeightFormat,
}

/// One step's worth of work for [`Transformer::forward`], as plain data.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    tokens: Vec<u32>,
    slots: Vec<u32>,
    positions: Vec<u32>,
    attention: AttentionBatch,
    logit_rows: Vec<u32>,
}

impl Default for ForwardBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl ForwardBatch {
    /// An empty batch whose contexts list their slots one by one (blocks of one slot).
    pub fn new() -> Self {
        Self::paged(1)
    }

    /// An empty batch whose contexts are block tables over a pool cut into blocks of
    /// `block_size` slots (see [`AttentionBatch`]).
    pub fn paged(block_size: usize) -> Self {
        Self {
            tokens: Vec::new(),
            slots: Vec::new(),
            positions: Vec::new(),
            attention: AttentionBatch::new(block_size),
            logit_rows: Vec::new(),
        }
    }

    /// Appends one sequence: its new `tokens` at `positions`, to be written into `slots`, and
    /// its whole context, positions `0..ctx_len` in `blocks` (which must cover the new
    /// tokens). With `want_logits`, the logits of the sequence's last new token are returned.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if the per-token lists differ in length or are empty, or the
    /// blocks do not cover the context.
    pub fn push(
        &mut self,
        tokens: &[u32],
        positions: &[u32],
        slots: &[u32],
        blocks: &[u32],
        ctx_len: usize,
        want_logits: bool,
    ) -> Result<()> {
        self.push_rows(tokens, positions, slots, blocks, ctx_len)?;
        if want_logits {
            self.logit_rows.push(self.tokens.len() as u32 - 1);
        }
        Ok(())
    }

    /// As [`Self::push`], returning the logits of every new token (scoring a sequence).
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn push_scored(
        &mut self,
        tokens: &[u32],
        positions: &[u32],
        slots: &[u32],
        blocks: &[u32],
        ctx_len: usize,
    ) -> Result<()> {
        let first = self.tokens.len() as u32;
        self.push_rows(tokens, positions, slots, blocks, ctx_len)?;
        self.logit_rows.extend(first..self.tokens.len() as u32);
        Ok(())
    }

    fn push_rows(
        &mut self,
        tokens: &[u32],
        positions: &[u32],
        slots: &[u32],
        blocks: &[u32],
        ctx_len: usize,
    ) -> Result<()> {
        if tokens.len() != positions.len() || tokens.len() != slots.len() {
            return Err(Error::InvalidBatch(format!(
                "{} tokens, {} positions, {} slots",
                tokens.len(),
                positions.len(),
                slots.len()
            )));
        }
        self.attention.push_sequence(positions, blocks, ctx_len)?;
        self.tokens.extend_from_slice(tokens);
        self.positions.extend_from_slice(positions);
        self.slots.extend_from_slice(slots);
        Ok(())
    }

    /// Number of new tokens.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Number of logit rows [`Transformer::forward`] will return.
    pub fn num_logit_rows(&self) -> usize {
        self.logit_rows.len()
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

impl Transformer {
    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of linear-layer weights one forward pass reads (every layer's projections and
    /// the output layer): the memory traffic that bounds a decode step.
    pub fn weight_bytes(&self) -> usize {
        self.linears().map(Linear::bytes).sum()
    }

    /// Every linear layer: each layer's projections and MLP, then the output layer.
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        let layers = self.layers.iter().flat_map(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo]
                .into_iter()
                .chain(l.ffn.linears())
        });
        layers.chain(std::iter::once(&self.lm_head))
    }

    /// Bytes of every weight the model holds on its device: the linear layers, the embedding
    /// table where it is not the output projection's, the norms and biases. About the file's
    /// tensor bytes where the weights keep their own codes.
    pub fn held_bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let head = match &self.lm_head {
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => Some(t.id()),
            _ => None,
        };
        let embed = match (&self.embed, &self.lm_head) {
            (Embedding::Table(t), _) if Some(t.id()) == head => 0,
            (Embedding::Table(t), _) => size(t),
            (Embedding::Packed(p), _) => p.as_ref().map_or(0, PackedLinear::bytes),
            (Embedding::Codes(q), Linear::Candle(QMatMul::QTensor(h))) if Arc::ptr_eq(q, h) => 0,
            (Embedding::Codes(q), _) => q.storage_size_in_bytes(),
        };
        let vectors: usize = (self.layers.iter())
            .flat_map(|l| l.vectors())
            .map(size)
            .sum();
        self.weight_bytes() + embed + vectors + size(&self.norm)
    }

    /// The pass's input: the embeddings of `tokens`, scaled where the architecture scales
    /// them.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let x = self.embed_rows(tokens)?;
        if !self.config.architecture.scales_embedding() {
            return Ok(x);
        }
        // In the activation type, as the reference implementations round it.
        let s = (self.config.hidden_size as f32).sqrt();
        let s = Tensor::new(&[s], &self.device)?.to_dtype(self.act)?;
        Ok(x.broadcast_mul(&s)?)
    }

    /// The embeddings of `tokens`, `[tokens, hidden]` in the activation type.
    fn embed_rows(&self, tokens: &[u32]) -> Result<Tensor> {
        let packed = match (&self.embed, &self.lm_head) {
            (Embedding::Table(t), _) => {
                let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
                return Ok(t.index_select(&ids, 0)?.to_dtype(self.act)?);
            }
            (Embedding::Codes(q), _) => {
                let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
                return Ok(q.embedding(&ids)?.to_dtype(self.act)?);
            }
            (Embedding::Packed(Some(p)), _) | (Embedding::Packed(None), Linear::Packed(p, _)) => p,
            (Embedding::Packed(None), Linear::Candle(_)) => {
                return Err(Error::invalid_model(
                    "token embedding",
                    "tied to no packed output",
                ))
            }
        };
        let rows = packed.rows(tokens)?;
        let x = Tensor::from_vec(rows, (tokens.len(), self.config.hidden_size), &self.device)?;
        Ok(x.to_dtype(self.act)?)
    }

    /// A digest of what this model computes KV with: its hyper-parameters, weight format,
    /// activation type and a sample of its weights (every 64th embedding row and the norm
    /// weights), so KV stored by another model or format is never taken for this one's.
    ///
    /// # Errors
    /// [`Error::Candle`] if the weights cannot be read.
    pub fn fingerprint(&self) -> Result<[u8; 32]> {
        let mut h = blake3::Hasher::new();
        h.update(format!("{:?}|{:?}|{:?}", self.config, self.format, self.act).as_bytes());
        h.update(&self.weight_bytes().to_le_bytes());
        let rows: Vec<u32> = (0..self.config.vocab_size as u32).step_by(64).collect();
        let mut sample = vec![self.embed_rows(&rows)?.flatten_all()?, self.norm.clone()];
        sample.extend(self.layers.iter().map(|l| l.attn_norm.clone()));
        for t in sample {
            for x in t.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                h.update(&x.to_le_bytes());
            }
        }
        Ok(*h.finalize().as_bytes())
    }

    /// How the linear-layer weights are held.
    pub fn weight_format(&self) -> WeightFormat {
        self.format
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs one forward pass, writing the new tokens' K/V into `pool`, and returns f32 logits
    /// `[num_logit_rows, vocab]` in push order.
    ///
    /// # Errors
    /// [`Error::TokenOutOfVocab`], [`Error::ContextOverflow`], [`Error::InvalidBatch`] for bad
    /// batches (nothing is written then); [`Error::Candle`] for device failures.
    pub fn forward(&self, batch: &ForwardBatch, pool: &KvPool) -> Result<Tensor> {
        // The pass runs on a worker of rayon's pool, so each parallel op inside it forks from
        // a worker (work stealing) instead of waking the pool from outside and sleeping on a
        // latch: one hand-off per pass instead of one per op (measured: 1.2x replay output).
        // Beside it, the other workers are kept awake until it ends (`awake`; measured on a
        // Xeon, 8 rows of SmolLM2: 23.6 ms a step before, 16.1-18.2 ms after).
        awake::run(|| self.forward_here(batch, pool))
    }

    /// Refuses a batch with a token outside the vocabulary or a position past the window.
    fn check_batch(&self, batch: &ForwardBatch) -> Result<()> {
        let c = &self.config;
        if let Some(&id) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::TokenOutOfVocab {
                id,
                vocab: c.vocab_size,
            });
        }
        let longest = batch.attention.sequences().map(|s| s.ctx_len).max();
        if let Some(n) = longest.filter(|&n| n > c.max_position_embeddings) {
            return Err(Error::ContextOverflow {
                position: n - 1,
                window: c.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// The rotary tables (cos, sin) of every RoPE the layers use, at the batch's positions.
    fn rope_tables(&self, positions: &[u32]) -> Result<Vec<(Tensor, Tensor)>> {
        let (c, t) = (&self.config, positions.len());
        let positions: Vec<f32> = positions.iter().map(|&p| p as f32).collect();
        let positions = Tensor::from_vec(positions, (t, 1), &self.device)?;
        self.inv_freqs
            .iter()
            .map(|inv_freq| {
                let angles = positions.broadcast_mul(inv_freq)?;
                let scale = f64::from(c.rope.attention_factor.unwrap_or(1.0));
                let at = |v: Tensor| -> Result<Tensor> {
                    let v = if scale == 1.0 {
                        v
                    } else {
                        v.affine(scale, 0.0)?
                    };
                    Ok(v.to_dtype(self.act)?.reshape((t, 1, c.rotary_dim() / 2))?)
                };
                Ok((at(angles.cos()?)?, at(angles.sin()?)?))
            })
            .collect()
    }

    fn forward_here(&self, batch: &ForwardBatch, pool: &KvPool) -> Result<Tensor> {
        let c = &self.config;
        self.check_batch(batch)?;
        // CUDA cannot allocate zero bytes (`cuMemAllocAsync` refuses them): a pass without
        // logit rows returns its empty logits on the CPU.
        let no_logits = || Tensor::zeros((0, c.vocab_size), DType::F32, &Device::Cpu);
        if batch.is_empty() {
            return Ok(no_logits()?);
        }
        #[cfg(feature = "cuda")]
        if self.fuses(pool) {
            return self.forward_fused(batch, pool);
        }
        let t = batch.num_tokens();
        let dev = &self.device;
        let write_index = pool.write_index(&batch.slots, dev)?;
        let ropes = self.rope_tables(&batch.positions)?;
        let scale = c.attention_scale();
        let eps = c.rms_norm_eps as f32;
        let arch = c.architecture;

        let mut x = self.embed(&batch.tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = &ropes[layer.rope.min(ropes.len() - 1)];
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let [q, k, v] = Linear::forward_many([&layer.wq, &layer.wk, &layer.wv], &h)?;
            let project = |y: Tensor, bias: usize, heads: usize| -> Result<Tensor> {
                let y = match &layer.qkv_bias {
                    Some(b) => y.broadcast_add(&b[bias])?,
                    None => y,
                };
                Ok(y.reshape((t, heads, c.head_dim))?)
            };
            let (mut q, mut k) = (project(q, 0, c.num_heads)?, project(k, 1, c.num_kv_heads)?);
            let v = project(v, 2, c.num_kv_heads)?;
            if let Some([qn, kn]) = &layer.qk_norm {
                q = candle_nn::ops::rms_norm(&q, qn, eps)?;
                k = candle_nn::ops::rms_norm(&k, kn, eps)?;
            }
            let (q, k) = (self.rope(&q, cos, sin)?, self.rope(&k, cos, sin)?);
            pool.write(i, &write_index, &k, &v)?;
            let (k_pool, v_pool) = pool.layer(i)?;
            let (window, sinks) = (layer.window, layer.sinks.as_deref());
            let how = Attend::new(&batch.attention, scale).window(window);
            let a = attention_in_window(&q, k_pool, v_pool, how.sinks(sinks))?;
            let a = a.reshape((t, c.num_heads * c.head_dim))?;
            x = match &layer.post_attn_norm {
                Some(n) => (&x + candle_nn::ops::rms_norm(&layer.wo.forward(&a)?, n, eps)?)?,
                None => layer.wo.forward_residual(&a, &x)?,
            };
            if let Some(b) = &layer.o_bias {
                x = x.broadcast_add(b)?;
            }

            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let act = arch.activation();
            x = match &layer.post_ffn_norm {
                Some(n) => {
                    let y = layer.ffn.forward(&h, None, act)?;
                    (&x + candle_nn::ops::rms_norm(&y, n, eps)?)?
                }
                None => layer.ffn.forward(&h, Some(&x), act)?,
            };
        }
        if batch.logit_rows.is_empty() {
            return Ok(no_logits()?);
        }
        let rows = Tensor::from_slice(&batch.logit_rows, batch.logit_rows.len(), dev)?;
        let x = x.index_select(&rows, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self.lm_head.forward(&x)?.to_dtype(DType::F32)?)
    }

    /// `x`: `[tokens, heads, head_dim]` → rotated, same shape.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (t, heads, d) = x.dims3()?;
        // [tokens, heads, 1, d] is candle's [batch, heads, seq, d] with one position per
        // "batch" row, which lets every token carry its own position.
        let x = x.reshape((t, heads, 1, d))?;
        let rotary = self.config.rotary_dim();
        let turn = |x: &Tensor| -> Result<Tensor> {
            Ok(match self.config.rope.variant {
                RopeVariant::Interleaved => candle_nn::rotary_emb::rope_i(x, cos, sin)?,
                RopeVariant::HalfSplit => candle_nn::rotary_emb::rope(x, cos, sin)?,
            })
        };
        let y = match rotary < d {
            // Partial rotary: the first dimensions turn, the rest pass as they are.
            true => {
                let turned = turn(&x.narrow(3, 0, rotary)?.contiguous()?)?;
                Tensor::cat(&[turned, x.narrow(3, rotary, d - rotary)?], 3)?
            }
            false => turn(&x)?,
        };
        Ok(y.reshape((t, heads, d))?)
    }
}

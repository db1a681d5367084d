//! The pass on a GPU with a step's small ops fused (`crate::model::fused`, `kernels/step.cu`).
//!
//! A decode step on a GPU takes as long as the host takes to issue it: some twenty launches a
//! layer, each a few microseconds of candle and driver work, against a GPU that reads a 1B
//! model's layer in a few dozen. This pass issues about half as many: the residual add with
//! the next norm, RoPE with the Q widening and the KV write, the MLP's activation with its
//! product, each one kernel. Every row is computed on its own, so a row's output does not
//! depend on the batch. It takes the Llama family's layer (no biases, no per-head or post
//! norms, no sinks, a dense MLP, RoPE over the whole head); other layers run
//! [`Transformer::forward_here`]'s candle ops.

use candle_core::{DType, Device, Tensor};

use super::ffn::Ffn;
use super::{ForwardBatch, Linear, RopeVariant, Transformer};
use crate::attention::{attention_in_window, Attend, KvPool};
use crate::model::fused::{self, add_rms_norm, RopeWrite};
use crate::Result;

/// Whether a type is one the fused kernels take.
fn takes(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

impl Transformer {
    /// Whether a pass over `pool` runs fused: on a CUDA device, for a stack of Llama-family
    /// layers with activations and KV in f32, f16 or bf16, where [`fused::runs_on`] the device.
    pub(super) fn fuses(&self, pool: &KvPool) -> bool {
        let plain = |l: &super::Layer| {
            l.qkv_bias.is_none()
                && l.qk_norm.is_none()
                && l.post_attn_norm.is_none()
                && l.post_ffn_norm.is_none()
                && l.o_bias.is_none()
                && l.sinks.is_none()
                && matches!(l.ffn, Ffn::Dense { .. })
        };
        matches!(&self.device, Device::Cuda(d) if fused::runs_on(d))
            && takes(self.act)
            && takes(pool.dtype())
            && self.config.rotary_dim() == self.config.head_dim
            && !self.layers.is_empty()
            && self.layers.iter().all(plain)
    }

    /// [`Transformer::forward`] fused (see the module comment); the caller checked the batch
    /// and [`Self::fuses`].
    pub(super) fn forward_fused(&self, batch: &ForwardBatch, pool: &KvPool) -> Result<Tensor> {
        let c = &self.config;
        let (t, dev) = (batch.num_tokens(), &self.device);
        let (scale, eps) = (c.attention_scale(), c.rms_norm_eps as f32);
        let slots = pool.slot_tensor(&batch.slots, dev)?;
        let ropes = (self.rope_tables(&batch.positions)?.into_iter())
            .map(|(cos, sin)| {
                Ok((
                    cos.reshape((t, c.head_dim / 2))?,
                    sin.reshape((t, c.head_dim / 2))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let act = c.architecture.activation();

        let mut x = self.embed(&batch.tokens)?;
        let mut h = candle_nn::ops::rms_norm(&x, &self.layers[0].attn_norm, eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = &ropes[layer.rope.min(ropes.len() - 1)];
            let [q, k, v] = Linear::forward_many([&layer.wq, &layer.wk, &layer.wv], &h)?;
            let (k_pool, v_pool) = pool.layer(i)?;
            let rope = RopeWrite {
                cos,
                sin,
                slots: &slots,
                k_pool,
                v_pool,
                n_heads: c.num_heads,
                n_kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                interleaved: matches!(c.rope.variant, RopeVariant::Interleaved),
            };
            let q = q.apply_op3_no_bwd(&k, &v, &rope)?;
            let a = attention_in_window(
                &q,
                k_pool,
                v_pool,
                Attend::new(&batch.attention, scale).window(layer.window),
            )?;
            let a = a
                .reshape((t, c.num_heads * c.head_dim))?
                .to_dtype(self.act)?;
            (x, h) = add_rms_norm(&x, &layer.wo.forward(&a)?, &layer.ffn_norm, eps)?;
            let y = layer.ffn.forward(&h, None, act)?;
            // The next layer's norm, or after the last the model's (over every row: a row's
            // norm is its own, so the logit rows' are as if chosen first).
            let norm = self.layers.get(i + 1).map_or(&self.norm, |l| &l.attn_norm);
            (x, h) = add_rms_norm(&x, &y, norm, eps)?;
        }
        if batch.logit_rows.is_empty() {
            return Ok(Tensor::zeros((0, c.vocab_size), DType::F32, &Device::Cpu)?);
        }
        let rows = Tensor::from_slice(&batch.logit_rows, batch.logit_rows.len(), dev)?;
        let h = h.index_select(&rows, 0)?;
        Ok(self.lm_head.forward(&h)?.to_dtype(DType::F32)?)
    }
}

//! Building a [`Llama`]: from GGUF or safetensors tensors, or seeded random weights of a
//! shape; the weight format each linear layer is held in, and the activation type that goes
//! with it.

use std::collections::HashMap;
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::{Layer, Linear, Llama, WeightFormat};
use crate::model::config::LlamaConfig;
use crate::model::packed::{Isa, PackedLinear};
use crate::{Error, Result};

/// Names of one layer's tensors in a checkpoint format (without the layer prefix and the
/// `.weight` suffix).
struct LayerNames {
    attn_norm: &'static str,
    ffn_norm: &'static str,
    wq: &'static str,
    wk: &'static str,
    wv: &'static str,
    wo: &'static str,
    w_gate: &'static str,
    w_up: &'static str,
    w_down: &'static str,
}

/// llama.cpp's GGUF names.
const GGUF_NAMES: LayerNames = LayerNames {
    attn_norm: "attn_norm",
    ffn_norm: "ffn_norm",
    wq: "attn_q",
    wk: "attn_k",
    wv: "attn_v",
    wo: "attn_output",
    w_gate: "ffn_gate",
    w_up: "ffn_up",
    w_down: "ffn_down",
};

/// Hugging Face `LlamaForCausalLM` names.
const HF_NAMES: LayerNames = LayerNames {
    attn_norm: "input_layernorm",
    ffn_norm: "post_attention_layernorm",
    wq: "self_attn.q_proj",
    wk: "self_attn.k_proj",
    wv: "self_attn.v_proj",
    wo: "self_attn.o_proj",
    w_gate: "mlp.gate_proj",
    w_up: "mlp.up_proj",
    w_down: "mlp.down_proj",
};

impl Layer {
    /// Reads one layer through `fetch` (a raw tensor by name), turning raw tensors into
    /// linear weights and norm weights with the format's converters.
    fn load<T>(
        names: &LayerNames,
        mut fetch: impl FnMut(&str) -> Result<T>,
        linear: impl Fn(T) -> Result<Linear>,
        norm: impl Fn(T) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut lin = |n: &str| linear(fetch(n)?);
        let (wq, wk, wv, wo) = (
            lin(names.wq)?,
            lin(names.wk)?,
            lin(names.wv)?,
            lin(names.wo)?,
        );
        let (w_gate, w_up, w_down) = (lin(names.w_gate)?, lin(names.w_up)?, lin(names.w_down)?);
        Ok(Self {
            attn_norm: norm(fetch(names.attn_norm)?)?,
            ffn_norm: norm(fetch(names.ffn_norm)?)?,
            wq,
            wk,
            wv,
            wo,
            w_gate,
            w_up,
            w_down,
        })
    }
}

impl Llama {
    /// Loads a `llama` GGUF file.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for other architectures, missing tensors or corrupt data.
    pub fn from_gguf<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let config = LlamaConfig::from_gguf(content)?;
        let mut get = |name: &str| -> Result<QTensor> {
            content
                .tensor(reader, name, device)
                .map_err(|e| Error::invalid_model(name, e))
        };
        let embed_q = get("token_embd.weight")?;
        let embed = embed_q.dequantize(device)?;
        let lm_head = if config.tie_word_embeddings {
            linear_from_q(embed_q, format, device)?
        } else {
            linear_from_q(get("output.weight")?, format, device)?
        };
        let norm = get("output_norm.weight")?.dequantize(device)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            layers.push(Layer::load(
                &GGUF_NAMES,
                |n| get(&format!("blk.{i}.{n}.weight")),
                |q| linear_from_q(q, format, device),
                |q| Ok(q.dequantize(device)?),
            )?);
        }
        Self::assemble(config, embed, layers, norm, lm_head, device)?.with_format(format, device)
    }

    /// Builds the model from Hugging Face-named tensors (`model.layers.N.self_attn.q_proj.weight`
    /// ...), as found in safetensors checkpoints.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for missing tensors or wrong shapes.
    pub fn from_hf_tensors(
        config: LlamaConfig,
        mut tensors: HashMap<String, Tensor>,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let mut take = |name: &str| -> Result<Tensor> {
            let t = tensors
                .remove(name)
                .ok_or_else(|| Error::invalid_model(name, "missing tensor"))?;
            Ok(t.to_device(device)?.to_dtype(DType::F32)?)
        };
        let embed = take("model.embed_tokens.weight")?;
        let lm_head = if config.tie_word_embeddings {
            linear_from_tensor(embed.clone(), format)?
        } else {
            linear_from_tensor(take("lm_head.weight")?, format)?
        };
        let norm = take("model.norm.weight")?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            layers.push(Layer::load(
                &HF_NAMES,
                |n| take(&format!("model.layers.{i}.{n}.weight")),
                |t| linear_from_tensor(t, format),
                Ok,
            )?);
        }
        Self::assemble(config, embed, layers, norm, lm_head, device)?.with_format(format, device)
    }

    /// A model of `config`'s shape with random weights, for throughput studies of shapes whose
    /// weights are not at hand (the papers measure 7B-70B shapes). Values are uniform, scaled by
    /// each matrix's fan-in so activations keep their size through the layers; norms are one.
    /// The same `seed` gives the same weights.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for an inconsistent `config`.
    pub fn random(
        config: LlamaConfig,
        seed: u64,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let (h, q, kv, ff) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let mut state = seed;
        let mut matrix = |rows: usize, cols: usize| -> Result<Tensor> {
            let bound = (3.0 / cols as f32).sqrt();
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| (2.0 * splitmix_unit(&mut state) - 1.0) * bound)
                .collect();
            Ok(Tensor::from_vec(values, (rows, cols), device)?)
        };
        let ones = || Tensor::ones(h, DType::F32, device);
        let mut tensors = HashMap::new();
        tensors.insert(
            "model.embed_tokens.weight".to_string(),
            matrix(c.vocab_size, h)?,
        );
        if !c.tie_word_embeddings {
            tensors.insert("lm_head.weight".to_string(), matrix(c.vocab_size, h)?);
        }
        tensors.insert("model.norm.weight".to_string(), ones()?);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            for (name, rows, cols) in [
                ("self_attn.q_proj", q, h),
                ("self_attn.k_proj", kv, h),
                ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, q),
                ("mlp.gate_proj", ff, h),
                ("mlp.up_proj", ff, h),
                ("mlp.down_proj", h, ff),
            ] {
                tensors.insert(format!("{p}.{name}.weight"), matrix(rows, cols)?);
            }
            for norm in ["input_layernorm", "post_attention_layernorm"] {
                tensors.insert(format!("{p}.{norm}.weight"), ones()?);
            }
        }
        Self::from_hf_tensors(config, tensors, format, device)
    }

    fn assemble(
        config: LlamaConfig,
        embed: Tensor,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Linear,
        device: &Device,
    ) -> Result<Self> {
        let c = &config;
        let expect = [
            (
                "token embedding",
                embed.dims().to_vec(),
                vec![c.vocab_size, c.hidden_size],
            ),
            ("output norm", norm.dims().to_vec(), vec![c.hidden_size]),
        ];
        for (what, got, want) in expect {
            if got != want {
                return Err(Error::invalid_model(
                    what,
                    format!("shape {got:?}, expected {want:?}"),
                ));
            }
        }
        let inv_freq = config.rope_inv_freq();
        let half = inv_freq.len();
        let n = config.max_position_embeddings;
        let inv_freq = Tensor::from_vec(inv_freq, (1, half), device)?;
        let pos = Tensor::arange(0u32, n as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((n, 1))?;
        let freqs = pos.broadcast_mul(&inv_freq)?;
        Ok(Self {
            cos: freqs.cos()?.contiguous()?,
            sin: freqs.sin()?.contiguous()?,
            embed,
            layers,
            norm,
            lm_head,
            device: device.clone(),
            config,
            act: DType::F32,
            format: WeightFormat::default(),
        })
    }

    /// The same model, recorded as held in `format`, computing its activations in the type
    /// that format calls for on `device`.
    fn with_format(mut self, format: WeightFormat, device: &Device) -> Result<Self> {
        self.format = format;
        self.with_activations(activation_dtype(format, device))
    }

    /// The same model computing its activations in `act`: the tensors activations meet
    /// (embeddings, norm weights, rotary tables) are converted once here.
    fn with_activations(mut self, act: DType) -> Result<Self> {
        if act == self.act {
            return Ok(self);
        }
        for t in [
            &mut self.embed,
            &mut self.norm,
            &mut self.cos,
            &mut self.sin,
        ] {
            *t = t.to_dtype(act)?;
        }
        for l in &mut self.layers {
            l.attn_norm = l.attn_norm.to_dtype(act)?;
            l.ffn_norm = l.ffn_norm.to_dtype(act)?;
        }
        self.act = act;
        Ok(self)
    }
}

/// f16 activations where the weights are f16 on a GPU (every op there has an f16 kernel and
/// the residual stream's bytes halve); f32 elsewhere.
fn activation_dtype(format: WeightFormat, device: &Device) -> DType {
    if format == WeightFormat::F16 && !device.is_cpu() {
        DType::F16
    } else {
        DType::F32
    }
}

fn linear_from_q(q: QTensor, format: WeightFormat, device: &Device) -> Result<Linear> {
    let main = match (format, q.dtype()) {
        (WeightFormat::Packed, _) if device.is_cpu() => {
            return Ok(Linear::Packed(
                PackedLinear::from_qtensor(&q)?,
                Isa::detect(),
            ));
        }
        (WeightFormat::F16, _) => QMatMul::TensorF16(q.dequantize_f16(device)?),
        (WeightFormat::Quantized, dt) if !matches!(dt, GgmlDType::F32 | GgmlDType::F16) => {
            QMatMul::QTensor(std::sync::Arc::new(q))
        }
        _ => QMatMul::Tensor(q.dequantize(device)?),
    };
    Ok(Linear::Candle(main))
}

fn linear_from_tensor(w: Tensor, format: WeightFormat) -> Result<Linear> {
    let main = match format {
        WeightFormat::Packed if w.device().is_cpu() => {
            let (n, k) = w.dims2()?;
            let values = w.flatten_all()?.to_vec1::<f32>()?;
            return Ok(Linear::Packed(
                PackedLinear::from_f32(&values, n, k)?,
                Isa::detect(),
            ));
        }
        WeightFormat::F32 | WeightFormat::Packed => QMatMul::Tensor(w),
        WeightFormat::F16 => QMatMul::TensorF16(w.to_dtype(DType::F16)?),
        WeightFormat::Quantized => {
            QMatMul::QTensor(std::sync::Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0)?))
        }
    };
    Ok(Linear::Candle(main))
}

/// splitmix64: a uniform value in [0, 1) from a 64-bit state, fast enough for a billion
/// weights and stable across platforms and crate versions (unlike a `rand` generator).
fn splitmix_unit(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}

/// Reads every tensor of the safetensors files in `paths` (shards of one checkpoint).
///
/// # Errors
/// [`Error::InvalidModel`] for unreadable or corrupt files.
pub fn read_safetensors(
    paths: &[impl AsRef<Path>],
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let mut all = HashMap::new();
    for p in paths {
        let p = p.as_ref();
        let tensors = candle_core::safetensors::load(p, device)
            .map_err(|e| Error::invalid_model(p.display().to_string(), e))?;
        all.extend(tensors);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::super::ForwardBatch;
    use super::*;
    use crate::attention::KvPool;

    /// The f16 activation path (a GPU's, run here on the CPU) tracks f32 activations over the
    /// same f16 weights.
    #[test]
    fn f16_activations_track_f32() {
        let config = LlamaConfig::from_hf_json(
            r#"{"vocab_size":300,"hidden_size":128,"intermediate_size":256,"num_hidden_layers":3,
                "num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-5,
                "rope_theta":10000.0,"max_position_embeddings":256,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let cpu = Device::Cpu;
        let f32_act = Llama::random(config.clone(), 3, WeightFormat::F16, &cpu).unwrap();
        let f16_act = Llama::random(config, 3, WeightFormat::F16, &cpu)
            .unwrap()
            .with_activations(DType::F16)
            .unwrap();
        assert_eq!((f32_act.act, f16_act.act), (DType::F32, DType::F16));
        let n = 40u32;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 37 + 5) % 300).collect();
        let idx: Vec<u32> = (0..n).collect();
        let logits = |m: &Llama| {
            let pool = KvPool::new(m.config().kv_shape(), n as usize, DType::F16, &cpu).unwrap();
            let mut batch = ForwardBatch::new();
            batch.push_scored(&tokens, &idx, &idx, &idx, &idx).unwrap();
            let out = m.forward(&batch, &pool).unwrap();
            assert_eq!(out.dtype(), DType::F32);
            out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let (a, b) = (logits(&f32_act), logits(&f16_act));
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(scale > 0.1, "degenerate logits");
        assert!(
            err < 1e-2 * scale,
            "f16 activations off by {err} (scale {scale})"
        );
    }
}

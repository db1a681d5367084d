//! Building a [`Llama`]: from GGUF or safetensors tensors, or seeded random weights of a
//! shape; the weight format each linear layer is held in, and the activation type that goes
//! with it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::ffn::{Biases, Ffn, Mixture};
use super::names::{check_tensors, Part, Role, Scheme};
use super::{device, Embedding, Layer, Linear, Transformer, WeightFormat};
use crate::model::config::ModelConfig;
use crate::model::gguf::GgufType;
use crate::model::packed::{Isa, PackedLinear};
use crate::{Error, Result};

impl Layer {
    /// Reads layer `index` of `config`'s graph through `fetch` (a raw tensor by name),
    /// turning raw tensors into linear weights (of a part, where a tensor holds several: one
    /// expert of stacked ones, one projection of fused ones) and vectors (norms, biases) with
    /// the format's converters.
    pub(super) fn load<T: Clone>(
        config: &ModelConfig,
        scheme: Scheme,
        index: usize,
        mut fetch: impl FnMut(&str) -> Result<T>,
        linear: impl Fn(T, Part) -> Result<Linear>,
        vector: impl Fn(T) -> Result<Tensor>,
    ) -> Result<Self> {
        let arch = config.architecture;
        let mut raw = |r: Role| fetch(&r.name(scheme, arch, index));
        // A fused matrix's projections, by their rows: read once, split in `linear`.
        let mut split = |r: Role, lens: &[usize]| -> Result<Vec<Linear>> {
            let t = raw(r)?;
            let starts = lens.iter().scan(0, |at, &len| {
                *at += len;
                Some(*at - len)
            });
            (starts.zip(lens))
                .map(|(start, &len)| linear(t.clone(), Part::Rows { start, len }))
                .collect()
        };
        let (q, kv) = (
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        );
        let fused = arch.fused_projections();
        let qkv = match fused {
            true => split(Role::Wqkv, &[q, kv, kv])?,
            false => Vec::new(),
        };
        let ff = config.intermediate_size;
        let gate_up = match fused && config.experts.is_none() {
            true => split(Role::GateUp, &[ff, ff])?,
            false => Vec::new(),
        };
        let mut lin = |r: Role| linear(raw(r)?, r.part(scheme));
        let [wq, wk, wv] = match <[Linear; 3]>::try_from(qkv) {
            Ok(split) => split,
            Err(_) => [lin(Role::Wq)?, lin(Role::Wk)?, lin(Role::Wv)?],
        };
        let wo = lin(Role::Wo)?;
        let ffn = match (config.experts, <[Linear; 2]>::try_from(gate_up)) {
            (None, Ok([gate, up])) => Ffn::Dense {
                gate,
                up,
                down: lin(Role::Down)?,
            },
            (None, Err(_)) => Ffn::Dense {
                gate: lin(Role::Gate)?,
                up: lin(Role::Up)?,
                down: lin(Role::Down)?,
            },
            (Some(shape), _) => Ffn::Experts(Mixture {
                router: lin(Role::Router)?,
                experts: (0..shape.count)
                    .map(|e| {
                        Ok([
                            lin(Role::ExpertGate(e))?,
                            lin(Role::ExpertUp(e))?,
                            lin(Role::ExpertDown(e))?,
                        ])
                    })
                    .collect::<Result<_>>()?,
                shape,
                biases: None,
            }),
        };
        let roles = Role::of(config);
        // A GGUF file's experts' biases are rows of one tensor per projection, read once.
        let mut stacked: Option<(String, Tensor)> = None;
        let mut vectors = roles
            .iter()
            .filter(|r| r.is_vector())
            .map(|&r| {
                let mut v = match r.part(scheme) {
                    Part::Expert(e) => {
                        let name = r.name(scheme, arch, index);
                        let whole = match stacked.take() {
                            Some((held, t)) if held == name => t,
                            _ => vector(raw(r)?)?,
                        };
                        let row = whole.get(e)?;
                        stacked = Some((name, whole));
                        row
                    }
                    _ => vector(raw(r)?)?,
                };
                if r.is_norm() && scheme == Scheme::Hf && arch.hf_norm_offset() {
                    v = (v + 1.0)?;
                }
                Ok((r, v))
            })
            .collect::<Result<Vec<(Role, Tensor)>>>()?;
        let mut take = |r: Role| {
            let i = vectors.iter().position(|(role, _)| *role == r)?;
            Some(vectors.swap_remove(i).1)
        };
        let required = |v: Option<Tensor>, r: Role| {
            v.ok_or_else(|| Error::invalid_model(r.name(scheme, arch, index), "missing tensor"))
        };
        let attn_norm = required(take(Role::AttnNorm), Role::AttnNorm)?;
        let ffn_norm = required(take(Role::FfnNorm), Role::FfnNorm)?;
        let qkv_bias = match (take(Role::QBias), take(Role::KBias), take(Role::VBias)) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        };
        let qk_norm = match (take(Role::QNorm), take(Role::KNorm)) {
            (Some(q), Some(k)) => Some([q, k]),
            _ => None,
        };
        let window = config.layer_windows.get(index).copied().flatten();
        let mut ffn = ffn;
        if let (Ffn::Experts(m), true) = (&mut ffn, arch.sinks_and_biases()) {
            let router = required(take(Role::RouterBias), Role::RouterBias)?;
            let experts = (0..m.shape.count)
                .map(|e| {
                    let [g, u, d] = [
                        Role::ExpertGateBias(e),
                        Role::ExpertUpBias(e),
                        Role::ExpertDownBias(e),
                    ]
                    .map(|r| required(take(r), r));
                    Ok([g?, u?, d?])
                })
                .collect::<Result<_>>()?;
            m.biases = Some(Biases { router, experts });
        }
        let sinks = match take(Role::Sinks) {
            Some(s) => Some(s.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Self {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            qkv_bias,
            o_bias: take(Role::OBias),
            sinks,
            qk_norm,
            post_attn_norm: take(Role::PostAttnNorm),
            ffn_norm,
            ffn,
            post_ffn_norm: take(Role::PostFfnNorm),
            window,
            rope: usize::from(window.is_some() && !config.uniform_rope()),
        })
    }
}

impl Transformer {
    /// Loads a safetensors checkpoint (one file or shards) memory-mapped, after checking
    /// from the files' headers that they hold exactly the tensors `config`'s graph reads.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for unreadable or corrupt files, missing or unused tensors.
    pub fn from_safetensors(
        config: ModelConfig,
        paths: &[impl AsRef<Path>],
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let shown = |p: &[_]| {
            p.iter()
                .map(|p: &std::path::PathBuf| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let paths: Vec<std::path::PathBuf> =
            paths.iter().map(|p| p.as_ref().to_path_buf()).collect();
        // SAFETY: the files are mapped read-only; the caller must not modify them while the
        // model loads (the same contract as every memory-mapped checkpoint reader).
        let files = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&paths) }
            .map_err(|e| Error::invalid_model(shown(&paths), e))?;
        let names: Vec<String> = files.tensors().into_iter().map(|(n, _)| n).collect();
        // Tensor by tensor, each in its own type until it is packed: never the whole
        // checkpoint in a second copy.
        Self::from_hf(config, &names, format, device, |n| {
            files
                .load(n, device)
                .map_err(|e| Error::invalid_model(n, e))
        })
    }

    /// Builds the model from Hugging Face-named tensors (`model.layers.N.self_attn.q_proj.weight`
    /// ...), as found in safetensors checkpoints.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for missing, unused or wrongly shaped tensors.
    pub fn from_hf_tensors(
        config: ModelConfig,
        mut tensors: HashMap<String, Tensor>,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let names: Vec<String> = tensors.keys().cloned().collect();
        Self::from_hf(config, &names, format, device, |name| {
            tensors
                .remove(name)
                .ok_or_else(|| Error::invalid_model(name, "missing tensor"))
        })
    }

    /// Builds the model from the tensors `names`, each read once through `fetch`.
    fn from_hf(
        config: ModelConfig,
        names: &[String],
        format: WeightFormat,
        device: &Device,
        mut fetch: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let config = untie_if_present(config, names);
        // gpt-oss's fused experts are read as each expert's projections.
        let gpt_oss = config.architecture == crate::model::Architecture::GptOss;
        let mut unfuse = super::gpt_oss::Unfuse::new(names);
        let names = match gpt_oss {
            true => super::gpt_oss::unfused_names(&config, names),
            false => names.to_vec(),
        };
        check_tensors(&config, Scheme::Hf, names.iter().map(String::as_str))?;
        let mut take = |name: &str| {
            let t = match gpt_oss {
                true => unfuse.fetch(name, &mut fetch)?,
                false => fetch(name)?,
            };
            Ok(t.to_device(device)?)
        };
        let f32 = |t: Tensor| Ok(t.to_dtype(DType::F32)?);
        let g = Scheme::Hf.globals();
        let embed = take(g.embed)?;
        let packed = packs(format, device);
        let (embed, lm_head) = match (packed, config.tie_word_embeddings) {
            (true, true) => (Embedding::Packed(None), linear_from_tensor(embed, format)?),
            (true, false) => (
                Embedding::Packed(Some(PackedLinear::from_tensor(&embed)?)),
                linear_from_tensor(take(g.output)?, format)?,
            ),
            (false, tied) => {
                let output = if tied { embed.clone() } else { take(g.output)? };
                // In the type its format holds floats in, the output's own where tied.
                let head = linear_from_tensor(output, format)?;
                let table = match format {
                    WeightFormat::Packed if tied => Embedding::of(&head),
                    _ => Embedding::Table(embed.to_dtype(table_type(format, embed.dtype()))?),
                };
                (table, head)
            }
        };
        let mut norm = f32(take(g.norm)?)?;
        if config.architecture.hf_norm_offset() {
            norm = (norm + 1.0)?;
        }
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            layers.push(Layer::load(
                &config,
                Scheme::Hf,
                i,
                &mut take,
                |t, part| match part {
                    Part::Rows { start, len } => {
                        linear_from_tensor(t.narrow(0, start, len)?, format)
                    }
                    // Safetensors checkpoints hold each expert apart.
                    Part::Whole | Part::Expert(_) => linear_from_tensor(t, format),
                },
                f32,
            )?);
            loaded(i + 1, config.num_layers);
        }
        Self::assemble(config, embed, layers, norm, lm_head, device)?.with_format(format, device)
    }

    pub(super) fn assemble(
        config: ModelConfig,
        embed: Embedding,
        layers: Vec<Layer>,
        norm: Tensor,
        lm_head: Linear,
        device: &Device,
    ) -> Result<Self> {
        pass_buffers_on_the_heap();
        let c = &config;
        let embed_dims = match (&embed, &lm_head) {
            (Embedding::Table(t), _) => t.dims().to_vec(),
            (Embedding::Codes(q), _) => q.shape().dims().to_vec(),
            (Embedding::Packed(Some(p)), _) | (Embedding::Packed(None), Linear::Packed(p, _)) => {
                let (n, k) = p.dims();
                vec![n, k]
            }
            (Embedding::Packed(None), Linear::Candle(_)) => Vec::new(),
        };
        let expect = [
            (
                "token embedding",
                embed_dims,
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
        // Frequencies 0 serve the global layers; 1, where there are any, the sliding-window
        // layers with their own base (`Layer::rope` picks).
        let first_local = (0..c.num_layers).find(|&l| c.layer_windows[l].is_some());
        let sources = match first_local {
            Some(l) if !c.uniform_rope() => vec![c.global_inv_freq(), c.rope_inv_freq(l)],
            _ => vec![c.global_inv_freq()],
        };
        let inv_freqs = sources
            .into_iter()
            .map(|f| {
                let half = f.len();
                Ok(Tensor::from_vec(f, (1, half), device)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            inv_freqs,
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
    pub(super) fn with_format(mut self, format: WeightFormat, device: &Device) -> Result<Self> {
        self.format = format;
        let act = match device.is_cpu() {
            // candle's CPU f16 and bf16 element-wise ops are slow.
            true => DType::F32,
            false => device::common_float_type(self.candle_linears()).unwrap_or(DType::F32),
        };
        self.with_activations(act)
    }

    /// The linear layers held as candle matmuls.
    fn candle_linears(&self) -> impl Iterator<Item = &QMatMul> {
        self.linears().filter_map(|l| match l {
            Linear::Candle(q) => Some(q),
            Linear::Packed(..) => None,
        })
    }

    /// The same model computing its activations in `act`: the tensors activations meet
    /// (embeddings held as a table, norm weights) are converted once here.
    fn with_activations(mut self, act: DType) -> Result<Self> {
        if act == self.act {
            return Ok(self);
        }
        // The embedding table keeps its type: its rows are converted as they are looked up.
        let layers = self.layers.iter_mut().flat_map(|l| l.vectors_mut());
        for t in [&mut self.norm].into_iter().chain(layers) {
            *t = t.to_dtype(act)?;
        }
        self.act = act;
        Ok(self)
    }
}

/// Whether `format` keeps the weights packed on `device`: the packed kernel is the CPU's.
/// Elsewhere the packed format keeps each tensor in its own codes on candle's kernels there
/// (`device.rs`).
pub(super) fn packs(format: WeightFormat, device: &Device) -> bool {
    format == WeightFormat::Packed && device.is_cpu()
}

/// The type an embedding table of `dtype` is held in under `format` (not packed).
fn table_type(format: WeightFormat, dtype: DType) -> DType {
    match format {
        WeightFormat::F16 => DType::F16,
        WeightFormat::Bf16 => DType::BF16,
        WeightFormat::Packed if matches!(dtype, DType::F16 | DType::BF16) => dtype,
        _ => DType::F32,
    }
}

/// A candle linear layer of `q` in `format` (not the packed one).
pub(super) fn linear_from_q(q: QTensor, format: WeightFormat, device: &Device) -> Result<Linear> {
    let main = match (format, q.dtype()) {
        (WeightFormat::F16, _) => QMatMul::TensorF16(q.dequantize_f16(device)?),
        (WeightFormat::Bf16, _) => QMatMul::Tensor(q.dequantize(device)?.to_dtype(DType::BF16)?),
        (WeightFormat::Quantized, dt) if !matches!(dt, GgmlDType::F32 | GgmlDType::F16) => {
            QMatMul::QTensor(std::sync::Arc::new(q))
        }
        _ => QMatMul::Tensor(q.dequantize(device)?),
    };
    Ok(Linear::Candle(main))
}

fn linear_from_tensor(w: Tensor, format: WeightFormat) -> Result<Linear> {
    if w.dtype() == DType::U8 {
        return mxfp4_linear(&w, format);
    }
    let main = match format {
        // Packed weights keep the checkpoint's type, on the CPU's kernel or a GPU's.
        WeightFormat::Packed if w.device().is_cpu() => {
            return Ok(Linear::Packed(
                PackedLinear::from_tensor(&w)?,
                Isa::detect(),
            ));
        }
        WeightFormat::Packed => device::float_linear(w)?,
        WeightFormat::F32 => QMatMul::Tensor(w.to_dtype(DType::F32)?),
        WeightFormat::F16 => QMatMul::TensorF16(w.to_dtype(DType::F16)?),
        WeightFormat::Bf16 => QMatMul::Tensor(w.to_dtype(DType::BF16)?),
        WeightFormat::Quantized => QMatMul::QTensor(std::sync::Arc::new(QTensor::quantize(
            &w.to_dtype(DType::F32)?,
            GgmlDType::Q8_0,
        )?)),
    };
    Ok(Linear::Candle(main))
}

/// A matrix as rows of GGUF's MXFP4 blocks (`super::gpt_oss` cuts them out of a checkpoint's
/// `_blocks` and `_scales`), kept in its codes by the packed format on the CPU, converted to
/// f16 by it on a GPU (no kernel there reads them).
///
/// # Errors
/// [`Error::InvalidModel`] in the other formats, which do not read MXFP4.
fn mxfp4_linear(w: &Tensor, format: WeightFormat) -> Result<Linear> {
    if format != WeightFormat::Packed {
        return Err(Error::invalid_model(
            "MXFP4 experts",
            "only read by the packed format",
        ));
    }
    let (n, row) = w.dims2()?;
    let bytes = w.flatten_all()?.to_vec1::<u8>()?;
    let packed =
        PackedLinear::from_gguf(GgufType::Mxfp4, n, row / 17 * 32, &mut |at, len, buf| {
            let part = bytes.get(at..at + len);
            let part =
                part.ok_or_else(|| Error::invalid_model("MXFP4 experts", "rows cut short"))?;
            buf.clear();
            buf.extend_from_slice(part);
            Ok(())
        })?;
    match w.device() {
        Device::Cpu => Ok(Linear::Packed(packed, Isa::detect())),
        gpu => Ok(Linear::Candle(device::packed_as_f16(
            "MXFP4 experts",
            &packed,
            gpu,
        )?)),
    }
}

/// Sets glibc's allocator to serve the buffers of a pass (candle allocates each op's output,
/// up to megabytes) from its heap, as it does by itself once a process has freed a large
/// block: a threshold of 32 MiB for fresh mappings, and heap memory returned to the system
/// only above 64 MiB free. Left at its start-up values (128 KiB), every such buffer is a new
/// mapping whose pages fault in and are zeroed on every pass: measured 30% of a 256-token
/// prefill on SmolLM2 once loading stopped freeing large blocks (docs/BENCHMARKS.md). Only
/// glibc's `malloc` is touched (a host with its own global allocator is unaffected), once per
/// process.
fn pass_buffers_on_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes glibc's allocator parameters; it is thread-safe.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
            }
        });
    }
}

/// Logs the load's progress at each quarter of the layers: a large model takes a while to
/// read and pack, and a host should see that it moves.
pub(super) fn loaded(layers: usize, of: usize) {
    if (layers * 4 / of.max(1)) > ((layers - 1) * 4 / of.max(1)) {
        tracing::info!(layers, of, "weights loaded");
    }
}

/// `config`, its output projection untied when the checkpoint ships one (some tied
/// checkpoints store a copy of the embedding as `lm_head.weight`; reading it is exact).
fn untie_if_present(mut config: ModelConfig, names: &[String]) -> ModelConfig {
    let output = Scheme::Hf.globals().output;
    if names.iter().any(|n| n == output) {
        config.tie_word_embeddings = false;
    }
    config
}

#[cfg(test)]
mod tests {
    use super::super::ForwardBatch;
    use super::*;
    use crate::attention::KvPool;

    /// The f16 and bf16 activation paths (a GPU's, run here on the CPU) track f32 activations
    /// over the same f16 or bf16 weights.
    #[test]
    fn half_activations_track_f32() {
        for (format, act, tolerance) in [
            (WeightFormat::F16, DType::F16, 1e-2),
            (WeightFormat::Bf16, DType::BF16, 8e-2),
        ] {
            half_activations_track_f32_in(format, act, tolerance);
        }
    }

    fn half_activations_track_f32_in(format: WeightFormat, half: DType, tolerance: f32) {
        let config = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":300,"hidden_size":128,"intermediate_size":256,"num_hidden_layers":3,
                "num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-5,
                "rope_theta":10000.0,"max_position_embeddings":256,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let cpu = Device::Cpu;
        let f32_act = Transformer::random(config.clone(), 3, format, &cpu).unwrap();
        let f16_act = Transformer::random(config, 3, format, &cpu)
            .unwrap()
            .with_activations(half)
            .unwrap();
        assert_eq!((f32_act.act, f16_act.act), (DType::F32, half));
        let n = 40u32;
        let tokens: Vec<u32> = (0..n).map(|i| (i * 37 + 5) % 300).collect();
        let idx: Vec<u32> = (0..n).collect();
        let logits = |m: &Transformer| {
            let pool = KvPool::new(
                m.config().kv_shape(),
                n as usize,
                crate::attention::KvPrecision::F16,
                &cpu,
            )
            .unwrap();
            let mut batch = ForwardBatch::new();
            batch
                .push_scored(&tokens, &idx, &idx, &idx, idx.len())
                .unwrap();
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
            err < tolerance * scale,
            "{half:?} activations off by {err} (scale {scale})"
        );
    }
}

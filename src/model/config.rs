//! Llama-family hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use candle_core::quantized::gguf_file;
use serde::Deserialize;

use crate::attention::KvShape;
use crate::{Error, Result};

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeVariant {
    /// Pairs `(2i, 2i+1)`: GGUF files of Llama models (llama.cpp permutes Q/K weights to it).
    Interleaved,
    /// Pairs `(i, i + d/2)`: Hugging Face checkpoints ("neox" style).
    HalfSplit,
}

/// The longest context window a model may declare (2^20 tokens).
pub const MAX_CONTEXT: usize = 1 << 20;

/// Llama 3 frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub struct Llama3RopeScaling {
    /// Overall scale factor.
    pub factor: f32,
    /// Wavelength boundary factor for the low-frequency band.
    pub low_freq_factor: f32,
    /// Wavelength boundary factor for the high-frequency band.
    pub high_freq_factor: f32,
    /// Context length the base model was trained with.
    pub original_max_position_embeddings: usize,
}

/// Rotary embedding as the model declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    /// Frequency base (`rope_theta`).
    pub base: f32,
    /// Dimension pairing.
    pub variant: RopeVariant,
    /// Optional Llama 3 scaling.
    pub llama3_scaling: Option<Llama3RopeScaling>,
}

/// Hyper-parameters of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Context window.
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the token embedding.
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// Checks the shape relations the graph relies on.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming the inconsistent field.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid_model("config", reason));
        if self.num_layers == 0 || self.num_heads == 0 || self.num_kv_heads == 0 {
            return bad("layer and head counts must be positive".into());
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} heads not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be positive and even",
                self.head_dim
            ));
        }
        if self.vocab_size == 0 || self.max_position_embeddings == 0 {
            return bad("vocabulary and context window must be positive".into());
        }
        // The rotary table spans the whole window: a window past this is a corrupt or
        // hostile file, refused before anything of its size is allocated.
        if self.max_position_embeddings > MAX_CONTEXT {
            return bad(format!(
                "context length {} is beyond the {MAX_CONTEXT} tokens supported",
                self.max_position_embeddings
            ));
        }
        if !(self.rope.base.is_finite() && self.rope.base > 1.0) {
            return bad(format!(
                "RoPE frequency base {} must be a finite number above 1",
                self.rope.base
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return bad(format!(
                "RMSNorm epsilon {} must be in (0, 1)",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// The shape of one KV-token, as the KV pool stores it.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            num_layers: self.num_layers,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Reads the config of a `llama` GGUF file.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for another architecture or missing keys.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            return Err(Error::invalid_model(
                "general.architecture",
                format!("'{arch}' is not a Llama-family model"),
            ));
        }
        let get = |key: &str| -> Result<usize> {
            md.get(key)
                .ok_or_else(|| Error::invalid_model(key, "missing"))?
                .to_u32()
                .map(|v| v as usize)
                .map_err(|e| Error::invalid_model(key, e))
        };
        let get_f = |key: &str| md.get(key).and_then(|v| v.to_f32().ok());
        let hidden_size = get("llama.embedding_length")?;
        let num_heads = get("llama.attention.head_count")?;
        let vocab_size = match get("llama.vocab_size") {
            Ok(v) => v,
            Err(_) => md
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.to_vec().ok())
                .map(|t| t.len())
                .ok_or_else(|| Error::invalid_model("llama.vocab_size", "missing"))?,
        };
        let config = Self {
            vocab_size,
            hidden_size,
            intermediate_size: get("llama.feed_forward_length")?,
            num_layers: get("llama.block_count")?,
            num_heads,
            num_kv_heads: get("llama.attention.head_count_kv").unwrap_or(num_heads),
            head_dim: get("llama.rope.dimension_count").unwrap_or(hidden_size / num_heads.max(1)),
            rms_norm_eps: get_f("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64,
            rope: RopeConfig {
                base: get_f("llama.rope.freq_base").unwrap_or(10_000.0),
                variant: RopeVariant::Interleaved,
                llama3_scaling: None,
            },
            max_position_embeddings: get("llama.context_length").unwrap_or(4096),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        };
        config.validate()?;
        Ok(config)
    }

    /// Parses a Hugging Face `config.json` of a `LlamaForCausalLM`-style model.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for malformed JSON or missing fields.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        #[derive(Deserialize)]
        struct RopeScaling {
            #[serde(alias = "type")]
            rope_type: Option<String>,
            #[serde(flatten)]
            params: serde_json::Value,
        }
        #[derive(Deserialize)]
        struct Hf {
            vocab_size: usize,
            hidden_size: usize,
            intermediate_size: usize,
            num_hidden_layers: usize,
            num_attention_heads: usize,
            num_key_value_heads: Option<usize>,
            head_dim: Option<usize>,
            rms_norm_eps: Option<f64>,
            rope_theta: Option<f32>,
            rope_scaling: Option<RopeScaling>,
            max_position_embeddings: Option<usize>,
            tie_word_embeddings: Option<bool>,
        }
        let hf: Hf =
            serde_json::from_str(json).map_err(|e| Error::invalid_model("config.json", e))?;
        let llama3_scaling = match hf.rope_scaling {
            Some(s) if s.rope_type.as_deref() == Some("llama3") => Some(
                serde_json::from_value(s.params)
                    .map_err(|e| Error::invalid_model("config.json rope_scaling", e))?,
            ),
            Some(s) => {
                return Err(Error::invalid_model(
                    "config.json rope_scaling",
                    format!("unsupported rope_type {:?}", s.rope_type),
                ))
            }
            None => None,
        };
        let config = Self {
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-5),
            rope: RopeConfig {
                base: hf.rope_theta.unwrap_or(10_000.0),
                variant: RopeVariant::HalfSplit,
                llama3_scaling,
            },
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        };
        config.validate()?;
        Ok(config)
    }

    /// Inverse frequencies of the rotary embedding, `head_dim / 2` of them, with Llama 3
    /// scaling applied when declared.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base = self.rope.base;
        let raw = (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32));
        match self.rope.llama3_scaling {
            None => raw.collect(),
            Some(s) => {
                let old = s.original_max_position_embeddings as f32;
                let low_wavelen = old / s.low_freq_factor;
                let high_wavelen = old / s.high_freq_factor;
                raw.map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                })
                .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL_JSON: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,
        "num_key_value_heads":3,"rms_norm_eps":1e-05,"rope_theta":100000,
        "max_position_embeddings":8192,"tie_word_embeddings":true,"vocab_size":49152}"#;

    #[test]
    fn hf_config_parses() {
        let c = LlamaConfig::from_hf_json(SMOL_JSON).unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.rope.variant),
            (64, 3, RopeVariant::HalfSplit)
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.kv_shape().token_bytes(4), 2 * 30 * 3 * 64 * 4);
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        assert!(LlamaConfig::from_hf_json("{").is_err());
        let bad = SMOL_JSON.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4");
        assert!(matches!(
            LlamaConfig::from_hf_json(&bad),
            Err(Error::InvalidModel { .. })
        ));
    }

    #[test]
    fn insane_metadata_is_refused_before_anything_is_allocated() {
        let cases = [
            (
                "\"max_position_embeddings\":8192",
                "\"max_position_embeddings\":4294967295",
            ),
            ("\"rms_norm_eps\":1e-05", "\"rms_norm_eps\":-1e-05"),
            ("\"rope_theta\":100000", "\"rope_theta\":-5"),
            ("\"rope_theta\":100000", "\"rope_theta\":1e39"),
        ];
        for (from, to) in cases {
            let json = SMOL_JSON.replace(from, to);
            let r = LlamaConfig::from_hf_json(&json);
            assert!(matches!(r, Err(Error::InvalidModel { .. })), "{to}: {r:?}");
        }
        let mut c = LlamaConfig::from_hf_json(SMOL_JSON).unwrap();
        c.rope.base = f32::NAN;
        assert!(c.validate().is_err());
    }

    #[test]
    fn llama3_scaling_keeps_high_and_scales_low_frequencies() {
        let json = SMOL_JSON.replace(
            "\"rope_theta\":100000",
            "\"rope_theta\":500000,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0,\
             \"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\
             \"original_max_position_embeddings\":8192}",
        );
        let c = LlamaConfig::from_hf_json(&json).unwrap();
        let mut plain = c.clone();
        plain.rope.llama3_scaling = None;
        let (a, b) = (c.rope_inv_freq(), plain.rope_inv_freq());
        assert_eq!(a[0], b[0]);
        assert!((a[31] - b[31] / 8.0).abs() < 1e-12);
    }
}

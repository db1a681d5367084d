//! Decoder hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`, for
//! every [`Architecture`]: what differs between them is data here (biases, norms, windows,
//! RoPE bases), so one graph runs them all.

use serde::Deserialize;

use super::arch::Architecture;
use crate::attention::KvShape;
use crate::{Error, Result};

mod hf_rope;
mod parse;
mod yarn;

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
#[non_exhaustive]
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
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RopeConfig {
    /// Frequency base (`rope_theta`) of the layers that attend globally.
    pub base: f32,
    /// Frequency base of the sliding-window layers, where it differs (Gemma 3's local layers).
    pub local_base: Option<f32>,
    /// Dimension pairing.
    pub variant: RopeVariant,
    /// Optional Llama 3 scaling.
    pub llama3_scaling: Option<Llama3RopeScaling>,
    /// Linear position scaling of the global layers (positions divided by it).
    pub linear_factor: Option<f32>,
    /// Per-frequency divisors, one per rotated pair (a Llama 3.x GGUF's `rope_freqs` tensor:
    /// its RoPE scaling, computed by the converter; Phi-3's LongRoPE short or long factors).
    pub freq_factors: Option<Vec<f32>>,
    /// Dimensions of each head that rotate, the first ones (Phi's `partial_rotary_factor`);
    /// `None`: all of them.
    pub rotary_dim: Option<usize>,
    /// Scale of the rotary tables' cosines and sines (LongRoPE's attention factor), so of
    /// queries and keys alike; `None`: 1.
    pub attention_factor: Option<f32>,
}

impl RopeConfig {
    /// LongRoPE (Phi-3's `longrope`, once `su`): per-frequency `short` factors for a model
    /// that serves no more than the `original` window it was trained with, `long` ones past it,
    /// chosen once by the window it serves, `max_positions` (as llama.cpp chooses by its
    /// context size: a conversation's cached keys keep their rotation as it grows), with the
    /// attention factor `sqrt(1 + ln(max / original) / ln(original))` unless `attention`
    /// names one.
    pub fn longrope(
        &mut self,
        short: Vec<f32>,
        long: Vec<f32>,
        original: usize,
        max_positions: usize,
        attention: Option<f32>,
    ) {
        let scale = max_positions as f32 / original.max(1) as f32;
        self.freq_factors = Some(if max_positions > original {
            long
        } else {
            short
        });
        self.attention_factor = attention.or_else(|| {
            (scale > 1.0).then(|| (1.0 + scale.ln() / (original.max(2) as f32).ln()).sqrt())
        });
    }
}

/// A mixture-of-experts MLP: per token, a router's softmax over `count` gated (SwiGLU)
/// experts picks the `per_token` most likely, whose outputs are summed with those
/// probabilities as weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Experts {
    /// Experts in each layer.
    pub count: usize,
    /// Experts each token is routed to.
    pub per_token: usize,
    /// Each expert's inner width.
    pub intermediate_size: usize,
    /// Whether the chosen experts' probabilities are rescaled to sum to one (Mixtral always,
    /// Qwen3 MoE with `norm_topk_prob`).
    pub normalize: bool,
}

/// Hyper-parameters of a decoder of one of the supported [`Architecture`]s.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ModelConfig {
    /// The architecture: which of the graph's optional parts are present.
    pub architecture: Architecture,
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
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2` (`head_dim` unless the
    /// model says otherwise).
    pub query_pre_attn_scalar: Option<f32>,
    /// The attention window of each layer: `Some(w)` sees only the last `w` positions (its
    /// own included), `None` the whole context.
    pub layer_windows: Vec<Option<u32>>,
    /// The mixture of experts every layer's MLP is, for the architectures that have one (the
    /// MLP is then no dense one: `intermediate_size` is unused).
    pub experts: Option<Experts>,
}

impl ModelConfig {
    /// Whether every layer has the same rotary frequencies (one table serves all).
    pub fn uniform_rope(&self) -> bool {
        self.rope.local_base.is_none() || self.layer_windows.iter().all(Option::is_none)
    }

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
        let rotary = self.rotary_dim();
        if rotary == 0 || rotary > self.head_dim || !rotary.is_multiple_of(2) {
            return bad(format!(
                "rotary_dim {rotary} must be positive, even and at most head_dim {}",
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
        if self.layer_windows.len() != self.num_layers {
            return bad(format!(
                "{} layer windows for {} layers",
                self.layer_windows.len(),
                self.num_layers
            ));
        }
        if self.layer_windows.contains(&Some(0)) {
            return bad("a sliding window of 0 tokens".into());
        }
        let factors_ok = self.rope.freq_factors.as_ref().is_none_or(|f| {
            f.len() == self.rotary_dim() / 2 && f.iter().all(|x| x.is_finite() && *x > 0.0)
        });
        let scalars_ok = [
            self.rope.local_base.map(|b| b > 1.0),
            self.rope.linear_factor.map(|f| f >= 1.0),
            self.query_pre_attn_scalar.map(|s| s > 0.0),
            (self.rope.attention_factor).map(|f| f.is_finite() && f > 0.0),
        ]
        .into_iter()
        .all(|ok| ok != Some(false));
        if !factors_ok || !scalars_ok {
            return bad(format!(
                "RoPE local base {:?}, linear factor {:?}, frequency factors of {:?} entries, \
                 attention factor {:?} or query scalar {:?} out of range",
                self.rope.local_base,
                self.rope.linear_factor,
                self.rope.freq_factors.as_ref().map(Vec::len),
                self.rope.attention_factor,
                self.query_pre_attn_scalar
            ));
        }
        match (self.architecture.has_experts(), self.experts) {
            (true, None) => return bad(format!("a {} model needs experts", self.architecture)),
            (false, Some(_)) => {
                return bad(format!("a {} model has no experts", self.architecture))
            }
            (true, Some(e))
                if e.per_token == 0 || e.per_token > e.count || e.intermediate_size == 0 =>
            {
                return bad(format!(
                    "{} experts per token of {}, of inner width {}",
                    e.per_token, e.count, e.intermediate_size
                ))
            }
            _ => {}
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return bad(format!(
                "RMSNorm epsilon {} must be in (0, 1)",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// The layers that attend to the whole history (no sliding window), in order: what a
    /// chunk out of every window still needs (its narrow KV).
    pub(crate) fn full_layers(&self) -> Vec<usize> {
        (self.layer_windows.iter().enumerate())
            .filter(|(_, w)| w.is_none())
            .map(|(i, _)| i)
            .collect()
    }

    /// The longest sliding window, where some layers have one and others none: how far back
    /// from a position its sliding-window layers still read (a model whose layers all slide
    /// or none does keeps every chunk whole).
    pub(crate) fn narrowing_window(&self) -> Option<usize> {
        let full = self.full_layers().len();
        if full == 0 || full == self.num_layers {
            return None;
        }
        self.layer_windows
            .iter()
            .flatten()
            .max()
            .map(|&w| w as usize)
    }

    /// The shape of one KV-token, as the KV pool stores it.
    #[cfg_attr(feature = "internals", visibility::make(pub))]
    pub(crate) fn kv_shape(&self) -> KvShape {
        KvShape {
            num_layers: self.num_layers,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// The scale of attention scores.
    pub fn attention_scale(&self) -> f32 {
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f32)
            .sqrt()
    }

    /// Dimensions of each head that rotate.
    pub fn rotary_dim(&self) -> usize {
        self.rope.rotary_dim.unwrap_or(self.head_dim)
    }

    /// Inverse frequencies of the rotary embedding of `layer`, `rotary_dim / 2` of them, with
    /// the model's scaling applied (sliding-window layers with their own base are unscaled).
    pub fn rope_inv_freq(&self, layer: usize) -> Vec<f32> {
        let d = self.rotary_dim();
        let local = self.layer_windows.get(layer).copied().flatten().is_some();
        if let (true, Some(base)) = (local, self.rope.local_base) {
            return (0..d / 2)
                .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
                .collect();
        }
        self.global_inv_freq()
    }

    /// Inverse frequencies of the layers that attend globally (every layer but the
    /// sliding-window ones with a base of their own).
    pub fn global_inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim();
        let base = self.rope.base;
        let linear = self.rope.linear_factor.unwrap_or(1.0);
        let raw = (0..d / 2).map(|i| {
            let divisor = self
                .rope
                .freq_factors
                .as_ref()
                .and_then(|f| f.get(i).copied())
                .unwrap_or(1.0);
            1.0 / base.powf((2 * i) as f32 / d as f32) / divisor / linear
        });
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
        let c = ModelConfig::from_hf_json(SMOL_JSON).unwrap();
        assert_eq!(
            (c.head_dim, c.num_kv_heads, c.rope.variant),
            (64, 3, RopeVariant::HalfSplit)
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(
            c.kv_shape().token_bytes(crate::attention::KvPrecision::F32),
            2 * 30 * 3 * 64 * 4
        );
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        assert!(ModelConfig::from_hf_json("{").is_err());
        let bad = SMOL_JSON.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4");
        assert!(matches!(
            ModelConfig::from_hf_json(&bad),
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
            let r = ModelConfig::from_hf_json(&json);
            assert!(matches!(r, Err(Error::InvalidModel { .. })), "{to}: {r:?}");
        }
        let mut c = ModelConfig::from_hf_json(SMOL_JSON).unwrap();
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
        let c = ModelConfig::from_hf_json(&json).unwrap();
        let mut plain = c.clone();
        plain.rope.llama3_scaling = None;
        let (a, b) = (c.rope_inv_freq(0), plain.rope_inv_freq(0));
        assert_eq!(a[0], b[0]);
        assert!((a[31] - b[31] / 8.0).abs() < 1e-12);
    }
}

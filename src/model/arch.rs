//! The decoder architectures pensieve runs, as differences from Llama's graph.
//!
//! Every architecture here is the Llama decoder (token embedding, then per layer an RMSNorm,
//! grouped-query attention with rotary positions and a gated MLP, each added to the residual
//! stream, then a final RMSNorm and the output projection) with these changes, read from
//! llama.cpp's `llama-model.cpp` and candle-transformers' model files:
//!
//! | architecture | changes |
//! |---|---|
//! | `llama` | none; Llama 3.x scale RoPE frequencies (`rope_freqs` in GGUF, `rope_scaling` of type `llama3` in `config.json`) |
//! | `mistral` | none, beyond an optional sliding window on every layer (`sliding_window`) |
//! | `qwen2` | biases on the Q, K and V projections; RoPE pairs `(i, i + d/2)` in GGUF too |
//! | `qwen3` | an RMSNorm over each head of Q and of K before RoPE; no biases |
//! | `qwen3moe` | Qwen3's attention; the MLP a mixture of experts: a router picks `k` of `n` SwiGLU experts per token by softmax, their outputs weighted (renormalized with `norm_topk_prob`) |
//! | `mixtral` | Mistral's attention; the MLP a mixture of experts, weights always renormalized over the `k` chosen |
//! | `phi3` | Q, K and V in one fused projection, gate and up in another (split at load); a sliding window on every layer (`sliding_window`); LongRoPE and partial rotary |
//! | `gpt_oss` | biases on Q, K, V and the output projection; a learned attention sink per query head (one more score in the softmax); sliding-window and full layers in turn (`layer_types`); YaRN; the MLP a mixture of experts whose router and projections carry biases, softmax over the `k` chosen scores, and a clamped SwiGLU (`g * sigmoid(1.702 g) * (u + 1)`, `g <= 7`, `-7 <= u <= 7`) |
//! | `gemma3` | embeddings scaled by `sqrt(hidden)`; RMSNorm weights are `1 + w` (GGUF files store the sum); a norm after attention and after the MLP as well as before; per-head Q/K RMSNorm; GeGLU with tanh GELU; scores scaled by `query_pre_attn_scalar^-1/2`; five of every six layers attend within a sliding window with their own RoPE base, the sixth globally with the model's base |
//!
//! GGUF files of `llama` and `mistral` hold Q and K permuted for RoPE's interleaved pairs
//! `(2i, 2i + 1)` (llama.cpp's converter permutes them); the others keep Hugging Face's order.

use std::fmt;

use crate::{Error, Result};

/// A decoder architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Architecture {
    /// Llama 1-3, SmolLM, TinyLlama and other `LlamaForCausalLM` models.
    Llama,
    /// Mistral 7B and other `MistralForCausalLM` models.
    Mistral,
    /// Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`), and models distilled into them.
    Qwen2,
    /// Qwen3 dense models (`Qwen3ForCausalLM`).
    Qwen3,
    /// Gemma 3 text models (`Gemma3ForCausalLM`).
    Gemma3,
    /// Qwen3 mixture-of-experts models (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, ...).
    Qwen3Moe,
    /// Mixtral and other `MixtralForCausalLM` mixture-of-experts models.
    Mixtral,
    /// Phi-3, Phi-3.5 and Phi-4 mini (`Phi3ForCausalLM`), with LongRoPE and partial rotary.
    Phi3,
    /// OpenAI's gpt-oss (`GptOssForCausalLM`): a mixture of experts with biases and a clamped
    /// SwiGLU, attention sinks, alternating sliding-window and full layers, YaRN.
    GptOss,
}

pub use crate::math::Activation;

/// Every architecture, in the order the README lists them.
pub const ARCHITECTURES: [Architecture; 9] = [
    Architecture::Llama,
    Architecture::Mistral,
    Architecture::Qwen2,
    Architecture::Qwen3,
    Architecture::Gemma3,
    Architecture::Qwen3Moe,
    Architecture::Mixtral,
    Architecture::Phi3,
    Architecture::GptOss,
];

impl Architecture {
    /// The name GGUF files use (`general.architecture`), which also prefixes their keys:
    /// llama.cpp writes Mixtral as `llama` with experts.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama | Self::Mixtral => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3",
            Self::Qwen3Moe => "qwen3moe",
            Self::Phi3 => "phi3",
            Self::GptOss => "gpt-oss",
        }
    }

    /// Its own name, as messages and `config.json`'s `model_type` give it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mixtral => "mixtral",
            Self::GptOss => "gpt_oss",
            other => other.gguf_name(),
        }
    }

    /// The class Hugging Face `config.json` names in `architectures`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Mixtral => "MixtralForCausalLM",
            Self::Phi3 => "Phi3ForCausalLM",
            Self::GptOss => "GptOssForCausalLM",
        }
    }

    /// The architecture a GGUF file declares.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming the key, the value and what is supported.
    pub fn from_gguf_name(name: &str) -> Result<Self> {
        ARCHITECTURES
            .into_iter()
            .find(|a| a.gguf_name() == name)
            .ok_or_else(|| {
                Error::invalid_model(
                    "general.architecture",
                    format!(
                        "'{name}' is not supported (supported: {})",
                        Self::supported(Self::gguf_name)
                    ),
                )
            })
    }

    /// The architecture a `config.json` declares in `architectures`.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming the value and what is supported.
    pub fn from_hf_name(name: &str) -> Result<Self> {
        ARCHITECTURES
            .into_iter()
            .find(|a| a.hf_name() == name)
            .ok_or_else(|| {
                Error::invalid_model(
                    "config.json architectures",
                    format!(
                        "'{name}' is not supported (supported: {})",
                        Self::supported(Self::hf_name)
                    ),
                )
            })
    }

    fn supported(name: fn(Self) -> &'static str) -> String {
        let mut names: Vec<&str> = Vec::new();
        for n in ARCHITECTURES.map(name) {
            if !names.contains(&n) {
                names.push(n);
            }
        }
        names.join(", ")
    }

    /// Whether the Q, K and V projections carry biases.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Self::Qwen2 | Self::GptOss)
    }

    /// Whether the attention output projection, the router and the experts carry biases, and
    /// each query head has an attention sink (gpt-oss).
    pub fn sinks_and_biases(self) -> bool {
        self == Self::GptOss
    }

    /// Whether each head of Q and K is RMS-normalized before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Qwen3Moe | Self::Gemma3)
    }

    /// Whether checkpoints hold Q, K and V in one projection (`qkv_proj`) and the MLP's gate
    /// and up in another (`gate_up_proj`).
    pub fn fused_projections(self) -> bool {
        self == Self::Phi3
    }

    /// Whether the MLP is a mixture of experts.
    pub fn has_experts(self) -> bool {
        matches!(self, Self::Qwen3Moe | Self::Mixtral | Self::GptOss)
    }

    /// Whether attention and MLP outputs are normalized before they join the residual stream.
    pub fn post_norms(self) -> bool {
        self == Self::Gemma3
    }

    /// Whether a checkpoint's RMSNorm weights are stored as `w` for a scale of `1 + w`
    /// (Hugging Face's Gemma; llama.cpp's converter stores `1 + w`).
    pub fn hf_norm_offset(self) -> bool {
        self == Self::Gemma3
    }

    /// Whether the embedding is scaled by `sqrt(hidden)` on the way in.
    pub fn scales_embedding(self) -> bool {
        self == Self::Gemma3
    }

    /// The MLP's activation.
    pub fn activation(self) -> Activation {
        match self {
            Self::Gemma3 => Activation::GeluTanh,
            Self::GptOss => Activation::ClampedSwiglu,
            _ => Activation::Silu,
        }
    }

    /// Whether GGUF files hold Q and K permuted for interleaved RoPE pairs.
    pub fn gguf_interleaved_rope(self) -> bool {
        matches!(self, Self::Llama | Self::Mistral | Self::Mixtral)
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_name_what_is_supported() {
        for a in ARCHITECTURES {
            // Mixtral's GGUF files say `llama`: the expert count tells them apart.
            let gguf = if a == Architecture::Mixtral {
                Architecture::Llama
            } else {
                a
            };
            let from_gguf = Architecture::from_gguf_name(a.gguf_name()).ok();
            assert_eq!(from_gguf, Some(gguf));
            assert_eq!(Architecture::from_hf_name(a.hf_name()).ok(), Some(a));
        }
        let e = Architecture::from_gguf_name("phi2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("general.architecture") && e.contains("phi2") && e.contains("gemma3"),
            "{e}"
        );
    }
}

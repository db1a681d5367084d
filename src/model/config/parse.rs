//! Reading a [`ModelConfig`] from GGUF metadata (`<arch>.*` keys, llama.cpp's names) or from a
//! Hugging Face `config.json`, refusing what the graph would not compute as written.

use candle_core::quantized::gguf_file;
use serde::Deserialize;

use super::hf_rope::{HfRope, RopeFields};
use super::yarn::Yarn;
use super::{Architecture, Experts, ModelConfig, RopeConfig, RopeVariant};
use crate::{Error, Result};

/// Gemma 3's layer pattern when a file does not give one: five local layers, then a global.
const GEMMA3_PATTERN: usize = 6;
/// Gemma 3's local RoPE base when a file does not give one (llama.cpp's default too).
const GEMMA3_LOCAL_BASE: f32 = 10_000.0;

/// Windows of `layers` layers where every `pattern`-th (1-based) attends globally and the
/// others within `window`.
fn patterned_windows(layers: usize, window: Option<u32>, pattern: usize) -> Vec<Option<u32>> {
    (0..layers)
        .map(|i| window.filter(|_| pattern == 0 || (i + 1) % pattern != 0))
        .collect()
}

/// A GGUF file's metadata, read by key under its architecture's prefix (`<arch>.<key>`).
struct Gguf<'a> {
    md: &'a std::collections::HashMap<String, gguf_file::Value>,
    arch: String,
}

impl<'a> Gguf<'a> {
    fn new(md: &'a std::collections::HashMap<String, gguf_file::Value>) -> Self {
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        Self { md, arch }
    }

    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// An integer key that must be there.
    fn get(&self, k: &str) -> Result<usize> {
        let k = self.key(k);
        self.md
            .get(&k)
            .ok_or_else(|| Error::invalid_model(&k, "missing"))?
            .to_u32()
            .map(|v| v as usize)
            .map_err(|e| Error::invalid_model(&k, e))
    }

    fn get_f(&self, k: &str) -> Option<f32> {
        self.md.get(&self.key(k)).and_then(|v| v.to_f32().ok())
    }

    fn get_s(&self, k: &str) -> Option<String> {
        self.md
            .get(&self.key(k))
            .and_then(|v| v.to_string().ok())
            .cloned()
    }

    /// The vocabulary's size: its key, or the tokenizer's token list.
    fn vocab_size(&self) -> Result<usize> {
        self.get("vocab_size").or_else(|_| {
            self.md
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.to_vec().ok())
                .map(|t| t.len())
                .ok_or_else(|| Error::invalid_model(self.key("vocab_size"), "missing"))
        })
    }

    /// The head size (`default` where no key gives it; the rotated dimensions' count where
    /// the architecture turns them all); values of another size are refused.
    fn head_dim(&self, default: usize, rotates_all: bool) -> Result<usize> {
        let rotated = (self.get("rope.dimension_count"))
            .ok()
            .filter(|_| rotates_all);
        let head_dim = (self.get("attention.key_length"))
            .ok()
            .or(rotated)
            .unwrap_or(default);
        match self.get("attention.value_length") {
            Ok(v) if v != head_dim => Err(Error::invalid_model(
                self.key("attention.value_length"),
                format!("{v} differs from the key length {head_dim} (not supported)"),
            )),
            _ => Ok(head_dim),
        }
    }

    /// A linear RoPE scaling factor, if the file sets one.
    fn linear_factor(&self) -> Result<Option<f32>> {
        match self.get_s("rope.scaling.type").as_deref() {
            None | Some("none") => Ok(None),
            Some("linear") => Ok(self.get_f("rope.scaling.factor").filter(|&f| f != 1.0)),
            // Applied once the config is read (`Gguf::yarn`).
            Some("yarn") => Ok(None),
            Some(other) => Err(Error::invalid_model(
                self.key("rope.scaling.type"),
                format!("'{other}' is not supported (supported: none, linear, yarn)"),
            )),
        }
    }
}

impl Gguf<'_> {
    /// YaRN, if the file scales its RoPE so.
    fn yarn(&self) -> Result<Option<Yarn>> {
        if self.get_s("rope.scaling.type").as_deref() != Some("yarn") {
            return Ok(None);
        }
        let factor = (self.get_f("rope.scaling.factor"))
            .ok_or_else(|| Error::invalid_model(self.key("rope.scaling.factor"), "missing"))?;
        let original = self.get("rope.scaling.original_context_length").ok();
        let betas =
            ["yarn_beta_fast", "yarn_beta_slow"].map(|k| self.get_f(&format!("rope.scaling.{k}")));
        Ok(Some(Yarn::gguf(factor, original, betas)))
    }
}

impl ModelConfig {
    /// LongRoPE from a GGUF (Phi-3's): its `short` and `long` factors (the file's
    /// `rope_factors_short` and `rope_factors_long` tensors), with the window the model was
    /// trained with and the attention factor from its metadata.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if the factors do not fit the rotated dimensions.
    pub(crate) fn gguf_longrope(
        &mut self,
        content: &gguf_file::Content,
        short: Vec<f32>,
        long: Vec<f32>,
    ) -> Result<()> {
        let md = Gguf::new(&content.metadata);
        let window = self.max_position_embeddings;
        let original = md
            .get("rope.scaling.original_context_length")
            .unwrap_or(window);
        let attention = md.get_f("rope.scaling.attn_factor");
        self.rope.longrope(short, long, original, window, attention);
        self.validate()
    }

    /// Reads the config of a GGUF file of a supported architecture.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] naming the key for another architecture, missing keys or values
    /// out of range.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let md = Gguf::new(&content.metadata);
        let arch = Architecture::from_gguf_name(&md.arch)?;
        // llama.cpp writes Mixtral as `llama` with experts; its mixtures renormalize the
        // chosen experts' weights (Qwen3 MoE's `norm_topk_prob` is true in every release).
        let experts = match md.get("expert_count") {
            Ok(count) if count > 0 => Some(Experts {
                count,
                per_token: md.get("expert_used_count")?,
                intermediate_size: (md.get("expert_feed_forward_length"))
                    .or_else(|_| md.get("feed_forward_length"))?,
                normalize: true,
            }),
            _ => None,
        };
        let arch = match (arch, &experts) {
            (Architecture::Llama, Some(_)) => Architecture::Mixtral,
            (arch, _) => arch,
        };
        let (get, get_f) = (|k: &str| md.get(k), |k: &str| md.get_f(k));
        let hidden_size = get("embedding_length")?;
        let num_heads = get("attention.head_count")?;
        let num_layers = get("block_count")?;
        let vocab_size = md.vocab_size()?;
        let phi = arch == Architecture::Phi3;
        let head_dim = md.head_dim(hidden_size / num_heads.max(1), !phi)?;
        let linear_factor = md.linear_factor()?;
        let window = get("attention.sliding_window")
            .ok()
            .filter(|&w| w > 0)
            .map(|w| w as u32);
        let (layer_windows, local_base, query_pre_attn_scalar) = match arch {
            Architecture::Gemma3 => (
                patterned_windows(num_layers, window, GEMMA3_PATTERN),
                Some(get_f("rope.freq_base_swa").unwrap_or(GEMMA3_LOCAL_BASE)),
                // llama.cpp: the 27B model (62 layers) scales by hidden / heads, the others
                // by the head size.
                Some(if num_layers == 62 {
                    (hidden_size / num_heads.max(1)) as f32
                } else {
                    head_dim as f32
                }),
            ),
            Architecture::Mistral | Architecture::Phi3 => (vec![window; num_layers], None, None),
            // Sliding and full layers in turn (llama.cpp's pattern for the architecture).
            Architecture::GptOss => (patterned_windows(num_layers, window, 2), None, None),
            _ => (vec![None; num_layers], None, None),
        };
        let mut config = Self {
            architecture: arch,
            vocab_size,
            hidden_size,
            intermediate_size: match experts {
                Some(e) => get("feed_forward_length").unwrap_or(e.intermediate_size),
                None => get("feed_forward_length")?,
            },
            num_layers,
            num_heads,
            num_kv_heads: get("attention.head_count_kv").unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64,
            rope: RopeConfig {
                base: get_f("rope.freq_base").unwrap_or(10_000.0),
                local_base,
                variant: if arch.gguf_interleaved_rope() {
                    RopeVariant::Interleaved
                } else {
                    RopeVariant::HalfSplit
                },
                llama3_scaling: None,
                linear_factor,
                freq_factors: None,
                // Phi's partial rotary: fewer rotated dimensions than the head has.
                rotary_dim: (get("rope.dimension_count").ok()).filter(|&r| phi && r < head_dim),
                attention_factor: None,
            },
            max_position_embeddings: get("context_length").unwrap_or(4096),
            tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
            query_pre_attn_scalar,
            layer_windows,
            experts,
        };
        if let Some(yarn) = md.yarn()? {
            let (dim, window) = (config.rotary_dim(), config.max_position_embeddings);
            yarn.apply(&mut config.rope, dim, window);
        }
        config.validate()?;
        Ok(config)
    }

    /// Parses a Hugging Face `config.json` of one of the supported architectures (named by
    /// `architectures`, or `model_type` where that is absent).
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for malformed JSON, missing fields, another architecture, or
    /// a setting the graph does not implement (named, with its value).
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: Hf =
            serde_json::from_str(json).map_err(|e| Error::invalid_model("config.json", e))?;
        let arch = hf.architecture()?;
        let gemma = arch == Architecture::Gemma3;
        let rope = hf.rope.read(gemma)?;
        hf.refuse_unsupported(arch, &rope)?;
        let n = hf.num_hidden_layers;
        let layer_windows = hf.layer_windows(arch)?;
        let mut config = Self {
            architecture: arch,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: n,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-5),
            rope: RopeConfig {
                base: rope.base().unwrap_or(10_000.0),
                local_base: gemma.then(|| rope.local_base().unwrap_or(GEMMA3_LOCAL_BASE)),
                variant: RopeVariant::HalfSplit,
                llama3_scaling: rope.llama3()?,
                linear_factor: rope.linear_factor()?,
                freq_factors: None,
                rotary_dim: None,
                attention_factor: None,
            },
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
            // Each architecture's own default in transformers.
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(gemma),
            query_pre_attn_scalar: if gemma {
                hf.query_pre_attn_scalar
            } else {
                None
            },
            layer_windows,
            experts: hf.experts(arch)?,
        };
        let head_dim = config.head_dim;
        if let Some(f) = rope.partial_rotary_factor().filter(|&f| f != 1.0) {
            // As transformers rounds it.
            config.rope.rotary_dim = Some((head_dim as f64 * f) as usize);
        }
        if let Some(yarn) = rope.yarn()? {
            let (dim, window) = (config.rotary_dim(), config.max_position_embeddings);
            yarn.apply(&mut config.rope, dim, window);
        }
        if let Some(((short, long, attention), original)) = rope.longrope()? {
            let window = config.max_position_embeddings;
            let original = original.unwrap_or(window);
            config
                .rope
                .longrope(short, long, original, window, attention);
        }
        config.validate()?;
        Ok(config)
    }
}

/// The `config.json` fields the graph reads or must check.
#[derive(Deserialize)]
struct Hf {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<u32>,
    use_sliding_window: Option<bool>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f32>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    swiglu_limit: Option<f64>,
    swiglu_alpha: Option<f64>,
    quantization_config: Option<serde_json::Value>,
    use_bidirectional_attention: Option<bool>,
    #[serde(flatten)]
    rope: RopeFields,
}

impl Hf {
    /// The architecture `architectures` names (exactly one), or else `model_type`.
    fn architecture(&self) -> Result<Architecture> {
        match (&self.architectures, self.model_type.as_deref()) {
            (Some(list), _) => match list.as_slice() {
                [one] => Architecture::from_hf_name(one),
                _ => Err(Error::invalid_model(
                    "config.json architectures",
                    format!("{list:?}: expected exactly one"),
                )),
            },
            (None, Some(t)) => {
                let t = t.strip_suffix("_text").unwrap_or(t);
                (crate::model::arch::ARCHITECTURES.into_iter())
                    .find(|a| a.name() == t)
                    .ok_or_else(|| {
                        Error::invalid_model(
                            "config.json model_type",
                            format!("'{t}' is not supported"),
                        )
                    })
            }
            (None, None) => Err(Error::invalid_model(
                "config.json",
                "names no architecture (neither `architectures` nor `model_type`)",
            )),
        }
    }

    /// Each layer's sliding window (`None`: global attention).
    fn layer_windows(&self, arch: Architecture) -> Result<Vec<Option<u32>>> {
        let (n, window) = (
            self.num_hidden_layers,
            self.sliding_window.filter(|&w| w > 0),
        );
        Ok(match arch {
            Architecture::Gemma3 | Architecture::GptOss => match &self.layer_types {
                Some(types) => types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(window),
                        "full_attention" => Ok(None),
                        other => Err(Error::invalid_model(
                            "config.json layer_types",
                            format!("'{other}' is not supported"),
                        )),
                    })
                    .collect::<Result<_>>()?,
                None => patterned_windows(
                    n,
                    window,
                    self.sliding_window_pattern.unwrap_or(GEMMA3_PATTERN),
                ),
            },
            Architecture::Mistral | Architecture::Mixtral | Architecture::Phi3 => {
                vec![window; n]
            }
            _ => vec![None; n],
        })
    }

    /// The experts of a mixture-of-experts architecture, with each one's defaults in
    /// transformers where a field is absent.
    fn experts(&self, arch: Architecture) -> Result<Option<Experts>> {
        let need = |v: Option<usize>, field: &str| {
            v.ok_or_else(|| Error::invalid_model(format!("config.json {field}"), "missing"))
        };
        Ok(match arch {
            Architecture::Qwen3Moe => Some(Experts {
                // transformers 5 renamed it to the other architectures' name.
                count: match (self.num_experts, self.num_local_experts) {
                    (Some(a), Some(b)) if a != b => {
                        return Err(Error::invalid_model(
                            "config.json num_local_experts",
                            format!("{b} differs from num_experts {a}"),
                        ));
                    }
                    (a, b) => need(a.or(b), "num_local_experts")?,
                },
                per_token: need(self.num_experts_per_tok, "num_experts_per_tok")?,
                intermediate_size: need(self.moe_intermediate_size, "moe_intermediate_size")?,
                normalize: self.norm_topk_prob.unwrap_or(false),
            }),
            Architecture::GptOss => Some(Experts {
                count: need(self.num_local_experts, "num_local_experts")?,
                per_token: need(self.num_experts_per_tok, "num_experts_per_tok")?,
                intermediate_size: self.intermediate_size,
                // A softmax over the chosen experts' scores.
                normalize: true,
            }),
            Architecture::Mixtral => Some(Experts {
                count: self.num_local_experts.unwrap_or(8),
                per_token: self.num_experts_per_tok.unwrap_or(2),
                intermediate_size: self.intermediate_size,
                normalize: true,
            }),
            _ => None,
        })
    }

    /// Settings that would change what the graph computes and that it does not implement.
    fn refuse_unsupported(&self, arch: Architecture, rope: &HfRope) -> Result<()> {
        let refuse = |field: &str, value: String| {
            Err(Error::invalid_model(
                format!("config.json {field}"),
                format!("{value} is not supported for {}", arch.hf_name()),
            ))
        };
        let act = self.hidden_activation.as_ref().or(self.hidden_act.as_ref());
        let want = match arch {
            Architecture::Gemma3 => ["gelu_pytorch_tanh", "gelu_pytorch_tanh"],
            _ => ["silu", "swish"],
        };
        if let Some(a) = act.filter(|a| !want.contains(&a.as_str())) {
            return refuse("hidden_act", format!("'{a}'"));
        }
        // Qwen2's and gpt-oss's own biases are part of the architecture; another's would be
        // dropped.
        if self.attention_bias == Some(true) && !arch.qkv_bias() {
            return refuse("attention_bias", "true".into());
        }
        // OpenAI's gpt-oss checkpoints keep their experts in MXFP4, which the packed format
        // holds in its codes (`transformer::gpt_oss`); the tensors tell which are.
        let mxfp4 = arch == Architecture::GptOss;
        if let Some(q) =
            (self.quantization_config.as_ref()).filter(|q| !(mxfp4 && q["quant_method"] == "mxfp4"))
        {
            return refuse(
                "quantization_config",
                format!("method {}", q["quant_method"]),
            );
        }
        // gpt-oss's SwiGLU is built with its release's clamp and slope.
        if let Some(l) = self.swiglu_limit.filter(|&l| l != 7.0) {
            return refuse("swiglu_limit", l.to_string());
        }
        if let Some(a) = self.swiglu_alpha.filter(|&a| (a - 1.702).abs() > 1e-6) {
            return refuse("swiglu_alpha", a.to_string());
        }
        // Gemma 3's text encoders (EmbeddingGemma) see the whole sequence; a decoder does not.
        if self.use_bidirectional_attention == Some(true) {
            return refuse("use_bidirectional_attention", "true".into());
        }
        if self.mlp_bias == Some(true) {
            return refuse("mlp_bias", "true".into());
        }
        if self.use_sliding_window == Some(true) && arch != Architecture::Mistral {
            return refuse("use_sliding_window", "true".into());
        }
        // Phi's attention turns the first dimensions only; others' turn all of them.
        if let Some(f) = rope.partial_rotary_factor().filter(|&f| f != 1.0)
            && arch != Architecture::Phi3
        {
            return refuse("partial_rotary_factor", f.to_string());
        }
        // Every layer's MLP is the mixture: dense layers among them are not implemented.
        if let Some(step) = self.decoder_sparse_step.filter(|&s| s != 1) {
            return refuse("decoder_sparse_step", step.to_string());
        }
        if let Some(dense) = self.mlp_only_layers.as_ref().filter(|l| !l.is_empty()) {
            return refuse("mlp_only_layers", format!("{dense:?}"));
        }
        for (field, v) in [
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if let Some(v) = v {
                return refuse(field, v.to_string());
            }
        }
        Ok(())
    }
}

//! Models: configuration, weights (GGUF and safetensors), the Llama-family graph on candle,
//! tokenizer and chat template, and where a model comes from.
//!
//! [`Model`] bundles what a chat needs: the graph, the tokenizer built from the same files, the
//! model's own chat template and its end-of-turn tokens.

mod arch;
mod chat_template;
mod config;
mod detokenize;
mod llama;
mod ops;
mod packed;
mod source;
mod tiny;
mod tokenizer;

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use tokenizers::Tokenizer;

pub use arch::{Activation, Architecture, ARCHITECTURES};
pub use chat_template::{common_prefix, ChatTemplate, Message};
pub use config::{Llama3RopeScaling, LlamaConfig, RopeConfig, RopeVariant};
pub use detokenize::IncrementalDecoder;
pub use llama::{ForwardBatch, Llama, WeightFormat};
pub use source::{
    default_cache_dir, default_model_path, HubSource, ModelSource, ResolvedFiles, NAMED_MODELS,
};
pub use tokenizer::{tokenizer_from_file, tokenizer_from_gguf};

use crate::{Error, Result};

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Device for weights and compute.
    pub device: Device,
    /// In-memory weight format.
    pub format: WeightFormat,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            format: WeightFormat::default(),
        }
    }
}

/// A loaded model with its tokenizer and chat template.
#[derive(Debug)]
pub struct Model {
    llama: Llama,
    tokenizer: Tokenizer,
    /// The same vocabulary, reading the text of special tokens as plain text: for what users
    /// and tools write, so that only the template's own markup makes control tokens.
    text_tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    eos_token_ids: Vec<u32>,
}

impl Model {
    /// A model from its parts: the network, the tokenizer of its vocabulary, its chat template
    /// (if any) and the tokens that end a reply.
    pub fn new(
        llama: Llama,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        let mut text_tokenizer = tokenizer.clone();
        text_tokenizer.set_encode_special_tokens(true);
        Self {
            llama,
            tokenizer,
            text_tokenizer,
            template,
            eos_token_ids,
        }
    }

    /// The same tokenizer and template over other weights (random weights of a larger shape,
    /// for throughput studies).
    pub fn with_llama(self, llama: Llama) -> Self {
        Self { llama, ..self }
    }

    /// The network.
    pub fn llama(&self) -> &Llama {
        &self.llama
    }

    /// The network's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        self.llama.config()
    }

    /// The tokenizer shipped with the weights.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's chat template, when it ships one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// Tokens that end a reply (end of turn, end of text).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Resolves `source` and loads it.
    ///
    /// # Errors
    /// As [`ModelSource::resolve`], plus [`Error::InvalidModel`], [`Error::Tokenizer`] and
    /// [`Error::ChatTemplate`] for unusable files.
    pub fn load(source: &ModelSource, options: &LoadOptions) -> Result<Self> {
        match source.resolve()? {
            ResolvedFiles::Gguf(path) => Self::from_gguf(&path, options),
            ResolvedFiles::Safetensors {
                config,
                tokenizer,
                tokenizer_config,
                weights,
            } => {
                let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| Error::io(p, e));
                let config_json = read(&config)?;
                let config = LlamaConfig::from_hf_json(&config_json)?;
                let tokenizer = tokenizer_from_file(&tokenizer)?;
                let llama =
                    Llama::from_safetensors(config, &weights, options.format, &options.device)?;
                let tok_config = match tokenizer_config {
                    Some(p) => serde_json::from_str(&read(&p)?)
                        .map_err(|e| Error::invalid_model(p.display().to_string(), e))?,
                    None => serde_json::Value::Null,
                };
                let config_value: serde_json::Value = serde_json::from_str(&config_json)
                    .map_err(|e| Error::invalid_model("config.json", e))?;
                Self::from_hf_parts(llama, tokenizer, &tok_config, &config_value)
            }
        }
    }

    /// Loads a GGUF file.
    ///
    /// # Errors
    /// [`Error::Io`] if unreadable, [`Error::InvalidModel`] if not a usable Llama GGUF.
    pub fn from_gguf(path: &Path, options: &LoadOptions) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| Error::invalid_model(path.display().to_string(), e))?;
        // Everything read from metadata is checked before the weights are.
        let tokenizer = tokenizer_from_gguf(&content)?;
        let llama = Llama::from_gguf(&content, &mut file, options.format, &options.device)?;
        let md = &content.metadata;
        let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        let name = |id: Option<u32>| {
            id.and_then(|i| tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        let (bos, eos) = (
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
        );
        let template = match md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
        {
            Some(src) => Some(ChatTemplate::new(src, &name(bos), &name(eos))?),
            None => None,
        };
        let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
        // Chat models end turns with an end-of-turn token that GGUF may not list as eos.
        for t in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"] {
            add_stop_token(&tokenizer, &mut eos_token_ids, t);
        }
        Ok(Self::new(llama, tokenizer, template, eos_token_ids))
    }

    fn from_hf_parts(
        llama: Llama,
        tokenizer: Tokenizer,
        tok_config: &serde_json::Value,
        config: &serde_json::Value,
    ) -> Result<Self> {
        // Special tokens appear either as strings or as {"content": ...} objects.
        let token_str = |v: &serde_json::Value| {
            v.as_str()
                .or_else(|| v["content"].as_str())
                .unwrap_or_default()
                .to_string()
        };
        let bos = token_str(&tok_config["bos_token"]);
        let eos = token_str(&tok_config["eos_token"]);
        // `chat_template` is a string, or a list of named templates of which "default" is used.
        let source = match &tok_config["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(String::from),
            _ => None,
        };
        let template = match source {
            Some(s) => Some(ChatTemplate::new(&s, &bos, &eos)?),
            None => None,
        };
        let mut eos_token_ids: Vec<u32> = match &config["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64().map(|i| i as u32).into_iter().collect(),
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|i| i as u32)
                .collect(),
            _ => Vec::new(),
        };
        add_stop_token(&tokenizer, &mut eos_token_ids, &eos);
        Ok(Self::new(llama, tokenizer, template, eos_token_ids))
    }

    /// Token ids of `text`, special tokens (`<|im_start|>`, ...) recognised.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if encoding fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// Token ids of `text` taken as plain text: the text of a special token (`<|im_end|>`)
    /// becomes ordinary tokens, never the control token. For what users and tools write.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the tokenizer fails.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .text_tokenizer
            .encode_fast(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`, special tokens included.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for ids outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Renders `messages` with the model's chat template.
    ///
    /// # Errors
    /// [`Error::Unsupported`] if the model ships no template; [`Error::ChatTemplate`] if it
    /// fails to render.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        match &self.template {
            Some(t) => t.render(messages, add_generation_prompt),
            None => Err(Error::Unsupported(
                "this model ships no chat template".into(),
            )),
        }
    }
}

/// Adds `token`'s id to `ids` if the vocabulary has it and it is not there yet.
fn add_stop_token(tokenizer: &Tokenizer, ids: &mut Vec<u32>, token: &str) {
    if let Some(i) = tokenizer.token_to_id(token) {
        if !ids.contains(&i) {
            ids.push(i);
        }
    }
}

//! Models: configuration, weights (GGUF and safetensors), the Llama-family graph on candle,
//! the tokenizer, and where a model comes from. What turns messages into text and text back
//! into messages (templates, tool calls, reasoning, grammars) is `crate::chat`'s.
//!
//! [`Model`] bundles what a chat needs: the graph, the tokenizer built from the same files, the
//! model's own chat template and its end-of-turn tokens.

mod arch;
mod config;
mod detokenize;
#[cfg(feature = "cuda")]
mod fused;
mod generation;
mod gguf;
mod ops;
mod packed;
mod source;
mod tiny;
mod tokenizer;
mod transformer;

use std::path::Path;

/// The candle and tokenizers types this crate's signatures name, so that a host needs no
/// dependency of its own on those crates (nor the same versions) to use them.
pub use candle_core::{DType, Device};
pub use tokenizers::Tokenizer;

pub use crate::message::{Message, ToolCall};
pub use arch::{Activation, Architecture, ARCHITECTURES};
pub use config::{Experts, Llama3RopeScaling, ModelConfig, RopeConfig, RopeVariant};
pub use detokenize::IncrementalDecoder;
pub use generation::GenerationDefaults;
#[cfg(not(feature = "internals"))]
pub(crate) use gguf::GgufHeader;
#[cfg(feature = "internals")]
pub use gguf::{GgufHeader, GgufType, OtherTensor};
pub use source::{
    default_cache_dir, default_model_path, HubSource, ModelSource, ResolvedFiles, NAMED_MODELS,
};
pub use tokenizer::{tokenizer_from_file, tokenizer_from_gguf};
pub use transformer::WeightFormat;
#[cfg(feature = "internals")]
pub use transformer::{ForwardBatch, Transformer};
#[cfg(not(feature = "internals"))]
pub(crate) use transformer::{ForwardBatch, Transformer};

pub(crate) use packed::Isa;

use crate::chat::{
    split_thought, ChatTemplate, Constraint, Grammars, Guide, ReasoningParser, Vocab,
    BUILTIN_TEMPLATES,
};
use crate::setters::setters;

/// The matmul kernels' instruction path on this CPU (chosen at run time; `PENSIEVE_ISA` picks
/// another), as benchmark tables name it.
#[cfg(feature = "internals")]
pub fn matmul_path() -> &'static str {
    packed::Isa::detect().label()
}
use crate::{Error, Result};

/// GPU `ordinal` as pensieve runs fastest on it: with a CUDA stream of its own, on which every
/// op is issued whichever thread issues it. On such a device the KV pool turns off cudarc's
/// per-op event tracking and the forward pass runs its fused kernels. candle's
/// `Device::new_cuda` uses each thread's default stream instead; pensieve runs on it too, with
/// the tracking on and the fused kernels off (a decode step then costs up to 1.7x), and says
/// so in a warning.
///
/// # Errors
/// [`Error::Candle`] when there is no such GPU or its driver fails.
#[cfg(feature = "cuda")]
pub fn cuda_device(ordinal: usize) -> Result<Device> {
    Ok(Device::Cuda(candle_core::CudaDevice::new_with_stream(
        ordinal,
    )?))
}

/// How to load a model.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Device for weights and compute (a GPU: best built by `model::cuda_device`, feature
    /// `cuda`).
    pub device: Device,
    /// In-memory weight format.
    pub format: WeightFormat,
    /// A `tokenizer.json` to use in place of the one the model's files describe. Without it,
    /// a GGUF file whose vocabulary cannot be rebuilt from its metadata falls back to a
    /// `tokenizer.json` beside it, if there is one.
    pub tokenizer: Option<std::path::PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            format: WeightFormat::default(),
            tokenizer: None,
        }
    }
}

setters!(LoadOptions {
    value device: Device,
    value format: WeightFormat,
    some_into tokenizer: std::path::PathBuf,
});

/// Which special tokens the vocabulary puts around raw text.
#[derive(Debug, Clone, Copy)]
struct AddSpecial {
    bos: bool,
    eos: bool,
}

/// A loaded model with its tokenizer and chat template.
#[derive(Debug)]
pub struct Model {
    llama: Transformer,
    tokenizer: Tokenizer,
    /// The same vocabulary, reading the text of special tokens as plain text: for what users
    /// and tools write, so that only the template's own markup makes control tokens.
    text_tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    eos_token_ids: Vec<u32>,
    /// The vocabulary's begin and end tokens as text, for templates to write.
    bos_text: String,
    eos_text: String,
    /// The token raw text (no template) starts with, when the vocabulary asks for one.
    bos_token_id: Option<u32>,
    /// The token a raw prompt ends with, when the vocabulary asks for one (`add_eos_token`).
    appended_eos: Option<u32>,
    /// See [`Model::prefixes_space`].
    prefixes_space: bool,
    /// See [`Model::generation_defaults`].
    generation: GenerationDefaults,
    /// The vocabulary as the grammar engine reads it, built at the first constrained turn.
    grammars: Grammars,
}

impl Model {
    /// A model from its parts: the network, the tokenizer of its vocabulary, its chat template
    /// (if any) and the tokens that end a reply.
    #[cfg_attr(feature = "internals", visibility::make(pub))]
    pub(crate) fn new(
        llama: Transformer,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        let mut eos_token_ids = eos_token_ids;
        harmony_stops(&tokenizer, &mut eos_token_ids);
        let mut text_tokenizer = tokenizer.clone();
        text_tokenizer.set_encode_special_tokens(true);
        // Seen, not configured: a tokenizer.json may prefix by normalizer or pre-tokenizer.
        let prefixes_space = text_tokenizer
            .encode_fast("x", false)
            .ok()
            .and_then(|e| e.get_ids().first().and_then(|&i| tokenizer.id_to_token(i)))
            .is_some_and(|t| t.starts_with('\u{2581}'));
        Self {
            llama,
            tokenizer,
            text_tokenizer,
            template,
            eos_token_ids,
            bos_text: String::new(),
            eos_text: String::new(),
            bos_token_id: None,
            appended_eos: None,
            prefixes_space,
            generation: GenerationDefaults::default(),
            grammars: Grammars::default(),
        }
    }

    /// The guide of `constraint` on this model's vocabulary.
    ///
    /// # Errors
    /// As [`Grammars::guide`].
    pub(crate) fn guide(&self, constraint: &Constraint) -> Result<Guide> {
        let vocab = Vocab {
            tokenizer: &self.tokenizer,
            size: self.config().vocab_size,
            eos: &self.eos_token_ids,
        };
        self.grammars.guide(vocab, constraint)
    }

    /// The same model with the sampling defaults its checkpoint ships; the ends of generation
    /// they list join the model's.
    pub fn with_generation_defaults(mut self, defaults: GenerationDefaults) -> Self {
        for &t in &defaults.eos_token_ids {
            if !self.eos_token_ids.contains(&t) {
                self.eos_token_ids.push(t);
            }
        }
        self.generation = defaults;
        self
    }

    /// The sampling defaults of the checkpoint's `generation_config.json` (none for a GGUF),
    /// for a server to apply to requests that leave a field unset.
    pub fn generation_defaults(&self) -> &GenerationDefaults {
        &self.generation
    }

    /// The same model with its begin and end tokens named (`bos`, `eos`: ids in the
    /// vocabulary) for templates; raw text (a turn without a template, a raw prompt) starts
    /// with `bos` where `add.bos`, and a raw prompt ends with `eos` where `add.eos`.
    fn with_special(mut self, bos: Option<u32>, eos: Option<u32>, add: AddSpecial) -> Self {
        let name = |id: Option<u32>| {
            id.and_then(|i| self.tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        (self.bos_text, self.eos_text) = (name(bos), name(eos));
        self.bos_token_id = bos.filter(|_| add.bos);
        self.appended_eos = eos.filter(|_| add.eos);
        self
    }

    /// The same model with a built-in chat template (`chatml`, `gemma`, `llama3`: see
    /// [`BUILTIN_TEMPLATES`]) in place of its own, for models that ship none. The template's
    /// end-of-turn token ends replies.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for an unknown name or a template whose markup tokens are not
    /// in this model's vocabulary.
    pub fn with_builtin_template(mut self, name: &str) -> Result<Self> {
        let Some((_, source, tokens)) = BUILTIN_TEMPLATES.iter().find(|t| t.0 == name) else {
            return Err(Error::Unsupported(format!(
                "no built-in chat template '{name}' (built-in: {})",
                BUILTIN_TEMPLATES.map(|t| t.0).join(", ")
            )));
        };
        if let Some(missing) = tokens
            .iter()
            .find(|t| self.tokenizer.token_to_id(t).is_none())
        {
            return Err(Error::Unsupported(format!(
                "chat template '{name}' needs the token {missing}, which this model's \
                 vocabulary lacks"
            )));
        }
        self.template = Some(ChatTemplate::new(source, &self.bos_text, &self.eos_text)?);
        if let Some(end) = tokens.last() {
            add_stop_token(&self.tokenizer, &mut self.eos_token_ids, end);
        }
        Ok(self)
    }

    /// The same model with the chat template `source` (Jinja, as `tokenizer.chat_template`)
    /// in place of its own.
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] if it does not parse.
    pub fn with_template_source(mut self, source: &str) -> Result<Self> {
        self.template = Some(ChatTemplate::new(source, &self.bos_text, &self.eos_text)?);
        Ok(self)
    }

    /// Whether the tokenizer puts a space marker before every piece of text it is given
    /// (SentencePiece's `add_space_prefix`: Llama 2, Mistral v0.x), so that text tokenized in
    /// pieces differs from the same text tokenized whole at every boundary.
    pub fn prefixes_space(&self) -> bool {
        self.prefixes_space
    }

    /// The token raw text starts with (a turn of a model without a chat template, at the
    /// start of a conversation), when the vocabulary asks for one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The same tokenizer and template over other weights (random weights of a larger shape,
    /// for throughput studies).
    #[cfg(any(feature = "cli", feature = "internals"))]
    #[cfg_attr(feature = "internals", visibility::make(pub))]
    pub(crate) fn with_transformer(self, llama: Transformer) -> Self {
        Self { llama, ..self }
    }

    /// The network.
    #[cfg_attr(feature = "internals", visibility::make(pub))]
    pub(crate) fn transformer(&self) -> &Transformer {
        &self.llama
    }

    /// The network's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        self.llama.config()
    }

    /// Bytes of the weights the model holds on its device (linear layers, embedding table
    /// unless it is the output projection's, norms and biases): about the file's tensor bytes
    /// in the packed format, which keeps each tensor in its own codes on the CPU and on a GPU.
    pub fn weight_bytes(&self) -> usize {
        self.llama.held_bytes()
    }

    /// The tokenizer shipped with the weights.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// A reply as a conversation's transcript keeps it: for a thinking model's template
    /// ([`ChatTemplate::thinks`]), a reply that closes its thought has it apart from its
    /// answer ([`Message::reasoning_content`]); for a harmony template
    /// ([`ChatTemplate::harmony`]), the analysis channel is the thought and the rest's
    /// messages, without their markup, the answer.
    pub fn assistant_message(&self, reply: String) -> Message {
        if self.template.as_ref().is_some_and(ChatTemplate::harmony) {
            let (thought, answer) = ReasoningParser::GptOss.split(&reply);
            let m = Message::new("assistant", answer);
            return match thought {
                Some(t) => m.with_reasoning(t),
                None => m,
            };
        }
        let thinks = self.template.as_ref().is_some_and(ChatTemplate::thinks);
        match split_thought(&reply).filter(|_| thinks) {
            Some((thought, answer)) => Message::new("assistant", answer).with_reasoning(thought),
            None => Message::new("assistant", reply),
        }
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
                generation_config,
                weights,
            } => {
                let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| Error::io(p, e));
                let config_json = read(&config)?;
                let config = ModelConfig::from_hf_json(&config_json)?;
                let tokenizer =
                    tokenizer_from_file(options.tokenizer.as_ref().unwrap_or(&tokenizer))?;
                let llama = Transformer::from_safetensors(
                    config,
                    &weights,
                    options.format,
                    &options.device,
                )?;
                let tok_config = match tokenizer_config {
                    Some(p) => serde_json::from_str(&read(&p)?)
                        .map_err(|e| Error::invalid_model(p.display().to_string(), e))?,
                    None => serde_json::Value::Null,
                };
                let config_value: serde_json::Value = serde_json::from_str(&config_json)
                    .map_err(|e| Error::invalid_model("config.json", e))?;
                let generation = match generation_config {
                    Some(p) => GenerationDefaults::from_json(&read(&p)?)?,
                    None => GenerationDefaults::default(),
                };
                Ok(
                    Self::from_hf_parts(llama, tokenizer, &tok_config, &config_value)?
                        .with_generation_defaults(generation),
                )
            }
        }
    }

    /// Loads a GGUF file.
    ///
    /// # Errors
    /// [`Error::Io`] if unreadable, [`Error::InvalidModel`] if not a usable Llama GGUF.
    pub fn from_gguf(path: &Path, options: &LoadOptions) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let header = GgufHeader::read(&mut file).map_err(|e| match e {
            Error::InvalidModel { reason, .. } => {
                Error::invalid_model(path.display().to_string(), reason)
            }
            Error::Io { source, .. } => Error::io(path, source),
            e => e,
        })?;
        let content = &header.content;
        // Everything read from metadata is checked before the weights are.
        let beside = path.with_file_name("tokenizer.json");
        let tokenizer = match (&options.tokenizer, tokenizer_from_gguf(content)) {
            (Some(file), _) => tokenizer_from_file(file)?,
            (None, Ok(t)) => t,
            (None, Err(_)) if beside.is_file() => tokenizer_from_file(&beside)?,
            (None, Err(e)) => return Err(e),
        };
        let llama = Transformer::from_gguf(&header, &mut file, options.format, &options.device)?;
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
        eos_token_ids
            .extend(id("tokenizer.ggml.eot_token_id").filter(|i| !eos_token_ids.contains(i)));
        // Chat models end turns with an end-of-turn token that GGUF may not list (llama.cpp
        // takes these as ends of generation too).
        for t in END_OF_TURN {
            add_stop_token(&tokenizer, &mut eos_token_ids, t);
        }
        let flag = |key: &str| md.get(key).and_then(|v| v.to_bool().ok()).unwrap_or(false);
        let add = AddSpecial {
            bos: flag("tokenizer.ggml.add_bos_token"),
            eos: flag("tokenizer.ggml.add_eos_token"),
        };
        Ok(Self::new(llama, tokenizer, template, eos_token_ids).with_special(bos, eos, add))
    }

    fn from_hf_parts(
        llama: Transformer,
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
        let (bos_id, eos_id) = (tokenizer.token_to_id(&bos), tokenizer.token_to_id(&eos));
        // tokenizer.json adds BOS through its post-processor, which pensieve does not run
        // (templates write it): raw text gets it when tokenizer_config.json asks.
        let add = AddSpecial {
            bos: tok_config["add_bos_token"].as_bool().unwrap_or(false),
            eos: tok_config["add_eos_token"].as_bool().unwrap_or(false),
        };
        Ok(Self::new(llama, tokenizer, template, eos_token_ids).with_special(bos_id, eos_id, add))
    }

    /// Token ids of `text`, special tokens (`<|im_start|>`, ...) recognised.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if encoding fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode_fast(text, false)
            .map_err(Error::Tokenizer)?
            .get_ids()
            .to_vec())
    }

    /// Token ids of a raw prompt (`/v1/completions`) as llama.cpp and vLLM make them: `text`
    /// with special tokens recognised and, with `add_special`, the begin token before it and
    /// the end token after it where the vocabulary asks for them (`add_bos_token`,
    /// `add_eos_token`). Base models such as Gemma 3 continue text sensibly only after BOS.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if encoding fails.
    pub fn encode_prompt(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let (bos, eos) = match add_special {
            true => (self.bos_token_id, self.appended_eos),
            false => (None, None),
        };
        let mut ids: Vec<u32> = bos.into_iter().collect();
        ids.extend(self.encode(text)?);
        ids.extend(eos);
        Ok(ids)
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
            .map_err(Error::Tokenizer)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`, special tokens included.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for ids outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, false).map_err(Error::Tokenizer)
    }

    /// Renders `messages` with the model's chat template.
    ///
    /// # Errors
    /// [`Error::Unsupported`] if the model ships no template; [`Error::ChatTemplate`] if it
    /// fails to render.
    pub fn render_chat(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        match &self.template {
            Some(t) => t.render(messages, add_generation_prompt),
            None => Err(Error::Unsupported(format!(
                "this model ships no chat template: give one (`--chat-template FILE` in the \
                 examples and the server, `Model::with_template_source` in the library) or name \
                 a built-in (`--chat-template {}`, `Model::with_builtin_template`)",
                BUILTIN_TEMPLATES.map(|t| t.0).join("|")
            ))),
        }
    }
}

/// Tokens that end a turn in the chat formats of the supported models.
const END_OF_TURN: [&str; 5] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "</s>",
    "<end_of_turn>",
];

/// A harmony vocabulary's (gpt-oss) replies end at `<|return|>` (an answer) or `<|call|>` (a
/// tool call), not at `<|end|>`, which ends the analysis message before the answer. As
/// llama.cpp does, a vocabulary with both has them as stops and `<|end|>` not.
fn harmony_stops(tokenizer: &Tokenizer, ids: &mut Vec<u32>) {
    let (Some(ret), Some(call)) = (
        tokenizer.token_to_id("<|return|>"),
        tokenizer.token_to_id("<|call|>"),
    ) else {
        return;
    };
    if let Some(end) = tokenizer.token_to_id("<|end|>") {
        ids.retain(|&i| i != end);
    }
    for t in [ret, call] {
        if !ids.contains(&t) {
            ids.push(t);
        }
    }
}

/// Adds `token`'s id to `ids` if the vocabulary has it and it is not there yet.
fn add_stop_token(tokenizer: &Tokenizer, ids: &mut Vec<u32>, token: &str) {
    if let Some(i) = tokenizer.token_to_id(token)
        && !ids.contains(&i)
    {
        ids.push(i);
    }
}

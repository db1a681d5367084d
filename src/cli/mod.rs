//! The command-line flags pensieve's tools share (feature `cli`, on clap): the model, weight
//! format, cache mode and budgets ([`EngineArgs`]), the store below host ([`StoreArgs`]), flag
//! checks, and how a failed run is reported ([`exit_code`]). A host with its own command line
//! can `#[command(flatten)]` them. Every flag has a `PENSIEVE_<FLAG>` environment form.

mod exit;

use std::time::Duration;

use candle_core::Device;
use clap::{Args, ValueEnum};
pub use exit::exit_code;

use crate::chat::BUILTIN_TEMPLATES;
use crate::engine::{
    Budgets, CacheMode, EngineConfig, KvPrecision, OverflowPolicy, RedisConfig, Speculation,
    StoreConfig,
};
use crate::model::{LoadOptions, Model, ModelSource, Transformer, WeightFormat};
use crate::{Error, Result};

/// Cache mode, as the papers name the three systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// KV released after every turn (vLLM-style).
    Stateless,
    /// Device pool only; evicted KV is dropped.
    DeviceOnly,
    /// Device pool plus host tier (Pensieve).
    Tiered,
    /// Device pool, host tier and a store tier (AttentionStore; `--store-gib`, `--store`).
    #[value(alias = "tiered-disk")]
    TieredStore,
}

impl Mode {
    /// All three, baseline first.
    pub const ALL: [Mode; 3] = [Mode::Stateless, Mode::DeviceOnly, Mode::Tiered];

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Stateless => "stateless",
            Mode::DeviceOnly => "device-only",
            Mode::Tiered => "tiered",
            Mode::TieredStore => "tiered-store",
        }
    }

    /// The engine's mode.
    pub fn cache_mode(self) -> CacheMode {
        match self {
            Mode::Stateless => CacheMode::Stateless,
            Mode::DeviceOnly => CacheMode::DeviceOnly,
            Mode::Tiered | Mode::TieredStore => CacheMode::Tiered,
        }
    }
}

/// In-memory weight format.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// Packed weights on pensieve's batch-invariant matmul (the default).
    Packed,
    /// f32 on candle's GEMM.
    F32,
    /// f16 on candle's matmul.
    F16,
    /// The file's quantization on candle's quantized matmul.
    Quantized,
    /// bf16 on candle's matmul.
    Bf16,
}

/// How the KV cache stores values.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Kv {
    /// Half precision (the default): half the bytes per token in every tier.
    F16,
    /// f32.
    F32,
    /// bfloat16 (for GPUs; the CPU widens it on every read).
    Bf16,
    /// 8 bits (llama.cpp's q8_0 blocks): 53% of f16's bytes in every tier.
    Q8,
    /// 4 bits (llama.cpp's q4_0 blocks): 28% of f16's bytes in every tier.
    Q4,
}

impl From<Kv> for KvPrecision {
    fn from(kv: Kv) -> Self {
        match kv {
            Kv::F16 => KvPrecision::F16,
            Kv::F32 => KvPrecision::F32,
            Kv::Bf16 => KvPrecision::Bf16,
            Kv::Q8 => KvPrecision::Q8,
            Kv::Q4 => KvPrecision::Q4,
        }
    }
}

/// What a turn that would pass the context window does.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Overflow {
    /// Refuse the turn.
    Error,
    /// Keep the end of the new prompt that fits.
    TruncatePrompt,
    /// Drop the oldest turns after the system prompt, keeping the cached KV of the rest.
    DropOldest,
}

/// Flags for the model and the engine's cache.
#[derive(Args, Debug)]
pub struct EngineArgs {
    /// Model: `default`, a name `scripts/fetch-assets --model NAME` installs (`gemma3-270m`), a
    /// .gguf file, a safetensors folder, an `org/name` hub repo, or `tiny` (random weights with
    /// a byte tokenizer: no files needed, e.g. on a GPU machine with `--model-shape`).
    #[arg(long, env = "PENSIEVE_MODEL", default_value = "default")]
    pub model: String,
    /// Where weights, KV pool and compute live: `cpu`, or `cuda` / `cuda:N` (a build with
    /// `--features cuda`).
    #[arg(long, env = "PENSIEVE_DEVICE", default_value = "cpu", value_parser = device)]
    pub device: Device,
    /// Weight format.
    #[arg(long, env = "PENSIEVE_FORMAT", value_enum, default_value = "packed")]
    pub format: Format,
    /// Cache mode.
    #[arg(long, env = "PENSIEVE_MODE", value_enum, default_value = "tiered")]
    pub mode: Mode,
    /// Device KV pool in tokens.
    #[arg(long, env = "PENSIEVE_DEVICE_TOKENS", default_value_t = 8192, value_parser = positive)]
    pub device_tokens: usize,
    /// Host KV tier in MiB.
    #[arg(long, env = "PENSIEVE_HOST_MIB", default_value_t = 1024)]
    pub host_mib: usize,
    /// KV cache precision.
    #[arg(long, env = "PENSIEVE_KV", value_enum, default_value = "f16")]
    pub kv: Kv,
    /// What a turn that would pass the context window does.
    #[arg(
        long,
        env = "PENSIEVE_OVERFLOW",
        value_enum,
        default_value = "drop-oldest"
    )]
    pub overflow: Overflow,
    /// Context window in tokens, when shorter than the model's.
    #[arg(long, env = "PENSIEVE_MAX_CONTEXT", value_parser = positive)]
    pub max_context: Option<usize>,
    /// Each conversation keeps its own KV: no sharing of equal prefixes by content.
    #[arg(long, env = "PENSIEVE_NO_PREFIX_SHARING")]
    pub no_prefix_sharing: bool,
    /// Every tier keeps every layer of every chunk, sliding-window layers' included, where
    /// by default a chunk no window reads again keeps only the other layers below the device
    /// (llama.cpp's `--swa-full`; outputs are the same either way).
    #[arg(long, env = "PENSIEVE_SWA_FULL")]
    pub swa_full: bool,
    /// Most tokens a decode step drafts from the conversation's history and verifies
    /// (speculative decoding; the output is the same either way). 0 turns it off.
    #[arg(long, env = "PENSIEVE_DRAFT_TOKENS", default_value_t = Speculation::default().max_draft)]
    pub draft_tokens: usize,
    /// A `tokenizer.json` in place of the one the model's files describe.
    #[arg(long, env = "PENSIEVE_TOKENIZER")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Chat template in place of the model's own (base models ship none): a built-in name
    /// (`chatml`, `gemma`, `llama3`) or a Jinja file.
    #[arg(long, env = "PENSIEVE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
}

impl EngineArgs {
    /// Load options for `--format` on `--device`.
    pub fn load_options(&self) -> LoadOptions {
        let mut options =
            LoadOptions::default()
                .device(self.device.clone())
                .format(match self.format {
                    Format::F32 => WeightFormat::F32,
                    Format::F16 => WeightFormat::F16,
                    Format::Quantized => WeightFormat::Quantized,
                    Format::Bf16 => WeightFormat::Bf16,
                    Format::Packed => WeightFormat::Packed,
                });
        options.tokenizer = self.tokenizer.clone();
        options
    }

    /// The KV precision of `--kv`.
    pub fn kv_precision(&self) -> KvPrecision {
        self.kv.into()
    }

    /// The overflow policy of `--overflow`.
    pub fn overflow_policy(&self) -> OverflowPolicy {
        match self.overflow {
            Overflow::Error => OverflowPolicy::Error,
            Overflow::TruncatePrompt => OverflowPolicy::TruncatePrompt,
            Overflow::DropOldest => OverflowPolicy::DropOldest,
        }
    }

    /// Loads `--model`.
    ///
    /// # Errors
    /// The model cannot be found or loaded, or `--chat-template` cannot be read or compiled.
    pub fn load_model(&self) -> Result<Model> {
        tracing::info!(model = %self.model, "loading");
        let options = self.load_options();
        if self.model == "tiny" {
            let tiny = Model::tiny(7)?;
            let llama =
                Transformer::random(tiny.config().clone(), 7, options.format, &options.device)?;
            return Ok(tiny.with_transformer(llama));
        }
        let source: ModelSource = self.model.parse()?;
        let model = Model::load(&source, &options)?;
        Ok(match &self.chat_template {
            None => model,
            Some(name) if BUILTIN_TEMPLATES.iter().any(|t| t.0 == name) => {
                model.with_builtin_template(name)?
            }
            Some(file) => {
                let source =
                    std::fs::read_to_string(file).map_err(|e| Error::io(file.as_str(), e))?;
                model.with_template_source(&source)?
            }
        })
    }

    /// Loads `--model` for a chat: it must have a chat template, its own or `--chat-template`.
    ///
    /// # Errors
    /// As [`EngineArgs::load_model`], or the model has no chat template.
    pub fn load_chat_model(&self) -> Result<Model> {
        let model = self.load_model()?;
        // Renders nothing: only asks whether there is a template, with the error that names
        // the ways to give one.
        if model.template().is_none() {
            model.render_chat(&[], true)?;
        }
        Ok(model)
    }

    /// The engine's configuration from these flags, with the tier below host that `store`
    /// names, if any.
    pub fn engine_config(&self, store: &StoreArgs) -> EngineConfig {
        EngineConfig::default()
            .budgets(self.budgets())
            .mode(self.mode.cache_mode())
            .kv_precision(self.kv_precision())
            .overflow(self.overflow_policy())
            .max_context_tokens(self.max_context)
            .prefix_sharing(!self.no_prefix_sharing)
            .narrow_windows(!self.swa_full)
            .speculation(self.speculation())
            .store(store.store_config())
    }

    /// Speculation as `--draft-tokens` sets it.
    pub fn speculation(&self) -> Speculation {
        Speculation::default().max_draft(self.draft_tokens)
    }

    /// The budgets of `--device-tokens` and `--host-mib`.
    pub fn budgets(&self) -> Budgets {
        Budgets::default()
            .device_tokens(self.device_tokens)
            .host_bytes(self.host_mib << 20)
    }
}

/// Where KV goes below host memory: a folder (`--store`) or a Redis shared by a fleet of
/// engines (`--redis`).
#[derive(Args, Debug, Clone)]
pub struct StoreArgs {
    /// Folder of a store tier: KV and named conversations persist there across runs.
    #[arg(long, env = "PENSIEVE_STORE", conflicts_with = "redis")]
    pub store: Option<std::path::PathBuf>,
    /// A Redis (or Valkey) shared by several engines: `redis://[user:password@]host:port`,
    /// `rediss://` for TLS. Conversations continue on any engine attached to it.
    #[arg(long, env = "PENSIEVE_REDIS", value_name = "URL")]
    pub redis: Option<String>,
    /// Key prefix of this deployment in Redis.
    #[arg(
        long,
        env = "PENSIEVE_REDIS_PREFIX",
        default_value = "pensieve",
        requires = "redis"
    )]
    pub redis_prefix: String,
    /// PEM file of the CA that signed the Redis server's certificate (`rediss://` with a
    /// private CA).
    #[arg(long, env = "PENSIEVE_REDIS_CA", requires = "redis")]
    pub redis_ca: Option<std::path::PathBuf>,
    /// `--redis` names nodes of a Redis Cluster (one or more, comma-separated): KV spreads
    /// over its shards.
    #[arg(long, env = "PENSIEVE_REDIS_CLUSTER", requires = "redis")]
    pub redis_cluster: bool,
    /// Seconds an unused chunk or conversation stays in Redis (0: until deleted or evicted).
    #[arg(
        long,
        env = "PENSIEVE_REDIS_TTL_S",
        default_value_t = 86400,
        requires = "redis"
    )]
    pub redis_ttl_s: u64,
    /// Days a folder store keeps a named conversation after its last turn (0: until it is
    /// closed or ended).
    #[arg(
        long,
        env = "PENSIEVE_STORE_EXPIRE_DAYS",
        default_value_t = 30.0,
        requires = "store",
        value_parser = days
    )]
    pub store_expire_days: f64,
    /// Budget in GiB of the chunks this engine stores (in the folder or in Redis).
    #[arg(
        long,
        env = "PENSIEVE_STORE_GIB",
        alias = "disk-gib",
        default_value_t = 4.0
    )]
    pub store_gib: f64,
}

impl StoreArgs {
    /// The tier below host these flags name, if any.
    pub fn store_config(&self) -> Option<StoreConfig> {
        let store = match (&self.store, &self.redis) {
            (Some(dir), _) => StoreConfig::new(dir).expire_after(
                (self.store_expire_days > 0.0)
                    .then(|| Duration::from_secs_f64(self.store_expire_days * 86400.0)),
            ),
            (None, Some(url)) => {
                let mut redis = RedisConfig::new(url)
                    .key_prefix(self.redis_prefix.clone())
                    .cluster(self.redis_cluster)
                    .ttl((self.redis_ttl_s > 0).then(|| Duration::from_secs(self.redis_ttl_s)));
                redis.ca_file = self.redis_ca.clone();
                StoreConfig::redis(redis)
            }
            (None, None) => return None,
        };
        Some(store.budget_bytes(gib_bytes(self.store_gib)))
    }

    /// Whether conversations can be stored by name.
    pub fn any(&self) -> bool {
        self.store.is_some() || self.redis.is_some()
    }
}

/// `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn device(s: &str) -> Result<Device, String> {
    let ordinal = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => return Err("expected cpu, cuda or cuda:N".into()),
        },
    };
    #[cfg(feature = "cuda")]
    let device = crate::model::cuda_device(ordinal);
    #[cfg(not(feature = "cuda"))]
    let device = Device::new_cuda(ordinal);
    device.map_err(|e| format!("no CUDA device {ordinal}: {e}"))
}

/// Bytes in `gib` GiB (a flag's fractional size).
pub fn gib_bytes(gib: f64) -> usize {
    (gib * (1u64 << 30) as f64) as usize
}

/// A flag value of at least 1.
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A number of days from 0 to 100 years' worth (a time to live; 0 for none).
pub fn days(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.0..=36_500.0).contains(&x) => Ok(x),
        Ok(_) => Err("must be from 0 to 36500 days".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite flag value above 0.
pub fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("must be a finite number above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

//! Typed engine configuration with validation.

pub use crate::attention::KvPrecision;
use std::path::PathBuf;
use std::time::Duration;

use crate::kv::CostModel;
pub use crate::kv::RedisConfig;
use crate::model::{LoadOptions, ModelSource};
use crate::scheduler::Speculation;
use crate::setters::setters;
use crate::{Error, Result};

/// How the engine treats KV between turns; the three variants the papers compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CacheMode {
    /// Device pool plus host tier (Pensieve).
    #[default]
    Tiered,
    /// Device pool only: evicted chunks are dropped (the "GPU cache" variant).
    DeviceOnly,
    /// KV released after every turn; each turn re-prefills the whole history (vLLM-style).
    Stateless,
}

/// Which eviction policy to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EvictionKind {
    /// Recompute cost / idle time (Pensieve thesis §3.4.3).
    #[default]
    Value,
    /// Least recently used.
    Lru,
}

/// Where the value policy's cost curve comes from.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
#[non_exhaustive]
pub enum CostProfile {
    /// Measured on the loaded model at start-up.
    #[default]
    Measure,
    /// Given (e.g. a profile measured earlier).
    Fixed(CostModel),
}

/// What to do with a prompt that does not fit the context window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OverflowPolicy {
    /// Refuse the turn with [`Error::ContextOverflow`].
    #[default]
    Error,
    /// Keep the end of the new turn's prompt that fits (the history is kept whole).
    TruncatePrompt,
    /// Drop the oldest turns after the system prompt (whole turns, as few as leave room for
    /// the reply, up to a quarter of the window), keeping the cached KV of the rest: its keys
    /// are re-rotated to their new positions (AttentionStore §3.5), so only what had been
    /// evicted is recomputed. The kept KV was computed with the dropped turns in view, so the
    /// outputs approximate (closely) a fresh prefill of the shortened history.
    DropOldest,
}

/// Memory budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Budgets {
    /// Device pool size in KV-tokens (slots); rounded down to whole chunks.
    pub device_tokens: usize,
    /// Device pool size in bytes instead; when set it overrides `device_tokens`, converted with
    /// the loaded model's KV-token size.
    pub device_bytes: Option<usize>,
    /// Host tier size in bytes (ignored in `DeviceOnly` and `Stateless` modes).
    pub host_bytes: usize,
}

impl Default for Budgets {
    fn default() -> Self {
        Self {
            device_tokens: 16 * 1024,
            device_bytes: None,
            host_bytes: 4 << 30,
        }
    }
}

setters!(Budgets {
    value device_tokens: usize,
    some device_bytes: usize,
    value host_bytes: usize,
});

/// Where the tier below host keeps its chunks and conversation manifests.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum StoreLocation {
    /// Files in a folder of this machine (created if absent; engines of different models may
    /// share it). A later engine over the same folder resumes every named conversation.
    Folder(PathBuf),
    /// A Redis (or Valkey) server shared by a fleet of engines: any of them continues a
    /// conversation another one served, from its KV ([`super::Engine::resume`]), and finds
    /// by content the chunks the others computed.
    Redis(RedisConfig),
}

/// The tier below host (AttentionStore): chunks and conversation manifests in a folder or a
/// shared Redis, under a byte budget. Conversations opened with a name persist there.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct StoreConfig {
    /// Where the chunks go.
    pub location: StoreLocation,
    /// Most bytes of chunks this engine keeps stored; eviction keeps it under. (In a shared
    /// store, the bytes this engine wrote: Redis's own `maxmemory` is the server's guard.)
    pub budget_bytes: usize,
    /// Bytes per second the store reads back, weighed against recomputing a chunk: a chunk
    /// cheaper to recompute than to read is not saved.
    pub read_bytes_per_s: f64,
    /// How long a folder store keeps a named conversation after its last turn: older ones are
    /// removed (with their chunks) when an engine opens the folder, and while one writes to
    /// it, so that the folder's conversations stay bounded to those in use. `None` keeps them
    /// until they are closed or ended. A Redis store expires its keys by [`RedisConfig::ttl`]
    /// instead, and refuses this.
    pub expire_after: Option<Duration>,
}

impl StoreConfig {
    /// A store in `dir` of up to 16 GiB, read at 1 GB/s (an NVMe drive or the page cache),
    /// keeping conversations for 30 days after their last turn.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            location: StoreLocation::Folder(dir.into()),
            budget_bytes: 16 << 30,
            read_bytes_per_s: 1e9,
            expire_after: Some(Duration::from_secs(30 * 24 * 3600)),
        }
    }

    /// A shared store in the Redis `config` names, of up to 16 GiB written by this engine,
    /// read at 500 MB/s (a GET over a local network).
    pub fn redis(config: RedisConfig) -> Self {
        Self {
            location: StoreLocation::Redis(config),
            budget_bytes: 16 << 30,
            read_bytes_per_s: 5e8,
            expire_after: None,
        }
    }
}

setters!(StoreConfig {
    value location: StoreLocation,
    value budget_bytes: usize,
    value read_bytes_per_s: f64,
    value expire_after: Option<Duration>,
});

/// Everything an [`super::Engine`] is built from.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// The model.
    pub model: ModelSource,
    /// Device and weight format.
    pub load: LoadOptions,
    /// Memory budgets.
    pub budgets: Budgets,
    /// KV-tokens per chunk (unit of allocation, eviction and swap).
    pub chunk_size: usize,
    /// Most tokens one step runs through the model (prefill is split across steps beyond it).
    pub step_token_budget: usize,
    /// Ahead-of-time swap-out starts when free device slots fall below this fraction.
    pub swap_out_threshold: f64,
    /// Admission keeps at least this fraction of device slots free for running decodes.
    pub reserve: f64,
    /// Cache behaviour between turns.
    pub mode: CacheMode,
    /// Eviction policy.
    pub eviction: EvictionKind,
    /// Cost curve of the value policy.
    pub cost_profile: CostProfile,
    /// Prompts beyond the context window.
    pub overflow: OverflowPolicy,
    /// A context window shorter than the model's (`max_model_len` in vLLM terms): turns and
    /// replies are bounded by it, and overflow is handled at it.
    pub max_context_tokens: Option<usize>,
    /// How KV values are stored.
    pub kv_precision: KvPrecision,
    /// Restore swapped-in KV layer by layer: on a GPU a pass starts computing layer 0 while
    /// later layers are still being copied (each layer waits only for its own copies). Off,
    /// the step waits for the whole restore first (the serial baseline). Outputs are the same
    /// either way; the CPU copies synchronously regardless.
    pub pipelined_restore: bool,
    /// The store tier, if any (only in [`CacheMode::Tiered`]).
    pub store: Option<StoreConfig>,
    /// Share KV across conversations by content: a turn whose tokens start with full chunks
    /// another conversation holds (in memory, or in the store) takes a reference to them
    /// instead of prefilling them, and a chunk shared that way is stored once. Off, each
    /// conversation computes and keeps its own (Pensieve's model).
    pub prefix_sharing: bool,
    /// How many waiting turns (from the head of the queue) have their KV read ahead from the
    /// store tier into free host memory, and are spared by ahead-of-time eviction.
    pub prefetch_window: usize,
    /// How long before a conversation's expected resume ([`super::Engine::expect_resume`])
    /// its KV is read ahead from the store.
    pub prefetch_lead: std::time::Duration,
    /// Check the cache and queue invariants after every step, failing the step with
    /// [`Error::Invariant`] if one is broken. On by default in debug builds; tests turn it on
    /// in release builds too.
    pub check_invariants: bool,
    /// Speculative decoding from each conversation's history: a decode row drafts the tokens
    /// that followed the latest earlier occurrence of its last few, and one step verifies
    /// them. The output is the same as without it (token for token under greedy decoding or
    /// a seed); only how many tokens a step yields changes.
    pub speculation: Speculation,
    /// Sliding-window layers keep their window: a chunk that none of them reads again leaves
    /// the device with only the other layers' KV (Gemma 3 keeps 1 layer in 6, gpt-oss 1 in
    /// 2), and a turn that would read a narrowed chunk through a window recomputes it. Off,
    /// every tier keeps every layer of every chunk (llama.cpp's `--swa-full`). Outputs are
    /// the same either way.
    pub narrow_windows: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            model: ModelSource::Default,
            load: LoadOptions::default(),
            budgets: Budgets::default(),
            chunk_size: 32,
            step_token_budget: 512,
            swap_out_threshold: 0.25,
            reserve: 0.10,
            mode: CacheMode::Tiered,
            eviction: EvictionKind::Value,
            cost_profile: CostProfile::Measure,
            overflow: OverflowPolicy::Error,
            max_context_tokens: None,
            kv_precision: KvPrecision::default(),
            pipelined_restore: true,
            store: None,
            prefix_sharing: true,
            prefetch_window: 8,
            prefetch_lead: std::time::Duration::from_secs(2),
            check_invariants: cfg!(debug_assertions),
            speculation: Speculation::default(),
            narrow_windows: true,
        }
    }
}

setters!(EngineConfig {
    value model: ModelSource,
    value load: LoadOptions,
    value budgets: Budgets,
    value chunk_size: usize,
    value step_token_budget: usize,
    value swap_out_threshold: f64,
    value reserve: f64,
    value mode: CacheMode,
    value eviction: EvictionKind,
    value cost_profile: CostProfile,
    value overflow: OverflowPolicy,
    some max_context_tokens: usize,
    value kv_precision: KvPrecision,
    value pipelined_restore: bool,
    some store: StoreConfig,
    value prefix_sharing: bool,
    value prefetch_window: usize,
    value prefetch_lead: std::time::Duration,
    value check_invariants: bool,
    value speculation: Speculation,
    value narrow_windows: bool,
});

impl EngineConfig {
    /// Whether KV is shared by content: with `prefix_sharing`, except in `Stateless` mode.
    pub(crate) fn shares_kv(&self) -> bool {
        self.prefix_sharing && self.mode != CacheMode::Stateless
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| {
            Err(Error::InvalidConfig {
                field,
                reason: reason.to_string(),
            })
        };
        if self.chunk_size == 0 {
            return bad("chunk_size", "must be positive");
        }
        if self.max_context_tokens.is_some_and(|n| n < 2) {
            return bad("max_context_tokens", "must be at least 2");
        }
        if self.budgets.device_bytes.is_none() && self.budgets.device_tokens < self.chunk_size {
            return bad("budgets.device_tokens", "must hold at least one chunk");
        }
        if self.step_token_budget == 0 {
            return bad("step_token_budget", "must be positive");
        }
        if self.store.as_ref().is_some_and(|d| {
            d.read_bytes_per_s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        }) {
            return bad("store.read_bytes_per_s", "must be positive");
        }
        let s = &self.speculation;
        if s.is_on() && !(1..=s.max_ngram).contains(&s.min_ngram) {
            return bad("speculation", "needs 1 <= min_ngram <= max_ngram");
        }
        if !(0.0..1.0).contains(&self.reserve) {
            return bad("reserve", "must be in [0, 1)");
        }
        if !(0.0..=1.0).contains(&self.swap_out_threshold) {
            return bad("swap_out_threshold", "must be in [0, 1]");
        }
        Ok(())
    }

    /// Device blocks of `chunk_size` slots, for a model whose KV-token takes
    /// `kv_token_bytes` in the pool.
    pub fn num_blocks(&self, kv_token_bytes: usize) -> usize {
        let tokens = match self.budgets.device_bytes {
            Some(bytes) => bytes / kv_token_bytes.max(1),
            None => self.budgets.device_tokens,
        };
        tokens / self.chunk_size
    }
}

//! The stateful engine (Pensieve §4): the public API, and the step loop tying the scheduler,
//! the cache manager and the model together.
//!
//! One `step()`: drain commands sent through [`EngineHandle`]s → `Scheduler::schedule` plans
//! the step → the executor copies KV between tiers and runs one forward pass over all rows →
//! tokens are sampled → `commit` applies the outcome and emits [`Event`]s. The core takes time
//! as an argument ([`Engine::step_at`]); [`Engine::step`] reads the clock for convenience.
//! Invariants (no slot leak, one tier per chunk, budgets) are checked after every step in
//! debug builds.

mod config;
mod executor;
mod handle;
mod types;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_transformers::generation::{LogitsProcessor, Sampling};

pub use config::{Budgets, CacheMode, CostProfile, EngineConfig, EvictionKind, OverflowPolicy};
pub use handle::EngineHandle;
pub use types::{EngineStats, Event, FinishReason, RequestId, SamplingParams, Turn, TurnStats};

pub use crate::conversation::ConversationId;
use crate::conversation::{Conversation, Conversations};
use crate::kv::cache::CacheManager;
pub use crate::kv::CostModel;
use crate::kv::{BlockAllocator, EvictionPolicy, HostPool, KvPool, LruPolicy, ValuePolicy};
use crate::model::{IncrementalDecoder, Message, Model};
use crate::scheduler::{Limits, Request, Scheduler};
use crate::{Error, Result};
use handle::{Command, Shared};

/// Options of a new conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConversationOptions {
    /// System prompt; the template's default applies when `None`.
    pub system: Option<String>,
}

/// Engine-side state of a live turn that the scheduler does not need.
struct Live {
    conv: ConversationId,
    params: SamplingParams,
    sampler: LogitsProcessor,
    decoder: IncrementalDecoder,
    reply: String,
    generated: Vec<u32>,
    /// Message and text to add to the conversation once the turn is admitted.
    user_message: Option<Message>,
    prompt_text: String,
    prompt_tokens: usize,
    submitted: Instant,
    first_token: Option<Instant>,
}

impl std::fmt::Debug for Live {
    // candle's sampler has no Debug; the rest is what matters when inspecting a turn.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("conv", &self.conv)
            .field("params", &self.params)
            .field("generated", &self.generated.len())
            .finish_non_exhaustive()
    }
}

/// The stateful inference engine. See the module documentation for the step loop.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    pool: KvPool,
    cache: CacheManager,
    sched: Scheduler,
    convs: Conversations,
    live: HashMap<RequestId, Live>,
    config: EngineConfig,
    shared: Arc<Shared>,
    next_conversation: u64,
    backlog: Vec<Event>,
    stats: EngineStats,
    /// The model's context window.
    window: usize,
    /// Tokens a conversation may reach: the window, capped by the device pool.
    max_conversation_tokens: usize,
}

impl Engine {
    /// Loads the configured model and builds the engine.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for bad values; model loading errors.
    pub fn new(config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let model = Model::load(&config.model, &config.load)?;
        Self::with_model(model, config)
    }

    /// Builds the engine around an already loaded model (`config.model` is not used). Engines
    /// can share one model's weights through an `Arc`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for bad values; [`Error::Candle`] if the pool cannot be
    /// allocated.
    pub fn with_model(model: impl Into<Arc<Model>>, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let model = model.into();
        let mc = model.llama.config().clone();
        let blocks = config.num_blocks(mc.kv_token_bytes(4));
        if blocks == 0 {
            return Err(Error::InvalidConfig(
                "the device budget must hold at least one chunk".into(),
            ));
        }
        let slots = blocks * config.chunk_size;
        let pool = KvPool::new(&mc, slots, candle_core::DType::F32, model.llama.device())?;
        let cost = match config.cost_profile {
            CostProfile::Fixed(c) => c,
            CostProfile::Measure => executor::measure_cost(&model, &pool, config.chunk_size)?,
        };
        let policy: Box<dyn EvictionPolicy> = match config.eviction {
            EvictionKind::Value => Box::new(ValuePolicy { cost }),
            EvictionKind::Lru => Box::new(LruPolicy),
        };
        let host_bytes = match config.mode {
            CacheMode::Tiered => config.budgets.host_bytes,
            CacheMode::DeviceOnly | CacheMode::Stateless => 0,
        };
        let cache = CacheManager::new(
            BlockAllocator::new(blocks, config.chunk_size),
            HostPool::new(host_bytes),
            policy,
            mc.kv_token_bytes(4),
        );
        let frac = |f: f64| (f * blocks as f64).ceil() as usize;
        let sched = Scheduler::new(Limits {
            token_budget: config.step_token_budget,
            reserve_blocks: frac(config.reserve),
            swap_out_blocks: frac(config.swap_out_threshold),
        });
        let stats = EngineStats {
            device_slots_total: slots,
            cost_model: Some(cost),
            ..EngineStats::default()
        };
        Ok(Self {
            window: mc.max_position_embeddings,
            max_conversation_tokens: mc.max_position_embeddings.min(slots),
            model,
            pool,
            cache,
            sched,
            convs: Conversations::new(),
            live: HashMap::new(),
            config,
            shared: Arc::new(Shared::default()),
            next_conversation: 0,
            backlog: Vec::new(),
            stats,
        })
    }

    /// The loaded model (tokenizer, template, config).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// A cloneable, thread-safe handle for submitting and cancelling from other threads.
    pub fn handle(&self) -> EngineHandle {
        EngineHandle::new(self.shared.clone())
    }

    /// Opens a conversation.
    ///
    /// # Errors
    /// None today; fallible for forward compatibility (conversation limits).
    pub fn open(&mut self, options: ConversationOptions) -> Result<ConversationId> {
        let id = ConversationId(self.next_conversation);
        self.next_conversation += 1;
        let messages = options
            .system
            .map(|s| vec![Message::new("system", s)])
            .unwrap_or_default();
        self.convs
            .insert(id, Conversation::new(Instant::now(), messages));
        Ok(id)
    }

    /// Closes a conversation: a running turn is cancelled and all its KV released.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn close(&mut self, conv: ConversationId) -> Result<()> {
        if !self.convs.contains_key(&conv) {
            return Err(Error::UnknownConversation(conv.0));
        }
        let running: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.conv == conv)
            .map(|(id, _)| *id)
            .collect();
        for id in running {
            self.finish(id, FinishReason::Cancelled, Instant::now());
        }
        self.cache.release_all(&mut self.convs, conv, true);
        self.convs.remove(&conv);
        Ok(())
    }

    /// The token history of a conversation (prompts and replies, exactly as the model saw them).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn tokens(&self, conv: ConversationId) -> Result<&[u32]> {
        self.convs
            .get(&conv)
            .map(|c| c.tokens.as_slice())
            .ok_or(Error::UnknownConversation(conv.0))
    }

    /// Queues a turn of `conv`.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`], [`Error::ConversationBusy`], [`Error::EmptyTurn`],
    /// [`Error::InvalidParams`], [`Error::TokenOutOfVocab`], [`Error::ContextOverflow`],
    /// [`Error::BudgetTooSmall`]; template and tokenizer errors. Nothing changes on error.
    pub fn submit(
        &mut self,
        conv: ConversationId,
        turn: Turn,
        params: SamplingParams,
    ) -> Result<RequestId> {
        let id = self.shared.next_request_id();
        self.submit_as(id, conv, turn, params, Instant::now())?;
        Ok(id)
    }

    fn submit_as(
        &mut self,
        id: RequestId,
        conv_id: ConversationId,
        turn: Turn,
        params: SamplingParams,
        now: Instant,
    ) -> Result<()> {
        validate_params(&params)?;
        let conv = self
            .convs
            .get(&conv_id)
            .ok_or(Error::UnknownConversation(conv_id.0))?;
        if conv.busy {
            return Err(Error::ConversationBusy(conv_id.0));
        }
        let (mut prompt, prompt_text, user_message) = match turn {
            Turn::User(text) => {
                if text.trim().is_empty() {
                    return Err(Error::EmptyTurn);
                }
                let message = Message::new("user", text.clone());
                let new_text = match &self.model.template {
                    Some(t) => {
                        let mut messages = conv.messages.clone();
                        messages.push(message.clone());
                        t.continuation(&messages, &conv.seen_text)?
                    }
                    None => text,
                };
                (self.model.encode(&new_text)?, new_text, Some(message))
            }
            Turn::Tokens(ids) => {
                if ids.is_empty() {
                    return Err(Error::EmptyTurn);
                }
                let vocab = self.model.llama.config().vocab_size;
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(Error::TokenOutOfVocab { id: bad, vocab });
                }
                let text = self.model.decode(&ids)?;
                (ids, text, None)
            }
        };
        let history = conv.tokens.len();
        if history + prompt.len() >= self.window {
            let room = self.window.saturating_sub(history + 1);
            match self.config.overflow {
                OverflowPolicy::TruncatePrompt if room > 0 => {
                    prompt.drain(..prompt.len() - room);
                }
                _ => {
                    return Err(Error::ContextOverflow {
                        position: history + prompt.len(),
                        window: self.window,
                    });
                }
            }
        }
        let chunk = self.config.chunk_size;
        let needed = (history + prompt.len() + 1).div_ceil(chunk) * chunk;
        let available = self.cache.blocks.num_blocks() * chunk;
        if needed > available {
            return Err(Error::BudgetTooSmall { needed, available });
        }
        let sampling = match (params.temperature, params.top_k, params.top_p) {
            (t, _, _) if t <= 0.0 => Sampling::ArgMax,
            (temperature, None, None) => Sampling::All { temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        };
        self.live.insert(
            id,
            Live {
                conv: conv_id,
                sampler: LogitsProcessor::from_sampling(params.seed, sampling),
                params,
                decoder: IncrementalDecoder::new(),
                reply: String::new(),
                generated: Vec::new(),
                user_message,
                prompt_text,
                prompt_tokens: prompt.len(),
                submitted: now,
                first_token: None,
            },
        );
        if let Some(c) = self.convs.get_mut(&conv_id) {
            c.busy = true;
        }
        self.sched.enqueue(Request::new(id, conv_id, now, prompt));
        Ok(())
    }

    /// Cancels a queued or running turn; it finishes with [`FinishReason::Cancelled`] in the
    /// next events. Tokens generated so far stay in the conversation.
    ///
    /// # Errors
    /// [`Error::UnknownRequest`] if the request is unknown or already finished.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        if !self.live.contains_key(&id) {
            return Err(Error::UnknownRequest(id.0));
        }
        self.finish(id, FinishReason::Cancelled, Instant::now());
        Ok(())
    }

    /// Whether any turn is queued or running.
    pub fn has_work(&self) -> bool {
        !self.sched.is_idle() || !self.backlog.is_empty() || self.shared.has_commands()
    }

    /// Counters since start.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.clone();
        let c = self.cache.counters;
        s.bytes_swapped_out = c.bytes_swapped_out;
        s.bytes_swapped_in = c.bytes_swapped_in;
        s.chunks_dropped_from_device = c.chunks_dropped_from_device;
        s.chunks_dropped_from_host = c.chunks_dropped_from_host;
        s.suspensions = self.sched.suspensions;
        s.device_slots_used = (self.cache.blocks.num_blocks() - self.cache.blocks.num_free())
            * self.config.chunk_size;
        s.host_bytes_used = self.cache.host.used_bytes();
        s
    }

    /// Runs one step now. See [`Engine::step_at`].
    ///
    /// # Errors
    /// As [`Engine::step_at`].
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.step_at(Instant::now())
    }

    /// Runs one step at time `now`: admits, schedules, moves KV, runs one forward pass over
    /// every scheduled row and returns the events. `now` drives scheduling (idle times);
    /// turn timings in [`TurnStats`] are measured when the pass's outputs are ready. A failing forward pass fails the turns in
    /// it (as `Finished` events) and leaves the engine serving the others.
    ///
    /// # Errors
    /// Only for broken internal invariants (checked in debug builds).
    pub fn step_at(&mut self, now: Instant) -> Result<Vec<Event>> {
        let t0 = Instant::now();
        self.drain_commands(now);
        let plan = self.sched.schedule(&mut self.convs, &mut self.cache, now);
        for &(id, needed, available) in &plan.rejected {
            let e = Error::BudgetTooSmall { needed, available };
            self.finish(id, FinishReason::Failed(e.to_string()), now);
        }
        let t1 = Instant::now();
        self.stats.schedule_time += t1 - t0;
        if !plan.is_empty() {
            self.stats.steps += 1;
            executor::transfer(&self.pool, &mut self.cache, &mut self.convs, &plan);
            let t2 = Instant::now();
            let result = executor::forward(&self.model, &self.pool, &plan.rows);
            // Outputs exist once the pass is done: turn timings are taken then, while
            // scheduling decisions above used the caller's `now`.
            let t3 = Instant::now();
            let done = now.max(t3);
            match result {
                Ok(logits) => self.commit(&plan.rows, logits, done),
                Err(e) => {
                    let failed: Vec<RequestId> = plan.rows.iter().map(|r| r.request).collect();
                    for id in failed {
                        self.finish(id, FinishReason::Failed(e.to_string()), done);
                    }
                }
            }
            self.stats.transfer_time += t2 - t1;
            self.stats.forward_time += t3 - t2;
            self.stats.commit_time += t3.elapsed();
        }
        #[cfg(debug_assertions)]
        self.check_invariants()?;
        Ok(std::mem::take(&mut self.backlog))
    }

    /// Runs one turn to completion, calling `on_text` with each text delta. Events of other
    /// turns that occur meanwhile are kept for the next `step()`.
    ///
    /// # Errors
    /// As [`Engine::submit`].
    pub fn run_turn(
        &mut self,
        conv: ConversationId,
        turn: Turn,
        params: SamplingParams,
        mut on_text: impl FnMut(&str),
    ) -> Result<(FinishReason, TurnStats)> {
        let id = self.submit(conv, turn, params)?;
        let mut kept = Vec::new();
        loop {
            for ev in self.step()? {
                match ev {
                    Event::Token {
                        request, ref text, ..
                    } if request == id => on_text(text),
                    Event::Finished {
                        request,
                        reason,
                        stats,
                        ..
                    } if request == id => {
                        self.backlog.extend(kept);
                        return Ok((reason, stats));
                    }
                    other => kept.push(other),
                }
            }
        }
    }

    fn drain_commands(&mut self, now: Instant) {
        for cmd in self.shared.take_commands() {
            match cmd {
                Command::Submit {
                    id,
                    conv,
                    turn,
                    params,
                } => {
                    if let Err(e) = self.submit_as(id, conv, turn, params, now) {
                        self.backlog.push(Event::Finished {
                            request: id,
                            conversation: conv,
                            reason: FinishReason::Failed(e.to_string()),
                            stats: TurnStats::default(),
                        });
                    }
                }
                Command::Cancel(id) => {
                    // Cancelling an unknown or finished request from a handle is a no-op.
                    let _ = self.cancel(id);
                }
            }
        }
    }

    /// Applies the outcome of a forward pass.
    fn commit(
        &mut self,
        rows: &[crate::scheduler::RowPlan],
        logits: Option<candle_core::Tensor>,
        now: Instant,
    ) {
        let mut sample_index = 0;
        for row in rows {
            self.sched.commit_row(row, &mut self.convs);
            if !row.sample {
                continue;
            }
            let token = match logits.as_ref().map(|l| l.get(sample_index)) {
                Some(Ok(row_logits)) => self
                    .live
                    .get_mut(&row.request)
                    .map(|l| l.sampler.sample(&row_logits)),
                _ => None,
            };
            sample_index += 1;
            match token {
                Some(Ok(t)) => self.accept_token(row.request, t, now),
                Some(Err(e)) => self.finish(row.request, FinishReason::Failed(e.to_string()), now),
                None => self.finish(
                    row.request,
                    FinishReason::Failed("no logits for a sampled row".into()),
                    now,
                ),
            }
        }
    }

    fn accept_token(&mut self, id: RequestId, token: u32, now: Instant) {
        let Some(live) = self.live.get_mut(&id) else {
            return;
        };
        live.first_token.get_or_insert(now);
        live.generated.push(token);
        self.stats.generated_tokens += 1;
        self.sched.push_token(id, token, &mut self.convs);
        let p = &live.params;
        let eos = !p.ignore_eos
            && (self.model.eos_token_ids.contains(&token) || p.stop_token_ids.contains(&token));
        let text = if eos {
            String::new()
        } else {
            match live.decoder.push(&self.model.tokenizer, token) {
                Ok(t) => t,
                Err(e) => {
                    self.finish(id, FinishReason::Failed(e.to_string()), now);
                    return;
                }
            }
        };
        live.reply.push_str(&text);
        let stop_string = p
            .stop_strings
            .iter()
            .any(|s| !s.is_empty() && live.reply.ends_with(s.as_str()));
        let length = live.generated.len() >= p.max_tokens;
        let full = self
            .convs
            .get(&live.conv)
            .is_none_or(|c| c.tokens.len() >= self.max_conversation_tokens);
        self.backlog.push(Event::Token {
            request: id,
            conversation: live.conv,
            token,
            text,
        });
        let reason = if eos {
            Some(FinishReason::Stop)
        } else if stop_string {
            Some(FinishReason::StopString)
        } else if length {
            Some(FinishReason::Length)
        } else if full {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        if let Some(r) = reason {
            self.finish(id, r, now);
        }
    }

    /// Ends a turn: its KV stays cached (released in `Stateless` mode), the conversation
    /// records the exchange, and a `Finished` event is emitted.
    fn finish(&mut self, id: RequestId, reason: FinishReason, now: Instant) {
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        let req = self.sched.remove(id);
        let conv_id = live.conv;
        if let Some(req) = &req {
            self.cache.settle(&mut self.convs, conv_id, req.progress);
        }
        let admitted = req.as_ref().is_some_and(|r| r.admitted_once);
        let mut stats = TurnStats {
            prompt_tokens: live.prompt_tokens,
            output_tokens: live.generated.len(),
            ttft: live
                .first_token
                .map(|t| t - live.submitted)
                .unwrap_or_default(),
            latency: now.saturating_duration_since(live.submitted),
            ..TurnStats::default()
        };
        if let Some(r) = &req {
            stats.reused_tokens = r.reused_device + r.reused_host;
            stats.reused_from_host_tokens = r.reused_host;
            stats.recomputed_tokens = r.recomputed;
            stats.prefilled_tokens = r.prefilled;
            if admitted {
                self.stats.reused_device_tokens += r.reused_device as u64;
                self.stats.reused_host_tokens += r.reused_host as u64;
                self.stats.recomputed_tokens += r.recomputed as u64;
                self.stats.prefilled_tokens += r.prefilled as u64;
            }
        }
        if let Some(conv) = self.convs.get_mut(&conv_id) {
            conv.busy = false;
            conv.last_active = now;
            if admitted {
                conv.seen_text.push_str(&live.prompt_text);
                if let Ok(text) = self.model.decode(&live.generated) {
                    conv.seen_text.push_str(&text);
                }
                conv.messages.extend(live.user_message);
                conv.messages.push(Message::new("assistant", live.reply));
            }
        }
        if self.config.mode == CacheMode::Stateless {
            self.cache.release_all(&mut self.convs, conv_id, false);
        }
        self.stats.turns_finished += 1;
        self.backlog.push(Event::Finished {
            request: id,
            conversation: conv_id,
            reason,
            stats,
        });
    }

    /// Checks the cache invariants; called after every step in debug builds.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] describing the violated invariant.
    pub fn check_invariants(&self) -> Result<()> {
        self.cache
            .check(&self.convs)
            .map_err(|e| Error::InvalidBatch(format!("invariant violated: {e}")))?;
        for (id, l) in &self.live {
            if !self.sched.requests.contains_key(id)
                || !self.convs.get(&l.conv).is_some_and(|c| c.busy)
            {
                return Err(Error::InvalidBatch(format!(
                    "invariant violated: {id} is live but not scheduled"
                )));
            }
        }
        Ok(())
    }
}

fn validate_params(p: &SamplingParams) -> Result<()> {
    let bad = |m: &str| Err(Error::InvalidParams(m.to_string()));
    if p.max_tokens == 0 {
        return bad("max_tokens must be at least 1");
    }
    if !p.temperature.is_finite() {
        return bad("temperature must be finite");
    }
    if p.top_p.is_some_and(|x| !(x > 0.0 && x <= 1.0)) {
        return bad("top_p must be in (0, 1]");
    }
    if p.top_k == Some(0) {
        return bad("top_k must be at least 1");
    }
    Ok(())
}

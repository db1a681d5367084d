//! The stateful engine (Pensieve §4): the public API, and the step loop tying the scheduler,
//! the cache manager and the model together.
//!
//! One `step()`: drain commands sent through [`EngineHandle`]s → `Scheduler::schedule` plans
//! the step (plain data) → the executor copies KV between tiers and runs one forward pass over
//! the rows whose KV is in place → tokens are sampled → `Scheduler::commit` applies the
//! outcome → finished turns emit [`Event`]s. The core takes time as an argument
//! ([`Engine::step_at`]); [`Engine::step`] reads the clock for convenience.
//!
//! Who owns what: the scheduler owns the turn table (its requests carry this module's
//! `turn::ActiveTurn` as payload), the cache manager owns the chunk tables, and the engine
//! owns the conversations' token histories and transcripts. Input is validated at the edge
//! (`turn::prepare`, `sampler::validate`). Invariants (no slot leak, one tier per chunk,
//! budgets, every turn queued once) are checked after every step when
//! [`EngineConfig::check_invariants`] is on.

mod config;
mod encode;
mod executor;
mod finish;
mod fork;
mod handle;
mod hints;
mod overflow;
mod persist;
mod ready;
mod resume;
mod rewind;
mod sampler;
mod share;
mod tools;
mod turn;
mod types;
mod verify;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

pub use crate::persist::{Durability, Fetched, Registration, Removing, ResumeReader, Writing};
pub use crate::scheduler::Speculation;
pub use config::{
    Budgets, CacheMode, CostProfile, EngineConfig, EvictionKind, KvPrecision, OverflowPolicy,
    RedisConfig, StoreConfig, StoreLocation,
};
pub use ready::{ReadyTurn, TurnPreparer};
pub use turn::TurnSize;
pub use types::{
    ConversationOptions, EngineStats, Event, FinishReason, SamplingParams, TokenLogprobs, Turn,
    TurnStats,
};
pub use {
    encode::{chat_tokens, chat_tokens_with},
    handle::EngineHandle,
};

use crate::attention::KvPool;
use crate::conversation::Conversations;
pub use crate::ids::{ConversationId, RequestId};
pub use crate::kv::CostModel;
use crate::kv::{CacheManager, ChunkFormat, EvictionPolicy, LruPolicy, Narrowing, ValuePolicy};
use crate::model::{Message, Model};
use crate::persist::Persistence;
use crate::scheduler::{Limits, Outcome, RowPlan, Scheduler, StepPlan};
use crate::{Error, Result};
use executor::Faults;
use handle::Shared;
use turn::{ActiveTurn, TurnLimits};

/// The stateful inference engine. See the module documentation for the step loop.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    pool: KvPool,
    cache: CacheManager,
    sched: Scheduler<ActiveTurn>,
    convs: Conversations,
    config: EngineConfig,
    limits: TurnLimits,
    shared: Arc<Shared>,
    next_conversation: u64,
    backlog: Vec<Event>,
    stats: EngineStats,
    faults: Faults,
    /// Stored conversations' manifests, and what is owed to the store and promised about it.
    persist: Persistence,
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
        let shape = model.config().kv_shape();
        let token_bytes = shape.token_bytes(config.kv_precision);
        let blocks = config.num_blocks(token_bytes);
        if blocks == 0 {
            return Err(Error::InvalidConfig {
                field: "budgets",
                reason: "the device budget must hold at least one chunk".into(),
            });
        }
        let slots = blocks * config.chunk_size;
        let mut pool = KvPool::new(
            shape,
            slots,
            config.kv_precision,
            model.transformer().device(),
        )?;
        let full_layers = model.config().full_layers();
        let narrow_token_bytes = token_bytes / shape.num_layers.max(1) * full_layers.len();
        pool.set_narrow_layers(full_layers);
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
        let mut cache =
            CacheManager::new(blocks, config.chunk_size, host_bytes, policy, token_bytes);
        // Narrow chunks from a store are recomputed where a window reads them whatever this
        // engine does itself.
        if let Some(window) = model.config().narrowing_window() {
            let narrows = config.narrow_windows && pool.copies_narrow();
            cache.set_narrowing(Narrowing {
                window,
                token_bytes: narrows.then_some(narrow_token_bytes),
            });
        }
        let mut manifests = None;
        if config.mode == CacheMode::Tiered {
            let value_bytes = match config.kv_precision {
                KvPrecision::Q8 => ChunkFormat::Q8_0,
                KvPrecision::Q4 => ChunkFormat::Q4_0,
                kv => kv.dtype().size_in_bytes() as u32,
            };
            if let Some(tier) = persist::open_store(&model, &config, shape, value_bytes, cost)? {
                manifests = Some(tier.store.manifest_store());
                cache.attach_store(tier);
            }
        }
        let persist = Persistence::new(manifests, model.config().vocab_size, config.chunk_size);
        let frac = |f: f64| (f * blocks as f64).ceil() as usize;
        let window = config
            .max_context_tokens
            .map_or(model.config().max_position_embeddings, |n| {
                n.min(model.config().max_position_embeddings)
            });
        let sched = Scheduler::new(Limits {
            token_budget: config.step_token_budget,
            reserve_blocks: frac(config.reserve),
            swap_out_blocks: frac(config.swap_out_threshold),
            prefetch_window: config.prefetch_window,
            sharing: config.shares_kv(),
            speculation: config.speculation,
            window,
        });
        let limits = TurnLimits {
            window,
            pool_slots: slots,
            chunk_size: config.chunk_size,
            overflow: config.overflow,
        };
        let stats = EngineStats {
            device_slots_total: slots,
            cost_model: Some(cost),
            ..EngineStats::default()
        };
        let mut engine = Self {
            model,
            pool,
            cache,
            sched,
            convs: Conversations::new(),
            config,
            limits,
            shared: Arc::new(Shared::default()),
            next_conversation: 0,
            backlog: Vec::new(),
            stats,
            faults: Faults::default(),
            persist,
        };
        engine.resume_stored(Instant::now());
        Ok(engine)
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
    /// [`Error::ConversationExists`] if `options.name` is taken.
    pub fn open(&mut self, options: ConversationOptions) -> Result<ConversationId> {
        self.open_with(options, None)
    }

    /// [`Self::open`], given who registered `options.name` (`None`: read it now).
    pub(super) fn open_with(
        &mut self,
        mut options: ConversationOptions,
        registration: Option<Registration>,
    ) -> Result<ConversationId> {
        match options.name.take() {
            Some(name) if self.persist.active() => self.open_named(name, options, registration),
            _ => Ok(self.open_unnamed(options)),
        }
    }

    fn next_id(&mut self) -> ConversationId {
        let id = ConversationId(self.next_conversation);
        self.next_conversation += 1;
        id
    }

    fn open_unnamed(&mut self, options: ConversationOptions) -> ConversationId {
        let id = self.next_id();
        self.convs.insert(id, ready::opened(options));
        self.cache.open(id, Instant::now());
        id
    }

    /// Closes a conversation: a running turn is cancelled and all its KV released, its files
    /// and stored state (for a named one) included.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn close(&mut self, conv: ConversationId) -> Result<()> {
        self.close_removing(conv).map(drop)
    }

    /// The token history of a conversation (prompts and replies, exactly as the model saw them).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn tokens(&self, conv: ConversationId) -> Result<&[u32]> {
        self.convs
            .get(&conv)
            .map(|c| c.tokens())
            .ok_or(Error::UnknownConversation(conv))
    }

    /// The chat transcript of a conversation: its messages (system prompt first, if any),
    /// replies included.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn messages(&self, conv: ConversationId) -> Result<&[Message]> {
        self.convs
            .get(&conv)
            .map(|c| c.messages())
            .ok_or(Error::UnknownConversation(conv))
    }

    /// How much room `turn` would take in `conv`, without submitting it: the tokens it adds
    /// (after the chat template) and the longest reply that still fits. Drivers use it to size
    /// requests instead of re-deriving the template's overhead.
    ///
    /// # Errors
    /// As [`Engine::submit`] would fail for this turn (parameters aside).
    pub fn turn_size(&self, conv: ConversationId, turn: Turn) -> Result<TurnSize> {
        let c = self
            .convs
            .get(&conv)
            .ok_or(Error::UnknownConversation(conv))?;
        Ok(turn::prepare(&self.model, c, turn, &self.limits, usize::MAX)?.size)
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
        self.submit_with(id, conv, turn, params, Instant::now(), None)?;
        Ok(id)
    }

    /// Queues turn `id`, taking its prepared tokens from `ready` where they were made for it.
    fn submit_with(
        &mut self,
        id: RequestId,
        conv_id: ConversationId,
        turn: Turn,
        mut params: SamplingParams,
        now: Instant,
        ready: Option<&mut ReadyTurn>,
    ) -> Result<()> {
        let conv = self.idle(conv_id)?;
        sampler::validate(&params, self.model.config().vocab_size)?;
        let guide = match &params.constraint {
            Some(c) => Some(self.model.guide(c)?),
            None => None,
        };
        let mut limits = self.limits;
        limits.overflow = params.overflow.unwrap_or(limits.overflow);
        let max_reply = params.max_tokens;
        let mut prepared = match ready.and_then(|r| r.take_for(conv, &turn, &limits, max_reply)) {
            Some(prepared) => prepared?,
            None => turn::prepare(&self.model, conv, turn, &limits, max_reply)?,
        };
        if let Some(cut) = prepared.rewind.take() {
            self.rewind(conv_id, &cut);
        }
        if let Some(cut) = prepared.cut.take() {
            self.apply_cut(conv_id, &cut);
        }
        let prompt = (std::mem::take(&mut prepared.prompt), params.max_tokens);
        let eos = self.model.eos_token_ids();
        let prediction = std::mem::take(&mut params.prediction);
        let active = ActiveTurn::new(prepared, params, eos, guide, now);
        self.sched.enqueue(id, conv_id, now, prompt, active);
        if !prediction.is_empty() {
            self.sched.predict(id, prediction);
        }
        if self.sharing() {
            let taken = self.sched.share(id, &self.convs, &mut self.cache);
            self.stats.shared_tokens += taken as u64;
        }
        Ok(())
    }

    /// Checks sampling parameters as [`Engine::submit`] does, without touching any
    /// conversation: a host validates a request with it before changing anything for it.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] naming the bad value.
    pub fn validate_params(&self, params: &SamplingParams) -> Result<()> {
        sampler::validate(params, self.model.config().vocab_size)
    }

    /// Cancels a queued or running turn; it finishes with [`FinishReason::Cancelled`] in the
    /// next events, and the conversation is left as it was before the turn.
    ///
    /// # Errors
    /// [`Error::UnknownRequest`] if the request is unknown or already finished.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        if self.sched.get(id).is_none() {
            return Err(Error::UnknownRequest(id));
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
        let c = self.cache.counters();
        EngineStats {
            bytes_swapped_out: c.bytes_swapped_out,
            bytes_swapped_in: c.bytes_swapped_in,
            chunks_dropped_from_device: c.chunks_dropped_from_device,
            chunks_dropped_from_host: c.chunks_dropped_from_host,
            chunks_to_store: c.chunks_to_store,
            narrow_swap_outs: c.narrow_swap_outs,
            narrow_recomputed: c.narrow_recomputed,
            chunks_dropped_from_store: c.chunks_dropped_from_store,
            store: self.cache.store_stats(),
            swap_out_failures: c.swap_out_failures,
            swap_in_failures: c.swap_in_failures,
            suspensions: self.sched.suspensions(),
            requests_waiting: self.sched.queue_lengths().0,
            requests_running: self.sched.queue_lengths().1,
            device_slots_used: (self.cache.num_blocks() - self.cache.num_free_blocks())
                * self.config.chunk_size,
            host_bytes_used: self.cache.host_used_bytes(),
            shared_bytes_saved: self.cache.shared_bytes_saved(),
            ..self.stats.clone()
        }
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
    /// turn timings in [`TurnStats`] are measured when the pass's outputs are ready. A failing
    /// forward pass fails the turns in it (as `Finished` events) and leaves the engine serving
    /// the others.
    ///
    /// # Errors
    /// [`Error::Invariant`] when [`EngineConfig::check_invariants`] is on and the engine's
    /// bookkeeping is broken.
    pub fn step_at(&mut self, now: Instant) -> Result<Vec<Event>> {
        let _step = tracing::debug_span!("step", n = self.stats.steps).entered();
        let t0 = Instant::now();
        self.drain_commands(now);
        self.cache.poll_store();
        self.prefetch_expected(now);
        let plan = self.sched.schedule(&self.convs, &mut self.cache, now);
        self.stats.shared_tokens += plan.shared_tokens as u64;
        let t1 = Instant::now();
        self.stats.schedule_time += t1 - t0;
        let mut failed: Vec<(RequestId, FinishReason)> = Vec::new();
        if !plan.is_empty() {
            self.stats.steps += 1;
            let (outcome, done) = self.execute(&plan, now, &mut failed);
            let t3 = Instant::now();
            self.sched
                .commit(&plan, &outcome, &mut self.convs, &mut self.cache, now);
            self.index_prefilled(&plan.rows);
            for (id, tokens) in &outcome.sampled {
                self.accept_tokens(*id, tokens, done);
            }
            self.stats.commit_time += t3.elapsed();
        }
        for r in &plan.rejected {
            let e = Error::BudgetTooSmall {
                needed: r.needed,
                available: r.available,
            };
            failed.push((r.request, FinishReason::failed(e)));
        }
        for (id, v) in plan.broken {
            failed.push((id, FinishReason::failed(Error::Invariant(v))));
        }
        for (id, reason) in failed {
            self.finish(id, reason, now);
        }
        self.save_finished(now);
        if self.config.check_invariants {
            self.check_invariants()?;
        }
        Ok(std::mem::take(&mut self.backlog))
    }

    /// Copies KV and runs the forward pass of `plan`, sampling the rows that sample. Turns
    /// whose pass or sampling failed go to `failed`. Returns the outcome and when the pass's
    /// outputs were ready.
    fn execute(
        &mut self,
        plan: &StepPlan,
        now: Instant,
        failed: &mut Vec<(RequestId, FinishReason)>,
    ) -> (Outcome, Instant) {
        let t1 = Instant::now();
        let lost = executor::transfer(
            &self.pool,
            &mut self.cache,
            &plan.moves,
            &mut self.faults,
            self.config.pipelined_restore,
        );
        let mut requeue: Vec<RequestId> =
            lost.iter().filter_map(|&c| self.sched.turn_of(c)).collect();
        let mut ran: Vec<bool> = plan.rows.iter().map(|r| !lost.contains(&r.conv)).collect();
        let rows: Vec<&RowPlan> = plan
            .rows
            .iter()
            .zip(&ran)
            .filter(|&(_, &r)| r)
            .map(|(row, _)| row)
            .collect();
        let t2 = Instant::now();
        let result = executor::forward(&self.model, &self.pool, self.config.chunk_size, &rows);
        // Outputs exist once the pass is done: turn timings are taken then, while scheduling
        // decisions used the caller's `now`.
        let t3 = Instant::now();
        let (late, waited) = executor::restored(&self.pool, &mut self.cache, &plan.moves);
        self.stats.restore_wait_time += waited;
        self.stats.transfer_time += t2 - t1;
        self.stats.forward_time += t3 - t2;
        if result.is_ok() {
            let tokens = rows.iter().map(|r| r.tokens.len()).sum();
            self.sched.observe_step(tokens, (t3 - t2).as_secs_f64());
        }
        let mut sampled = Vec::new();
        match result {
            Ok(logits) => {
                let mut first = 0;
                for row in rows.iter().filter(|r| r.sample) {
                    let logits_from = first;
                    first += 1 + row.drafted;
                    // A restore refused partway: the row read unchecked KV; it is redone.
                    if late.contains(&row.conv) {
                        continue;
                    }
                    match self.verify(row, logits.as_ref(), logits_from) {
                        Ok(tokens) => sampled.push((row.request, tokens)),
                        Err(e) => failed.push((row.request, FinishReason::failed(e))),
                    }
                }
            }
            Err(e) => {
                let reason = FinishReason::failed(e);
                failed.extend(rows.iter().map(|r| (r.request, reason.clone())));
                ran.iter_mut().for_each(|r| *r = false);
            }
        }
        for (r, row) in ran.iter_mut().zip(&plan.rows) {
            if late.contains(&row.conv) {
                *r = false;
            }
        }
        let late_only = late.iter().filter(|c| !lost.contains(c));
        requeue.extend(late_only.filter_map(|&c| self.sched.turn_of(c)));
        let outcome = Outcome {
            ran,
            sampled,
            requeue,
        };
        (outcome, now.max(t3))
    }

    /// Runs one turn to completion, calling `on_text` with each text delta. Events of other
    /// turns that occur meanwhile are kept for the next `step()`.
    ///
    /// # Errors
    /// As [`Engine::submit`] and [`Engine::step`].
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

    /// Checks the invariants: the cache's (no slot leak, one owner per block and host chunk,
    /// budgets) and the turn table's (every turn queued or running exactly once).
    ///
    /// # Errors
    /// [`Error::Invariant`] naming the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        self.cache.check()?;
        self.sched.check()?;
        Ok(())
    }
}

//! An async front to the engine (feature `service`): [`Service::spawn`] moves an [`Engine`]
//! onto a thread of its own, which drives `step()` whenever there is work and sleeps
//! otherwise, and hands out a cheap `Clone + Send + Sync` handle whose methods are futures.
//! Any async runtime runs them; the service has none of its own.
//!
//! ```no_run
//! # async fn demo(engine: pensieve::engine::Engine) -> pensieve::Result<()> {
//! use pensieve::engine::{ConversationOptions, SamplingParams, Turn};
//! use pensieve::service::{Service, ServiceConfig, TurnEvent};
//!
//! let service = Service::spawn(engine, ServiceConfig::default())?;
//! let conv = service.open(ConversationOptions::default()).await?;
//! let mut turn = service.submit(conv, Turn::user("Hi!"), SamplingParams::greedy()).await?;
//! while let Some(event) = turn.next_event().await {
//!     match event {
//!         TurnEvent::Token { text, .. } => print!("{text}"),
//!         TurnEvent::Finished(end) => println!("\n({:?})", end.reason),
//!         _ => {}
//!     }
//! }
//! service.shutdown()?;
//! # Ok(()) }
//! ```
//!
//! Each turn is a [`TurnStream`] of [`TurnEvent`]s that ends with the turn's
//! [`TurnEvent::Finished`], sent once the turn is finished **and**, for a named conversation
//! in a store, once its state is durable there (a turn the store could not keep finishes
//! failed, and the engine drops its copy so that the next turn resumes what the store has).
//! Dropping the stream before its end cancels the turn, freeing its KV reservation.
//!
//! [`Service::chat`] continues conversations by content, as a stateless client expects: a
//! message list whose messages before the last are a held conversation's transcript (a client
//! resending its whole history) continues that conversation with its KV; anything else opens a
//! conversation with the request's history, and the engine's prefix index shares whatever
//! full chunks of it any conversation holds. [`Service::complete`] does the same for token
//! prompts. A chat may also name its conversation (stored under that name when the engine has
//! a store, and checked against the store before each turn: another engine of a fleet may
//! have served it). Conversations the service opened this way close, least recently used
//! first, past [`ServiceConfig::max_conversations`].
//!
//! Stopping: [`Service::drain`] refuses new turns while those in flight finish;
//! [`Service::shutdown`] cancels what still runs, writes everything the store was promised,
//! sends the held turn ends and joins the engine thread. Dropping the last handle (and the
//! last stream) does the same.

mod calls;
mod chat;
mod driver;
mod edit;
mod fetch;
mod prepare;
mod sessions;
mod stream;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};

use crate::engine::{
    ConversationId, ConversationOptions, Engine, EngineStats, FinishReason, ResumeReader,
    SamplingParams, Turn, TurnPreparer, TurnStats,
};
use crate::model::Model;
use crate::setters::setters;
use crate::{Error, Result};

pub use chat::{Chat, Hints};
use driver::{Command, Driver, Submission, What};
pub use edit::{Change, Record};
pub use stream::{Reply, TurnEnd, TurnEvent, TurnStream};

/// How a [`Service`] runs.
#[derive(Clone)]
#[non_exhaustive]
pub struct ServiceConfig {
    /// Turns queued or running at most; more are refused with [`Error::QueueFull`].
    pub max_in_flight: usize,
    /// Conversations [`Service::chat`] and [`Service::complete`] keep for clients to continue;
    /// the least recently used idle ones close beyond (named ones stay in their store).
    pub max_conversations: usize,
    /// Called on the engine thread as turns progress (for metrics).
    pub observer: Option<Arc<dyn Observer>>,
    /// The engine thread's name (what profilers and `/proc/<pid>/task/*/comm` show).
    pub thread_name: String,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 256,
            max_conversations: 1024,
            observer: None,
            thread_name: "pensieve-engine".into(),
        }
    }
}

impl std::fmt::Debug for ServiceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceConfig")
            .field("max_in_flight", &self.max_in_flight)
            .field("max_conversations", &self.max_conversations)
            .field("observer", &self.observer.is_some())
            .field("thread_name", &self.thread_name)
            .finish()
    }
}

setters!(ServiceConfig {
    value max_in_flight: usize,
    value max_conversations: usize,
    fill observer: Arc<dyn Observer>,
    into thread_name: String,
});

/// Hooks the engine thread calls as turns progress. They run between steps: keep them short.
pub trait Observer: Send + Sync {
    /// A turn generated a token `gap` after its previous one (not called for a turn's first).
    fn token(&self, gap: Duration) {
        let _ = gap;
    }

    /// A turn finished (before a named conversation's store has confirmed it).
    fn finished(&self, reason: &FinishReason, stats: &TurnStats) {
        let _ = (reason, stats);
    }
}

/// Numbers the engine thread publishes after every step.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ServiceStats {
    /// The engine's own counters.
    pub engine: EngineStats,
    /// Conversations the service keeps for clients to continue.
    pub conversations: usize,
    /// Steps driven.
    pub steps: u64,
    /// Seconds spent in `step()`.
    pub step_seconds: f64,
    /// Turns refused because the queue was full.
    pub rejected: u64,
    /// Turns of named conversations generated but not confirmed by the store.
    pub store_failures: u64,
    /// Turns of named conversations not stored because another engine stored one first.
    pub store_conflicts: u64,
    /// Turns queued or running now.
    pub in_flight: usize,
}

/// A handle to an engine running on its own thread. Cheap to clone; every clone drives the
/// same engine.
#[derive(Clone)]
pub struct Service {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("in_flight", &self.in_flight())
            .field("alive", &self.is_alive())
            .finish()
    }
}

struct Inner {
    tx: Sender<Command>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: usize,
    stats: Arc<Mutex<ServiceStats>>,
    alive: Arc<AtomicBool>,
    died: Arc<Notify>,
    model: Arc<Model>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Reads what resuming a name needs off the engine thread (`None`: no store).
    reader: Option<ResumeReader>,
    /// Prepares a large chat's first turn off the engine thread.
    preparer: TurnPreparer,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Stop);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

/// The one stream of a single-choice submission.
fn one(streams: Result<Vec<TurnStream>>) -> Result<TurnStream> {
    streams?.pop().ok_or(Error::ServiceStopped)
}

/// One place in the queue; given back when dropped, on every path a turn can take.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Service {
    /// Moves `engine` onto a thread of its own and starts serving.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero limit; [`Error::Io`] if the thread cannot start.
    pub fn spawn(engine: Engine, config: ServiceConfig) -> Result<Self> {
        if config.max_in_flight == 0 || config.max_conversations == 0 {
            let field = match config.max_in_flight {
                0 => "max_in_flight",
                _ => "max_conversations",
            };
            return Err(Error::InvalidConfig {
                field,
                reason: "must be at least 1".into(),
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let wake = tx.clone();
        engine.set_store_waker(Arc::new(move || {
            let _ = wake.send(Command::Wake);
        }));
        let model = engine.model().clone();
        let reader = engine.resume_reader();
        let preparer = engine.turn_preparer();
        let stats = Arc::new(Mutex::new(ServiceStats::default()));
        let alive = Arc::new(AtomicBool::new(true));
        let died = Arc::new(Notify::new());
        let mut driver = Driver::new(engine, &config, stats.clone());
        let (flag, notify) = (alive.clone(), died.clone());
        let thread = std::thread::Builder::new()
            .name(config.thread_name.clone())
            .spawn(move || {
                let run = std::panic::AssertUnwindSafe(|| driver.run(&rx));
                if std::panic::catch_unwind(run).is_err() {
                    flag.store(false, Ordering::SeqCst);
                    notify.notify_waiters();
                }
            })
            .map_err(|e| Error::io("the engine thread", e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                tx,
                in_flight: Arc::new(AtomicUsize::new(0)),
                max_in_flight: config.max_in_flight,
                stats,
                alive,
                died,
                model,
                thread: Mutex::new(Some(thread)),
                reader,
                preparer,
            }),
        })
    }

    /// The engine's model (its tokenizer and chat template), usable from any thread.
    pub fn model(&self) -> &Arc<Model> {
        &self.inner.model
    }

    /// Runs `f` on the engine thread between steps, and returns what it returns. For what
    /// the handle has no method for (reading a transcript, the configuration, ...); a long
    /// `f` stalls every running turn.
    ///
    /// # Errors
    /// [`Error::ServiceStopped`] once the engine thread has ended.
    pub async fn with_engine<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Engine) -> T + Send + 'static,
    {
        self.call(move |d| f(d.engine_mut())).await
    }

    async fn call<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Driver) -> T + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let call = Box::new(move |d: &mut Driver| {
            let _ = reply.send(f(d));
        });
        self.inner
            .tx
            .send(Command::Call(call))
            .map_err(|_| Error::ServiceStopped)?;
        answer.await.map_err(|_| Error::ServiceStopped)
    }

    /// Opens a conversation ([`Engine::open`]). It is the caller's to close: the service
    /// never closes it for room.
    ///
    /// # Errors
    /// As [`Engine::open`]; [`Error::ServiceStopped`].
    pub async fn open(&self, options: ConversationOptions) -> Result<ConversationId> {
        let registration = self.registered(options.name.as_deref()).await;
        self.call(move |d| match registration {
            Some(r) => d.engine_mut().open_registered(options, r),
            None => d.engine_mut().open(options),
        })
        .await?
    }

    /// Resumes a stored conversation by name ([`Engine::resume`]). On an engine without a
    /// store, names live in the service only: this finds the conversation a chat named
    /// ([`Chat::name`]) while it is open.
    ///
    /// # Errors
    /// As [`Engine::resume`]; [`Error::ServiceStopped`].
    pub async fn resume(&self, name: &str) -> Result<ConversationId> {
        let name = name.to_string();
        let fetched = self.fetched(Some(&name)).await;
        self.call(move |d| d.resume(&name, fetched)).await?
    }

    /// Closes a conversation ([`Engine::close`]): its KV is freed and a stored one deleted,
    /// answered once the deletion is written.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::NotRemoved`] if the store could not delete it
    /// (it keeps the conversation); [`Error::ServiceStopped`].
    pub async fn close(&self, conv: ConversationId) -> Result<()> {
        let (reply, closed) = oneshot::channel();
        self.call(move |d| d.close(conv, reply)).await?;
        closed.await.map_err(|_| Error::ServiceStopped)?
    }

    /// Drops a stored conversation from this engine only ([`Engine::detach`]): the store
    /// keeps it, to be resumed here or by another engine.
    ///
    /// # Errors
    /// As [`Engine::detach`]; [`Error::ServiceStopped`].
    pub async fn detach(&self, conv: ConversationId) -> Result<()> {
        self.call(move |d| d.detach(conv)).await?
    }

    /// Pins or unpins a conversation's KV ([`Engine::pin`]).
    ///
    /// # Errors
    /// As [`Engine::pin`]; [`Error::ServiceStopped`].
    pub async fn pin(&self, conv: ConversationId, pinned: bool) -> Result<()> {
        self.call(move |d| d.engine_mut().pin(conv, pinned)).await?
    }

    /// Says when a conversation is expected back ([`Engine::expect_resume`]).
    ///
    /// # Errors
    /// As [`Engine::expect_resume`]; [`Error::ServiceStopped`].
    pub async fn expect_resume(&self, conv: ConversationId, after: Duration) -> Result<()> {
        self.call(move |d| d.engine_mut().expect_resume(conv, after))
            .await?
    }

    /// Queues a turn of `conv`; its events come on the returned stream.
    ///
    /// # Errors
    /// As [`Engine::submit`]; [`Error::QueueFull`], [`Error::ServiceStopped`].
    pub async fn submit(
        &self,
        conv: ConversationId,
        turn: Turn,
        params: SamplingParams,
    ) -> Result<TurnStream> {
        one(self.send(What::Turn { conv, turn }, params, 1).await)
    }

    /// Queues a chat turn on the conversation its content (or name) continues, or on a new
    /// one; see the module documentation.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a message list that ends with no user message or has a
    /// system message past the first; [`Error::ConversationBusy`] when the conversation it
    /// continues has a turn running; as [`Engine::resume`] for a named one; as
    /// [`Engine::submit`]; [`Error::QueueFull`], [`Error::ServiceStopped`].
    pub async fn chat(&self, chat: Chat, params: SamplingParams) -> Result<TurnStream> {
        let what = self.chat_what(chat, &params).await;
        one(self.send(what, params, 1).await)
    }

    /// [`Service::chat`] with `n` replies: the first continues the conversation, the others
    /// run on forks of it (each a conversation the service keeps, so a client may continue
    /// whichever reply it keeps), choice `i` sampled with seed `params.seed + i`. They take
    /// `n` places in the queue.
    ///
    /// # Errors
    /// As [`Service::chat`]; [`Error::InvalidRequest`] for `n == 0`.
    pub async fn chat_choices(
        &self,
        chat: Chat,
        params: SamplingParams,
        n: usize,
    ) -> Result<Vec<TurnStream>> {
        let what = self.chat_what(chat, &params).await;
        self.send(what, params, n).await
    }

    /// Queues a raw completion of `prompt` on the idle conversation whose tokens are its
    /// longest proper prefix, or on a new one.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an empty prompt; as [`Engine::submit`];
    /// [`Error::QueueFull`], [`Error::ServiceStopped`].
    pub async fn complete(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<TurnStream> {
        one(self.send(What::Completion(prompt), params, 1).await)
    }

    /// [`Service::complete`] with `n` completions, as [`Service::chat_choices`].
    ///
    /// # Errors
    /// As [`Service::complete`]; [`Error::InvalidRequest`] for `n == 0`.
    pub async fn complete_choices(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        n: usize,
    ) -> Result<Vec<TurnStream>> {
        self.send(What::Completion(prompt), params, n).await
    }

    async fn send(&self, what: What, params: SamplingParams, n: usize) -> Result<Vec<TurnStream>> {
        if n == 0 {
            return Err(Error::InvalidRequest {
                field: "n",
                reason: "at least one choice".into(),
            });
        }
        let busy = self.inner.in_flight.fetch_add(n, Ordering::SeqCst);
        let slots: Vec<Slot> = (0..n).map(|_| Slot(self.inner.in_flight.clone())).collect();
        if busy + n > self.inner.max_in_flight {
            self.inner.stats.lock().rejected += 1;
            return Err(Error::QueueFull { in_flight: busy });
        }
        let mut receivers = Vec::with_capacity(n);
        let choices = slots
            .into_iter()
            .map(|slot| {
                let (events, rx) = tokio::sync::mpsc::unbounded_channel();
                receivers.push(rx);
                (events, slot)
            })
            .collect();
        let (reply, accepted) = oneshot::channel();
        let submission = Submission {
            what,
            params,
            reply,
            choices,
        };
        self.inner
            .tx
            .send(Command::Submit(Box::new(submission)))
            .map_err(|_| Error::ServiceStopped)?;
        let turns = accepted.await.map_err(|_| Error::ServiceStopped)??;
        let streams = turns
            .into_iter()
            .zip(receivers)
            .map(|((request, conv, rewrites), rx)| {
                let stream =
                    TurnStream::new(request, conv, rx, self.inner.tx.clone(), self.clone());
                stream.rewriting(rewrites)
            });
        Ok(streams.collect())
    }

    /// The numbers of the latest steps (the engine's counters as of at most 100 ms ago while
    /// it is busy, and of its last step once idle), with the turns in flight now.
    pub fn stats(&self) -> ServiceStats {
        let mut s = self.inner.stats.lock().clone();
        s.in_flight = self.in_flight();
        s
    }

    /// Turns queued or running (a turn counts until its stream has received its end).
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// False once the engine thread has died (a bug in pensieve).
    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    /// Completes when the engine thread dies (never, unless pensieve has a bug).
    pub async fn died(&self) {
        loop {
            let notified = self.inner.died.notified();
            if !self.is_alive() {
                return;
            }
            notified.await;
        }
    }

    /// Stops taking turns: new ones get [`Error::ServiceStopped`]; those in flight run on.
    pub fn drain(&self) {
        let _ = self.inner.tx.send(Command::Drain);
    }

    /// Cancels the turns still running (their streams end with
    /// [`FinishReason::Cancelled`]), writes everything the store was promised, sends the held
    /// turn ends, and joins the engine thread. Blocks until then; later calls return at once.
    ///
    /// # Errors
    /// [`Error::EngineDied`] if the engine thread panicked.
    pub fn shutdown(&self) -> Result<()> {
        let _ = self.inner.tx.send(Command::Stop);
        let thread = self.inner.thread.lock().take();
        let joined = thread.map_or(Ok(()), JoinHandle::join);
        match joined.is_ok() && self.is_alive() {
            true => Ok(()),
            false => Err(Error::EngineDied),
        }
    }
}

//! The engine thread: the only owner of the engine. HTTP handlers send it commands over a
//! channel; it maps each request to a conversation, submits the turn, calls `step()` while
//! there is work, and sends each request's tokens and end back on the request's own channel.
//!
//! Requests map to conversations by content: a chat request whose messages before the last
//! are exactly a stored conversation's transcript (a client resending the whole history)
//! continues that conversation, its KV reused; a completion whose prompt tokens start with a
//! stored conversation's tokens continues it. Anything else opens a conversation with the
//! request's history, and the engine's prefix index shares whatever full chunks of it any
//! conversation holds (a shared system prompt, an edited or regenerated turn). A request may
//! also name its conversation (`conversation_id`), with session hints. Conversations nobody
//! continues are closed, least recently used first, past `max_sessions`.
//!
//! With a store below host (`--store`, `--redis`), a named conversation is stored under its
//! name: servers sharing a Redis serve its turns wherever they land, each checking its copy
//! against the stored one first, and one that closes it for lack of room only drops its own
//! copy (the conversation ends when a request says `end_conversation`). Resent histories find
//! the chunks any server of the fleet computed, by content. A named conversation's turn is
//! answered only once its state is durable in the store (`Engine::durability`); a turn the
//! store could not keep is answered with an error, and the engine's copy is dropped so that
//! the next turn resumes what the store has: the client and the store never disagree.
//!
//! Stopping: `Drain` refuses new requests while those in flight finish; `Stop` cancels what
//! still runs (cancelled turns leave no trace), writes everything the store was promised,
//! answers the held turn ends, and ends the thread.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use axum::http::StatusCode;
use parking_lot::Mutex;
use pensieve::engine::{
    ConversationId, Durability, Engine, EngineStats, Event, FinishReason, RequestId,
    SamplingParams, StoreLocation, Turn,
};
use pensieve::model::Message;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{oneshot, Notify};

use crate::api::{ApiError, Hints, Usage};
use crate::metrics::{finished_reason, Metrics};

mod handle;
mod sessions;

pub use handle::{CancelOnDrop, Handle, Slot};

/// What a request asks for.
#[derive(Debug)]
pub enum Job {
    /// A chat turn: `messages` ends with the user's new message.
    Chat {
        messages: Vec<Message>,
        name: Option<String>,
        hints: Hints,
    },
    /// A raw completion of `prompt`.
    Completion { prompt: PromptInput },
}

#[derive(Debug)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// One generated token's log-probability and the most likely alternatives, each token as the
/// text it decodes to alone (a piece of a character decodes to U+FFFD).
#[derive(Debug, Clone)]
pub struct Logprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What the engine thread sends back for one request.
#[derive(Debug)]
pub enum Update {
    /// A text delta (possibly empty mid-character), with the token's log-probabilities when
    /// the request asked for them.
    Token {
        text: String,
        logprob: Option<Logprob>,
    },
    /// The end: OpenAI's finish reason and the usage.
    Done { reason: &'static str, usage: Usage },
    /// The turn failed after it was accepted.
    Failed(ApiError),
}

struct Submission {
    job: Job,
    params: SamplingParams,
    reply: oneshot::Sender<Result<RequestId, ApiError>>,
    updates: UnboundedSender<Update>,
    slot: Slot,
}

enum Command {
    Submit(Box<Submission>),
    Cancel(RequestId),
    Drain,
    Stop,
    /// The store finished a job: turn ends held for it may be answered.
    Wake,
}

/// Numbers the engine thread publishes after every step, for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub stats: EngineStats,
    /// Conversations open.
    pub conversations: usize,
    pub steps: u64,
    pub step_seconds: f64,
    pub requests_rejected: u64,
    /// Turns generated whose state the store could not keep (answered with an error).
    pub store_failures: u64,
    /// Turns generated and not stored because another server stored a turn of the same
    /// conversation meanwhile (answered 409).
    pub store_conflicts: u64,
}

/// A conversation the server keeps.
struct Session {
    /// Its chat transcript (with the replies), or `None` for a completion.
    messages: Option<Vec<Message>>,
    name: Option<String>,
    last_used: Instant,
    busy: bool,
}

struct Running {
    conv: ConversationId,
    updates: UnboundedSender<Update>,
    slot: Slot,
    reply: String,
    hints: Hints,
    last_token: Option<Instant>,
}

/// What a turn's answer waits for.
enum Wait {
    /// The named conversation's state to be durable in the store.
    Durable(ConversationId),
    /// The store to have written what was queued before this mark (a fleet's shared chunks).
    Mark(u64),
}

/// A turn's end, held until the store has what it wrote.
struct Held {
    wait: Wait,
    updates: UnboundedSender<Update>,
    update: Update,
    _slot: Slot,
}

struct Driver {
    engine: Engine,
    sessions: HashMap<ConversationId, Session>,
    /// Chat sessions by the hash of their transcript.
    by_content: HashMap<u64, ConversationId>,
    by_name: HashMap<String, ConversationId>,
    running: HashMap<RequestId, Running>,
    max_sessions: usize,
    /// Whether the engine stores conversations (named ones persist, and may be the fleet's).
    stored: bool,
    /// Whether the store is a fleet's (Redis): a turn's end is answered once what it stored
    /// is written, so that the next turn finds it on whichever server it lands.
    fleet: bool,
    /// Ends of turns waiting for the store.
    held: Vec<Held>,
    /// Refusing new requests (the server is stopping).
    draining: bool,
    snapshot: Arc<Mutex<Snapshot>>,
    metrics: Arc<Metrics>,
    /// Testing only: a chat whose last message is this text panics the engine thread.
    panic_on: Option<String>,
}

/// Starts the engine thread; it stops on [`Handle::stop`] or when every handle is dropped.
/// If it ever panics (a bug), the handle reports unhealthy and `died` is notified.
pub fn spawn(
    engine: Engine,
    max_in_flight: usize,
    max_sessions: usize,
    died: Arc<Notify>,
    panic_on: Option<String>,
) -> std::io::Result<(Handle, JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let wake = tx.clone();
    engine.set_store_waker(Arc::new(move || {
        let _ = wake.send(Command::Wake);
    }));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let snapshot = Arc::new(Mutex::new(Snapshot::default()));
    let metrics = Arc::new(Metrics::new(snapshot.clone(), in_flight.clone()));
    let healthy = Arc::new(AtomicBool::new(true));
    let disk = engine.config().disk.as_ref();
    let fleet = disk.is_some_and(|d| matches!(d.location, StoreLocation::Redis(_)));
    let mut driver = Driver {
        stored: disk.is_some(),
        fleet,
        held: Vec::new(),
        draining: false,
        engine,
        sessions: HashMap::new(),
        by_content: HashMap::new(),
        by_name: HashMap::new(),
        running: HashMap::new(),
        max_sessions,
        snapshot: snapshot.clone(),
        metrics: metrics.clone(),
        panic_on,
    };
    let alive = healthy.clone();
    let thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            if catch_unwind(AssertUnwindSafe(|| driver.run(&rx))).is_err() {
                alive.store(false, Ordering::SeqCst);
                died.notify_one();
            }
        })?;
    let handle = Handle {
        tx,
        in_flight,
        max_in_flight,
        snapshot,
        metrics,
        healthy,
    };
    Ok((handle, thread))
}

impl Driver {
    fn run(&mut self, rx: &Receiver<Command>) {
        'serve: loop {
            // Idle: sleep until a command (a request, or the store's wake while turn ends wait
            // for it) or the engine's next timed work (a read-ahead due). Busy: take what
            // arrived and step.
            self.release_held();
            if !self.engine.has_work() {
                let due = self.engine.poll_timeout();
                let next = match due {
                    Some(at) => rx.recv_timeout(at.saturating_duration_since(Instant::now())),
                    None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                };
                match next {
                    Ok(Command::Stop) | Err(RecvTimeoutError::Disconnected) => break 'serve,
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout)
                        if due.is_some_and(|at| at <= Instant::now()) =>
                    {
                        self.step();
                        continue;
                    }
                    Err(RecvTimeoutError::Timeout) => continue,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(Command::Stop) => break 'serve,
                    Ok(c) => self.handle(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if !self.engine.has_work() => break 'serve,
                    Err(TryRecvError::Disconnected) => break,
                }
            }
            if self.engine.has_work() {
                self.step();
            }
        }
        self.stop();
    }

    /// Cancels what still runs (its clients get an error), writes everything queued for
    /// the store, and answers the turn ends held for it.
    fn stop(&mut self) {
        let running: Vec<RequestId> = self.running.keys().copied().collect();
        for id in running {
            let _ = self.engine.cancel(id);
        }
        // The cancelled turns' ends are in the engine's next events.
        if let Ok(events) = self.engine.step() {
            events.into_iter().for_each(|e| self.route(e));
        }
        self.engine.flush();
        self.release_held();
    }

    /// The fault `--fault-panic-on` asks for: tests check that a dead engine thread makes
    /// the server report unhealthy and exit non-zero.
    #[allow(clippy::panic)]
    fn inject_fault(&self, job: &Job) {
        let Job::Chat { messages, .. } = job else {
            return;
        };
        let last = messages.last().map(|m| m.content.as_str());
        if self.panic_on.is_some() && last == self.panic_on.as_deref() {
            panic!("fault injected by --fault-panic-on");
        }
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Submit(submission) => {
                let Submission {
                    job,
                    params,
                    reply,
                    updates,
                    slot,
                } = *submission;
                self.inject_fault(&job);
                let accepted = match self.draining {
                    true => Err(ApiError::busy(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the server is stopping",
                        1,
                    )),
                    false => self.submit(job, params, updates, slot),
                };
                // A handler gone before the answer: its request is cancelled by its guard,
                // which it never got; cancel here instead.
                if let Err(Ok(request)) = reply.send(accepted) {
                    let _ = self.engine.cancel(request);
                }
            }
            Command::Cancel(request) => {
                // Already finished is not an error: the guard raced the end.
                let _ = self.engine.cancel(request);
            }
            Command::Drain => self.draining = true,
            // `run` checks the held turn ends at the top of every round.
            Command::Wake => {}
            // Taken by `run`.
            Command::Stop => {}
        }
    }

    fn submit(
        &mut self,
        job: Job,
        params: SamplingParams,
        updates: UnboundedSender<Update>,
        slot: Slot,
    ) -> Result<RequestId, ApiError> {
        let (conv, turn, hints, opened) = match job {
            Job::Chat {
                messages,
                name,
                hints,
            } => {
                let (conv, turn, opened) = self.chat_conversation(messages, name)?;
                (conv, turn, hints, opened)
            }
            Job::Completion { prompt } => {
                let tokens = match prompt {
                    PromptInput::Tokens(t) => t,
                    PromptInput::Text(s) => self
                        .engine
                        .model()
                        .encode(&s)
                        .map_err(|e| ApiError::from_engine(&e))?,
                };
                let (conv, rest, opened) = self.completion_conversation(tokens)?;
                (conv, Turn::Tokens(rest), Hints::default(), opened)
            }
        };
        // A pin is asked for before the turn, so that a refusal (too much pinned) is the
        // request's answer.
        let pinned = match hints.pin {
            Some(p) => self.engine.pin(conv, p),
            None => Ok(()),
        };
        let submitted = pinned.and_then(|()| self.engine.submit(conv, turn, params));
        match submitted {
            Ok(request) => {
                if let Some(s) = self.sessions.get_mut(&conv) {
                    s.busy = true;
                    s.last_used = Instant::now();
                }
                let running = Running {
                    conv,
                    updates,
                    slot,
                    reply: String::new(),
                    hints,
                    last_token: None,
                };
                self.running.insert(request, running);
                Ok(request)
            }
            Err(e) => {
                match opened {
                    true => self.forget(conv, true),
                    false => self.unsend(conv),
                }
                Err(ApiError::from_engine(&e))
            }
        }
    }

    fn step(&mut self) {
        let start = Instant::now();
        let events = self.engine.step();
        let took = start.elapsed();
        match events {
            Ok(events) => events.into_iter().for_each(|e| self.route(e)),
            // A step that fails has failed its turns (they come back as `Failed` events);
            // the engine itself goes on serving.
            Err(e) => tracing::error!(error = %e, "step failed"),
        }
        let mut snap = self.snapshot.lock();
        snap.stats = self.engine.stats();
        snap.conversations = self.sessions.len();
        snap.steps += 1;
        snap.step_seconds += took.as_secs_f64();
    }

    fn route(&mut self, e: Event) {
        match e {
            Event::Token {
                request,
                token,
                text,
                logprobs,
                ..
            } => {
                if let Some(r) = self.running.get_mut(&request) {
                    let now = Instant::now();
                    if let Some(last) = r.last_token.replace(now) {
                        self.metrics.next_token(now - last);
                    }
                    r.reply.push_str(&text);
                    let model = self.engine.model();
                    let piece = |id: u32| model.decode(&[id]).unwrap_or_default();
                    let logprob = logprobs.map(|l| Logprob {
                        token: piece(token),
                        logprob: l.logprob,
                        top: l.top.iter().map(|&(id, lp)| (piece(id), lp)).collect(),
                    });
                    if !text.is_empty() || logprob.is_some() {
                        let _ = r.updates.send(Update::Token { text, logprob });
                    }
                }
            }
            Event::Finished {
                request,
                conversation,
                reason,
                stats,
            } => {
                let Some(r) = self.running.remove(&request) else {
                    return;
                };
                let history = self.engine.tokens(conversation).map_or(0, <[u32]>::len);
                let usage = Usage {
                    prompt_tokens: history.saturating_sub(stats.output_tokens),
                    cached_tokens: stats.reused_tokens,
                    completion_tokens: stats.output_tokens,
                };
                self.metrics.finished(finished_reason(&reason), &stats);
                let update = match &reason {
                    FinishReason::Stop | FinishReason::StopString => Update::Done {
                        reason: "stop",
                        usage,
                    },
                    FinishReason::Length | FinishReason::ContextFull => Update::Done {
                        reason: "length",
                        usage,
                    },
                    FinishReason::Cancelled => Update::Failed(ApiError::busy(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "cancelled",
                        1,
                    )),
                    FinishReason::Failed(e) => Update::Failed(ApiError::from_failed_turn(e)),
                };
                let settled = matches!(update, Update::Done { .. });
                let named = self.settle(r.conv, settled.then_some(r.reply), &r.hints);
                let wait = match (named && self.stored, self.engine.store_mark()) {
                    (true, _) if settled => Some(Wait::Durable(r.conv)),
                    (_, Some(mark)) if self.fleet => Some(Wait::Mark(mark)),
                    _ => None,
                };
                // What a client has been answered, `/metrics` already shows.
                self.snapshot.lock().conversations = self.sessions.len();
                match wait {
                    Some(wait) => self.held.push(Held {
                        wait,
                        updates: r.updates,
                        update,
                        _slot: r.slot,
                    }),
                    None => {
                        let _ = r.updates.send(update);
                    }
                }
            }
        }
    }

    /// Sends the turn ends the store has caught up with. A named conversation's turn the
    /// store failed to keep is answered with the error, and this engine's copy is dropped:
    /// its next turn resumes the state the store has, which the client was never told had
    /// changed.
    fn release_held(&mut self) {
        let mut i = 0;
        while i < self.held.len() {
            let outcome = match self.held[i].wait {
                Wait::Mark(mark) => match self.engine.store_reached(mark) {
                    true => Some(Durability::Durable),
                    false => None,
                },
                Wait::Durable(conv) => match self.engine.durability(conv) {
                    Ok(Durability::Pending) => None,
                    Ok(d) => Some(d),
                    // Closed or replaced meanwhile: what it wrote is not this turn's to judge.
                    Err(_) => Some(Durability::NotStored),
                },
            };
            let Some(outcome) = outcome else {
                i += 1;
                continue;
            };
            let held = self.held.swap_remove(i);
            let update = match (outcome, held.wait) {
                (Durability::Failed(why), Wait::Durable(conv)) => {
                    tracing::warn!(%why, "a named conversation's turn could not be stored");
                    self.snapshot.lock().store_failures += 1;
                    self.forget(conv, false);
                    Update::Failed(ApiError::busy(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("the reply was generated but the store did not confirm it ({why}); resend the turn with the history you hold"),
                        1,
                    ))
                }
                (Durability::Conflict(why), Wait::Durable(conv)) => {
                    tracing::warn!(%why, "a named conversation's turn was not stored");
                    self.snapshot.lock().store_conflicts += 1;
                    self.forget(conv, false);
                    Update::Failed(ApiError::new(
                        StatusCode::CONFLICT,
                        format!("the reply was generated but not stored: {why}; resend the turn to continue the stored conversation"),
                    ))
                }
                _ => held.update,
            };
            let _ = held.updates.send(update);
        }
    }

    /// After a turn: the session becomes findable by its new transcript, hints apply, and
    /// old sessions close. A turn cut short (cancelled, failed) left the engine's
    /// conversation as it was: the session drops the message it sent. Returns whether the
    /// conversation is named.
    fn settle(&mut self, conv: ConversationId, reply: Option<String>, hints: &Hints) -> bool {
        let Some(reply) = reply else {
            self.unsend(conv);
            if let Some(s) = self.sessions.get_mut(&conv) {
                s.busy = false;
            }
            return false;
        };
        let Some(s) = self.sessions.get_mut(&conv) else {
            return false;
        };
        s.busy = false;
        s.last_used = Instant::now();
        let named = s.name.is_some();
        if let Some(m) = &mut s.messages {
            m.push(Message::new("assistant", reply));
            if !named {
                self.by_content.insert(sessions::transcript_key(m), conv);
            }
        }
        if hints.end {
            self.forget(conv, true);
            return false;
        }
        if let Some(after) = hints.expect_resume {
            // Validated at the edge (at most `api::MAX_RESUME_S`).
            let _ = self.engine.expect_resume(conv, after);
        }
        self.close_old();
        named
    }
}

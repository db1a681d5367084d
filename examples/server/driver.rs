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
//! the chunks any server of the fleet computed, by content.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pensieve::engine::{
    ConversationId, Engine, EngineStats, Event, FinishReason, RequestId, SamplingParams,
    StoreLocation, Turn,
};
use pensieve::model::Message;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

use crate::api::{ApiError, Hints, Usage};

mod sessions;

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

/// What the engine thread sends back for one request.
#[derive(Debug)]
pub enum Update {
    /// A text delta.
    Token(String),
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
}

enum Command {
    Submit(Box<Submission>),
    Cancel(RequestId),
}

/// Numbers the engine thread publishes after every step, for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub stats: EngineStats,
    /// Requests accepted and not finished (queued or running).
    pub in_flight: usize,
    /// Conversations open.
    pub conversations: usize,
    pub steps: u64,
    pub step_seconds: f64,
    pub requests_rejected: u64,
}

/// The handlers' side: submits requests (refusing past the queue limit) and cancels them.
#[derive(Clone)]
pub struct Handle {
    tx: Sender<Command>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: usize,
    pub snapshot: Arc<Mutex<Snapshot>>,
}

/// Cancels its request when dropped before `disarm` (the client went away).
pub struct CancelOnDrop {
    tx: Sender<Command>,
    request: RequestId,
    armed: bool,
}

impl CancelOnDrop {
    pub fn request(&self) -> RequestId {
        self.request
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // The engine thread gone means the server is stopping: nothing to cancel.
            let _ = self.tx.send(Command::Cancel(self.request));
        }
    }
}

impl Handle {
    /// Queues `job`; its updates arrive on the returned channel. 429 when `max_in_flight`
    /// requests are already queued or running.
    pub async fn submit(
        &self,
        job: Job,
        params: SamplingParams,
    ) -> Result<(CancelOnDrop, UnboundedReceiver<Update>), ApiError> {
        let busy = self.in_flight.fetch_add(1, Ordering::SeqCst);
        if busy >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.snapshot.lock().requests_rejected += 1;
            return Err(ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                format!("the queue is full ({busy} requests in flight); retry later"),
            ));
        }
        let (updates, rx) = unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let stopped = || ApiError::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, "stopping");
        let sent = self.tx.send(Command::Submit(Box::new(Submission {
            job,
            params,
            reply,
            updates,
        })));
        let accepted = match sent {
            Ok(()) => accepted.await.unwrap_or_else(|_| Err(stopped())),
            Err(_) => Err(stopped()),
        };
        match accepted {
            Ok(request) => Ok((
                CancelOnDrop {
                    tx: self.tx.clone(),
                    request,
                    armed: true,
                },
                rx,
            )),
            Err(e) => {
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                Err(e)
            }
        }
    }
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
    reply: String,
    /// Its stop strings: a reply that ends with one is stored without it, as the client gets
    /// it.
    stops: Vec<String>,
    hints: Hints,
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
    /// Ends of turns waiting for the store to reach their mark.
    held: Vec<(u64, UnboundedSender<Update>, Update)>,
    in_flight: Arc<AtomicUsize>,
    snapshot: Arc<Mutex<Snapshot>>,
}

/// Starts the engine thread; it stops when every handle is dropped.
pub fn spawn(engine: Engine, max_in_flight: usize, max_sessions: usize) -> std::io::Result<Handle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let snapshot = Arc::new(Mutex::new(Snapshot::default()));
    let disk = engine.config().disk.as_ref();
    let fleet = disk.is_some_and(|d| matches!(d.location, StoreLocation::Redis(_)));
    let mut driver = Driver {
        stored: disk.is_some(),
        fleet,
        held: Vec::new(),
        engine,
        sessions: HashMap::new(),
        by_content: HashMap::new(),
        by_name: HashMap::new(),
        running: HashMap::new(),
        max_sessions,
        in_flight: in_flight.clone(),
        snapshot: snapshot.clone(),
    };
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || driver.run(&rx))?;
    Ok(Handle {
        tx,
        in_flight,
        max_in_flight,
        snapshot,
    })
}

fn transcript_key(messages: &[Message]) -> u64 {
    let mut h = DefaultHasher::new();
    for m in messages {
        m.role.hash(&mut h);
        m.content.hash(&mut h);
    }
    h.finish()
}

impl Driver {
    fn run(&mut self, rx: &Receiver<Command>) {
        loop {
            // Idle: wait for work (polling the store while turn ends wait for it). Busy: take
            // what arrived and step.
            self.release_held();
            if !self.engine.has_work() {
                let next = match self.held.is_empty() {
                    true => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    false => rx.recv_timeout(Duration::from_millis(1)),
                };
                match next {
                    Ok(c) => self.handle(c),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if !self.engine.has_work() => return,
                    Err(TryRecvError::Disconnected) => break,
                }
            }
            if self.engine.has_work() {
                self.step();
            }
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
                } = *submission;
                // A refusal is counted out of the queue by the handler.
                let accepted = self.submit(job, params, updates);
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
        }
    }

    fn submit(
        &mut self,
        job: Job,
        params: SamplingParams,
        updates: UnboundedSender<Update>,
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
        let stops = params.stop_strings.clone();
        match self.engine.submit(conv, turn, params) {
            Ok(request) => {
                if let Some(s) = self.sessions.get_mut(&conv) {
                    s.busy = true;
                    s.last_used = Instant::now();
                }
                self.running.insert(
                    request,
                    Running {
                        conv,
                        updates,
                        reply: String::new(),
                        stops,
                        hints,
                    },
                );
                Ok(request)
            }
            Err(e) => {
                if opened {
                    self.forget(conv, true);
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
            Err(e) => eprintln!("step failed: {e}"),
        }
        let mut snap = self.snapshot.lock();
        snap.stats = self.engine.stats();
        snap.in_flight = self.in_flight.load(Ordering::SeqCst);
        snap.conversations = self.sessions.len();
        snap.steps += 1;
        snap.step_seconds += took.as_secs_f64();
    }

    fn route(&mut self, e: Event) {
        match e {
            Event::Token { request, text, .. } => {
                if let Some(r) = self.running.get_mut(&request) {
                    r.reply.push_str(&text);
                    let _ = r.updates.send(Update::Token(text));
                }
            }
            Event::Finished {
                request,
                conversation,
                reason,
                stats,
            } => {
                let Some(mut r) = self.running.remove(&request) else {
                    return;
                };
                if matches!(reason, FinishReason::StopString) {
                    if let Some(s) = r.stops.iter().find(|s| r.reply.ends_with(s.as_str())) {
                        r.reply.truncate(r.reply.len() - s.len());
                    }
                }
                self.in_flight.fetch_sub(1, Ordering::SeqCst);
                let history = self.engine.tokens(conversation).map_or(0, <[u32]>::len);
                let usage = Usage {
                    prompt_tokens: history.saturating_sub(stats.output_tokens),
                    cached_tokens: stats.reused_tokens,
                    completion_tokens: stats.output_tokens,
                };
                let update = match &reason {
                    FinishReason::Stop | FinishReason::StopString => Update::Done {
                        reason: "stop",
                        usage,
                    },
                    FinishReason::Length | FinishReason::ContextFull => Update::Done {
                        reason: "length",
                        usage,
                    },
                    FinishReason::Cancelled => Update::Failed(ApiError::bad("cancelled")),
                    FinishReason::Failed(e) => Update::Failed(ApiError::from_engine(e)),
                };
                let settled = matches!(update, Update::Done { .. });
                self.settle(r.conv, settled.then_some(r.reply), &r.hints);
                // What a client has been answered, `/metrics` already shows.
                {
                    let mut snap = self.snapshot.lock();
                    snap.in_flight = self.in_flight.load(Ordering::SeqCst);
                    snap.conversations = self.sessions.len();
                }
                match self.engine.store_mark().filter(|_| self.fleet) {
                    Some(mark) if !self.engine.store_reached(mark) => {
                        self.held.push((mark, r.updates, update));
                    }
                    _ => {
                        let _ = r.updates.send(update);
                    }
                }
            }
        }
    }

    /// Sends the turn ends whose store writes are done.
    fn release_held(&mut self) {
        let engine = &self.engine;
        let done = self
            .held
            .extract_if(.., |(mark, ..)| engine.store_reached(*mark));
        for (_, updates, update) in done {
            let _ = updates.send(update);
        }
    }

    /// After a turn: the session becomes findable by its new transcript, hints apply, and
    /// old sessions close. A turn cut short (cancelled, failed) leaves a history no client
    /// holds: its session closes.
    fn settle(&mut self, conv: ConversationId, reply: Option<String>, hints: &Hints) {
        let Some(reply) = reply else {
            self.forget(conv, false);
            return;
        };
        let Some(s) = self.sessions.get_mut(&conv) else {
            return;
        };
        s.busy = false;
        s.last_used = Instant::now();
        if let Some(m) = &mut s.messages {
            m.push(Message::new("assistant", reply));
            if s.name.is_none() {
                self.by_content.insert(transcript_key(m), conv);
            }
        }
        if hints.end {
            self.forget(conv, true);
            return;
        }
        if let Some(p) = hints.pin {
            let _ = self.engine.pin(conv, p);
        }
        if let Some(after) = hints.expect_resume {
            let _ = self.engine.expect_resume(conv, after);
        }
        self.close_old();
    }
}

//! The engine thread: the only owner of the engine. It takes commands from the handles,
//! maps chat and completion requests to conversations (`sessions`), calls `step()` while
//! there is work, and sends each turn's events on the turn's own channel. Idle, it sleeps until
//! a command arrives (the store's wake-up is one) or the engine's next timed work is due.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

mod held;

use held::{Answer, Held, Wait};

use super::sessions::{named, Naming, Opened, Sessions};
use super::stream::settled;
use super::{Chat, Hints, Observer, ServiceConfig, ServiceStats, Slot, TurnEnd, TurnEvent};
use crate::chat::ToolStream;
use crate::engine::{
    ConversationId, Durability, Engine, Event, Fetched, FinishReason, ReadyTurn, Removing,
    RequestId, SamplingParams, StoreLocation, Turn,
};
use crate::model::Message;
use crate::{Error, Result};

/// What a submission asks for.
#[derive(Debug)]
pub(super) enum What {
    Turn {
        conv: ConversationId,
        turn: Turn,
    },
    /// A chat, what the store held of its conversation's name and its first turn if it opens
    /// one (both read off this thread).
    Chat(Chat, Option<Box<Fetched>>, Option<Box<ReadyTurn>>),
    Completion(Vec<u32>),
}

/// A turn the engine took: its request, its conversation, and whether it rewrites a named
/// conversation's history (the client sent another one than the conversation holds).
pub(super) type Accepted = (RequestId, ConversationId, bool);

pub(super) struct Submission {
    pub what: What,
    pub params: SamplingParams,
    pub reply: oneshot::Sender<Result<Vec<Accepted>>>,
    /// One per choice asked for: where its events go, and its queue place.
    pub choices: Vec<(UnboundedSender<TurnEvent>, Slot)>,
}

type Call = Box<dyn FnOnce(&mut Driver) + Send>;

pub(super) enum Command {
    Submit(Box<Submission>),
    Call(Call),
    Cancel(RequestId),
    Drain,
    Stop,
    /// The store finished a job: turn ends held for it may be sent.
    Wake,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(_) => f.write_str("Submit"),
            Command::Call(_) => f.write_str("Call"),
            Command::Cancel(r) => write!(f, "Cancel({r})"),
            Command::Drain => f.write_str("Drain"),
            Command::Stop => f.write_str("Stop"),
            Command::Wake => f.write_str("Wake"),
        }
    }
}

struct Running {
    conv: ConversationId,
    events: UnboundedSender<TurnEvent>,
    slot: Slot,
    hints: Hints,
    last_token: Option<Instant>,
    /// The name this turn's conversation takes once it has a reply (see [`Opened::Naming`]).
    naming: Option<Naming>,
    /// With tools: the reply's calls as they are read.
    tools: Option<ToolStream>,
}

pub(super) struct Driver {
    pub(super) engine: Engine,
    sessions: Sessions,
    running: HashMap<RequestId, Running>,
    /// Whether the engine stores conversations (named ones persist, and may be a fleet's).
    stored: bool,
    /// Whether the store is a fleet's (Redis): a turn's end is sent once what it stored is
    /// written, so that the next turn finds it on whichever engine it lands.
    fleet: bool,
    held: Vec<Held>,
    /// Refusing new turns (the service is stopping).
    draining: bool,
    stats: Arc<Mutex<ServiceStats>>,
    /// When `stats.engine` was last taken.
    stats_taken: Instant,
    observer: Option<Arc<dyn Observer>>,
}

/// How often the engine's counters are taken while it is busy.
const STATS_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

impl Driver {
    pub(super) fn new(
        engine: Engine,
        config: &ServiceConfig,
        stats: Arc<Mutex<ServiceStats>>,
    ) -> Self {
        let store = engine.config().store.as_ref();
        let (stored, fleet) = (
            store.is_some(),
            store.is_some_and(|d| matches!(d.location, StoreLocation::Redis(_))),
        );
        Self {
            stored,
            fleet,
            engine,
            sessions: Sessions::new(config.max_conversations, stored),
            running: HashMap::new(),
            held: Vec::new(),
            draining: false,
            stats,
            stats_taken: Instant::now(),
            observer: config.observer.clone(),
        }
    }

    pub(super) fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Resumes the stored conversation `name` with what the store held of it (`None`: read
    /// it now), keeping its session up to date.
    pub(super) fn resume(
        &mut self,
        name: &str,
        fetched: Option<Fetched>,
    ) -> Result<ConversationId> {
        self.sessions.resume(&mut self.engine, name, fetched)
    }

    /// Gives the conversation `name` the history `messages` and the host's `attributes`
    /// ([`Sessions::rewrite`]): the conversation that now holds the name.
    pub(super) fn rewrite(
        &mut self,
        name: &str,
        messages: Vec<Message>,
        attributes: serde_json::Map<String, serde_json::Value>,
    ) -> Result<ConversationId> {
        (self.sessions).rewrite(&mut self.engine, name, messages, attributes)
    }

    /// Closes the idle sessions past the service's limit (the store keeps named ones), as
    /// after a turn.
    pub(super) fn close_old(&mut self) {
        self.sessions.close_old(&mut self.engine);
        self.stats.lock().conversations = self.sessions.len();
    }

    /// An answer to hold until the state of `conv` is durable in the store; `None` when it is
    /// not stored (nothing to wait for).
    pub(super) fn hold_durable(
        &mut self,
        conv: ConversationId,
    ) -> Option<oneshot::Receiver<Result<()>>> {
        if !(self.stored && named(&self.engine, conv)) {
            return None;
        }
        let (reply, answer) = oneshot::channel();
        self.held.push(Held {
            wait: self.durable(conv),
            answer: Answer::Done(reply),
        });
        Some(answer)
    }

    /// Whether `chat` would continue a conversation held now ([`Sessions::would_continue`]).
    pub(super) fn would_continue(&self, chat: &Chat) -> bool {
        self.sessions.would_continue(&self.engine, chat)
    }

    /// Drops this engine's copy of a stored conversation, or closes one the store does not
    /// keep.
    pub(super) fn detach(&mut self, conv: ConversationId) -> Result<()> {
        self.sessions.close(&mut self.engine, conv, false).map(drop)
    }

    /// Closes a conversation, deleting a stored one: `reply` is answered once the deletion
    /// is written, or with why it could not be (the store then keeps the conversation).
    pub(super) fn close(&mut self, conv: ConversationId, reply: oneshot::Sender<Result<()>>) {
        match self.sessions.close(&mut self.engine, conv, true) {
            Ok(Some(removing)) => self.held.push(Held {
                wait: Wait::Removed(removing),
                answer: Answer::Done(reply),
            }),
            closed => {
                let _ = reply.send(closed.map(drop));
            }
        }
    }

    /// An answer to hold until the latest manifest write of `conv` is done (stored or not);
    /// `None` when none is queued.
    pub(super) fn behind(&mut self, conv: ConversationId) -> Option<oneshot::Receiver<Result<()>>> {
        let write = self.engine.writing(conv).ok().flatten()?;
        if self.engine.write_durability(write) != Durability::Pending {
            return None;
        }
        let (reply, answer) = oneshot::channel();
        self.held.push(Held {
            wait: Wait::Settled(write),
            answer: Answer::Done(reply),
        });
        Some(answer)
    }

    /// What waits for the state of `conv` as its latest manifest write stores it.
    fn durable(&self, conv: ConversationId) -> Wait {
        Wait::Durable(conv, self.engine.writing(conv).ok().flatten())
    }

    pub(super) fn run(&mut self, rx: &Receiver<Command>) {
        'serve: loop {
            // Idle: sleep until a command (a turn, or the store's wake while turn ends wait
            // for it) or the engine's next timed work (a read-ahead due). Busy: take what
            // arrived and step.
            self.release_held();
            let due = self.engine.poll_timeout();
            if due.is_none_or(|at| at > Instant::now()) {
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

    /// Cancels what still runs, writes everything queued for the store, and sends the turn
    /// ends held for it.
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

    fn handle(&mut self, c: Command) {
        match c {
            Command::Submit(submission) => {
                let Submission {
                    what,
                    params,
                    reply,
                    choices,
                } = *submission;
                let accepted = match self.draining {
                    true => Err(Error::ServiceStopped),
                    false => self.submit(what, params, choices),
                };
                // A caller gone before the answer never got the streams that would cancel
                // its turns: cancel here instead.
                if let Err(Ok(turns)) = reply.send(accepted) {
                    for (request, ..) in turns {
                        let _ = self.engine.cancel(request);
                    }
                }
            }
            Command::Call(f) => f(self),
            // Already finished is not an error: the stream's drop raced the end.
            Command::Cancel(request) => {
                let _ = self.engine.cancel(request);
            }
            Command::Drain => self.draining = true,
            // `run` checks the held turn ends at the top of every round; it takes `Stop`.
            Command::Wake | Command::Stop => {}
        }
    }

    /// Submits the turn `what` asks for, once per choice: the first on the conversation it
    /// continues, the others on forks of it (sessions of their own, so that a client may
    /// continue whichever choice it keeps), each with the next seed.
    fn submit(
        &mut self,
        what: What,
        params: SamplingParams,
        choices: Vec<(UnboundedSender<TurnEvent>, Slot)>,
    ) -> Result<Vec<Accepted>> {
        if choices.len() > 1 && matches!(what, What::Turn { .. }) {
            return Err(Error::InvalidRequest {
                field: "n",
                reason: "several choices are for chats and completions; fork the conversation"
                    .into(),
            });
        }
        // Nothing a request names changes before its parameters are known good.
        self.engine.validate_params(&params)?;
        let mut ready = None;
        let (conv, turn, hints, opened) = match what {
            What::Turn { conv, turn } => (conv, turn, Hints::default(), None),
            What::Chat(chat, fetched, prepared) => {
                let hints = chat.hints.clone();
                let (conv, turn, opened) = (self.sessions).chat_conversation(
                    &mut self.engine,
                    chat,
                    fetched.map(|f| *f),
                )?;
                ready = prepared;
                (conv, turn, hints, Some(opened))
            }
            What::Completion(tokens) => {
                let (conv, rest, opened) =
                    (self.sessions).completion_conversation(&mut self.engine, tokens)?;
                (conv, Turn::Tokens(rest), Hints::default(), Some(opened))
            }
        };
        let mut convs = vec![conv];
        let mut accepted = Vec::new();
        // A pin is asked for before the turn, so that a refusal (too much pinned) is the
        // turn's answer.
        let pinned = match hints.pin {
            Some(p) => self.engine.pin(conv, p),
            None => Ok(()),
        };
        let submitted = pinned.and_then(|()| {
            for _ in 1..choices.len() {
                convs.push(self.sessions.fork_session(&mut self.engine, conv)?);
            }
            for (i, &c) in convs.iter().enumerate() {
                let mut p = params.clone();
                p.seed = p.seed.wrapping_add(i as u64);
                let request = match ready.as_deref_mut() {
                    Some(r) => self.engine.submit_ready(c, turn.clone(), p, r)?,
                    None => self.engine.submit(c, turn.clone(), p)?,
                };
                accepted.push((request, c));
            }
            Ok(())
        });
        if let Err(e) = submitted {
            for &(request, _) in &accepted {
                let _ = self.engine.cancel(request);
            }
            for &fork in &convs[1..] {
                self.sessions.forget(&mut self.engine, fork, true);
            }
            match opened {
                Some(Opened::New | Opened::Naming(_)) => {
                    self.sessions.forget(&mut self.engine, conv, true)
                }
                Some(Opened::Continued) => self.sessions.unsend(conv),
                None => {}
            }
            return Err(e);
        }
        let naming = match opened {
            Some(Opened::Naming(naming)) => {
                // No other turn continues what it replaces meanwhile: the name is this turn's.
                if let Some(old) = naming.replaces {
                    self.sessions.mark_busy(old);
                }
                Some(naming)
            }
            _ => None,
        };
        for (i, (&(request, conv), (events, slot))) in accepted.iter().zip(choices).enumerate() {
            self.sessions.mark_busy(conv);
            let running = Running {
                conv,
                events,
                slot,
                hints: match i {
                    0 => hints.clone(),
                    _ => Hints::default(),
                },
                last_token: None,
                naming: naming.clone().filter(|_| i == 0),
                tools: self.engine.tool_stream(conv, request),
            };
            self.running.insert(request, running);
        }
        let rewrites = naming.is_some_and(|n| n.replaces.is_some());
        let accepted = accepted.into_iter().enumerate();
        Ok((accepted.map(|(i, (request, conv))| (request, conv, rewrites && i == 0))).collect())
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
        // The engine's counters cost a pass over every conversation held: taken at most every
        // `STATS_EVERY` while busy, and always when the engine goes idle, so that what a
        // finished turn did is in them.
        let now = Instant::now();
        let due = now.saturating_duration_since(self.stats_taken) >= STATS_EVERY;
        let engine = (due || !self.engine.has_work()).then(|| self.engine.stats());
        let mut stats = self.stats.lock();
        if let Some(e) = engine {
            stats.engine = e;
            self.stats_taken = now;
        }
        stats.conversations = self.sessions.len();
        stats.steps += 1;
        stats.step_seconds += took.as_secs_f64();
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
                let Some(r) = self.running.get_mut(&request) else {
                    return;
                };
                let now = Instant::now();
                if let (Some(last), Some(o)) = (r.last_token.replace(now), &self.observer) {
                    o.token(now - last);
                }
                let deltas = r.tools.as_mut().map(|s| s.push(&text)).unwrap_or_default();
                let _ = r.events.send(TurnEvent::Token {
                    token,
                    text,
                    logprobs,
                });
                for d in deltas {
                    let _ = r.events.send(TurnEvent::Tool(d));
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
                for d in r.tools.as_mut().map(ToolStream::finish).unwrap_or_default() {
                    let _ = r.events.send(TurnEvent::Tool(d));
                }
                if let Some(o) = &self.observer {
                    o.finished(&reason, &stats);
                }
                let history_tokens = self.engine.tokens(conversation).map_or(0, <[u32]>::len);
                let mut reason = reason;
                if let Some(naming) = r.naming {
                    let replied = settled(&reason);
                    if let Err(e) =
                        (self.sessions).finish_naming(&mut self.engine, r.conv, naming, replied)
                    {
                        reason = FinishReason::Failed(Arc::new(e));
                    }
                }
                let settled = settled(&reason);
                // The reply as the conversation recorded it (its calls read out of it).
                let recorded = self.engine.messages(r.conv).ok().and_then(|m| m.last());
                let message = recorded.filter(|_| settled).cloned();
                let named = self.stored && named(&self.engine, r.conv);
                let removing = self.settle(r.conv, message.clone(), &r.hints);
                let end = TurnEnd {
                    reason,
                    stats,
                    history_tokens,
                    message,
                };
                // A turn that ended its stored conversation is answered once the removal is
                // written: a client told it is forgotten is not resumed after a crash.
                let wait = match (named, self.engine.store_mark()) {
                    _ if removing.is_some() => removing.map(Wait::Removed),
                    (true, _) if settled => Some(self.durable(r.conv)),
                    (_, Some(mark)) if self.fleet => Some(Wait::Mark(mark)),
                    _ => None,
                };
                // What a client has been answered, the stats already show.
                self.stats.lock().conversations = self.sessions.len();
                match wait {
                    Some(wait) => self.held.push(Held {
                        wait,
                        answer: Answer::Turn {
                            events: r.events,
                            end: Box::new(end),
                            _slot: r.slot,
                        },
                    }),
                    None => {
                        let _ = r.events.send(TurnEvent::Finished(end));
                    }
                }
            }
        }
    }

    /// After a turn: the session becomes findable by its new transcript, hints apply, and
    /// old sessions close. A turn cut short (cancelled, failed) left the engine's
    /// conversation as it was: the session drops the message it sent.
    fn settle(
        &mut self,
        conv: ConversationId,
        reply: Option<Message>,
        hints: &Hints,
    ) -> Option<Removing> {
        let Some(reply) = reply else {
            self.sessions.unsend(conv);
            self.sessions.mark_idle(conv);
            return None;
        };
        if hints.end {
            return (self.sessions.close(&mut self.engine, conv, true)).unwrap_or(None);
        }
        if let Some(after) = hints.expect_resume {
            let _ = self.engine.expect_resume(conv, after);
        }
        self.sessions.replied(conv, reply);
        self.sessions.close_old(&mut self.engine);
        None
    }
}

//! Answers: a turn's stream of events as one OpenAI response, or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use crate::chat::{ReasoningParser, ReasoningStream, ToolDelta};
use crate::engine::{FinishReason, SamplingParams, TokenLogprobs};
use crate::model::{Message, Model};
use crate::service::{Chat, TurnEnd, TurnEvent, TurnStream};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api::{Common, Usage};
use super::error::ApiError;
use super::logprobs::{self, Logprob};
use super::{now_s, AppState};

/// What a request asks for.
pub enum Job {
    /// A chat turn, continuing the conversation its messages (or name) continue; with
    /// `parallel`, a reply may make several tool calls; with `legacy`, the request offered
    /// them as `functions`, and its answer's call is a `function_call`.
    Chat {
        chat: Chat,
        parallel: bool,
        legacy: bool,
    },
    /// A raw completion of these prompt tokens.
    Completion(Vec<u32>),
}

#[derive(Clone, Copy)]
pub enum Kind {
    Chat,
    Completion,
}

/// The parts of a response that do not change from chunk to chunk.
struct Framing {
    kind: Kind,
    id: String,
    created: u64,
    model: Arc<str>,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
    /// Whether log-probabilities name tokens by id (`return_tokens_as_token_ids`).
    token_ids: bool,
    /// With tools offered: whether a reply may make several calls (else only its first is
    /// answered). Streamed, its text and calls go out as the service reads them.
    tools: Option<bool>,
    /// How a chat answer's thought is told from its answer (`--reasoning-parser`).
    reasoning: Option<ReasoningParser>,
    /// The request offered `functions` (the legacy form of `tools`): the reply's one call is
    /// answered as `function_call`.
    legacy: bool,
    /// The request gave a prediction: usage counts its tokens accepted and rejected.
    predicted: bool,
}

impl Framing {
    fn new(kind: Kind, model: Arc<str>, id: String, logprobs: bool, tools: Option<bool>) -> Self {
        Self {
            kind,
            id,
            created: now_s(),
            model,
            logprobs,
            token_ids: false,
            tools,
            reasoning: None,
            legacy: false,
            predicted: false,
        }
    }

    /// A choice's `logprobs` for these tokens (the first `offset` bytes into the reply), or
    /// null when the request did not ask.
    fn logprobs(&self, tokens: &[Logprob], offset: usize) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Chat) => logprobs::chat(tokens),
            (true, Kind::Completion) => logprobs::completion(tokens, offset),
        }
    }

    /// OpenAI's finish reason for a reply that ended for `reason`: a call is a
    /// `function_call` for a request that offered `functions`.
    fn reason(&self, reason: &'static str) -> &'static str {
        match (reason, self.legacy) {
            ("tool_calls", true) => "function_call",
            _ => reason,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// A whole response of these choices.
    fn whole(&self, choices: &[Choice], usage: &Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = self.logprobs(&c.tokens, 0);
                let message = match (&c.message, self.reasoning) {
                    (Some(m), _) if self.legacy => super::tools::legacy_message_json(m),
                    (Some(m), _) => super::tools::message_json(m, self.tools.unwrap_or(true)),
                    (None, Some(parser)) => match parser.split(&c.text) {
                        (Some(thought), content) => json!({"role": "assistant",
                            "content": content, "reasoning_content": thought}),
                        (None, content) => json!({"role": "assistant", "content": content}),
                    },
                    (None, None) => json!({"role": "assistant", "content": c.text}),
                };
                match self.kind {
                    Kind::Chat => json!({"index": index, "logprobs": logprobs,
                        "finish_reason": c.reason, "message": message}),
                    Kind::Completion => json!({"index": index, "logprobs": logprobs,
                        "finish_reason": c.reason, "text": c.text}),
                }
            })
            .collect();
        json!({"id": self.id, "object": self.object(false), "created": self.created,
            "model": &*self.model, "choices": choices, "usage": usage.json()})
    }

    /// A stream chunk of choice `index` carrying `text` (and `reason` at the end), or the
    /// role on the first; `logprobs` for the tokens it completes.
    fn chunk(
        &self,
        index: usize,
        text: Option<Piece>,
        reason: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match text {
                    Some(Piece::Call { name, .. }) if self.legacy => {
                        json!({"function_call": {"name": name, "arguments": ""}})
                    }
                    Some(Piece::Arguments { fragment, .. }) if self.legacy => {
                        json!({"function_call": {"arguments": fragment}})
                    }
                    Some(Piece::Answer(t)) => json!({"content": t}),
                    Some(Piece::Thought(t)) => json!({"reasoning_content": t}),
                    Some(Piece::Call { index, id, name }) => json!({"tool_calls": [{
                        "index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    Some(Piece::Arguments { index, fragment }) => json!({"tool_calls": [{
                        "index": index, "function": {"arguments": fragment}}]}),
                    None if reason.is_none() => json!({"role": "assistant", "content": ""}),
                    None => json!({}),
                };
                return self.delta_chunk(index, delta, reason, logprobs);
            }
            Kind::Completion => json!({"index": index, "text": text.map_or("", Piece::text),
                "logprobs": logprobs, "finish_reason": reason}),
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": &*self.model, "choices": [choice], "usage": null})
    }

    /// A chat stream chunk of choice `index` with this `delta`.
    fn delta_chunk(
        &self,
        index: usize,
        delta: Value,
        reason: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = json!({"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": reason});
        json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": &*self.model, "choices": [choice], "usage": null})
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": &*self.model, "choices": [], "usage": usage.json()})
    }
}

/// Streamed parts of a reply: its answer's text, its thought's (with a reasoning parser), and
/// with tools, a call's start and its arguments' fragments.
#[derive(Clone, Copy)]
enum Piece<'a> {
    Answer(&'a str),
    Thought(&'a str),
    Call {
        index: usize,
        id: &'a str,
        name: &'a str,
    },
    Arguments {
        index: usize,
        fragment: &'a str,
    },
}

impl<'a> Piece<'a> {
    /// Its text, for a completion (which has no thoughts or calls).
    fn text(self) -> &'a str {
        match self {
            Piece::Answer(t) | Piece::Thought(t) => t,
            Piece::Call { .. } | Piece::Arguments { .. } => "",
        }
    }
}

/// A choice as it is collected.
#[derive(Default)]
struct Choice {
    text: String,
    /// Log-probabilities of its tokens (streamed: of those whose text has not gone out).
    tokens: Vec<Logprob>,
    /// Bytes of text sent so far (streamed).
    sent: usize,
    reason: &'static str,
    end: Option<Usage>,
    /// The reply as the service recorded it (its tool calls parsed), with tools offered.
    message: Option<Message>,
    /// Its thought told from its answer as it streams (with a reasoning parser).
    split: Option<ReasoningStream>,
}

impl Choice {
    /// Keeps a token's log-probabilities, when they were asked for (named by id, with `ids`).
    fn record(&mut self, model: &Model, token: u32, logprobs: Option<TokenLogprobs>, ids: bool) {
        self.tokens
            .extend(logprobs.map(|l| Logprob::of(model, token, &l, ids)));
    }
}

/// The usage of a request's choices: the prompt once, every choice's tokens.
fn total(choices: &[Choice]) -> Usage {
    let mut usage = choices.first().and_then(|c| c.end).unwrap_or_default();
    let ends = || choices.iter().filter_map(|c| c.end);
    usage.completion_tokens = ends().map(|u| u.completion_tokens).sum();
    usage.prediction = usage.prediction.map(|_| {
        let each = ends().filter_map(|u| u.prediction);
        each.fold((0, 0), |(a, r), (x, y)| (a + x, r + y))
    });
    usage
}

/// Submits `job` (`n` choices) and answers with its turns, whole or streamed.
pub async fn serve(
    s: AppState,
    job: Job,
    params: SamplingParams,
    n: usize,
    common: &Common,
    kind: Kind,
) -> Response {
    let logprobs = params.logprobs.is_some();
    let tools = match &job {
        Job::Chat { chat, parallel, .. } => {
            (!chat.tools.is_empty() && !params.text_only).then_some(*parallel)
        }
        Job::Completion(_) => None,
    };
    let legacy = matches!(job, Job::Chat { legacy: true, .. });
    let predicted = !params.prediction.is_empty();
    let turns = match job {
        Job::Chat { chat, .. } => s.service.chat_choices(chat, params, n).await,
        Job::Completion(prompt) => s.service.complete_choices(prompt, params, n).await,
    };
    let turns = match turns {
        Ok(t) => t,
        Err(e) => return ApiError::from_engine(&e).into_response(),
    };
    let prefix = match kind {
        Kind::Chat => "chatcmpl-",
        Kind::Completion => "cmpl-",
    };
    let id = match super::random_id::random_id(prefix) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let mut framing = Framing::new(kind, s.model.clone(), id, logprobs, tools);
    framing.token_ids = common.return_tokens_as_token_ids;
    framing.reasoning = s.reasoning.filter(|_| matches!(kind, Kind::Chat));
    framing.legacy = legacy;
    framing.predicted = predicted;
    let rewrites = turns.iter().any(TurnStream::rewrites);
    let mut response = match common.stream {
        true => stream(framing, turns, s.tokens, common.include_usage()).into_response(),
        false => whole(framing, turns, &s.tokens).await,
    };
    if rewrites {
        // The client sent another history than its named conversation held: it is told, since
        // what the conversation held is replaced by this request's.
        (response.headers_mut()).insert(REWRITTEN, HeaderValue::from_static("true"));
    }
    response
}

/// The header that tells a client its request rewrote the history of the conversation it
/// named.
pub const REWRITTEN: HeaderName = HeaderName::from_static("x-conversation-rewritten");

/// OpenAI's finish reason and the usage of a turn that ended with its reply, or the error
/// it is answered with.
fn outcome(end: &TurnEnd, predicted: bool) -> Result<(&'static str, Usage), ApiError> {
    let reason = match &end.reason {
        FinishReason::Stop | FinishReason::StopString => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::Cancelled => {
            return Err(ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "cancelled",
                1,
            ))
        }
        FinishReason::Failed(e) => return Err(ApiError::from_failed_turn(e)),
    };
    let calls = end
        .message
        .as_ref()
        .is_some_and(|m| !m.tool_calls.is_empty());
    let mut usage = Usage::of(end);
    if predicted {
        let (drafted, accepted) = (end.stats.drafted_tokens, end.stats.accepted_tokens);
        usage.prediction = Some((accepted, drafted - accepted.min(drafted)));
    }
    Ok((if calls { "tool_calls" } else { reason }, usage))
}

/// The choices' events as one stream, each tagged with its choice's index. Dropping it drops
/// the turns' streams, which cancels those still running.
fn merged(turns: Vec<TurnStream>) -> impl futures_util::Stream<Item = (usize, TurnEvent)> {
    futures_util::stream::select_all(
        turns
            .into_iter()
            .enumerate()
            .map(|(i, t)| futures_util::StreamExt::map(t, move |e| (i, e))),
    )
}

/// Collects the replies; dropping the turns' streams cancels them if the client goes away
/// first (axum drops this future).
async fn whole(framing: Framing, turns: Vec<TurnStream>, model: &Model) -> Response {
    let mut choices: Vec<Choice> = turns.iter().map(|_| Choice::default()).collect();
    let mut events = std::pin::pin!(merged(turns));
    while let Some((i, event)) = futures_util::StreamExt::next(&mut events).await {
        match event {
            TurnEvent::Token {
                token,
                text,
                logprobs,
            } => {
                choices[i].text.push_str(&text);
                choices[i].record(model, token, logprobs, framing.token_ids);
            }
            TurnEvent::Finished(end) => match outcome(&end, framing.predicted) {
                Ok((reason, usage)) => {
                    choices[i].reason = framing.reason(reason);
                    choices[i].end = Some(usage);
                    choices[i].message = end.message.filter(|_| framing.tools.is_some());
                }
                Err(e) => return e.into_response(),
            },
            _ => {}
        }
    }
    match choices.iter().all(|c| c.end.is_some()) {
        true => Json(framing.whole(&choices, &total(&choices))).into_response(),
        false => ApiError::engine_stopped().into_response(),
    }
}

/// A streamed reply's state: its choices, and the chunks ready to send.
struct St<S> {
    framing: Framing,
    events: std::pin::Pin<Box<S>>,
    model: Arc<Model>,
    include_usage: bool,
    out: std::collections::VecDeque<String>,
    done: bool,
    choices: Vec<Choice>,
}
impl<S> St<S> {
    /// Takes choice `i`'s next event.
    fn on_event(&mut self, i: usize, event: TurnEvent) {
        match event {
            TurnEvent::Token {
                token,
                text,
                logprobs,
            } => {
                let ids = self.framing.token_ids;
                self.choices[i].record(&self.model, token, logprobs, ids);
                // With tools, the text comes as the service reads it (`Tool` events).
                if !text.is_empty() && self.framing.tools.is_none() {
                    self.send_text(i, &text);
                }
            }
            TurnEvent::Tool(delta) => {
                let all = self.framing.tools.unwrap_or(true);
                match delta {
                    ToolDelta::Text(text) => self.send_text(i, &text),
                    ToolDelta::Call { index, id, name } if all || index == 0 => self.send(
                        i,
                        Some(Piece::Call {
                            index,
                            id: &id,
                            name: &name,
                        }),
                        None,
                    ),
                    ToolDelta::Arguments { index, fragment } if all || index == 0 => {
                        let piece = Piece::Arguments {
                            index,
                            fragment: &fragment,
                        };
                        self.send(i, Some(piece), None)
                    }
                    _ => {}
                }
            }
            TurnEvent::Finished(end) => self.end(i, &end),
        }
    }

    /// A chunk of choice `i`'s reply text, its thought told from its answer with a reasoning
    /// parser.
    fn send_text(&mut self, i: usize, text: &str) {
        match self.choices[i].split.as_mut().map(|s| s.push(text)) {
            Some((thought, answer)) => self.send_split(i, &thought, &answer),
            None => self.send(i, Some(Piece::Answer(text)), None),
        }
    }

    /// Chunks of choice `i`'s thought and answer text, each when there is some; the first
    /// carries the tokens they complete.
    fn send_split(&mut self, i: usize, thought: &str, answer: &str) {
        if !thought.is_empty() {
            self.send(i, Some(Piece::Thought(thought)), None);
        }
        if !answer.is_empty() {
            self.send(i, Some(Piece::Answer(answer)), None);
        }
    }

    /// A chunk of choice `i`'s `text` (and `reason`), with the tokens it completes.
    fn send(&mut self, i: usize, text: Option<Piece>, reason: Option<&str>) {
        let c = &mut self.choices[i];
        let logprobs = self.framing.logprobs(&c.tokens, c.sent);
        c.sent += c.tokens.iter().map(|t| t.len).sum::<usize>();
        c.tokens.clear();
        let chunk = self.framing.chunk(i, text, reason, logprobs);
        self.out.push_back(chunk.to_string());
    }

    fn end(&mut self, i: usize, end: &TurnEnd) {
        match outcome(end, self.framing.predicted) {
            Ok((reason, usage)) => {
                self.choices[i].end = Some(usage);
                if let Some((thought, answer)) = self.choices[i].split.as_mut().map(|s| s.finish())
                {
                    self.send_split(i, &thought, &answer);
                }
                self.send(i, None, Some(self.framing.reason(reason)));
                if !self.choices.iter().all(|c| c.end.is_some()) {
                    return;
                }
                if self.include_usage {
                    let chunk = self.framing.usage_chunk(&total(&self.choices));
                    self.out.push_back(chunk.to_string());
                }
            }
            Err(e) => self.out.push_back(e.body().to_string()),
        }
        self.out.push_back("[DONE]".into());
        self.done = true;
    }
}

/// The replies as server-sent events; dropping the stream (the client went away) cancels the
/// turns through the turns' streams it owns.
fn stream(
    framing: Framing,
    turns: Vec<TurnStream>,
    model: Arc<Model>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let choices: Vec<Choice> = turns
        .iter()
        .map(|_| Choice {
            split: framing.reasoning.map(ReasoningParser::stream),
            ..Choice::default()
        })
        .collect();
    let mut first = std::collections::VecDeque::new();
    if let Kind::Chat = framing.kind {
        for i in 0..choices.len() {
            first.push_back(framing.chunk(i, None, None, Value::Null).to_string());
        }
    }
    let state = St {
        framing,
        events: Box::pin(merged(turns)),
        model,
        include_usage,
        out: first,
        done: false,
        choices,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.out.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            let (i, event) = futures_util::StreamExt::next(&mut st.events).await?;
            st.on_event(i, event);
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

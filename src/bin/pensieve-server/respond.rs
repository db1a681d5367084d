//! Answers: a turn's stream of events as one OpenAI response, or as server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use pensieve::engine::{FinishReason, SamplingParams};
use pensieve::model::Model;
use pensieve::service::{Chat, TurnEnd, TurnEvent, TurnStream};
use serde_json::{json, Value};

use crate::api::{ApiError, Common, Usage};
use crate::logprobs::{self, Logprob};
use crate::{now_s, AppState};

/// What a request asks for.
pub enum Job {
    /// A chat turn, continuing the conversation its messages (or name) continue.
    Chat(Chat),
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
}

impl Framing {
    fn new(kind: Kind, model: Arc<str>, request: u64, logprobs: bool) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        };
        Self {
            kind,
            id: format!("{prefix}-{request}"),
            created: now_s(),
            model,
            logprobs,
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

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// A whole response.
    fn whole(&self, text: String, reason: &str, usage: &Usage, tokens: &[Logprob]) -> Value {
        let logprobs = self.logprobs(tokens, 0);
        let choice = match self.kind {
            Kind::Chat => json!({"index": 0, "logprobs": logprobs, "finish_reason": reason,
                "message": {"role": "assistant", "content": text}}),
            Kind::Completion => {
                json!({"index": 0, "logprobs": logprobs, "finish_reason": reason, "text": text})
            }
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created,
            "model": &*self.model, "choices": [choice], "usage": usage.json()})
    }

    /// A stream chunk carrying `text` (and `reason` at the end), or the role on the first;
    /// `logprobs` for the tokens it completes.
    fn chunk(&self, text: Option<&str>, reason: Option<&str>, logprobs: Value) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None if reason.is_none() => json!({"role": "assistant", "content": ""}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            }
            Kind::Completion => json!({"index": 0, "text": text.unwrap_or(""),
                "logprobs": logprobs, "finish_reason": reason}),
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": &*self.model, "choices": [choice], "usage": null})
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
            "model": &*self.model, "choices": [], "usage": usage.json()})
    }
}

/// Submits `job` and answers with its turn, whole or streamed.
pub async fn serve(
    s: AppState,
    job: Job,
    params: SamplingParams,
    common: &Common,
    kind: Kind,
) -> Response {
    let logprobs = params.logprobs.is_some();
    let turn = match job {
        Job::Chat(chat) => s.service.chat(chat, params).await,
        Job::Completion(prompt) => s.service.complete(prompt, params).await,
    };
    let turn = match turn {
        Ok(t) => t,
        Err(e) => return ApiError::from_engine(&e).into_response(),
    };
    let framing = Framing::new(kind, s.model.clone(), turn.request().0, logprobs);
    if common.stream {
        stream(framing, turn, s.tokens, common.include_usage()).into_response()
    } else {
        whole(framing, turn, &s.tokens).await
    }
}

/// OpenAI's finish reason and the usage of a turn that ended with its reply, or the error
/// it is answered with.
fn outcome(end: &TurnEnd) -> Result<(&'static str, Usage), ApiError> {
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
    Ok((reason, Usage::of(end)))
}

/// Collects the reply; dropping the turn's stream cancels it if the client goes away first
/// (axum drops this future).
async fn whole(framing: Framing, mut turn: TurnStream, model: &Model) -> Response {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = turn.next_event().await {
        match event {
            TurnEvent::Token {
                token,
                text: t,
                logprobs,
            } => {
                text.push_str(&t);
                tokens.extend(logprobs.map(|l| Logprob::of(model, token, &l)));
            }
            TurnEvent::Finished(end) => {
                return match outcome(&end) {
                    Ok((reason, usage)) => {
                        Json(framing.whole(text, reason, &usage, &tokens)).into_response()
                    }
                    Err(e) => e.into_response(),
                }
            }
            _ => {}
        }
    }
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped").into_response()
}

/// The reply as server-sent events; dropping the stream (the client went away) cancels the
/// turn through the turn's stream it owns.
fn stream(
    framing: Framing,
    turn: TurnStream,
    model: Arc<Model>,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        framing: Framing,
        turn: TurnStream,
        model: Arc<Model>,
        include_usage: bool,
        out: std::collections::VecDeque<String>,
        done: bool,
        /// Log-probabilities of tokens whose text has not gone out yet.
        tokens: Vec<Logprob>,
        /// Bytes of text sent so far.
        sent: usize,
    }
    impl St {
        /// A chunk of `text` (and `reason`), with the tokens it completes.
        fn send(&mut self, text: Option<&str>, reason: Option<&str>) {
            let logprobs = self.framing.logprobs(&self.tokens, self.sent);
            self.sent += self.tokens.iter().map(|t| t.token.len()).sum::<usize>();
            self.tokens.clear();
            let chunk = self.framing.chunk(text, reason, logprobs);
            self.out.push_back(chunk.to_string());
        }

        fn end(&mut self, end: &TurnEnd) {
            match outcome(end) {
                Ok((reason, usage)) => {
                    self.send(None, Some(reason));
                    if self.include_usage {
                        let chunk = self.framing.usage_chunk(&usage);
                        self.out.push_back(chunk.to_string());
                    }
                }
                Err(e) => self.out.push_back(e.body().to_string()),
            }
            self.out.push_back("[DONE]".into());
            self.done = true;
        }
    }
    let mut first = std::collections::VecDeque::new();
    if let Kind::Chat = framing.kind {
        first.push_back(framing.chunk(None, None, Value::Null).to_string());
    }
    let state = St {
        framing,
        turn,
        model,
        include_usage,
        out: first,
        done: false,
        tokens: Vec::new(),
        sent: 0,
    };
    let events = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.out.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), st));
            }
            if st.done {
                return None;
            }
            match st.turn.next_event().await {
                Some(TurnEvent::Token {
                    token,
                    text,
                    logprobs,
                }) => {
                    let model = st.model.clone();
                    st.tokens
                        .extend(logprobs.map(|l| Logprob::of(&model, token, &l)));
                    if !text.is_empty() {
                        st.send(Some(&text), None);
                    }
                }
                Some(TurnEvent::Finished(end)) => st.end(&end),
                Some(_) => {}
                None => return None,
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

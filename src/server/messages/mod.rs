//! Anthropic's Messages API: `POST /v1/messages` (a reply whole, or streamed with Anthropic's
//! events) and `POST /v1/messages/count_tokens`, on the same sessions as chat: a client that
//! resends its history continues the conversation that holds it, so its KV is reused.
//!
//! Anthropic's prompt cache is what the engine does anyway; `cache_control` breakpoints say
//! for how long a conversation is expected back (their `ttl` becomes the eviction's expected
//! resume), and `usage` reports the cache as Anthropic defines it: `cache_read_input_tokens`
//! are the prompt tokens whose KV the engine reused, `cache_creation_input_tokens` those it
//! computed up to the last breakpoint, `input_tokens` the rest. Errors have Anthropic's shape
//! ([`errors`]).

mod blocks;
pub(super) mod input;

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::chat::{ReasoningStream, ToolDelta};
use crate::engine::FinishReason;
use crate::service::{Chat, Hints, TurnEnd, TurnEvent, TurnStream};

use super::api::{self, Common, Stop};
use super::error::ApiError;
use super::fields::{COUNT_TOKENS_ENDPOINT, MESSAGES_ENDPOINT};
use super::random_id::random_id;
use super::structured::ResponseFormat;
use super::tokens::prompt_tokens;
use super::{check_model_name, tools, AppState};
use blocks::Blocks;
use input::{Breakpoint, Prompt};

/// `POST /v1/messages`.
pub async fn create(State(s): State<AppState>, body: Bytes) -> Response {
    let run = match start(&s, &body).await {
        Ok(run) => run,
        Err(e) => return e.into_response(),
    };
    match run.stream {
        true => stream(run).into_response(),
        false => match finish(run).await {
            Ok(v) => Json(v).into_response(),
            Err(e) => e.into_response(),
        },
    }
}

/// `POST /v1/messages/count_tokens`: the tokens of the prompt a request of these messages,
/// system prompt and tools feeds the model (the template's markup included), which a reply's
/// `usage` splits into input, cache read and cache creation.
pub async fn count_tokens(State(s): State<AppState>, body: Bytes) -> Response {
    let answer = async {
        let request: input::Request =
            api::parse(&body, COUNT_TOKENS_ENDPOINT, s.ignore_unknown_fields)?;
        check_model_name(&s, Some(&request.model))?;
        api::check_template(&s.tokens)?;
        let prompt = request.prompt()?;
        if let Some(bound) = &s.prompt_bound {
            bound.check(prompt.bytes)?;
        }
        let vars = request.template_vars()?;
        let n = prompt_tokens(&s, prompt.messages, prompt.tools, vars, true).await?;
        Ok::<_, ApiError>(json!({"input_tokens": n}))
    };
    match answer.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A reply being made: its turn's events read into content blocks.
struct Run {
    id: String,
    model: String,
    stream: bool,
    turn: TurnStream,
    blocks: Blocks,
    /// With tools offered, the reply's text comes as the service reads it (`Tool` events).
    tools: bool,
    /// Tells the thought from the answer (`--reasoning-parser`).
    split: Option<ReasoningStream>,
    /// Prompt tokens up to the last breakpoint (`usize::MAX`: the whole prompt), if any.
    breakpoint: Option<usize>,
    /// The breakpoints' longest time-to-live: the bucket of `usage.cache_creation`.
    ttl: Option<Duration>,
    /// `max_tokens: 0`: the prompt computed and kept, no reply shown.
    warm_only: bool,
}

/// Checks the request and starts its turn.
async fn start(s: &AppState, body: &[u8]) -> Result<Run, ApiError> {
    let request: input::Request = api::parse(body, MESSAGES_ENDPOINT, s.ignore_unknown_fields)?;
    check_model_name(s, Some(&request.model))?;
    api::check_template(&s.tokens)?;
    let Some(max_tokens) = request.max_tokens else {
        return Err(ApiError::bad("max_tokens: a required field").with_param("max_tokens"));
    };
    let response_format = match request.response_format()? {
        Some(f) => Some(serde_json::from_value::<ResponseFormat>(f).map_err(|e| {
            ApiError::bad(format!("output_config.format: {e}")).with_param("output_config.format")
        })?),
        None => None,
    };
    if let Some(t) = request.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::bad(format!("temperature {t}: in [0, 1]")).with_param("temperature"));
    }
    let common = Common {
        max_tokens: Some(max_tokens.max(1)),
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: request.top_k,
        stop: Some(Stop::Many(request.stop_sequences.clone())),
        response_format,
        ..Common::default()
    };
    let mut params = common.params(s.default_max_tokens, s.tokens.generation_defaults())?;
    let Prompt {
        messages,
        tools: offered,
        choice,
        parallel,
        breakpoint,
        ttl,
        bytes,
    } = request.prompt()?;
    if let Some(bound) = &s.prompt_bound {
        bound.check(bytes)?;
    }
    let format = s.tokens.template().and_then(|t| t.tool_format());
    let (tools, forced) = tools::offered(&offered, choice.as_ref(), format)?;
    params.text_only = tools::text_only(choice.as_ref());
    tools::hold(&mut params, forced, &tools, format)?;
    let vars = request.template_vars()?;
    // Tokens up to a breakpoint before the last message, counted as the template renders
    // that far; one in the last message covers the whole prompt.
    let last = messages.len() - 1;
    let breakpoint = match breakpoint {
        None => None,
        Some(Breakpoint::Message(i)) if i >= last => Some(usize::MAX),
        Some(at) => {
            let upto = match at {
                Breakpoint::Tools => Vec::new(),
                Breakpoint::Message(i) => messages[..=i].to_vec(),
            };
            let counted = prompt_tokens(s, upto, tools.clone(), vars.clone(), false).await;
            // A template that renders nothing of tools alone: no tokens before the messages.
            Some(counted.unwrap_or(0))
        }
    };
    let with_tools = !tools.is_empty() && !params.text_only;
    let hints = Hints {
        expect_resume: ttl,
        ..Hints::default()
    };
    let chat = Chat::new(messages)
        .with_tools(tools)
        .with_template_vars(vars)
        .with_hints(hints);
    let turn = (s.service.chat(chat, params).await).map_err(|e| ApiError::from_engine(&e))?;
    Ok(Run {
        id: random_id("msg_")?,
        model: s.model.to_string(),
        stream: request.stream,
        turn,
        blocks: Blocks::new(parallel),
        tools: with_tools,
        split: s.reasoning.map(|p| p.stream()),
        breakpoint,
        ttl,
        warm_only: max_tokens == 0,
    })
}

impl Run {
    /// Reads one event of the turn into the blocks; its end when the turn ended.
    fn read(&mut self, event: TurnEvent) -> Option<TurnEnd> {
        match event {
            TurnEvent::Finished(end) => {
                if let Some((thought, answer)) = self.split.as_mut().map(|s| s.finish()) {
                    self.blocks.thought(&thought);
                    self.blocks.answer(&answer);
                }
                self.blocks.finish();
                return Some(end);
            }
            _ if self.warm_only => {}
            TurnEvent::Token { text, .. } if !self.tools => self.text(&text),
            TurnEvent::Token { .. } => {}
            TurnEvent::Tool(ToolDelta::Text(text)) => self.text(&text),
            TurnEvent::Tool(ToolDelta::Call { index, id, name }) => {
                self.blocks.call(index, &id, &name)
            }
            TurnEvent::Tool(ToolDelta::Arguments { index, fragment }) => {
                self.blocks.arguments(index, &fragment)
            }
        }
        None
    }

    /// Text of the reply, its thought told from its answer.
    fn text(&mut self, text: &str) {
        match self.split.as_mut().map(|s| s.push(text)) {
            Some((thought, answer)) => {
                self.blocks.thought(&thought);
                self.blocks.answer(&answer);
            }
            None => self.blocks.answer(text),
        }
    }

    /// Why the reply ended, and the stop sequence that ended it.
    fn stop(&self, end: &TurnEnd) -> (&'static str, Option<String>) {
        if self.warm_only {
            return ("max_tokens", None);
        }
        if self.blocks.calls() {
            return ("tool_use", None);
        }
        match end.reason {
            FinishReason::StopString => ("stop_sequence", end.stats.stop_string.clone()),
            FinishReason::Length => ("max_tokens", None),
            FinishReason::ContextFull => ("model_context_window_exceeded", None),
            _ => ("end_turn", None),
        }
    }

    /// `usage` as Anthropic defines it: every prompt token is read from the cache, written
    /// to it (computed up to the last breakpoint), or plain input.
    fn usage(&self, end: &TurnEnd) -> Value {
        let total = end.stats.history_tokens + end.stats.prompt_tokens;
        let read = end.stats.reused_tokens.min(total);
        let created = (self.breakpoint).map_or(0, |b| b.min(total).saturating_sub(read));
        let hour = self.ttl.is_some_and(|t| t >= Duration::from_secs(3600));
        let output = match self.warm_only {
            true => 0,
            false => end.stats.output_tokens,
        };
        json!({"input_tokens": total - read - created,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": if hour { 0 } else { created },
                "ephemeral_1h_input_tokens": if hour { created } else { 0 }},
            "output_tokens": output, "service_tier": "standard"})
    }

    /// The message, `content` and `usage` not yet known.
    fn message(&self) -> Value {
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}})
    }

    /// The finished message.
    fn finished(&self, end: &TurnEnd) -> Value {
        let (reason, sequence) = self.stop(end);
        let mut m = self.message();
        m["content"] = json!(self.blocks.content());
        m["stop_reason"] = json!(reason);
        m["stop_sequence"] = json!(sequence);
        m["usage"] = self.usage(end);
        m
    }
}

/// The finished message of `run`, or the error its turn ended with.
async fn finish(mut run: Run) -> Result<Value, ApiError> {
    while let Some(event) = run.turn.next_event().await {
        if let Some(end) = run.read(event) {
            return ApiError::of_end(&end).map(|()| run.finished(&end));
        }
    }
    Err(ApiError::engine_stopped())
}

/// The reply as Anthropic streams it: `message_start`, a `ping`, each block's start, deltas
/// and stop, `message_delta` (the stop reason and the whole usage), `message_stop`; a failure
/// after the start is an `error` event.
fn stream(run: Run) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        run: Run,
        out: std::collections::VecDeque<SseEvent>,
        done: bool,
    }
    impl St {
        fn event(&mut self, data: Value) {
            let kind = data["type"].as_str().unwrap_or_default().to_string();
            let event = SseEvent::default().event(kind).data(data.to_string());
            self.out.push_back(event);
        }
    }
    let mut st = St {
        run,
        out: Default::default(),
        done: false,
    };
    let start = st.run.message();
    st.event(json!({"type": "message_start", "message": start}));
    st.event(json!({"type": "ping"}));
    let events = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let Some(event) = st.run.turn.next_event().await else {
                st.done = true;
                st.event(anthropic_body(&ApiError::engine_stopped()));
                continue;
            };
            let end = st.run.read(event);
            for e in st.run.blocks.take_events() {
                st.event(e);
            }
            let Some(end) = end else { continue };
            st.done = true;
            match ApiError::of_end(&end) {
                Ok(()) => {
                    let (reason, sequence) = st.run.stop(&end);
                    let usage = st.run.usage(&end);
                    st.event(json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage}));
                    st.event(json!({"type": "message_stop"}));
                }
                Err(e) => st.event(anthropic_body(&e)),
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// Anthropic's name of an error's kind, by its status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// An error as Anthropic's body (and stream event) has it.
fn anthropic_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}})
}

/// Answers every error of the Messages routes (the handlers', the API key's, the body's
/// limits) in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, which its
/// clients read; the OpenAI routes keep OpenAI's.
pub async fn errors(request: Request, next: Next) -> Response {
    if !request.uri().path().starts_with("/v1/messages") {
        return next.run(request).await;
    }
    let response = next.run(request).await;
    let status = response.status();
    if status.is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 16)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let body = anthropic_body(&ApiError::new(status, message)).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}

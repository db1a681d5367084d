//! OpenAI's Responses API on named conversations: `POST /v1/responses` (text in and out,
//! whole or as its stream of events), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A stored response is the conversation it ends, named by the response's id, so it lives in
//! the engine's store as any named conversation does: `previous_response_id` finds it on
//! whichever server of a fleet the request lands (from the shared store when this one does
//! not hold it). A response continues its previous one on a conversation of its own, opened
//! with the previous one's transcript, whose KV it shares by content: the previous response
//! stays as it was, so another request may branch from it too.

use std::convert::Infallible;
use std::time::Duration;

use crate::engine::{ConversationId, FinishReason};
use crate::model::Message;
use crate::service::{Chat, TurnEnd, TurnEvent, TurnStream};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{self, Common, Usage};
use super::error::ApiError;
use super::{check_model_name, now_s, AppState};

/// The fields a `POST /v1/responses` body may have.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "metadata",
    "tools",
];

#[derive(Deserialize)]
struct Request {
    model: Option<String>,
    input: Input,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    #[serde(default = "yes")]
    store: bool,
    #[serde(default)]
    stream: bool,
    max_output_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    metadata: Option<Value>,
    #[serde(default)]
    tools: Vec<Value>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// An input item: a message (`{"role", "content"}`, with or without `"type": "message"`).
#[derive(Deserialize)]
struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<String>,
    content: Option<Content>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Item {
    fn message(&self) -> Result<Message, ApiError> {
        if self.kind.as_deref().is_some_and(|k| k != "message") {
            return Err(ApiError::bad(format!(
                "input items of type {:?} are not supported: messages only",
                self.kind.as_deref().unwrap_or_default()
            )));
        }
        let role = match self.role.as_deref() {
            Some("developer" | "system") => "system",
            Some(r @ ("user" | "assistant")) => r,
            other => return Err(ApiError::bad(format!("an input message's role {other:?}"))),
        };
        let text = match &self.content {
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("input_text" | "output_text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad(format!(
                                "content parts of type {kind:?} are not supported: text only"
                            )))
                        }
                    }
                }
                text
            }
            None => return Err(ApiError::bad("an input message needs content")),
        };
        Ok(Message::new(role, text))
    }
}

/// A new response's id.
fn new_id(prefix: &str) -> String {
    let mut h = blake3::Hasher::new();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.update(&now.map_or(0, |d| d.as_nanos()).to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    h.update(
        &NEXT
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_le_bytes(),
    );
    format!("{prefix}_{}", &h.finalize().to_hex()[..32])
}

fn missing(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no stored response {id:?}"))
}

/// The conversation of the stored response `id` (a 404 when there is none).
async fn stored(s: &AppState, id: &str) -> Result<ConversationId, ApiError> {
    if !id.starts_with("resp_") {
        return Err(missing(id));
    }
    s.service.resume(id).await.map_err(|_| missing(id))
}

/// The transcript of the stored response `id`.
async fn transcript(s: &AppState, id: &str) -> Result<Vec<Message>, ApiError> {
    let conv = stored(s, id).await?;
    let messages = s
        .service
        .with_engine(move |e| e.messages(conv).map(<[_]>::to_vec))
        .await;
    match messages {
        Ok(Ok(m)) => Ok(m),
        _ => Err(missing(id)),
    }
}

/// `POST /v1/responses`.
pub async fn create(State(s): State<AppState>, body: Bytes) -> Response {
    match start(&s, &body).await {
        Ok((framing, turn)) if framing.stream => stream(framing, turn).into_response(),
        Ok((framing, turn)) => whole(framing, turn).await,
        Err(e) => e.into_response(),
    }
}

/// What a response echoes of its request, and its ids.
struct Framing {
    id: String,
    item: String,
    created: u64,
    model: String,
    request: Value,
    stream: bool,
}

impl Framing {
    /// The response object, `status` and its output text so far.
    fn object(&self, status: &str, text: Option<&str>, end: Option<&TurnEnd>) -> Value {
        let output: Vec<Value> = text
            .map(|t| self.message(t, "completed"))
            .into_iter()
            .collect();
        let usage = end.map(|e| {
            let u = Usage::of(e);
            json!({"input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens})
        });
        let incomplete = end
            .filter(|e| matches!(e.reason, FinishReason::Length | FinishReason::ContextFull))
            .map(|_| json!({"reason": "max_output_tokens"}));
        let status = if incomplete.is_some() {
            "incomplete"
        } else {
            status
        };
        let mut v = json!({"id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output, "usage": usage,
            "incomplete_details": incomplete, "error": null, "parallel_tool_calls": false,
            "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}});
        if let (Some(o), Some(r)) = (v.as_object_mut(), self.request.as_object()) {
            o.extend(r.clone());
        }
        v
    }

    /// The output message item.
    fn message(&self, text: &str, status: &str) -> Value {
        json!({"id": self.item, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }
}

/// Checks the request, finds its history, and starts its turn.
async fn start(s: &AppState, body: &[u8]) -> Result<(Framing, TurnStream), ApiError> {
    let request: Request = api::parse_only(body, FIELDS)?;
    check_model_name(s, request.model.as_deref())?;
    api::check_template(&s.tokens)?;
    if !request.tools.is_empty() {
        return Err(ApiError::bad(
            "tools are not supported on /v1/responses yet: /v1/chat/completions takes them",
        ));
    }
    let common = Common {
        max_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        ..Common::default()
    };
    let params = common.params(s.default_max_tokens, s.tokens.generation_defaults())?;
    let mut messages = match &request.previous_response_id {
        Some(prev) => transcript(s, prev).await?,
        None => Vec::new(),
    };
    // Instructions are the system message: new ones replace those the history began with.
    if let Some(instructions) = &request.instructions {
        if messages.first().is_some_and(|m| m.role == "system") {
            messages.remove(0);
        }
        messages.insert(0, Message::new("system", instructions.clone()));
    }
    match &request.input {
        Input::Text(t) => messages.push(Message::new("user", t.clone())),
        Input::Items(items) => {
            for item in items {
                messages.push(item.message()?);
            }
        }
    }
    let id = new_id("resp");
    let mut chat = Chat::new(messages);
    if request.store {
        chat.name = Some(id.clone());
    }
    let turn = (s.service.chat(chat, params).await).map_err(|e| ApiError::from_engine(&e))?;
    let echo = json!({"previous_response_id": request.previous_response_id,
        "instructions": request.instructions, "store": request.store,
        "temperature": request.temperature, "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens, "metadata": request.metadata});
    let framing = Framing {
        id,
        item: new_id("msg"),
        created: now_s(),
        model: s.model.to_string(),
        request: echo,
        stream: request.stream,
    };
    Ok((framing, turn))
}

/// The end of a turn as the response's status, or the error it is answered with.
fn ended(end: &TurnEnd) -> Result<(), ApiError> {
    match &end.reason {
        FinishReason::Failed(e) => Err(ApiError::from_failed_turn(e)),
        FinishReason::Cancelled => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the response was cancelled",
        )),
        _ => Ok(()),
    }
}

async fn whole(framing: Framing, turn: TurnStream) -> Response {
    match turn.reply().await {
        Ok(reply) => match ended(&reply.end) {
            Ok(()) => {
                let object = framing.object("completed", Some(&reply.text), Some(&reply.end));
                Json(object).into_response()
            }
            Err(e) => e.into_response(),
        },
        Err(e) => ApiError::from_engine(&e).into_response(),
    }
}

/// The response's events, as the Responses API streams them.
fn stream(
    framing: Framing,
    turn: TurnStream,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        framing: Framing,
        turn: TurnStream,
        text: String,
        sequence: u64,
        out: std::collections::VecDeque<SseEvent>,
        done: bool,
    }
    impl St {
        fn event(&mut self, kind: &str, mut data: Value) {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
            self.out
                .push_back(SseEvent::default().event(kind).data(data.to_string()));
        }
        fn part(&self, extra: Value) -> Value {
            let mut v = json!({"item_id": self.framing.item, "output_index": 0,
                "content_index": 0});
            if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
                o.extend(e);
            }
            v
        }
    }
    let mut st = St {
        framing,
        turn,
        text: String::new(),
        sequence: 0,
        out: Default::default(),
        done: false,
    };
    let created = st.framing.object("in_progress", None, None);
    st.event("response.created", json!({"response": created}));
    st.event("response.in_progress", json!({"response": created}));
    let item = json!({"id": st.framing.item, "type": "message", "status": "in_progress",
        "role": "assistant", "content": []});
    st.event(
        "response.output_item.added",
        json!({"output_index": 0, "item": item}),
    );
    let part = st.part(json!({"part": {"type": "output_text", "text": "", "annotations": []}}));
    st.event("response.content_part.added", part);
    let events = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            match st.turn.next_event().await {
                Some(TurnEvent::Token { text, .. }) if !text.is_empty() => {
                    st.text.push_str(&text);
                    let delta = st.part(json!({"delta": text, "logprobs": []}));
                    st.event("response.output_text.delta", delta);
                }
                Some(TurnEvent::Finished(end)) => {
                    st.done = true;
                    if let Err(e) = ended(&end) {
                        st.event(
                            "error",
                            json!({"code": e.status.as_u16(),
                            "message": e.message, "param": null}),
                        );
                        continue;
                    }
                    let text = st.text.clone();
                    let done = st.part(json!({"text": text, "logprobs": []}));
                    st.event("response.output_text.done", done);
                    let part = st.part(json!({"part": {"type": "output_text", "text": text,
                        "annotations": []}}));
                    st.event("response.content_part.done", part);
                    let item = st.framing.message(&text, "completed");
                    st.event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": item}),
                    );
                    let object = st.framing.object("completed", Some(&text), Some(&end));
                    st.event("response.completed", json!({"response": object}));
                }
                Some(_) => {}
                None => return None,
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// `GET /v1/responses/{id}`: a stored response, from its conversation's transcript (its
/// output is the conversation's last reply; usage is not kept).
pub async fn retrieve(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let messages = match transcript(&s, &id).await {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let text = messages
        .last()
        .filter(|m| m.role == "assistant")
        .map(|m| m.content.clone());
    let framing = Framing {
        item: format!("msg_{}", id.trim_start_matches("resp_")),
        id,
        created: now_s(),
        model: s.model.to_string(),
        request: json!({}),
        stream: false,
    };
    Json(framing.object("completed", text.as_deref(), None)).into_response()
}

/// `DELETE /v1/responses/{id}`: the stored response's conversation is closed and removed.
pub async fn delete(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let conv = match stored(&s, &id).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match s.service.close(conv).await {
        Ok(()) => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        Err(e) => ApiError::from_engine(&e).into_response(),
    }
}

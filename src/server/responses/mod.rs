//! OpenAI's Responses API on named conversations: `POST /v1/responses` (text in and out,
//! whole or as its stream of events), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A stored response is the conversation it ends, named by the response's id, so it lives in
//! the engine's store as any named conversation does: `previous_response_id` finds it on
//! whichever server of a fleet the request lands (from the shared store when this one does
//! not hold it). A response continues its previous one on a conversation of its own, opened
//! with the previous one's transcript, whose KV it shares by content: the previous response
//! stays as it was, so another request may branch from it too.

mod background;
pub(super) mod compact;
pub(super) mod input;
mod output;
pub(super) mod socket;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use crate::chat::{ReasoningStream, ToolDelta};
use crate::engine::{ConversationId, FinishReason, OverflowPolicy};
use crate::model::{Message, Model};
use crate::service::{Change, Chat, Record, TurnEnd, TurnEvent, TurnStream};
use crate::ErrorKind;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::api::{self, Common, Usage};
use super::auth::Tenant;
use super::error::ApiError;
use super::fields::RESPONSES_ENDPOINT;
use super::logprobs::{self, Logprob};
use super::random_id::random_id;
use super::tokens::prompt_tokens;
use super::{check_model_name, conversations, now_s, tools, AppState};
use input::Request;
use output::Output;

fn missing(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no stored response {id:?}"))
}

/// The conversation of `tenant`'s stored response `id`: a 404 when there is none, the
/// store's failure (a 503 while it is unreachable) when it cannot tell.
async fn stored(s: &AppState, tenant: &Tenant, id: &str) -> Result<ConversationId, ApiError> {
    if !id.starts_with("resp_") {
        return Err(missing(id));
    }
    let resumed = s.service.resume(&tenant.name(id)).await;
    resumed.map_err(|e| match e.kind() {
        ErrorKind::NotFound => missing(id),
        _ => ApiError::from_engine(&e),
    })
}

/// The transcript of `tenant`'s stored response `id`.
async fn transcript(s: &AppState, tenant: &Tenant, id: &str) -> Result<Vec<Message>, ApiError> {
    let conv = stored(s, tenant, id).await?;
    s.service.messages(conv).await.map_err(|_| missing(id))
}

/// Puts `instructions` first in `messages` as their system message, in place of the one they
/// began with. Returns whether that changed them.
fn instruct(messages: &mut Vec<Message>, instructions: Option<&String>) -> bool {
    let Some(instructions) = instructions else {
        return false;
    };
    let same = messages.first().filter(|m| m.role == "system");
    if same.is_some_and(|m| m.content == *instructions) {
        return false;
    }
    if same.is_some() {
        messages.remove(0);
    }
    messages.insert(0, Message::new("system", instructions.clone()));
    true
}

/// `POST /v1/responses`.
pub async fn create(State(s): State<AppState>, tenant: Tenant, body: Bytes) -> Response {
    let run = match start(&s, &tenant, &body, Keep::AsAsked).await {
        Ok(run) => run,
        Err(e) => return e.into_response(),
    };
    let rewrites = run.turn.rewrites();
    let mut response = match &run.framing {
        f if f.stream => stream(run, s.clone(), tenant).into_response(),
        f if f.background => in_background(&s, &tenant, run),
        _ => match finish(run).await {
            Ok((object, window)) => {
                keep_outcome(&s, &tenant, &object, window).await;
                Json(object).into_response()
            }
            Err(e) => e.into_response(),
        },
    };
    if rewrites {
        let yes = axum::http::HeaderValue::from_static("true");
        response
            .headers_mut()
            .insert(super::respond::REWRITTEN, yes);
    }
    response
}

pub use background::Background;

/// Answers `run` at once, `in_progress`, and runs its turn on: polled by `GET`, cancelled by
/// `POST .../cancel`.
fn in_background(s: &AppState, tenant: &Tenant, run: Run) -> Response {
    let object = run.framing.object("in_progress", Vec::new(), None);
    let name = tenant.name(&run.framing.id);
    let failed = {
        let mut o = object.clone();
        o["status"] = json!("failed");
        o
    };
    let table = s.background.clone();
    let ended = name.clone();
    let (app, owner) = (s.clone(), tenant.clone());
    let task = tokio::spawn(async move {
        let object = match finish(run).await {
            Ok((object, window)) => {
                keep_outcome(&app, &owner, &object, window).await;
                object
            }
            Err(e) => {
                let mut o = failed;
                o["error"] = json!({"code": e.response_code(), "message": e.message});
                o
            }
        };
        table.ended(&ended, object);
    });
    s.background
        .started(name, object.clone(), task.abort_handle());
    Json(object).into_response()
}

/// What a stored response's `GET` reports beside its output, kept with its conversation's
/// attributes: its creation time, status, why it is incomplete, and usage. A failure to keep
/// them is logged, not answered: the turn itself is stored (its `GET` then reports it
/// `completed`, made when asked). A compaction's response keeps the compacted `window` as its
/// conversation's history, which the next response continues.
async fn keep_outcome(s: &AppState, tenant: &Tenant, object: &Value, window: Option<Vec<Message>>) {
    let stored = object["store"] == true && object.get("conversation").is_none();
    let Some(id) = object["id"].as_str().filter(|_| stored) else {
        return;
    };
    let outcome = json!({"created_at": object["created_at"], "status": object["status"],
        "incomplete_details": object["incomplete_details"], "usage": object["usage"]});
    let name = tenant.name(id);
    let edited = s.service.edit(&name, move |record| {
        let mut attributes = record.map(|r| r.attributes.clone()).unwrap_or_default();
        attributes.insert(OUTCOME.into(), outcome.clone());
        let change = match &window {
            Some(w) => Change::Rewrite(Record::new(w.clone(), attributes)),
            None => Change::Attributes(attributes),
        };
        Ok::<_, Infallible>((change, ()))
    });
    if let Err(e) = edited.await {
        tracing::warn!(response = id, error = %e, "a stored response's status was not kept");
    }
}

/// The attribute of a stored response's conversation that [`keep_outcome`] writes.
const OUTCOME: &str = "response";

/// `POST /v1/responses/{id}/cancel`: a background response is cancelled; one that ended is
/// answered as it ended.
pub async fn cancel(State(s): State<AppState>, tenant: Tenant, Path(id): Path<String>) -> Response {
    match s.background.cancel(&tenant.name(&id)) {
        Some(object) => Json(object).into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no background response {id:?}"),
        )
        .into_response(),
    }
}

/// What a response echoes of its request, and its id.
struct Framing {
    id: String,
    created: u64,
    model: String,
    request: Value,
    stream: bool,
    /// Answered at once and run on (`background: true`).
    background: bool,
}

impl Framing {
    /// The response object with `status`, its `output` items, and its `usage` once known.
    fn object(&self, status: &str, output: Vec<Value>, usage: Option<Value>) -> Value {
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        let mut v = json!({"id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output, "usage": usage,
            "incomplete_details": incomplete, "error": null, "parallel_tool_calls": true,
            "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}});
        if let (Some(o), Some(r)) = (v.as_object_mut(), self.request.as_object()) {
            o.extend(
                r.iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k.clone(), v.clone())),
            );
        }
        v
    }
}

/// A response's status at the end of its turn.
fn status(end: &TurnEnd) -> &'static str {
    match end.reason {
        FinishReason::Length | FinishReason::ContextFull => "incomplete",
        _ => "completed",
    }
}

/// A response being made: its turn's events read into output items.
struct Run {
    framing: Framing,
    turn: TurnStream,
    output: Output,
    /// With tools offered, the reply's text comes as the service reads it (`Tool` events).
    tools: bool,
    /// Tells the thought from the answer (`--reasoning-parser`).
    split: Option<ReasoningStream>,
    /// The same, token by token, to count the reply's tokens before its answer began.
    counter: Option<ReasoningStream>,
    answered: bool,
    reasoning_tokens: usize,
    /// With `include` of the answer's log-probabilities: the model that names the tokens,
    /// and those of the tokens whose text is not yet in the output.
    logprobs: Option<Arc<Model>>,
    pending: Vec<Logprob>,
    /// A compaction's turn (`compaction_trigger`): the history it summarizes; the reply's
    /// text is the summary, answered as a compaction item.
    compacting: Option<Vec<Message>>,
    summary: String,
}

impl Run {
    /// Reads one event of the turn into the output; its end when the turn ended.
    fn on_event(&mut self, event: TurnEvent) -> Option<TurnEnd> {
        match event {
            TurnEvent::Token { text, .. } if self.compacting.is_some() => {
                self.summary.push_str(&text)
            }
            TurnEvent::Tool(_) if self.compacting.is_some() => {}
            TurnEvent::Finished(end) if self.compacting.is_some() => {
                let summary = compact::answer(self.split.as_mut(), &self.summary);
                self.summary = summary;
                self.output.compaction(&compact::content(&self.summary));
                return Some(end);
            }
            TurnEvent::Token {
                token,
                text,
                logprobs,
            } => {
                if let (Some(model), Some(l)) = (&self.logprobs, logprobs) {
                    self.pending.push(Logprob::of(model, token, &l, false));
                }
                self.count(&text);
                if !self.tools {
                    self.text(&text);
                }
            }
            TurnEvent::Tool(ToolDelta::Text(text)) => self.text(&text),
            // A call's tokens are not the answer's: their log-probabilities are dropped.
            TurnEvent::Tool(ToolDelta::Call { index, id, name }) => {
                self.pending.clear();
                self.output.call(index, &id, &name)
            }
            TurnEvent::Tool(ToolDelta::Arguments { index, fragment }) => {
                self.pending.clear();
                self.output.arguments(index, &fragment)
            }
            TurnEvent::Finished(end) => {
                if let Some((thought, answer)) = self.split.as_mut().map(|s| s.finish()) {
                    self.output.thought(&thought);
                    self.output.answer(&answer);
                }
                self.output.finish(status(&end));
                return Some(end);
            }
        }
        None
    }

    /// Text of the reply, its thought told from its answer; the answer's text carries the
    /// log-probabilities of the tokens read since the last (a thought's are dropped).
    fn text(&mut self, text: &str) {
        let (thought, answer) = match self.split.as_mut().map(|s| s.push(text)) {
            Some(split) => split,
            None => (String::new(), text.to_string()),
        };
        self.output.thought(&thought);
        if !answer.is_empty() || !thought.is_empty() {
            let logprobs = logprobs::entries(&std::mem::take(&mut self.pending));
            self.output.answer_with(&answer, logprobs);
        }
    }

    /// Counts a token of the thought: one of a reply with a thought, before its answer began.
    fn count(&mut self, text: &str) {
        let Some(counter) = self.counter.as_mut() else {
            return;
        };
        let (_, answer) = counter.push(text);
        if counter.thought_seen() && !self.answered {
            self.reasoning_tokens += 1;
        }
        self.answered |= !answer.is_empty();
    }

    /// The history a compaction's response leaves: its window.
    fn window(&self) -> Option<Vec<Message>> {
        (self.compacting.as_ref()).map(|history| compact::window(history, &self.summary))
    }

    /// The finished response object.
    fn object(&self, end: &TurnEnd) -> Value {
        let u = Usage::of(end);
        let usage = json!({"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens});
        let status = status(end);
        (self.framing).object(status, self.output.items(status), Some(usage))
    }
}

/// Under which name a response's conversation is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keep {
    /// Its id when `store` says so (over HTTP).
    AsAsked,
    /// Its id in any case, for the socket's life (a `store: false` response on a socket).
    ForTheSocket,
}

/// Checks the request, finds its history, and starts its turn.
async fn start(s: &AppState, tenant: &Tenant, body: &[u8], keep: Keep) -> Result<Run, ApiError> {
    let mut request: Request = api::parse(body, RESPONSES_ENDPOINT, s.ignore_unknown_fields)?;
    input::check_include(&request.include)?;
    if request.background && request.stream {
        return Err(ApiError::bad(
            "a background response is polled here: give background or stream, not both",
        ));
    }
    if request.background && (!request.store || request.conversation.is_some()) {
        return Err(ApiError::bad(
            "a background response is stored under its id: it needs store (and no conversation)",
        ));
    }
    check_model_name(s, request.model.as_deref())?;
    api::check_template(&s.tokens)?;
    let common = Common {
        max_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        response_format: input::response_format(request.text.as_ref())?,
        guided: std::mem::take(&mut request.guided),
        ..Common::default()
    };
    let mut params = common.params(s.default_max_tokens, s.tokens.generation_defaults())?;
    let logprobs = request.include.iter().any(|v| v == input::LOGPROBS);
    params.logprobs = api::top_logprobs(logprobs, request.top_logprobs)?;
    params.overflow = match request.truncation.as_deref() {
        None => None,
        Some("auto") => Some(OverflowPolicy::DropOldest),
        Some("disabled") => Some(OverflowPolicy::Error),
        Some(other) => {
            return Err(ApiError::bad(format!(
                "truncation {other:?}: \"auto\" or \"disabled\""
            )))
        }
    };
    let format = s.tokens.template().and_then(|t| t.tool_format());
    let choice = input::chat_tool_choice(request.tool_choice.as_ref())?;
    let offered = input::chat_tools(&request.tools)?;
    let (tools, forced) = tools::offered(&offered, choice.as_ref(), format)?;
    params.text_only = tools::text_only(choice.as_ref());
    tools::hold(&mut params, forced, &tools, format)?;
    let (conversation, mut messages) = match (&request.previous_response_id, &request.conversation)
    {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad(
                "previous_response_id and conversation cannot both be given",
            ))
        }
        (Some(prev), None) => (None, transcript(s, tenant, prev).await?),
        (None, Some(c)) => {
            let (id, messages) = conversations::continued(s, tenant, c).await?;
            (Some(id), messages)
        }
        (None, None) => (None, Vec::new()),
    };
    let history = messages.len();
    let mut rewritten = instruct(&mut messages, request.instructions.as_ref());
    request.input.append_to(&mut messages)?;
    let trigger = request.input.compaction_trigger()?;
    if trigger && conversation.is_some() {
        return Err(ApiError::bad(
            "a compaction_trigger compacts a response's context: not a conversation's",
        ));
    }
    let effort = request.reasoning.as_ref().and_then(|r| r.effort.as_deref());
    let vars = api::template_vars(request.chat_template_kwargs.as_ref(), effort);
    let window = s.tokens.config().max_position_embeddings;
    let mut compaction = None;
    let threshold = compact::threshold(request.context_management.as_ref(), window)?;
    if let Some(threshold) = threshold.filter(|_| !trigger) {
        let n = prompt_tokens(s, messages.clone(), tools.clone(), vars.clone(), true).await?;
        let compacted = match n > threshold {
            true => compact::before_turn(s, &messages, tools.clone(), vars.clone()).await?,
            false => None,
        };
        if let Some((window, c)) = compacted {
            messages = window;
            rewritten = true;
            compaction = Some(c);
        }
    }
    // A named conversation's turn of new messages alone (users', tools' results) continues
    // it, whatever its history ends with (items added without a turn): the history goes
    // along only when the request changes it.
    let new = |m: &Message| m.role == "user" || m.role == "tool";
    if conversation.is_some() && !rewritten && messages[history..].iter().all(new) {
        messages.drain(..history);
    }
    // A compaction's turn: the summary of the context (tools stay listed, as the context
    // rendered them, so its KV is found by content; no call is read).
    let compacting = trigger.then(|| messages.clone());
    if trigger {
        messages.push(compact::prompt());
        params = compact::params(s)?;
        params.text_only = true;
    }
    let id = random_id("resp_")?;
    let with_tools = !tools.is_empty() && !params.text_only;
    let mut chat = Chat::new(messages)
        .with_tools(tools)
        .with_template_vars(vars);
    // A conversation's turn continues it under its own name; else a stored response is the
    // conversation of its id.
    chat.name = match &conversation {
        Some(c) => Some(tenant.name(c)),
        None => (request.store || keep == Keep::ForTheSocket).then(|| tenant.name(&id)),
    };
    // A conversation deleted since it was read is not made anew by its turn.
    chat.existing = conversation.is_some();
    let turn = s
        .service
        .chat(chat, params)
        .await
        .map_err(|e| match &conversation {
            Some(c) if e.kind() == ErrorKind::NotFound => conversations::missing(c),
            _ => ApiError::from_engine(&e),
        })?;
    let parallel = request.parallel_tool_calls.unwrap_or(true);
    let echo = json!({"previous_response_id": request.previous_response_id,
        "instructions": request.instructions, "store": request.store,
        "truncation": request.truncation, "background": request.background,
        "temperature": request.temperature, "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens, "metadata": request.metadata,
        "tools": request.tools, "tool_choice": request.tool_choice,
        "parallel_tool_calls": parallel, "text": request.text,
        "conversation": conversation.map(|c| json!({"id": c}))});
    let framing = Framing {
        id,
        created: now_s(),
        model: s.model.to_string(),
        request: echo,
        stream: request.stream,
        background: request.background,
    };
    let mut output = Output::new(parallel, &framing.id);
    if let Some(c) = &compaction {
        output.compaction(&c.content());
    }
    Ok(Run {
        output,
        framing,
        turn,
        tools: with_tools,
        split: s.reasoning.map(|p| p.stream()),
        counter: s.reasoning.map(|p| p.stream()),
        answered: false,
        reasoning_tokens: 0,
        logprobs: logprobs.then(|| Arc::clone(&s.tokens)),
        pending: Vec::new(),
        compacting,
        summary: String::new(),
    })
}

/// The finished response object of `run` (and the history a compaction leaves), or the error
/// its turn ended with.
async fn finish(mut run: Run) -> Result<(Value, Option<Vec<Message>>), ApiError> {
    while let Some(event) = run.turn.next_event().await {
        if let Some(end) = run.on_event(event) {
            return ApiError::of_end(&end).map(|()| (run.object(&end), run.window()));
        }
    }
    Err(ApiError::engine_stopped())
}

/// The response's events, as the Responses API streams them.
fn stream(
    run: Run,
    s: AppState,
    tenant: Tenant,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let events = events(run, s, tenant).map(|data| {
        let kind = data["type"].as_str().unwrap_or_default().to_string();
        Ok(SseEvent::default().event(kind).data(data.to_string()))
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// The response's events, numbered, as the HTTP stream and a socket carry them: created, in
/// progress, each output item's, then completed (or incomplete, or an error).
fn events(run: Run, s: AppState, tenant: Tenant) -> impl futures_util::Stream<Item = Value> {
    struct St {
        run: Run,
        sequence: u64,
        out: std::collections::VecDeque<Value>,
        done: bool,
        /// Where the finished response's outcome is kept ([`keep_outcome`]).
        s: AppState,
        tenant: Tenant,
    }
    impl St {
        fn event(&mut self, mut data: Value) {
            data["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
            self.out.push_back(data);
        }
        fn error(&mut self, e: &ApiError) {
            self.done = true;
            self.event(
                json!({"type": "error", "code": e.code(), "message": e.message,
                "param": e.param}),
            );
        }
    }
    let mut st = St {
        run,
        sequence: 0,
        out: Default::default(),
        done: false,
        s,
        tenant,
    };
    let created = st.run.framing.object("in_progress", Vec::new(), None);
    st.event(json!({"type": "response.created", "response": created}));
    st.event(json!({"type": "response.in_progress", "response": created}));
    futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.out.pop_front() {
                return Some((e, st));
            }
            if st.done {
                return None;
            }
            let Some(event) = st.run.turn.next_event().await else {
                st.error(&ApiError::engine_stopped());
                continue;
            };
            let end = st.run.on_event(event);
            for e in st.run.output.take_events() {
                st.event(e);
            }
            if let Some(end) = end {
                match ApiError::of_end(&end) {
                    Ok(()) => {
                        st.done = true;
                        let object = st.run.object(&end);
                        let window = st.run.window();
                        keep_outcome(&st.s, &st.tenant, &object, window).await;
                        // OpenAI ends a stream cut short by `max_output_tokens` (or the
                        // context) with `response.incomplete`.
                        let kind = format!("response.{}", status(&end));
                        st.event(json!({"type": kind, "response": object}));
                    }
                    Err(e) => st.error(&e),
                }
            }
        }
    })
}

/// `GET /v1/responses/{id}`: a stored response, from its conversation's transcript (its
/// output is the conversation's last reply, whose thought it does not keep) and what
/// [`keep_outcome`] kept (its status, creation time and usage).
pub async fn retrieve(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Response {
    if let Some(object) = s.background.get(&tenant.name(&id)) {
        return Json(object).into_response();
    }
    // Found once, then read: its transcript, and what `keep_outcome` kept with it.
    let conv = match stored(&s, &tenant, &id).await {
        Ok(conv) => conv,
        Err(e) => return e.into_response(),
    };
    let messages = match s.service.messages(conv).await {
        Ok(m) => m,
        Err(_) => return missing(&id).into_response(),
    };
    let kept = (s.service).with_engine(move |e| {
        e.attributes(conv)
            .ok()
            .and_then(|a| a.get(OUTCOME).cloned())
    });
    let outcome = kept.await.ok().flatten().unwrap_or(Value::Null);
    let status = outcome["status"]
        .as_str()
        .unwrap_or("completed")
        .to_string();
    let mut output = Output::new(true, &id);
    if let Some(reply) = messages.last().filter(|m| m.role == "assistant") {
        output.answer(&reply.content);
        for (index, call) in reply.tool_calls.iter().enumerate() {
            output.call(index, &call.id, &call.name);
            output.arguments(index, &call.arguments);
        }
    }
    output.finish(&status);
    let framing = Framing {
        id,
        created: outcome["created_at"].as_u64().unwrap_or_else(now_s),
        model: s.model.to_string(),
        request: json!({}),
        stream: false,
        background: false,
    };
    let usage = Some(outcome["usage"].clone()).filter(|u| !u.is_null());
    Json(framing.object(&status, output.items(&status), usage)).into_response()
}

/// `DELETE /v1/responses/{id}`: the stored response's conversation is closed and removed.
pub async fn delete(State(s): State<AppState>, tenant: Tenant, Path(id): Path<String>) -> Response {
    let deleted = Json(json!({"id": id, "object": "response", "deleted": true}));
    // A background response still running is cancelled, and so deleted: nothing was stored.
    let background = s.background.forget(&tenant.name(&id));
    match remove(&s, &tenant, &id).await {
        Ok(()) => deleted.into_response(),
        Err(e) if background && e.status == StatusCode::NOT_FOUND => deleted.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Closes and removes `tenant`'s stored response `id`.
async fn remove(s: &AppState, tenant: &Tenant, id: &str) -> Result<(), ApiError> {
    let conv = stored(s, tenant, id).await?;
    (s.service.close(conv).await).map_err(|e| ApiError::from_engine(&e))
}

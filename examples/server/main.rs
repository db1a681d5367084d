//! An OpenAI-compatible HTTP server over one pensieve engine: any OpenAI client (or `curl`)
//! talks to the stateful engine, and clients that resend the whole history every turn still
//! get the history's KV reused.
//!
//! ```text
//! cargo run --release --example server                      # http://127.0.0.1:8000, SmolLM2
//! curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"model": "pensieve", "messages": [{"role": "user", "content": "Hi!"}]}'
//! ```
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events
//! with `"stream": true`, `stream_options.include_usage` adding a usage chunk), vLLM's `POST
//! /tokenize` and `/detokenize`, `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus,
//! see `metrics`). `usage.prompt_tokens_details
//! .cached_tokens` counts the prompt tokens whose KV came from the cache, as vLLM reports it.
//! OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`, and vLLM's `ignore_eos`,
//! `min_tokens`, `repetition_penalty` and `min_p` are honoured; `user` is accepted without
//! effect; `logprobs` (chat: with `top_logprobs`) reports each generated token's
//! log-probability and up to 20 alternatives, each token as the text it decodes to alone; any
//! other field (`tools`, `response_format`, ...) is a 400 naming it.
//! Extensions of the chat request: `conversation_id` (or the `X-Conversation-Id` header) names
//! a conversation to continue, with hints `pin`, `expect_resume_s` and `end_conversation`.
//!
//! One thread owns the engine and drives `step()` (see `driver`); handlers talk to it over
//! channels. A client that disconnects cancels its turn; past `--max-queue` requests in
//! flight the server answers 429; a malformed request gets a 400 with OpenAI's error body,
//! and everyone else is served on.

use std::convert::Infallible;
use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use pensieve::engine::Engine;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Notify;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::RequestBodyTimeoutLayer;
use tower_http::trace::{DefaultMakeSpan, DefaultOnResponse, TraceLayer};
use tracing::Level;

mod api;
mod auth;
#[path = "../common/mod.rs"]
mod common;
mod driver;
mod listen;
mod logprobs;
mod metrics;
mod shutdown;
mod tokens;

use api::{ApiError, ChatRequest, Common, CompletionRequest, Emitter, Prompt, Usage};
use common::{positive, EngineArgs, StoreArgs};
use driver::{CancelOnDrop, Handle, Job, Logprob, PromptInput, Update};

#[derive(Parser, Debug)]
#[command(about = "OpenAI-compatible HTTP server over a stateful pensieve engine")]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, env = "PENSIEVE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed on start).
    #[arg(long, env = "PENSIEVE_PORT", default_value_t = 8000)]
    port: u16,
    /// The model name clients pass (`GET /v1/models` lists it).
    #[arg(long, env = "PENSIEVE_SERVED_MODEL_NAME", default_value = "pensieve")]
    served_model_name: String,
    /// Requests queued or running at most; more get 429.
    #[arg(long, env = "PENSIEVE_MAX_QUEUE", default_value_t = 256, value_parser = positive)]
    max_queue: usize,
    /// Conversations kept for clients to continue; the least recently used close beyond.
    #[arg(long, env = "PENSIEVE_MAX_CONVERSATIONS", default_value_t = 1024, value_parser = positive)]
    max_conversations: usize,
    /// Reply length when a request names none.
    #[arg(long, env = "PENSIEVE_DEFAULT_MAX_TOKENS", default_value_t = 256, value_parser = positive)]
    default_max_tokens: usize,
    /// On SIGINT or SIGTERM, seconds turns in flight get to finish before they are cancelled
    /// (a second signal cancels them at once).
    #[arg(long, env = "PENSIEVE_DRAIN_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    drain_timeout_s: f64,
    /// Seconds a client may take to send the next part of a request body (a client that
    /// stalls mid-request fails its request and holds nothing).
    #[arg(long, env = "PENSIEVE_BODY_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    body_timeout_s: f64,
    /// Seconds a client may take to send a request's head (and a kept-alive connection may
    /// stay idle before its next request begins).
    #[arg(long, env = "PENSIEVE_HEADER_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    header_timeout_s: f64,
    /// Connections open at once; past it, new ones wait until one closes.
    #[arg(long, env = "PENSIEVE_MAX_CONNECTIONS", default_value_t = 1024, value_parser = positive)]
    max_connections: usize,
    /// Clients must send `Authorization: Bearer KEY` to the `/v1` routes, `/tokenize` and
    /// `/detokenize` (`/health` and `/metrics` stay open).
    #[arg(long, env = "PENSIEVE_API_KEY")]
    api_key: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
    /// Testing only: the engine thread panics on a chat whose last message is this text.
    #[arg(long, hide = true)]
    fault_panic_on: Option<String>,
}

#[derive(Clone)]
struct AppState {
    engine: Handle,
    model: Arc<str>,
    default_max_tokens: usize,
    /// The model's tokenizer and chat template, for `/tokenize` and `/detokenize`.
    tokens: Arc<pensieve::model::Model>,
}

fn main() -> ExitCode {
    common::exit_code(run(Args::parse()))
}

fn run(args: Args) -> Result<(), Box<dyn Error>> {
    // Request lines and the library's warnings on stderr; `RUST_LOG` filters (default info).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let model = Arc::new(args.engine.load_chat_model()?);
    let config = args.engine.engine_config(&args.store);
    let engine = Engine::with_model(model.clone(), config)?;
    let died = Arc::new(Notify::new());
    let (handle, engine_thread) = driver::spawn(
        engine,
        args.max_queue,
        args.max_conversations,
        died.clone(),
        args.fault_panic_on,
    )?;
    let state = AppState {
        engine: handle.clone(),
        model: args.served_model_name.into(),
        default_max_tokens: args.default_max_tokens,
        tokens: model,
    };
    let mut guarded = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize));
    if let Some(key) = args.api_key.as_deref() {
        let key: Arc<str> = key.into();
        guarded = guarded.route_layer(axum::middleware::from_fn_with_state(key, auth::require_key));
    }
    let app = guarded
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        // One line per request at its end: method, path, status, latency.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(DefaultMakeSpan::new().level(Level::INFO))
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .layer(RequestBodyTimeoutLayer::new(Duration::from_secs_f64(
            args.body_timeout_s,
        )))
        // A handler that panics (a bug) answers 500 and leaves the server serving.
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }))
        .with_state(state);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let drain = Duration::from_secs_f64(args.drain_timeout_s);
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
        // Scripts and tests read the address from this line.
        println!("listening on http://{}", listener.local_addr()?);
        let began = Arc::new(Notify::new());
        let stopping = {
            let (handle, began) = (handle.clone(), began.clone());
            async move {
                let cause = shutdown::cause(died).await;
                tracing::info!(?cause, in_flight = handle.in_flight(), "stopping: draining");
                handle.drain();
                began.notify_one();
            }
        };
        let limits = listen::Limits {
            max_connections: args.max_connections,
            header_timeout: Duration::from_secs_f64(args.header_timeout_s),
        };
        let serve = listen::serve(listener, app, limits, stopping);
        tokio::select! {
            r = serve => r?,
            () = shutdown::deadline(began, drain) => {}
        }
        Ok::<_, Box<dyn Error>>(())
    });
    // Cancels what still runs, flushes the store, and ends the engine thread; the streams of
    // cancelled turns end on the runtime's threads meanwhile.
    handle.stop();
    let joined = engine_thread.join();
    runtime.shutdown_timeout(Duration::from_secs(2));
    served?;
    if joined.is_err() || !handle.healthy.load(Ordering::SeqCst) {
        return Err("the engine thread died; see the log above".into());
    }
    Ok(())
}

/// `ok` while the engine thread serves; 503 once it has died.
async fn health(State(s): State<AppState>) -> Response {
    match s.engine.healthy.load(Ordering::SeqCst) {
        true => "ok".into_response(),
        false => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine thread died").into_response()
        }
    }
}

/// A number of seconds, positive and finite.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
    }
}

async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": &*s.model, "object": "model", "created": now_s(), "owned_by": "pensieve",
    }]}))
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    match s.engine.metrics.render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Checks the requested model name.
fn check_model(s: &AppState, c: &Common) -> Result<(), ApiError> {
    check_model_name(s, c.model.as_deref())
}

/// A request naming a model must name the one served.
fn check_model_name(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &*s.model => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "the model `{m}` does not exist; this server serves `{}`",
                s.model
            ),
        )),
        _ => Ok(()),
    }
}

async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let request: ChatRequest = match api::parse(&body, api::CHAT_FIELDS) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prepared = (|| {
        check_model(&s, &request.common)?;
        let defaults = s.tokens.generation_defaults();
        let mut params = request.common.params(s.default_max_tokens, defaults)?;
        params.logprobs = request.top_logprobs()?;
        let messages = request
            .messages
            .iter()
            .map(api::ChatMessage::to_message)
            .collect::<Result<Vec<_>, _>>()?;
        let header = headers
            .get("x-conversation-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let name = request.conversation_id.clone().or(header);
        if name.as_ref().is_some_and(|n| n.len() > api::MAX_NAME_BYTES) {
            return Err(ApiError::bad(format!(
                "conversation_id is longer than {} bytes",
                api::MAX_NAME_BYTES
            )));
        }
        let hints = request.hints(name.is_some())?;
        Ok::<_, ApiError>((
            Job::Chat {
                messages,
                name,
                hints,
            },
            params,
        ))
    })();
    match prepared {
        Ok((job, params)) => serve(s, job, params, &request.common, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(s): State<AppState>, body: Bytes) -> Response {
    let request: CompletionRequest = match api::parse(&body, api::COMPLETION_FIELDS) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prepared = (|| {
        check_model(&s, &request.common)?;
        let mut params = request.common.params(16, s.tokens.generation_defaults())?;
        params.logprobs = request.top_logprobs()?;
        let prompt = match &request.prompt {
            Prompt::Text(t) => PromptInput::Text(t.clone()),
            Prompt::Tokens(t) => PromptInput::Tokens(t.clone()),
            Prompt::Texts(v) if v.len() == 1 => PromptInput::Text(v[0].clone()),
            Prompt::Texts(_) => return Err(ApiError::bad("only one prompt per request")),
        };
        Ok::<_, ApiError>((Job::Completion { prompt }, params))
    })();
    match prepared {
        Ok((job, params)) => serve(s, job, params, &request.common, Kind::Completion).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Clone, Copy)]
enum Kind {
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

async fn serve(
    s: AppState,
    job: Job,
    params: pensieve::engine::SamplingParams,
    common: &Common,
    kind: Kind,
) -> Response {
    let emitter = Emitter::new(params.stop_strings.clone());
    let logprobs = params.logprobs.is_some();
    let (guard, updates) = match s.engine.submit(job, params).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let framing = Framing::new(kind, s.model.clone(), guard.request().0, logprobs);
    if common.stream {
        stream(framing, guard, updates, emitter, common.include_usage()).into_response()
    } else {
        whole(framing, guard, updates, emitter).await
    }
}

/// Collects the reply; the guard cancels the turn if the client goes away first (axum drops
/// this future).
async fn whole(
    framing: Framing,
    mut guard: CancelOnDrop,
    mut updates: UnboundedReceiver<Update>,
    mut emitter: Emitter,
) -> Response {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(u) = updates.recv().await {
        match u {
            Update::Token { text: t, logprob } => {
                text.push_str(&emitter.push(&t));
                tokens.extend(logprob);
            }
            Update::Done { reason, usage } => {
                guard.disarm();
                text.push_str(&emitter.finish(reason == "stop"));
                return Json(framing.whole(text, reason, &usage, &tokens)).into_response();
            }
            Update::Failed(e) => {
                guard.disarm();
                return e.into_response();
            }
        }
    }
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped").into_response()
}

/// The reply as server-sent events; dropping the stream (the client went away) cancels the
/// turn through the guard it owns.
fn stream(
    framing: Framing,
    guard: CancelOnDrop,
    updates: UnboundedReceiver<Update>,
    emitter: Emitter,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    struct St {
        framing: Framing,
        guard: CancelOnDrop,
        updates: UnboundedReceiver<Update>,
        emitter: Emitter,
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
    }
    let mut first = std::collections::VecDeque::new();
    if let Kind::Chat = framing.kind {
        first.push_back(framing.chunk(None, None, Value::Null).to_string());
    }
    let state = St {
        framing,
        guard,
        updates,
        emitter,
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
            match st.updates.recv().await {
                Some(Update::Token { text, logprob }) => {
                    st.tokens.extend(logprob);
                    let text = st.emitter.push(&text);
                    if !text.is_empty() {
                        st.send(Some(&text), None);
                    }
                }
                Some(Update::Done { reason, usage }) => {
                    st.guard.disarm();
                    let text = st.emitter.finish(reason == "stop");
                    if !text.is_empty() {
                        st.send(Some(&text), None);
                    }
                    st.send(None, Some(reason));
                    if st.include_usage {
                        st.out.push_back(st.framing.usage_chunk(&usage).to_string());
                    }
                    st.out.push_back("[DONE]".into());
                    st.done = true;
                }
                Some(Update::Failed(e)) => {
                    st.guard.disarm();
                    st.out.push_back(e.body().to_string());
                    st.out.push_back("[DONE]".into());
                    st.done = true;
                }
                None => return None,
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

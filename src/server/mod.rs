//! `pensieve-server`, an OpenAI-compatible HTTP server over one engine (feature `server`): any
//! OpenAI client (or `curl`) talks to the stateful engine, and clients that resend the whole
//! history every turn still get the history's KV reused. The `pensieve-server` binary calls
//! [`main`]; a host (the Python package's `pensieve.serve`) may call [`run`] with a command line
//! of its own.
//!
//! ```text
//! cargo install --path . --features server
//! pensieve-server                                           # http://127.0.0.1:8000, SmolLM2
//! curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"model": "pensieve", "messages": [{"role": "user", "content": "Hi!"}]}'
//! ```
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as server-sent events
//! with `"stream": true`, `stream_options.include_usage` adding a usage chunk), vLLM's `POST
//! /tokenize` and `/detokenize`, `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus,
//! see `metrics`). `usage.prompt_tokens_details
//! .cached_tokens` counts the prompt tokens whose KV came from the cache, as vLLM reports it.
//! OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty` and `n` (choices sampled on
//! forks of the conversation, each a conversation a client may continue), and vLLM's `ignore_eos`,
//! `min_tokens`, `repetition_penalty` and `min_p` are honoured; `user` is accepted without
//! effect; `logprobs` (chat: with `top_logprobs`) reports each generated token's
//! log-probability and up to 20 alternatives, each token as the text it decodes to alone;
//! `response_format` (`json_object`, `json_schema`) holds the reply to JSON by constrained
//! decoding; `tools`, `tool_choice` and `parallel_tool_calls` offer tools through the chat
//! template and parse the calls out of replies (see `tools`); any other field is a 400
//! naming it.
//! Extensions of the chat request: `conversation_id` (or the `X-Conversation-Id` header) names
//! a conversation to continue, with hints `pin`, `expect_resume_s` and `end_conversation`.
//!
//! The server is a thin client of [`crate::service`], which owns the engine on its own thread,
//! maps each request to the conversation its content (or name) continues, and streams each
//! turn's events. A client that disconnects drops its turn's stream, which cancels the turn;
//! past `--max-queue` requests in flight the server answers 429; a malformed request gets a
//! 400 with OpenAI's error body, and everyone else is served on.

use std::error::Error;
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::chat::{ChatTemplate, ReasoningParser};
use crate::cli::{exit_code, positive, EngineArgs, StoreArgs};
use crate::engine::Engine;
use crate::service::{Chat, Service, ServiceConfig};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Parser;
use tokio::sync::Notify;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

mod api;
mod auth;
mod body;
mod conversations;
mod deadline;
mod error;
mod failure;
mod fields;
mod info;
mod listen;
mod logprobs;
mod messages;
mod metadata;
mod metrics;
mod ops;
mod random_id;
mod respond;
mod responses;
mod shutdown;
mod structured;
mod tokens;
mod tools;
mod usage;

use api::{ChatRequest, Common, CompletionRequest, Prompt};
use error::ApiError;
pub use failure::ServeError;
use metrics::{Metrics, Recorder};
use respond::{serve, Job, Kind};

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
    /// vLLM's: sampling defaults over those of the model's `generation_config.json`, as a JSON
    /// object (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`), which requests
    /// that give no value of their own take: `{"temperature": 0}` makes every such request
    /// greedy (for clients that send none, as Claude Code).
    #[arg(long, env = "PENSIEVE_OVERRIDE_GENERATION_CONFIG")]
    override_generation_config: Option<String>,
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
    /// On a signal, seconds the server serves on while `/health` answers 503 before it stops
    /// taking requests: behind a router, at least its health checks' interval times their
    /// failure threshold, so that a rolling restart fails no request (none by default).
    #[arg(long, env = "PENSIEVE_SHUTDOWN_GRACE_S", value_parser = seconds)]
    shutdown_grace_s: Option<f64>,
    /// Seconds a client may take to send a request's whole body (a client that stalls or
    /// trickles it is answered 408 and holds nothing).
    #[arg(long, env = "PENSIEVE_BODY_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    body_timeout_s: f64,
    /// Largest request body taken, in MiB; larger ones are answered 413.
    #[arg(long, env = "PENSIEVE_MAX_BODY_MIB", default_value_t = 2, value_parser = positive)]
    max_body_mib: usize,
    /// Seconds a client may leave the server's answer unread while the server waits to write
    /// more of it (a client that never reads is cut off, its turn cancelled).
    #[arg(long, env = "PENSIEVE_WRITE_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    write_timeout_s: f64,
    /// Seconds a client may take to send a request's head (and a kept-alive connection may
    /// stay idle before its next request begins).
    #[arg(long, env = "PENSIEVE_HEADER_TIMEOUT_S", default_value_t = 30.0, value_parser = seconds)]
    header_timeout_s: f64,
    /// Connections open at once; past it, new ones wait until one closes.
    #[arg(long, env = "PENSIEVE_MAX_CONNECTIONS", default_value_t = 1024, value_parser = positive)]
    max_connections: usize,
    /// Connections one client address may hold at once (default: a quarter of
    /// --max-connections, so that a few clients cannot take every place); past it, its new
    /// connections are answered 429. Behind a reverse proxy, every client has the proxy's
    /// address: raise it to --max-connections there.
    #[arg(long, env = "PENSIEVE_MAX_CONNECTIONS_PER_CLIENT", value_parser = positive)]
    max_connections_per_client: Option<usize>,
    /// Clients must send `Authorization: Bearer KEY` to the `/v1` routes, `/tokenize` and
    /// `/detokenize` (`/health` and `/metrics` stay open). Each is taken whole, commas
    /// included; repeat the flag (or use --api-key-file) for several: each key is then a
    /// tenant whose conversations and responses no other key reaches.
    #[arg(long, env = "PENSIEVE_API_KEY")]
    api_key: Vec<String>,
    /// A file of API keys, a line each: `KEY`, or `TENANT KEY` to name the key's tenant (its
    /// namespace, kept when the key is rotated); `#` starts a comment.
    #[arg(long, env = "PENSIEVE_API_KEY_FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Origins a browser page may call the API from (CORS), comma-separated, or `*` for any;
    /// none by default.
    #[arg(long, env = "PENSIEVE_ALLOWED_ORIGINS", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// How chat answers tell a thinking model's thought from its answer: `deepseek-r1`,
    /// `qwen3` or `gpt-oss` answer it as `reasoning_content` (streamed as its own deltas), as
    /// vLLM's parsers of these names do; without it, the thought stays in `content`. A model
    /// whose template is harmony's (gpt-oss) takes `gpt-oss` unless told otherwise: its
    /// replies are markup without it.
    #[arg(long, env = "PENSIEVE_REASONING_PARSER", value_parser = reasoning_parser)]
    reasoning_parser: Option<ReasoningParser>,
    /// Log lines as `text`, or `json` (one object per line) for log collectors.
    #[arg(long, env = "PENSIEVE_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: ops::LogFormat,
    /// Request fields that neither OpenAI's API nor this server has are ignored, where by
    /// default they are refused by name (a typo must not pass silently): for gateways that
    /// add fields of their own.
    #[arg(long, env = "PENSIEVE_IGNORE_UNKNOWN_FIELDS")]
    ignore_unknown_fields: bool,
    #[command(flatten)]
    store: StoreArgs,
    /// Testing only: the engine thread panics on a chat whose last message is this text.
    #[arg(long, hide = true)]
    fault_panic_on: Option<String>,
}

#[derive(Clone)]
struct AppState {
    service: Service,
    metrics: Arc<Metrics>,
    model: Arc<str>,
    default_max_tokens: usize,
    /// The model's tokenizer and chat template, for `/tokenize`, `/detokenize`, prompts and
    /// log-probabilities.
    tokens: Arc<crate::model::Model>,
    /// Testing only: a chat whose last message is this text panics the engine thread.
    panic_on: Option<Arc<str>>,
    /// What must fit in the context window, refused before the engine thread sees it (none
    /// under the `truncate-prompt` policy).
    prompt_bound: Option<tokens::PromptBound>,
    /// How chat answers split a thought from the answer (`--reasoning-parser`).
    reasoning: Option<ReasoningParser>,
    /// Request fields no schema has are ignored rather than refused (`--ignore-unknown-fields`).
    ignore_unknown_fields: bool,
    /// The responses running in the background, and the latest ended.
    background: responses::Background,
    /// Set for the grace period after a signal: `/health` answers 503.
    leaving: shutdown::Leaving,
}

fn reasoning_parser(name: &str) -> Result<ReasoningParser, String> {
    ReasoningParser::from_name(name).ok_or_else(|| {
        format!(
            "unknown reasoning parser {name:?} (known: {})",
            ReasoningParser::NAMES.join(", ")
        )
    })
}

/// The `pensieve-server` program: serves with the command line `args` (the program's name
/// first, as `std::env::args_os` gives it) until SIGINT or SIGTERM and their drain. A command
/// line it refuses prints clap's message and exits the process as clap does; a failure to
/// serve prints one line with its causes and returns a failure code.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Args::try_parse_from(args) {
        Ok(args) => exit_code(run_parsed(args).map_err(|e| Box::new(e) as Box<dyn Error>)),
        Err(e) => e.exit(),
    }
}

/// Serves with the command line `args` (the program's name first; the flags of
/// `pensieve-server --help`) until SIGINT or SIGTERM and their drain, on a runtime of its own;
/// it prints `listening on http://ADDRESS` once it takes requests.
///
/// # Errors
/// [`ServeError`]: a refused command line or a failure to serve.
pub fn run<I, T>(args: I) -> Result<(), ServeError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    run_parsed(Args::try_parse_from(args)?)
}

/// `model` with the sampling defaults of `--override-generation-config` (`json`) over its own;
/// its ends of generation stay.
fn overridden(model: crate::model::Model, json: &str) -> Result<crate::model::Model, String> {
    const TAKEN: [&str; 5] = [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
    ];
    let flag = "--override-generation-config";
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(json).map_err(|e| format!("{flag}: not a JSON object: {e}"))?;
    if let Some(k) = object.keys().find(|k| !TAKEN.contains(&k.as_str())) {
        return Err(format!(
            "{flag}: unknown field {k:?} (taken: {})",
            TAKEN.join(", ")
        ));
    }
    let o =
        crate::model::GenerationDefaults::from_json(json).map_err(|e| format!("{flag}: {e}"))?;
    let own = model.generation_defaults().clone();
    let defaults = crate::model::GenerationDefaults {
        temperature: o.temperature.or(own.temperature),
        top_p: o.top_p.or(own.top_p),
        top_k: o.top_k.or(own.top_k),
        min_p: o.min_p.or(own.min_p),
        repetition_penalty: o.repetition_penalty.or(own.repetition_penalty),
        eos_token_ids: own.eos_token_ids,
    };
    Ok(model.with_generation_defaults(defaults))
}

fn run_parsed(args: Args) -> Result<(), ServeError> {
    ops::init_logging(args.log_format);
    let cors = ops::cors(&args.allowed_origins).map_err(ServeError::Flag)?;
    // A model without a chat template (a base model) serves completions; chat requests to it
    // are refused, naming the flag that gives it one.
    let model = args.engine.load_model()?;
    let model = match &args.override_generation_config {
        Some(json) => overridden(model, json).map_err(ServeError::Flag)?,
        None => model,
    };
    let model = Arc::new(model);
    if model.template().is_none() {
        tracing::warn!(
            "the model ships no chat template: serving /v1/completions only; \
             --chat-template NAME|FILE serves chat too"
        );
    }
    let config = args.engine.engine_config(&args.store);
    let positions = model.config().max_position_embeddings;
    let window = (config.max_context_tokens).map_or(positions, |n| n.min(positions));
    let prompt_bound = tokens::PromptBound::new(&model, window, config.overflow);
    let engine = Engine::with_model(model.clone(), config)?;
    let recorder = Arc::new(Recorder::default());
    let service = Service::spawn(
        engine,
        ServiceConfig::default()
            .max_in_flight(args.max_queue)
            .max_conversations(args.max_conversations)
            .observer(recorder.clone()),
    )?;
    let harmony = model.template().is_some_and(ChatTemplate::harmony);
    let reasoning = (args.reasoning_parser).or(harmony.then_some(ReasoningParser::GptOss));
    let state = AppState {
        service: service.clone(),
        metrics: Arc::new(Metrics::new(
            &recorder,
            service.clone(),
            &args.served_model_name,
        )),
        model: args.served_model_name.into(),
        default_max_tokens: args.default_max_tokens,
        tokens: model,
        panic_on: args.fault_panic_on.map(Into::into),
        prompt_bound,
        reasoning,
        ignore_unknown_fields: args.ignore_unknown_fields,
        background: responses::Background::default(),
        leaving: shutdown::Leaving::default(),
    };
    let grace = (args.shutdown_grace_s).map_or(Duration::ZERO, Duration::from_secs_f64);
    let leaving = state.leaving.clone();
    let body = body::BodyLimits {
        deadline: Duration::from_secs_f64(args.body_timeout_s),
        max_bytes: args.max_body_mib << 20,
    };
    let keys = auth::Keys::new(&args.api_key, args.api_key_file.as_deref());
    let keys = keys.map_err(ServeError::Flag)?;
    let app = match (app(state, keys, body), cors) {
        // Outermost: a browser's preflight is answered before the key is asked for.
        (app, Some(cors)) => app.layer(cors),
        (app, None) => app,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServeError::io("starting the runtime"))?;
    let drain = Duration::from_secs_f64(args.drain_timeout_s);
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(ServeError::io("binding the address"))?;
        let signals = shutdown::Signals::listen();
        // Scripts and tests read the address from this line.
        let address = listener.local_addr();
        println!(
            "listening on http://{}",
            address.map_err(ServeError::io("reading the address"))?
        );
        let began = Arc::new(Notify::new());
        let stopping = {
            let (service, began) = (service.clone(), began.clone());
            async move {
                let cause = shutdown::cause(service.clone(), signals).await;
                if cause == shutdown::Cause::Signal {
                    leaving.wait_out(grace).await;
                }
                tracing::info!(
                    ?cause,
                    in_flight = service.in_flight(),
                    "stopping: draining"
                );
                service.drain();
                began.notify_one();
            }
        };
        let limits = listen::Limits {
            max_connections: args.max_connections,
            per_client: (args.max_connections_per_client)
                .unwrap_or((args.max_connections / 4).max(1)),
            header_timeout: Duration::from_secs_f64(args.header_timeout_s),
            write_timeout: Duration::from_secs_f64(args.write_timeout_s),
        };
        let serve = listen::serve(listener, app, limits, stopping);
        tokio::select! {
            r = serve => r.map_err(ServeError::io("serving"))?,
            () = shutdown::deadline(began, drain) => {}
        }
        Ok::<_, ServeError>(())
    });
    // Cancels what still runs, flushes the store, and ends the engine thread; the streams of
    // cancelled turns end on the runtime's threads meanwhile.
    let stopped = service.shutdown();
    runtime.shutdown_timeout(Duration::from_secs(2));
    served?;
    Ok(stopped?)
}

/// The routes, behind the API key (if any) but `/health` and `/metrics`, with a log line per
/// request, bodies read whole under their deadline and size limit, and a handler's panic
/// answered 500.
fn app(state: AppState, keys: Option<auth::Keys>, body: body::BodyLimits) -> Router {
    let mut guarded = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route(
            "/v1/responses",
            post(responses::create).get(responses::socket::connect),
        )
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/responses/compact", post(responses::compact::compact))
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/conversations", post(conversations::create))
        .route(
            "/v1/conversations/{id}",
            get(conversations::retrieve)
                .post(conversations::update)
                .delete(conversations::delete),
        )
        .route(
            "/v1/conversations/{id}/items",
            get(conversations::list_items).post(conversations::add_items),
        )
        .route(
            "/v1/conversations/{id}/items/{item}",
            get(conversations::retrieve_item).delete(conversations::delete_item),
        )
        .route("/v1/models", get(info::models))
        .route("/server_info", get(info::server_info))
        .route("/get_server_info", get(info::server_info))
        .route("/model_info", get(info::model_info))
        .route("/get_model_info", get(info::model_info))
        .route("/get_load", get(info::load))
        .route("/v1/models/{id}", get(info::model))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize));
    if let Some(keys) = keys {
        let keys = Arc::new(keys);
        guarded = guarded.route_layer(axum::middleware::from_fn_with_state(
            keys,
            auth::require_key,
        ));
    }
    guarded
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics_text))
        .fallback(info::unknown_route)
        .method_not_allowed_fallback(info::wrong_method)
        // One line per request at its end: method, path, status, latency. The path only,
        // never the query, which may carry a secret (`?api_key=`).
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|r: &axum::http::Request<_>| {
                    tracing::info_span!("request", method = %r.method(), path = %r.uri().path())
                })
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        .layer(axum::middleware::from_fn_with_state(body, body::read_whole))
        // The body was read whole, under the limit `body` sets.
        .layer(DefaultBodyLimit::disable())
        // A handler that panics (a bug) answers 500 and leaves the server serving.
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }))
        // Outermost: every error of the Anthropic routes, whoever made it, in their shape.
        .layer(axum::middleware::from_fn(messages::errors))
        .with_state(state)
}

/// A number of seconds, positive and finite.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
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
        )
        .with_code("model_not_found")),
        _ => Ok(()),
    }
}

async fn chat(
    State(s): State<AppState>,
    tenant: auth::Tenant,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request: ChatRequest =
        match api::parse(&body, fields::CHAT_ENDPOINT, s.ignore_unknown_fields) {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        };
    let prepared = (|| {
        check_model(&s, &request.common)?;
        api::check_template(&s.tokens)?;
        let defaults = s.tokens.generation_defaults();
        let mut params = request.common.params(s.default_max_tokens, defaults)?;
        params.logprobs = request.top_logprobs()?;
        let messages = request
            .messages
            .iter()
            .map(api::ChatMessage::to_message)
            .collect::<Result<Vec<_>, _>>()?;
        let name = api::conversation_name(
            request.conversation_id.as_deref(),
            headers.get("x-conversation-id").map(|v| v.as_bytes()),
        )?;
        let hints = request.hints(name.is_some())?;
        let format = s.tokens.template().and_then(|t| t.tool_format());
        let (offered, choice) = tools::from_legacy(
            &request.tools,
            request.tool_choice.as_ref(),
            request.functions.as_deref(),
            request.function_call.as_ref(),
        )?;
        let legacy = request.functions.is_some();
        let (tools, forced) = tools::offered(&offered, choice.as_ref(), format)?;
        params.text_only = tools::text_only(choice.as_ref());
        tools::hold(&mut params, forced, &tools, format)?;
        let vars = api::template_vars(
            request.chat_template_kwargs.as_ref(),
            request.reasoning_effort.as_deref(),
        );
        let mut chat = Chat::new(messages)
            .with_hints(hints)
            .with_tools(tools)
            .with_template_vars(vars);
        chat.name = name.map(|n| tenant.name(&n));
        let parallel = request.parallel_tool_calls.unwrap_or(!legacy);
        let job = Job::Chat {
            chat,
            parallel,
            legacy,
        };
        Ok::<_, ApiError>((job, params, request.common.choices()?))
    })();
    let prepared = match (prepared, &s.prompt_bound) {
        (Ok(p), Some(bound)) => {
            (bound.check_messages(&s.tokens, &request.messages).await).map(|()| p)
        }
        (p, _) => p,
    };
    // The prediction's tokens, tokenized as the reply's text is (no special tokens), off the
    // engine thread.
    let prepared = match (prepared, &request.prediction) {
        (Ok((job, mut params, n)), Some(p)) => match predicted_tokens(&s, p).await {
            Ok(tokens) => {
                params.prediction = tokens;
                Ok((job, params, n))
            }
            Err(e) => Err(e),
        },
        (p, _) => p,
    };
    if let (Some(p), Ok((Job::Chat { chat, .. }, _, _))) = (&s.panic_on, &prepared) {
        inject_fault(&s.service, p, chat).await;
    }
    match prepared {
        Ok((job, params, n)) => serve(s, job, params, n, &request.common, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(s): State<AppState>, body: Bytes) -> Response {
    let request: CompletionRequest =
        match api::parse(&body, fields::COMPLETION_ENDPOINT, s.ignore_unknown_fields) {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        };
    let prepared = async {
        check_model(&s, &request.common)?;
        let mut params = request.common.params(16, s.tokens.generation_defaults())?;
        params.logprobs = request.top_logprobs()?;
        let add_special = request.add_special_tokens.unwrap_or(true);
        let prompt = match &request.prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(text) => prompt_tokens(&s, text, add_special).await?,
            Prompt::Texts(v) if v.len() == 1 => prompt_tokens(&s, &v[0], add_special).await?,
            Prompt::Texts(_) => return Err(ApiError::bad("only one prompt per request")),
        };
        Ok::<_, ApiError>((Job::Completion(prompt), params, request.common.choices()?))
    };
    match prepared.await {
        Ok((job, params, n)) => serve(s, job, params, n, &request.common, Kind::Completion).await,
        Err(e) => e.into_response(),
    }
}

/// A prediction's tokens, as the reply would be tokenized; a prediction longer than a prompt
/// may be is refused untokenized.
async fn predicted_tokens(s: &AppState, p: &api::Prediction) -> Result<Vec<u32>, ApiError> {
    let text = p.text()?;
    if let Some(bound) = &s.prompt_bound {
        bound.check(text.len())?;
    }
    tokens::encode(&s.tokens, &text, false).await
}

/// A text prompt's tokens: refused untokenized if it must be longer than the context window,
/// else tokenized on a blocking thread (never on the runtime's, nor the engine's).
async fn prompt_tokens(s: &AppState, text: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
    if let Some(bound) = &s.prompt_bound {
        bound.check(text.len())?;
    }
    tokens::encode(&s.tokens, text, add_special).await
}

/// The fault `--fault-panic-on` asks for: tests check that a dead engine thread makes the
/// server report unhealthy and exit non-zero.
#[allow(clippy::panic)]
async fn inject_fault(service: &Service, text: &str, chat: &Chat) {
    if chat.messages.last().is_some_and(|m| m.content == text) {
        // Deliberate: the flag is hidden and exists to kill the engine thread in tests; the
        // service catches the panic, reports the thread dead, and the server exits non-zero.
        let _ = service
            .with_engine(|_| panic!("fault injected by --fault-panic-on"))
            .await;
    }
}

//! The server's own routes beside the API's: its health, its metrics, the served model
//! (`GET /v1/models`, `/v1/models/{id}`), what SGLang's router asks of a worker it registers
//! (`/server_info`, `/model_info`, and their older names `/get_server_info`,
//! `/get_model_info`), the load vLLM's router reads (`/get_load`), and OpenAI-shaped answers
//! to paths and methods it has no route for.

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{check_model_name, now_s, AppState};

/// `ok` while the engine thread serves; 503 once it has died, and while the server leaves
/// (the grace period after a signal, when requests are still served).
pub async fn health(State(s): State<AppState>) -> Response {
    let why = match (s.service.is_alive(), s.leaving.is_set()) {
        (true, false) => return "ok".into_response(),
        (false, _) => "the engine thread died",
        (true, true) => "the server is stopping: send new requests elsewhere",
    };
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why).into_response()
}

/// The served model as OpenAI's model object.
fn model_object(s: &AppState) -> Value {
    json!({"id": &*s.model, "object": "model", "created": now_s(), "owned_by": "pensieve"})
}

pub async fn models(State(s): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

/// `GET /v1/models/{id}`: the served model, or a 404 for any other name.
pub async fn model(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    match check_model_name(&s, Some(&id)) {
        Ok(()) => Json(model_object(&s)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /server_info`: what SGLang's router reads of a worker to register it under the
/// served model's name (so requests naming that model reach it). No `model_path`: the router
/// would load a tokenizer from it, and this server tokenizes for itself.
pub async fn server_info(State(s): State<AppState>) -> Json<Value> {
    Json(json!({
        "served_model_name": &*s.model,
        "version": env!("CARGO_PKG_VERSION"),
        "engine": "pensieve",
    }))
}

/// `GET /get_load`: the turns queued or running here, as vLLM's router reads a worker's load
/// (its `power_of_two` policy and its `/get_loads`).
pub async fn load(State(s): State<AppState>) -> Json<Value> {
    Json(json!({"load": s.service.in_flight()}))
}

/// `GET /model_info`: the served model's kind, as SGLang's router reads it (its labels).
pub async fn model_info(State(s): State<AppState>) -> Json<Value> {
    let architecture = s.tokens.config().architecture;
    Json(json!({
        "is_generation": true,
        "model_type": architecture.name(),
        "architectures": [architecture.hf_name()],
    }))
}

/// A path no route has: a 404 with OpenAI's error body (clients parse it), naming the path.
pub async fn unknown_route(uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route {}: this server has none of that path", uri.path()),
    )
    .into_response()
}

/// A route asked with a method it does not take: a 405 with OpenAI's error body.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    )
    .into_response()
}

pub async fn metrics_text(State(s): State<AppState>) -> Response {
    match s.metrics.render() {
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

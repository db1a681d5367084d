//! Errors as OpenAI answers them: a status, a message cut to a bounded length, `Retry-After`
//! for capacity refusals, and the body `{"error": {"message", "type", "param", "code"}}`. The
//! engine's errors map to statuses by their kind; a server-side failure says only its kind.

use std::borrow::Cow;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// An error answered with OpenAI's body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Seconds after which a capacity refusal (429, 503) may be retried (`Retry-After`).
    pub retry_after: Option<u64>,
    /// The request field at fault, where one is known (OpenAI's `param`): a name, or a path
    /// into the body (`reasoning.effort`, `input[2].content`).
    pub param: Option<Cow<'static, str>>,
    /// OpenAI's name of the condition, where it has one for this error (see
    /// [`ApiError::code`]).
    pub code: Option<&'static str>,
}

/// Longest error message answered: errors may quote what a request sent (a name, a field),
/// and never echo more of it than this.
const MAX_MESSAGE: usize = 512;

impl ApiError {
    /// A 400: the request is malformed or cannot be served.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        Self {
            status,
            message,
            retry_after: None,
            param: None,
            code: None,
        }
    }

    /// The same, naming the request field at fault.
    pub fn with_param(self, param: impl Into<Cow<'static, str>>) -> Self {
        Self {
            param: Some(param.into()),
            ..self
        }
    }

    /// The same, with OpenAI's name of the condition.
    pub fn with_code(self, code: &'static str) -> Self {
        Self {
            code: Some(code),
            ..self
        }
    }

    /// OpenAI's `code`: the condition's name where it has one (a capacity refusal is
    /// `rate_limit_exceeded`), else none (null in the body).
    pub fn code(&self) -> Option<&'static str> {
        match self.status {
            StatusCode::TOO_MANY_REQUESTS => self.code.or(Some("rate_limit_exceeded")),
            _ => self.code,
        }
    }

    /// The `code` of a failed response's `error`, one of the Responses API's (never null):
    /// `server_error` for the server's failures, `rate_limit_exceeded` for a capacity
    /// refusal, `invalid_prompt` for the request's.
    pub fn response_code(&self) -> &'static str {
        match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            s if s.is_server_error() => "server_error",
            _ => "invalid_prompt",
        }
    }

    /// A body that does not parse as `T`: a 400 naming the field at fault by its path.
    pub fn body_type(e: &serde_path_to_error::Error<serde_json::Error>) -> Self {
        let path = e.path().to_string();
        match path.as_str() {
            "." => Self::bad(format!("invalid request body: {}", e.inner())),
            _ => Self::bad(format!("invalid request body: {path}: {}", e.inner())).with_param(path),
        }
    }

    /// A refusal for lack of capacity, to retry after `seconds`.
    pub fn busy(status: StatusCode, message: impl Into<String>, seconds: u64) -> Self {
        Self {
            retry_after: Some(seconds),
            ..Self::new(status, message)
        }
    }

    /// The engine's refusal of a turn, by its kind: the caller's mistake (400), nothing by
    /// that name (404), a clash with the state found (409), a capacity limit (429, retry), the
    /// store or service unavailable (503, retry), else the server's (500).
    pub fn from_engine(e: &crate::Error) -> Self {
        use crate::ErrorKind as K;
        let status = match e.kind() {
            K::InvalidInput => StatusCode::BAD_REQUEST,
            K::NotFound => StatusCode::NOT_FOUND,
            K::Conflict => StatusCode::CONFLICT,
            K::Capacity => StatusCode::TOO_MANY_REQUESTS,
            K::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        match e {
            // Pins free up as conversations end, which takes longer than a queue drains.
            crate::Error::PinLimit { .. } => Self::busy(status, e.to_string(), 5),
            _ if status.is_server_error() => Self::internal(e, status),
            _ if matches!(e.kind(), K::Capacity) => Self::busy(status, e.to_string(), 1),
            crate::Error::ContextOverflow { .. } => Self {
                param: param_of(e).map(Cow::Borrowed),
                ..Self::new(status, e.to_string()).with_code("context_length_exceeded")
            },
            _ => Self {
                param: param_of(e).map(Cow::Borrowed),
                ..Self::new(status, e.to_string())
            },
        }
    }

    /// A failure on the server's side: the client learns what kind it is, the log what it
    /// was. Its text may name files, a store's address or a backtrace (candle's errors carry
    /// one), none of which a client should see.
    fn internal(e: &crate::Error, status: StatusCode) -> Self {
        tracing::error!(error = %e, status = status.as_u16(), "request failed");
        match e {
            crate::Error::ServiceStopped => {
                Self::busy(status, "the server is stopping; retry on another", 1)
            }
            _ if status == StatusCode::SERVICE_UNAVAILABLE => Self::busy(
                status,
                "the conversation store is unavailable; retry later (the server log says why)",
                1,
            ),
            _ => Self::new(status, "internal error (the server log says what failed)"),
        }
    }

    /// A turn that failed after it was accepted: the engine could not make room for it now
    /// (other conversations' KV, pins) is a capacity condition (503, retry), not the client's
    /// mistake; anything else as [`ApiError::from_engine`].
    pub fn from_failed_turn(e: &crate::Error) -> Self {
        match e {
            crate::Error::BudgetTooSmall { .. } => {
                Self::busy(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), 1)
            }
            _ => Self::from_engine(e),
        }
    }

    /// The engine thread ended while a request waited on it.
    pub fn engine_stopped() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped")
    }

    /// A turn's end as the request's answer: nothing for a reply, else the error it is
    /// answered with (its failure; a cancellation by the server, which a client may retry).
    pub fn of_end(end: &crate::service::TurnEnd) -> Result<(), Self> {
        use crate::engine::FinishReason;
        match &end.reason {
            FinishReason::Failed(e) => Err(Self::from_failed_turn(e)),
            FinishReason::Cancelled => Err(Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the request was cancelled",
            )),
            _ => Ok(()),
        }
    }

    pub fn body(&self) -> Value {
        let kind = match self.status.as_u16() {
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.code(),
        }})
    }
}

/// The request field an engine error names, as the OpenAI API calls it.
fn param_of(e: &crate::Error) -> Option<&'static str> {
    match e {
        // A turn's constraint comes from `response_format` or a forced tool choice: the
        // engine cannot tell which, so the error names neither.
        crate::Error::InvalidParams {
            param: "constraint",
            ..
        } => None,
        crate::Error::InvalidParams { param, .. } => Some(param),
        crate::Error::InvalidRequest { field, .. } => Some(field),
        _ => None,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_openais_names_or_null_never_the_status() {
        let body = |e: &ApiError| e.body()["error"]["code"].clone();
        let overflow = crate::Error::ContextOverflow {
            position: 9000,
            window: 8192,
        };
        let e = ApiError::from_engine(&overflow);
        assert_eq!(body(&e), json!("context_length_exceeded"));
        assert_eq!(e.response_code(), "invalid_prompt");
        let busy = ApiError::busy(StatusCode::TOO_MANY_REQUESTS, "busy", 1);
        assert_eq!(body(&busy), json!("rate_limit_exceeded"));
        assert_eq!(busy.response_code(), "rate_limit_exceeded");
        let unavailable = ApiError::busy(StatusCode::SERVICE_UNAVAILABLE, "down", 1);
        assert_eq!(body(&unavailable), Value::Null);
        assert_eq!(unavailable.response_code(), "server_error");
        assert_eq!(body(&ApiError::bad("no")), Value::Null);
    }
}

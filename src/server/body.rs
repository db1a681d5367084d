//! Request bodies, read whole before any handler sees them: under one deadline for the whole
//! body (a client that sends a byte now and then cannot hold its connection past it, as it
//! could under a deadline per frame) and a size limit, each refusal an OpenAI-style JSON error.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// The limits every request body is read under.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    /// How long the whole body may take to arrive.
    pub deadline: Duration,
    /// The most bytes it may have.
    pub max_bytes: usize,
}

/// Reads the body whole under `limits`, then passes the request on with it.
pub async fn read_whole(
    State(limits): State<BodyLimits>,
    request: Request,
    next: Next,
) -> Response {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {} bytes", limits.max_bytes),
        )
        .into_response()
    };
    let declared = (request.headers().get(header::CONTENT_LENGTH))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_bytes as u64) {
        return too_large();
    }
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, limits.max_bytes);
    let bytes = match tokio::time::timeout(limits.deadline, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) if is_length_limit(&e) => return too_large(),
        Ok(Err(_)) => {
            return ApiError::bad("the request body could not be read whole").into_response()
        }
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    limits.deadline.as_secs_f64()
                ),
            )
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Whether reading failed on the size limit (a body without a length, or one longer than it
/// said).
fn is_length_limit(e: &axum::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cause = c.source();
    }
    false
}

//! `--api-key`: the generation and tokenizer routes answer only requests that carry
//! `Authorization: Bearer KEY` (OpenAI's clients send their `api_key` so); `/health` and
//! `/metrics` stay open for probes and scrapers, as vLLM's do.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// Passes a request whose bearer token is `key`; answers any other with a 401.
pub async fn require_key(State(key): State<Arc<str>>, request: Request, next: Next) -> Response {
    let sent = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer);
    match sent {
        Some(sent) if same(sent.as_bytes(), key.as_bytes()) => next.run(request).await,
        _ => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "a valid API key is required: send `Authorization: Bearer KEY`",
        )
        .into_response(),
    }
}

/// The token of a `Bearer` credential; the scheme's name is case-insensitive (RFC 9110
/// section 11.1), so `bearer KEY` is the same credential.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

/// Equality in time independent of where the two differ, so that response times do not
/// reveal a key byte by byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::bearer;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer k1"), Some("k1"));
        assert_eq!(bearer("bearer k1"), Some("k1"));
        assert_eq!(bearer("BEARER   k1"), Some("k1"));
        assert_eq!(bearer("Basic k1"), None);
        assert_eq!(bearer("Bearerk1"), None);
    }
}

//! `--api-key` and `--api-key-file`: the generation, tokenizer and conversation routes answer
//! only requests that carry `Authorization: Bearer KEY` (OpenAI's clients send their `api_key`
//! so); `/health` and `/metrics` stay open for probes and scrapers, as vLLM's do.
//!
//! With more than one key, each key is a tenant: its conversation names, response ids and
//! conversation ids live in a namespace of their own ([`Tenant::name`]), so that another
//! tenant's id finds nothing (a 404, never its data). A key file names its tenants (`TENANT
//! KEY` lines), so that a key can be rotated without losing what its tenant stored; a key
//! given alone names its tenant by a digest of itself. One key (or none) is one tenant, whose
//! names are the names as sent.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;

/// Whose request it is: the namespace of its key's names and ids (none with one tenant).
#[derive(Clone, Debug, Default)]
pub struct Tenant(Option<Arc<str>>);

impl Tenant {
    /// The engine's name of `name` (a conversation's name, a response's or conversation's id)
    /// as this tenant sent it.
    pub fn name(&self, name: &str) -> String {
        match &self.0 {
            Some(ns) => format!("{ns}/{name}"),
            None => name.to_string(),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tenant {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(parts
            .extensions
            .get::<Tenant>()
            .cloned()
            .unwrap_or_default())
    }
}

/// The keys a server takes, each with its tenant.
#[derive(Debug)]
pub struct Keys(Vec<(String, Tenant)>);

impl Keys {
    /// The keys given on the command line (each its own tenant, named by its digest) and in
    /// `file` (lines `KEY` or `TENANT KEY`; blank lines and `#` comments skipped); `None`
    /// when there are none.
    ///
    /// # Errors
    /// The file unreadable, a tenant's name not 1 to 64 letters, digits, `-` or `_`, a key
    /// given twice, or an empty key.
    pub fn new(keys: &[String], file: Option<&Path>) -> Result<Option<Self>, String> {
        let mut named: Vec<(Option<String>, String)> =
            keys.iter().map(|k| (None, k.clone())).collect();
        if let Some(f) = file {
            let text = std::fs::read_to_string(f)
                .map_err(|e| format!("--api-key-file {}: {e}", f.display()))?;
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                named.push(match line.split_once(char::is_whitespace) {
                    Some((tenant, key)) => (Some(tenant.to_string()), key.trim().to_string()),
                    None => (None, line.to_string()),
                });
            }
        }
        if named.is_empty() {
            return Ok(None);
        }
        let spaced = named.len() > 1;
        let mut out: Vec<(String, Tenant)> = Vec::new();
        for (tenant, key) in named {
            if key.is_empty() {
                return Err("an API key must not be empty".into());
            }
            if out.iter().any(|(k, _)| *k == key) {
                return Err("an API key is given twice".into());
            }
            let ok = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
            let ns = match tenant {
                Some(t) if !t.is_empty() && t.len() <= 64 && t.chars().all(ok) => t,
                Some(t) => {
                    return Err(format!(
                        "tenant {t:?}: a tenant's name is 1 to 64 letters, digits, - or _"
                    ))
                }
                None => format!("key-{}", &blake3::hash(key.as_bytes()).to_hex()[..16]),
            };
            out.push((key, Tenant(spaced.then(|| ns.into()))));
        }
        Ok(Some(Self(out)))
    }
}

/// Anthropic's header of the API key.
const X_API_KEY: header::HeaderName = header::HeaderName::from_static("x-api-key");

/// Passes a request whose bearer token (or `x-api-key`) is one of `keys`, with its tenant; answers any other
/// with a 401.
pub async fn require_key(
    State(keys): State<Arc<Keys>>,
    mut request: Request,
    next: Next,
) -> Response {
    // Two credentials are one too many: which one a proxy or this server would read differs.
    for (name, shown) in [
        (header::AUTHORIZATION, "Authorization"),
        (X_API_KEY, "x-api-key"),
    ] {
        if request.headers().get_all(name).iter().count() > 1 {
            let e = ApiError::bad(format!("send one {shown} header, not several"));
            return e.with_param(shown).into_response();
        }
    }
    // Anthropic's clients send the key as `x-api-key`.
    let headers = request.headers();
    let sent = (headers.get(header::AUTHORIZATION))
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .or_else(|| headers.get(X_API_KEY).and_then(|v| v.to_str().ok()));
    // Every key is compared, so that the time taken says nothing of which one matched.
    let tenant = sent.and_then(|sent| {
        keys.0.iter().fold(None, |found, (key, tenant)| {
            match same(sent.as_bytes(), key.as_bytes()) {
                true => Some(tenant.clone()),
                false => found,
            }
        })
    });
    match tenant {
        Some(t) => {
            request.extensions_mut().insert(t);
            next.run(request).await
        }
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "a valid API key is required: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
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
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer k1"), Some("k1"));
        assert_eq!(bearer("bearer k1"), Some("k1"));
        assert_eq!(bearer("BEARER   k1"), Some("k1"));
        assert_eq!(bearer("Basic k1"), None);
        assert_eq!(bearer("Bearerk1"), None);
    }

    #[test]
    fn several_keys_are_tenants_and_one_key_is_none() {
        let one = Keys::new(&["k1".into()], None).unwrap().unwrap();
        assert_eq!(one.0[0].1.name("x"), "x");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys");
        std::fs::write(&file, "# tenants\nalice  sk-a\n\nsk-b\n").unwrap();
        let keys = Keys::new(&["k1".into()], Some(&file)).unwrap().unwrap();
        let names: Vec<String> = keys.0.iter().map(|(_, t)| t.name("x")).collect();
        assert_eq!(names[1], "alice/x");
        assert!(names[0].starts_with("key-") && names[2].starts_with("key-"));
        assert_ne!(names[0], names[2]);
        assert!(Keys::new(&["k".into(), "k".into()], None).is_err());
        std::fs::write(&file, "al/ice sk-a\n").unwrap();
        assert!(Keys::new(&[], Some(&file)).is_err());
        assert!(Keys::new(&[], None).unwrap().is_none());
    }
}

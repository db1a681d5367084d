//! How the server meets its operators and browsers: log lines as text or JSON, and the
//! origins a browser page may call it from (CORS).

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// How log lines are written.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal).
    Text,
    /// One JSON object per line, with the request's span (method, path) beside each event's
    /// fields: for log collectors.
    Json,
}

/// Request lines and the library's warnings on stderr, in `format`; `RUST_LOG` filters
/// (default info).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    // A host that set its own subscriber (or served before) keeps it.
    let _already_set = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

/// The CORS layer for `origins` (`*`: any), or none when no origin is given: browsers then
/// refuse pages of other origins, as they do by default. What a page may send is what the
/// API reads: every method a route takes (`GET`, `POST`, `DELETE`), a JSON body, a bearer key
/// and a conversation's name.
///
/// # Errors
/// An origin that is not a valid header value.
pub fn cors(origins: &[String]) -> Result<Option<CorsLayer>, String> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = match origins.iter().any(|o| o == "*") {
        true => AllowOrigin::any(),
        false => AllowOrigin::list(
            origins
                .iter()
                .map(|o| HeaderValue::from_str(o).map_err(|_| format!("bad origin {o:?}")))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("x-conversation-id"),
            ])
            .max_age(Duration::from_secs(600)),
    ))
}

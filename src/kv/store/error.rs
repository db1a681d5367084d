//! Why the store (a folder or Redis) failed a request: typed, with what the file system said
//! kept as the source, and Redis's error kind and detail (never its URL, which may hold a
//! password).

use std::path::PathBuf;
use std::sync::Arc;

use crate::kv::ChunkUnavailable;

/// Why the store failed a request.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The file system failed on a file or folder of the store.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Redis refused the request, or could not be reached in time.
    #[error("redis ({kind:?}): {detail}")]
    Redis {
        /// How the request failed.
        kind: RedisFailure,
        /// What the client or the server said.
        detail: String,
    },
    /// Redis failed recently and is left alone for a while before the next try.
    #[error("redis is unreachable (waiting to reconnect)")]
    BackingOff,
    /// The store's writer thread is gone (it panicked): nothing more is written.
    #[error("the store's writer thread stopped")]
    WriterStopped,
    /// What the store holds or was given cannot be used (a manifest that could not be built).
    #[error("{0}")]
    Invalid(String),
    /// A chunk's bytes never arrived to be written (a device copy failed).
    #[error("the chunk's bytes never arrived: {0}")]
    Unavailable(#[source] ChunkUnavailable),
}

/// How a request to Redis failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedisFailure {
    /// No answer within the deadline.
    Timeout,
    /// The connection was refused, dropped or broken.
    Connection,
    /// The credentials were refused.
    Authentication,
    /// The server answered with an error.
    Server,
    /// Anything else (a malformed URL, an unexpected reply, TLS).
    Other,
}

/// Equal when they are the same failure: the same variant, and the same path and OS error
/// kind, or the same Redis failure and detail.
impl PartialEq for StoreError {
    fn eq(&self, other: &Self) -> bool {
        use StoreError as E;
        match (self, other) {
            (E::Io { path: a, source: x }, E::Io { path: b, source: y }) => {
                a == b && x.kind() == y.kind()
            }
            (E::Redis { kind: a, detail: x }, E::Redis { kind: b, detail: y }) => a == b && x == y,
            (E::Invalid(a), E::Invalid(b)) => a == b,
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

impl Eq for StoreError {}

impl StoreError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            path: path.into(),
            source: Arc::new(source),
        }
    }

    pub(crate) fn redis(e: &redis::RedisError) -> Self {
        let kind = match e.kind() {
            _ if e.is_timeout() => RedisFailure::Timeout,
            _ if e.is_connection_refusal() || e.is_connection_dropped() => RedisFailure::Connection,
            redis::ErrorKind::Io => RedisFailure::Connection,
            redis::ErrorKind::AuthenticationFailed => RedisFailure::Authentication,
            redis::ErrorKind::Server(_) => RedisFailure::Server,
            _ => RedisFailure::Other,
        };
        StoreError::Redis {
            kind,
            detail: e.detail().unwrap_or("request failed").to_string(),
        }
    }

    /// The kind of I/O failure it amounts to (what a chunk's refusal records).
    pub(crate) fn io_kind(&self) -> std::io::ErrorKind {
        match self {
            StoreError::Io { source, .. } => source.kind(),
            StoreError::Redis {
                kind: RedisFailure::Timeout,
                ..
            } => std::io::ErrorKind::TimedOut,
            StoreError::Redis {
                kind: RedisFailure::Connection,
                ..
            } => std::io::ErrorKind::ConnectionAborted,
            StoreError::BackingOff => std::io::ErrorKind::NotConnected,
            _ => std::io::ErrorKind::Other,
        }
    }
}

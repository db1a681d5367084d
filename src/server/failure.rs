//! Why `pensieve-server` could not serve, as a type a caller can branch on (the Python
//! package's `serve` tells `--help` from a refused flag from a model it could not load).

/// A failure to serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The command line was refused, or asked for `--help` or `--version` (clap's
    /// `use_stderr` is false for those: print it and stop).
    #[error(transparent)]
    Args(#[from] clap::Error),
    /// A flag's value was refused when it was read (an origin, the API key file).
    #[error("{0}")]
    Flag(String),
    /// The model, the store or the engine thread: the library's typed error.
    #[error(transparent)]
    Engine(#[from] crate::Error),
    /// The operating system refused what serving needs: the address taken, no runtime.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

impl ServeError {
    /// An I/O failure while `what`.
    pub(super) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { what, source }
    }
}

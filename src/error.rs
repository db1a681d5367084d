//! The crate's error type: one `thiserror` enum, typed fields, `#[non_exhaustive]` so that new
//! failure kinds are not breaking changes.

use std::path::PathBuf;

use crate::ids::{ConversationId, RequestId};
use crate::kv::{StoreError, Violation};

/// Everything pensieve can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed inside candle (shape mismatch, device error, ...).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),

    /// A file could not be read or written.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file or folder involved.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },

    /// The store could not be reached, or refused the credentials, when the engine was built;
    /// or a conversation's stored state could not be read when asked for. (Once running, an
    /// unreachable store only costs recomputes.)
    #[error("store unavailable ({what}): {source}")]
    Store {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: StoreError,
    },

    /// No conversation is stored under this name (in this engine, or its shared store).
    #[error("no conversation named {0:?} is stored")]
    NotStored(String),

    /// A named conversation's stored state is damaged (its manifest missing while the name is
    /// registered, empty, cut short or inconsistent): refused rather than taken for a new,
    /// empty conversation. Nothing of it is deleted, so that it can be inspected or repaired.
    #[error("conversation {name:?} is stored but its state is damaged: {cause}")]
    StoreDamaged {
        /// The conversation's name.
        name: String,
        /// What is wrong with it.
        cause: String,
    },

    /// A named conversation is stored by engines of another model, weight format, KV
    /// precision or chunk size, whose KV and tokens this engine cannot continue.
    #[error("conversation {name:?} is stored under another model or format ({owner}): open it with that one, or use another name")]
    StoredElsewhere {
        /// The conversation's name.
        name: String,
        /// The model and format that store it.
        owner: String,
    },

    /// A model named by its asset name (the default among them) has not been fetched into the
    /// asset cache yet.
    #[error(
        "model file {path} not found: put the file there (the asset cache is $PENSIEVE_CACHE, else ~/.cache/pensieve; in a checkout of pensieve `scripts/fetch-assets{fetch_args}` fetches it), or load the model from a file or the Hugging Face hub instead"
    )]
    AssetsMissing {
        /// Where the model was expected.
        path: PathBuf,
        /// The arguments that make the script fetch it (empty for the default model).
        fetch_args: String,
    },

    /// A model file is present but unusable: wrong architecture, missing tensor or metadata,
    /// inconsistent shapes, corrupt bytes.
    #[error("invalid model {what}: {reason}")]
    InvalidModel {
        /// The file or key that was wrong.
        what: String,
        /// Why it is unusable.
        reason: String,
    },

    /// Building or running the tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// The chat template shipped with the model did not compile or render.
    #[error("chat template error: {0}")]
    ChatTemplate(#[from] minijinja::Error),

    /// Fetching a model through the Hugging Face hub (or its local cache) failed.
    #[error("hub error for {repo}{}: {source}", file.as_ref().map(|f| format!(", {f}")).unwrap_or_default())]
    Hub {
        /// The repository id.
        repo: String,
        /// The file asked for, if the failure is one file's.
        file: Option<String>,
        /// What the hub client said.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A workload file (ShareGPT dump or replay trace) is malformed.
    #[error("invalid workload {what}: {reason}")]
    InvalidWorkload {
        /// The file (and line) involved.
        what: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An attention batch description does not fit the tensors it is applied to.
    #[error("invalid attention batch: {0}")]
    InvalidBatch(String),

    /// A copy of KV between the device pool and host memory failed (the chunk is recomputed).
    #[error("KV copy failed: {0}")]
    Transfer(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// A chunk's KV bytes were not there to copy: a device copy or a store read failed (the
    /// chunk is recomputed).
    #[error("KV bytes unavailable: {0}")]
    Unavailable(#[from] crate::kv::ChunkUnavailable),

    /// The attention op takes head dimensions in pairs; this one is odd.
    #[error("head dimension {head_dim} is not supported (it must be even)")]
    UnsupportedHeadDim {
        /// The head dimension.
        head_dim: usize,
    },

    /// A token id outside the model's vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfVocab {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },

    /// A position beyond the model's context window.
    #[error("position {position} is beyond the context window of {window} tokens")]
    ContextOverflow {
        /// The offending position.
        position: usize,
        /// The model's window.
        window: usize,
    },

    /// An engine or service configuration value is out of range, or values disagree.
    #[error("invalid configuration of {field}: {reason}")]
    InvalidConfig {
        /// The setting at fault, as the configuration names it (`kv_chunk_tokens`, ...).
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },

    /// No open conversation has this id (never opened, or closed).
    #[error("unknown {0}")]
    UnknownConversation(ConversationId),

    /// No queued or running turn has this id (never submitted, or already finished).
    #[error("unknown or finished {0}")]
    UnknownRequest(RequestId),

    /// The conversation already has a turn queued or running.
    #[error("{0} already has a turn in progress")]
    ConversationBusy(ConversationId),

    /// A conversation is opened under a name another one has.
    #[error("a conversation named {0:?} already exists")]
    ConversationExists(String),

    /// A turn with no text or no tokens.
    #[error("empty turn")]
    EmptyTurn,

    /// A turn's parameters that cannot be honoured (sampling values, a constraint that does
    /// not compile or cannot be followed, a hint past the history).
    #[error("invalid {param}: {reason}")]
    InvalidParams {
        /// The parameter at fault, as a request names it (`temperature`, `response_format`,
        /// ...): a server reports it as OpenAI's `param`.
        param: &'static str,
        /// What is wrong with its value.
        reason: String,
    },

    /// The request can never fit the configured budgets, however much is evicted.
    #[error("request needs {needed} device slots but the budgets allow {available}")]
    BudgetTooSmall {
        /// Slots the request needs.
        needed: usize,
        /// Slots the pool can give one request.
        available: usize,
    },

    /// Pinning the conversation would take pinned KV past its share of the tiers (half of the
    /// device pool and host tier together): a capacity limit, not a malformed request.
    #[error(
        "pinned conversations would hold {tokens} tokens of KV; at most {limit} may be pinned"
    )]
    PinLimit {
        /// Tokens pinned conversations would hold.
        tokens: usize,
        /// Tokens they may hold.
        limit: usize,
    },

    /// The engine's own bookkeeping broke an invariant (a bug in pensieve, never the caller's
    /// doing). The turns involved fail; the engine keeps serving the others.
    #[error("internal invariant violated: {0}")]
    Invariant(#[from] Violation),

    /// A request to the service that names no valid turn: an empty message list, a last
    /// message that is not the user's, a system message past the first, an empty prompt.
    #[error("invalid request ({field}): {reason}")]
    InvalidRequest {
        /// The part of the request at fault (`messages`, `n`, `name`, ...).
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The service already has its limit of turns queued or running: a capacity condition,
    /// to retry later.
    #[error("the queue is full ({in_flight} turns in flight); retry later")]
    QueueFull {
        /// Turns queued or running.
        in_flight: usize,
    },

    /// The service is stopping (or its engine thread has ended) and takes no new work.
    #[error("the service is stopping")]
    ServiceStopped,

    /// The engine thread panicked (a bug in pensieve, never the caller's doing); its log
    /// line says where.
    #[error("the engine thread died (a bug in pensieve); see the log")]
    EngineDied,

    /// A named conversation's turn was generated but the store did not confirm its state
    /// (disk full, Redis unreachable): the engine dropped its copy, so the next turn resumes
    /// what the store holds. Resend the turn.
    #[error("the reply was generated but the store did not confirm it ({0}); resend the turn")]
    NotDurable(#[source] StoreError),

    /// A stored conversation's deletion (a close, or a turn that ended it) could not be
    /// written (disk failing, Redis unreachable): the store keeps the conversation, which
    /// continues from there. Retry the deletion.
    #[error("the store could not delete the conversation ({0}); it is kept: retry")]
    NotRemoved(#[source] StoreError),

    /// A named conversation's turn was generated but not stored, because another engine
    /// stored a turn of it meanwhile. Resend the turn to continue the stored conversation.
    #[error("the reply was generated but not stored: {0}; resend the turn to continue the stored conversation")]
    StoreConflict(String),

    /// The operation needs a feature this build or device does not have.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// What kind of failure an [`Error`] is: what its caller can do about it. A server derives
/// its status codes from this, and equal kinds are the same outcome to a caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request or configuration is wrong; it fails the same way until it is changed.
    InvalidInput,
    /// What the request names does not exist (a conversation, a turn, a stored name).
    NotFound,
    /// The request clashes with the state it finds (a turn in progress, a name taken, a
    /// conversation stored by another model or engine).
    Conflict,
    /// A capacity limit: retry later, or with less.
    Capacity,
    /// The store or the service is unavailable for now: retry later.
    Unavailable,
    /// The model's files cannot be used (missing, malformed, unsupported).
    Model,
    /// A file could not be read or written.
    Io,
    /// A bug in pensieve, never the caller's doing.
    Internal,
}

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        use Error as E;
        match self {
            E::ContextOverflow { .. }
            | E::EmptyTurn
            | E::InvalidParams { .. }
            | E::TokenOutOfVocab { .. }
            | E::BudgetTooSmall { .. }
            | E::ChatTemplate(_)
            | E::InvalidRequest { .. }
            | E::InvalidConfig { .. }
            | E::InvalidWorkload { .. }
            | E::Unsupported(_) => ErrorKind::InvalidInput,
            E::UnknownConversation(_) | E::UnknownRequest(_) | E::NotStored(_) => {
                ErrorKind::NotFound
            }
            E::ConversationBusy(_)
            | E::ConversationExists(_)
            | E::StoredElsewhere { .. }
            | E::StoreDamaged { .. }
            | E::StoreConflict(_) => ErrorKind::Conflict,
            E::QueueFull { .. } | E::PinLimit { .. } => ErrorKind::Capacity,
            E::Store { .. } | E::NotDurable(_) | E::NotRemoved(_) | E::ServiceStopped => {
                ErrorKind::Unavailable
            }
            E::AssetsMissing { .. }
            | E::InvalidModel { .. }
            | E::Tokenizer(_)
            | E::Hub { .. }
            | E::UnsupportedHeadDim { .. } => ErrorKind::Model,
            E::Io { .. } => ErrorKind::Io,
            E::Candle(_)
            | E::InvalidBatch(_)
            | E::Transfer(_)
            | E::Unavailable(_)
            | E::Invariant(_)
            | E::EngineDied => ErrorKind::Internal,
        }
    }
}

/// `Result` with pensieve's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid_model(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Error::InvalidModel {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}

//! Ids of the engine's handles. They live apart from the engine so that the layers below it
//! (`scheduler`, `kv`) can name conversations and turns without importing the engine.

use std::fmt;

/// Handle of an open conversation. Opaque: only the engine that opened it hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationId(pub(crate) u64);

impl ConversationId {
    /// Its number, unique in its engine (for logs and transports).
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ConversationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conversation {}", self.0)
    }
}

/// Handle of a submitted turn. Opaque, as [`ConversationId`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub(crate) u64);

impl RequestId {
    /// Its number, unique in its engine (for logs and transports).
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

//! Editing a named conversation without a turn, as one operation: [`Service::edit`] reads
//! the conversation, lets the caller decide what changes, writes it and answers once the store
//! has it, all on the engine thread between steps, under the same ownership as a turn. Two
//! edits of one conversation, an edit and its deletion, or an edit and a turn never interleave
//! their reads and writes: each sees what the one before it wrote, so none is lost (a host that
//! read in one call and wrote in another lost the writes that came between).
//!
//! An edit decides on stored state only: while the conversation's latest write (a turn's end, an
//! edit) is queued, it waits for it. An edit of a stored conversation is acknowledged only once
//! its manifest is durable, as a turn's end is: while the store is unreachable it fails ([`Error::NotDurable`]) and the
//! store keeps what it had. Another engine of a fleet that stored the conversation between
//! this one's read and its write makes the write a conflict: the edit is read and decided again
//! on the stored state, a few times, before [`Error::StoreConflict`] is returned.

use std::sync::Arc;

use serde_json::{Map, Value};
use tokio::sync::oneshot;

use super::driver::Driver;
use super::Service;
use crate::engine::Fetched;
use crate::model::Message;
use crate::{Error, Result};

/// A named conversation as [`Service::edit`] reads it: its transcript and the host's data
/// kept with it ([`crate::engine::ConversationOptions::attributes`]).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Record {
    /// Its messages, replies included.
    pub messages: Vec<Message>,
    /// The host's data.
    pub attributes: Map<String, Value>,
}

impl Record {
    /// A record of `messages` and `attributes`.
    pub fn new(messages: Vec<Message>, attributes: Map<String, Value>) -> Self {
        Self {
            messages,
            attributes,
        }
    }
}

/// What an edit does to the conversation it read.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Change {
    /// Nothing: a read.
    Keep,
    /// New host data; the history stays (with its KV).
    Attributes(Map<String, Value>),
    /// A new history and host data (made if the name holds none): the next turn continues it,
    /// with the KV of the prefix it shares with the old history reused by content.
    Rewrite(Record),
    /// The conversation is closed, and deleted from the store.
    Remove,
}

/// How many times an edit is decided again after another engine stored the conversation
/// between its read and its write.
const CONFLICT_RETRIES: usize = 4;

/// The outcome of an edit on the engine thread: the caller's refusal, or its value and what
/// to wait for before answering with it.
pub(super) enum Edited<T, E> {
    Refused(E),
    Done(T, Option<oneshot::Receiver<Result<()>>>),
    /// The conversation's latest write is not stored yet: decided again once it is done.
    Behind(oneshot::Receiver<Result<()>>),
}

/// An edit's decision: what changes and what the caller answers, or its refusal (nothing
/// changes). Given the conversation as read (`None`: the name holds none).
type Decide<T, E> = dyn Fn(Option<&Record>) -> std::result::Result<(Change, T), E> + Send + Sync;

impl Service {
    /// Reads the conversation named `name`, asks `decide` what to change, makes that change
    /// and answers once the store has it: one operation on the engine thread, which no turn or
    /// other edit of the name interleaves with. `decide` is given the conversation (`None`
    /// when the name holds none: [`Change::Rewrite`] then makes it) and returns the change
    /// with what to answer, or a refusal of its own, answered as `Ok(Err(refusal))` with
    /// nothing changed. It may be called again (another engine of a fleet wrote the
    /// conversation meanwhile), so it must only decide.
    ///
    /// # Errors
    /// [`Error::ConversationBusy`] while a turn of it runs; [`Error::NotStored`] for a change
    /// other than a rewrite of a name that holds none; [`Error::NotDurable`] (the store could
    /// not take it: it keeps what it had), [`Error::NotRemoved`], [`Error::StoreConflict`]
    /// (still conflicting after a few tries); as [`Service::resume`].
    pub async fn edit<T, E, F>(&self, name: &str, decide: F) -> Result<std::result::Result<T, E>>
    where
        T: Send + 'static,
        E: Send + 'static,
        F: Fn(Option<&Record>) -> std::result::Result<(Change, T), E> + Send + Sync + 'static,
    {
        let decide: Arc<Decide<T, E>> = Arc::new(decide);
        let mut tries = 0;
        loop {
            let fetched = self.fetched(Some(name)).await;
            let (name, decide) = (name.to_string(), decide.clone());
            let edited = self
                .call(move |d| d.edit(&name, fetched, &*decide))
                .await??;
            let (value, wait) = match edited {
                Edited::Refused(e) => return Ok(Err(e)),
                Edited::Done(value, wait) => (value, wait),
                Edited::Behind(done) => {
                    done.await.map_err(|_| Error::ServiceStopped)??;
                    continue;
                }
            };
            let stored = match wait {
                Some(wait) => wait.await.map_err(|_| Error::ServiceStopped)?,
                None => Ok(()),
            };
            match stored {
                Ok(()) => return Ok(Ok(value)),
                Err(Error::StoreConflict(_)) if tries < CONFLICT_RETRIES => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Driver {
    /// [`Service::edit`]'s operation on the engine thread: the name brought up to date with
    /// the store (`fetched`: what was read of it), read, changed as `decide` says.
    pub(super) fn edit<T, E>(
        &mut self,
        name: &str,
        fetched: Option<Fetched>,
        decide: &Decide<T, E>,
    ) -> Result<Edited<T, E>> {
        let conv = match self.resume(name, fetched) {
            Ok(conv) => Some(conv),
            Err(Error::NotStored(_)) => None,
            Err(e) => return Err(e),
        };
        // Deciding on a state the store may still refuse would build on what may be lost
        // (another engine's write can win): the edit waits for the write before it.
        if let Some(behind) = conv.and_then(|c| self.behind(c)) {
            return Ok(Edited::Behind(behind));
        }
        let record = match conv {
            Some(c) => Some(Record::new(
                self.engine.messages(c)?.to_vec(),
                self.engine.attributes(c)?.clone(),
            )),
            None => None,
        };
        let (change, value) = match decide(record.as_ref()) {
            Ok(decided) => decided,
            Err(e) => return Ok(Edited::Refused(e)),
        };
        let gone = || Error::NotStored(name.to_string());
        let wait = match change {
            Change::Keep => None,
            Change::Attributes(attributes) => {
                let conv = conv.ok_or_else(gone)?;
                self.engine.set_attributes(conv, attributes)?;
                self.hold_durable(conv)
            }
            Change::Rewrite(Record {
                messages,
                attributes,
            }) => {
                let conv = self.rewrite(name, messages, attributes)?;
                self.hold_durable(conv)
            }
            Change::Remove => {
                let (reply, answer) = oneshot::channel();
                self.close(conv.ok_or_else(gone)?, reply);
                Some(answer)
            }
        };
        // What an edit resumed counts against the service's limit, as a turn's conversation.
        self.close_old();
        Ok(Edited::Done(value, wait))
    }
}

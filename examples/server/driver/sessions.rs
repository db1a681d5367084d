//! Which conversation a request continues: by transcript (a client resending its history),
//! by token prefix (completions), or by name (checked against the store when there is one);
//! and which conversations close when there are too many.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;

use pensieve::engine::{ConversationId, ConversationOptions, Turn};
use pensieve::model::Message;

use super::{Driver, Session};
use crate::api::ApiError;

impl Driver {
    /// The conversation a chat request continues (or a new one with its history), and its
    /// turn; `true` if it was opened for this request.
    pub(super) fn chat_conversation(
        &mut self,
        messages: Vec<Message>,
        name: Option<String>,
    ) -> Result<(ConversationId, Turn, bool), ApiError> {
        let Some((last, history)) = messages.split_last() else {
            return Err(ApiError::bad("messages must not be empty"));
        };
        if last.role != "user" {
            return Err(ApiError::bad("the last message must be the user's"));
        }
        let turn = Turn::user(last.content.clone());
        if let (Some(n), true) = (&name, self.stored) {
            self.sync_named(n)?;
        }
        let continues = |s: &Session| {
            s.messages.as_deref() == Some(history) || (s.messages.is_some() && history.is_empty())
        };
        let found = match &name {
            Some(n) => self.by_name.get(n).copied(),
            None => self.by_content.get(&transcript_key(history)).copied(),
        };
        if let Some(conv) = found {
            match self.sessions.get(&conv) {
                Some(s) if s.busy => {
                    return Err(ApiError::new(
                        axum::http::StatusCode::CONFLICT,
                        "the conversation has a turn running",
                    ))
                }
                Some(s) if continues(s) => {
                    if let Some(key) = s.messages.as_deref().map(transcript_key) {
                        self.by_content.remove(&key);
                    }
                    if let Some(m) = self
                        .sessions
                        .get_mut(&conv)
                        .and_then(|s| s.messages.as_mut())
                    {
                        m.push(last.clone());
                    }
                    return Ok((conv, turn, false));
                }
                // A named conversation whose history the request rewrote starts over.
                _ => self.forget(conv, true),
            }
        }
        let (system, rest) = match history.split_first() {
            Some((first, rest)) if first.role == "system" => (Some(first.content.clone()), rest),
            _ => (None, history),
        };
        if rest.iter().any(|m| m.role == "system") {
            return Err(ApiError::bad("a system message may only come first"));
        }
        let conv = self
            .engine
            .open(ConversationOptions {
                system,
                history: rest.to_vec(),
                name: name.clone().filter(|_| self.stored),
            })
            .map_err(|e| ApiError::from_engine(&e))?;
        if let Some(n) = &name {
            self.by_name.insert(n.clone(), conv);
        }
        self.sessions.insert(
            conv,
            Session {
                messages: Some(messages.clone()),
                name,
                last_used: Instant::now(),
                busy: false,
            },
        );
        Ok((conv, turn, true))
    }

    /// The idle completion conversation whose tokens are the longest proper prefix of
    /// `tokens` (and the tokens past it), or a new one.
    pub(super) fn completion_conversation(
        &mut self,
        tokens: Vec<u32>,
    ) -> Result<(ConversationId, Vec<u32>, bool), ApiError> {
        if tokens.is_empty() {
            return Err(ApiError::bad("the prompt is empty"));
        }
        let best = self
            .sessions
            .iter()
            .filter(|(_, s)| s.messages.is_none() && !s.busy)
            .filter_map(|(&c, _)| {
                let have = self.engine.tokens(c).ok()?;
                (have.len() < tokens.len() && tokens.starts_with(have)).then_some((c, have.len()))
            })
            .max_by_key(|&(_, n)| n);
        if let Some((conv, n)) = best {
            return Ok((conv, tokens[n..].to_vec(), false));
        }
        let conv = self
            .engine
            .open(ConversationOptions::default())
            .map_err(|e| ApiError::from_engine(&e))?;
        self.sessions.insert(
            conv,
            Session {
                messages: None,
                name: None,
                last_used: Instant::now(),
                busy: false,
            },
        );
        Ok((conv, tokens, true))
    }

    /// Brings the session of the stored conversation `name` up to date: the engine checks
    /// its copy against the store (another server may have served a turn since) or loads it
    /// from there if this server holds none.
    fn sync_named(&mut self, name: &str) -> Result<(), ApiError> {
        let held = self.by_name.get(name).copied();
        if held.is_some_and(|c| self.sessions.get(&c).is_some_and(|s| s.busy)) {
            return Ok(());
        }
        match self.engine.resume(name) {
            Ok(conv) if Some(conv) == held => Ok(()),
            Ok(conv) => {
                // The engine replaced (or never had) this server's copy.
                if let Some(old) = held {
                    self.unlink(old);
                }
                let messages = self.engine.messages(conv).map(<[_]>::to_vec).ok();
                self.by_name.insert(name.to_string(), conv);
                let session = Session {
                    messages,
                    name: Some(name.to_string()),
                    last_used: Instant::now(),
                    busy: false,
                };
                self.sessions.insert(conv, session);
                Ok(())
            }
            Err(pensieve::Error::NotStored(_)) => Ok(()),
            Err(e) => {
                if matches!(e, pensieve::Error::StoreDamaged { .. }) {
                    tracing::warn!(error = %e, "refused a turn: the stored conversation is damaged");
                }
                Err(ApiError::from_engine(&e))
            }
        }
    }

    /// Takes back the user message a turn that did not happen had added to `conv`'s session
    /// (the engine rolled the turn back), so that a client resending its history continues
    /// the conversation where it was.
    pub(super) fn unsend(&mut self, conv: ConversationId) {
        let Some(s) = self.sessions.get_mut(&conv) else {
            return;
        };
        let Some(m) = s.messages.as_mut() else {
            return;
        };
        if m.last().is_some_and(|m| m.role == "user") {
            m.pop();
        }
        if s.name.is_none() {
            self.by_content.insert(transcript_key(m), conv);
        }
    }

    /// Forgets how to find a conversation.
    fn unlink(&mut self, conv: ConversationId) -> Option<Session> {
        let s = self.sessions.remove(&conv)?;
        if let Some(key) = s.messages.as_deref().map(transcript_key) {
            if self.by_content.get(&key) == Some(&conv) {
                self.by_content.remove(&key);
            }
        }
        if let Some(n) = &s.name {
            self.by_name.remove(n);
        }
        Some(s)
    }

    /// Forgets a conversation and closes it; a stored one that has not `ended` is only dropped
    /// from this engine, so that it can be resumed (here or on another server).
    pub(super) fn forget(&mut self, conv: ConversationId, ended: bool) {
        let named = self.unlink(conv).is_some_and(|s| s.name.is_some());
        let _ = match self.stored && named && !ended {
            true => self.engine.detach(conv),
            false => self.engine.close(conv),
        };
    }

    /// Closes the least recently used idle sessions past `max_sessions`.
    pub(super) fn close_old(&mut self) {
        while self.sessions.len() > self.max_sessions {
            let oldest = self
                .sessions
                .iter()
                .filter(|(_, s)| !s.busy)
                .min_by_key(|(_, s)| s.last_used)
                .map(|(&c, _)| c);
            match oldest {
                Some(c) => self.forget(c, false),
                None => return,
            }
        }
    }
}

/// The key of a chat transcript in `Driver::by_content`.
pub(super) fn transcript_key(messages: &[Message]) -> u64 {
    let mut h = DefaultHasher::new();
    for m in messages {
        m.role.hash(&mut h);
        m.content.hash(&mut h);
    }
    h.finish()
}

//! Which conversation a request continues: by transcript (a client resending its history),
//! by token prefix (completions), or by name (checked against the store when there is one);
//! and which conversations close when there are too many.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use super::chat::{new_turn, split_system};
use super::Chat;
use crate::engine::{
    ConversationId, ConversationOptions, Durability, Engine, Fetched, Removing, Turn,
};
use crate::model::Message;
use crate::{Error, Result};

/// How a request found its conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Opened {
    /// It continues one held.
    Continued,
    /// It was opened for this request.
    New,
    /// It was opened unnamed for a request that names it: it takes the name (in a store,
    /// its first manifest; over a conversation of that name whose history the request
    /// rewrote, that one's place) once its turn has a reply, and closes otherwise, so that a
    /// refused, failed or cancelled request changes nothing stored.
    Naming(Naming),
}

/// A name a conversation takes once its turn has a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Naming {
    pub name: String,
    /// The conversation of that name it replaces, if any.
    pub replaces: Option<ConversationId>,
}

/// A conversation the service opened for a chat or a completion, and keeps for clients to
/// continue.
pub(super) struct Session {
    /// Its chat transcript (with the replies), or `None` for a completion.
    messages: Option<Vec<Message>>,
    /// What its template renders beside the messages.
    setup: Setup,
    name: Option<String>,
    /// Its place in the `idle` order (a tick), while no turn of it runs.
    last_used: u64,
    busy: bool,
}

/// What a conversation's template renders beside its messages: the tools it lists and the
/// variables it reads. A chat continues a conversation only with the same.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Setup {
    pub(super) tools: Vec<serde_json::Value>,
    pub(super) vars: serde_json::Map<String, serde_json::Value>,
}

impl Setup {
    /// The options of a new unnamed conversation of this setup: the system prompt, then
    /// `history`, with the host's `attributes`.
    pub(super) fn options(
        &self,
        system: Option<String>,
        history: &[Message],
        attributes: serde_json::Map<String, serde_json::Value>,
    ) -> ConversationOptions {
        ConversationOptions {
            system,
            history: history.to_vec(),
            name: None,
            tools: self.tools.clone(),
            template_vars: self.vars.clone(),
            attributes,
        }
    }
}

/// The conversations the service holds, and how a request finds one again: by the transcript
/// a client resends, by name, or (for completions) by token prefix; the least recently used
/// idle ones close past `max`. Its fields are its own: the driver asks through the methods
/// below, which take the engine where a conversation opens, resumes or closes.
pub(super) struct Sessions {
    map: HashMap<ConversationId, Session>,
    /// Idle sessions by when they were last used, oldest first.
    idle: BTreeSet<(u64, ConversationId)>,
    tick: u64,
    /// Chat sessions by the hash of their transcript.
    by_content: HashMap<u64, ConversationId>,
    by_name: HashMap<String, ConversationId>,
    /// Idle sessions kept at most.
    max: usize,
    /// Whether the engine stores conversations (named ones persist).
    stored: bool,
}

impl Sessions {
    pub fn new(max: usize, stored: bool) -> Self {
        Self {
            map: HashMap::new(),
            idle: BTreeSet::new(),
            tick: 0,
            by_content: HashMap::new(),
            by_name: HashMap::new(),
            max,
            stored,
        }
    }

    /// How many conversations are held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// A turn of `conv` has a reply: its transcript takes it, and it becomes findable by the
    /// new transcript and idle.
    pub fn replied(&mut self, conv: ConversationId, reply: Message) {
        self.mark_idle(conv);
        if let Some(s) = self.map.get_mut(&conv)
            && let Some(m) = &mut s.messages
        {
            m.push(as_sent(false, reply));
            if s.name.is_none() {
                self.by_content.insert(transcript_key(m, &s.setup), conv);
            }
        }
    }

    /// The conversation a chat continues (or a new one with its history), its turn (the
    /// messages after the last assistant message: the user's, or tools' results), and how it
    /// was found.
    pub fn chat_conversation(
        &mut self,
        engine: &mut Engine,
        chat: Chat,
        fetched: Option<Fetched>,
    ) -> Result<(ConversationId, Turn, Opened)> {
        let Chat {
            messages,
            name,
            tools,
            template_vars,
            existing,
            ..
        } = chat;
        let setup = Setup {
            tools,
            vars: template_vars,
        };
        let (history, last, turn) = new_turn(&messages)?;
        let thinks = engine.model().template().is_some_and(|t| t.thinks());
        let sent: Vec<Message> = history.iter().map(|m| as_sent(thinks, m.clone())).collect();
        if let (Some(n), true) = (&name, self.stored) {
            self.sync_named(engine, n, fetched)?;
        }
        let found = self.found(name.as_deref(), &sent, &setup);
        if let (None, Some(n), true) = (found, &name, existing) {
            return Err(Error::NotStored(n.clone()));
        }
        let mut replaces = None;
        let mut claimed = false;
        if let Some(conv) = found {
            match self.map.get_mut(&conv) {
                Some(s) if s.busy => return Err(Error::ConversationBusy(conv)),
                Some(s) if continues(s, &sent, &setup) => {
                    if let Some(m) = &mut s.messages {
                        let key = transcript_key(m, &s.setup);
                        m.extend_from_slice(last);
                        self.by_content.remove(&key);
                    }
                    return Ok((conv, turn, Opened::Continued));
                }
                // A named conversation whose history the request rewrote starts over, once
                // the new history's turn has a reply.
                Some(_) if name.is_some() => (replaces, claimed) = (Some(conv), true),
                _ => self.forget(engine, conv, true),
            }
        }
        let (system, rest) = split_system(history)?;
        // A new name is claimed now (refused if another model keeps it), taken at the reply.
        if let (Some(n), false, true) = (&name, claimed, self.stored) {
            engine.check_name(n)?;
        }
        // What the host keeps with a name stays with it when a turn rewrites its history.
        let attributes = (replaces.and_then(|o| engine.attributes(o).ok()))
            .cloned()
            .unwrap_or_default();
        let conv = engine.open(setup.options(system, rest, attributes))?;
        let mut sent = sent;
        sent.extend_from_slice(last);
        self.add_session(conv, Some(sent), None, setup);
        let opened = match name {
            Some(name) => Opened::Naming(Naming { name, replaces }),
            None => Opened::New,
        };
        Ok((conv, turn, opened))
    }

    /// The session a chat names, or else the one whose transcript is its history as sent.
    fn found(&self, name: Option<&str>, sent: &[Message], setup: &Setup) -> Option<ConversationId> {
        match name {
            Some(n) => self.by_name.get(n).copied(),
            None => (self.by_content).get(&transcript_key(sent, setup)).copied(),
        }
    }

    /// Whether [`Sessions::chat_conversation`] would continue a held conversation with
    /// `chat` now, rather than open one with its history (a stored one not held yet counts as
    /// new).
    pub fn would_continue(&self, engine: &Engine, chat: &Chat) -> bool {
        let Ok((history, ..)) = new_turn(&chat.messages) else {
            return false;
        };
        let thinks = engine.model().template().is_some_and(|t| t.thinks());
        let sent: Vec<Message> = history.iter().map(|m| as_sent(thinks, m.clone())).collect();
        let setup = Setup {
            tools: chat.tools.clone(),
            vars: chat.template_vars.clone(),
        };
        let found = self.found(chat.name.as_deref(), &sent, &setup);
        found
            .and_then(|c| self.map.get(&c))
            .is_some_and(|s| continues(s, &sent, &setup))
    }

    /// Ends the turn of `new`, opened unnamed for a request that named it: with a reply
    /// (`replied`), `new` takes the name and, in a store, its first manifest, or the place of
    /// the conversation of that name it replaces; without one, `new` closes and what the name
    /// held stays as it was.
    ///
    /// # Errors
    /// The engine's refusal to store it under the name (nothing changed then, and `new` is
    /// closed).
    pub fn finish_naming(
        &mut self,
        engine: &mut Engine,
        new: ConversationId,
        naming: Naming,
        replied: bool,
    ) -> Result<()> {
        let Naming { name, replaces } = naming;
        if let Some(old) = replaces {
            self.mark_idle(old);
        }
        if !replied {
            self.forget(engine, new, true);
            return Ok(());
        }
        let taken = match replaces {
            Some(old) if self.stored && named(engine, old) => {
                engine.replace(old, new).map(|()| self.unlink(old))
            }
            Some(old) => self.close(engine, old, true).map(drop),
            None => Ok(()),
        };
        let taken = taken.and_then(|()| match self.stored && !named(engine, new) {
            true => engine.name(new, name.clone()),
            false => Ok(()),
        });
        if let Err(e) = taken {
            self.forget(engine, new, true);
            return Err(e);
        }
        if let Some(s) = self.map.get_mut(&new) {
            s.name = Some(name.clone());
            self.by_name.insert(name, new);
        }
        Ok(())
    }

    /// Gives the conversation named `name` the history `messages` and the host's data
    /// `attributes` without a turn (a client edited its items): a new conversation of that
    /// history takes the name, and the place of the one that held it, whose tools and
    /// template variables it keeps; it is returned. Its KV is computed at its next turn,
    /// shared by content with the old one's up to where the two differ, so that turn is what
    /// a stateless server computes on the new history. The caller has brought the name up to
    /// date with the store ([`Sessions::resume`]).
    ///
    /// # Errors
    /// [`Error::ConversationBusy`] while a turn of `name` runs; a system message past the
    /// first; the engine's refusal of the name or of the store (nothing changed then).
    pub fn rewrite(
        &mut self,
        engine: &mut Engine,
        name: &str,
        messages: Vec<Message>,
        attributes: serde_json::Map<String, serde_json::Value>,
    ) -> Result<ConversationId> {
        let old = self.by_name.get(name).copied();
        let session = old.and_then(|o| self.map.get(&o));
        if let (Some(o), Some(true)) = (old, session.map(|s| s.busy)) {
            return Err(Error::ConversationBusy(o));
        }
        let setup = session.map(|s| s.setup.clone()).unwrap_or_default();
        let (system, rest) = split_system(&messages)?;
        if let (None, true) = (old, self.stored) {
            engine.check_name(name)?;
        }
        let conv = engine.open(setup.options(system, rest, attributes))?;
        let thinks = engine.model().template().is_some_and(|t| t.thinks());
        let sent = messages.into_iter().map(|m| as_sent(thinks, m)).collect();
        self.add_session(conv, Some(sent), None, setup);
        let naming = Naming {
            name: name.to_string(),
            replaces: old,
        };
        self.finish_naming(engine, conv, naming, true)?;
        Ok(conv)
    }

    /// The idle completion conversation whose tokens are the longest proper prefix of
    /// `tokens` (and the tokens past it), or a new one.
    pub fn completion_conversation(
        &mut self,
        engine: &mut Engine,
        tokens: Vec<u32>,
    ) -> Result<(ConversationId, Vec<u32>, Opened)> {
        if tokens.is_empty() {
            return Err(Error::InvalidRequest {
                field: "prompt",
                reason: "the prompt is empty".into(),
            });
        }
        let best = self
            .map
            .iter()
            .filter(|(_, s)| s.messages.is_none() && !s.busy)
            .filter_map(|(&c, _)| {
                let have = engine.tokens(c).ok()?;
                (have.len() < tokens.len() && tokens.starts_with(have)).then_some((c, have.len()))
            })
            .max_by_key(|&(_, n)| n);
        if let Some((conv, n)) = best {
            return Ok((conv, tokens[n..].to_vec(), Opened::Continued));
        }
        let conv = engine.open(ConversationOptions::default())?;
        self.add_session(conv, None, None, Setup::default());
        Ok((conv, tokens, Opened::New))
    }

    /// A fork of the session `conv` before its new turn, as an unnamed session of its own.
    pub fn fork_session(
        &mut self,
        engine: &mut Engine,
        conv: ConversationId,
    ) -> Result<ConversationId> {
        let fork = engine.fork(conv, None)?;
        let session = self.map.get(&conv);
        let messages = session.and_then(|s| s.messages.clone());
        let setup = session.map(|s| s.setup.clone()).unwrap_or_default();
        self.add_session(fork, messages, None, setup);
        Ok(fork)
    }

    fn add_session(
        &mut self,
        conv: ConversationId,
        messages: Option<Vec<Message>>,
        name: Option<String>,
        setup: Setup,
    ) {
        self.tick += 1;
        let session = Session {
            messages,
            setup,
            name,
            last_used: self.tick,
            busy: false,
        };
        self.idle.insert((self.tick, conv));
        self.map.insert(conv, session);
    }

    pub fn mark_busy(&mut self, conv: ConversationId) {
        if let Some(s) = self.map.get_mut(&conv) {
            s.busy = true;
            self.idle.remove(&(s.last_used, conv));
        }
    }

    pub fn mark_idle(&mut self, conv: ConversationId) {
        if let Some(s) = self.map.get_mut(&conv) {
            self.idle.remove(&(s.last_used, conv));
            self.tick += 1;
            s.busy = false;
            s.last_used = self.tick;
            self.idle.insert((self.tick, conv));
        }
    }

    /// Brings the session of the stored conversation `name` up to date: the engine checks
    /// its copy against the store (another engine may have served a turn since) or loads it
    /// from there if this one holds none.
    fn sync_named(
        &mut self,
        engine: &mut Engine,
        name: &str,
        fetched: Option<Fetched>,
    ) -> Result<()> {
        let held = self.by_name.get(name).copied();
        if held.is_some_and(|c| self.map.get(&c).is_some_and(|s| s.busy)) {
            return Ok(());
        }
        match self.resume(engine, name, fetched) {
            Ok(_) | Err(Error::NotStored(_)) => Ok(()),
            Err(e) => {
                if matches!(e, Error::StoreDamaged { .. }) {
                    tracing::warn!(error = %e, "refused a turn: the stored conversation is damaged");
                }
                Err(e)
            }
        }
    }

    /// [`crate::engine::Engine::resume`] with what the store held of `name` (`None`: read it
    /// now), keeping the session of the name up to date.
    pub fn resume(
        &mut self,
        engine: &mut Engine,
        name: &str,
        fetched: Option<Fetched>,
    ) -> Result<ConversationId> {
        let held = self.by_name.get(name).copied();
        // Without a store, names live here only: the engine knows none.
        if let (false, Some(conv)) = (self.stored, held) {
            return Ok(conv);
        }
        let resumed = match fetched {
            Some(f) => engine.resume_with(name, f),
            None => engine.resume(name),
        };
        let conv = match resumed {
            Ok(conv) => conv,
            Err(e) => {
                // Removed from the store by another engine: the engine dropped its copy.
                if let Some(old) = held.filter(|&c| engine.tokens(c).is_err()) {
                    self.unlink(old);
                }
                return Err(e);
            }
        };
        if Some(conv) != held {
            // The engine replaced (or never had) this service's copy.
            if let Some(old) = held {
                self.unlink(old);
            }
            let messages = engine
                .messages(conv)
                .map(|m| m.iter().map(|m| as_sent(false, m.clone())).collect())
                .ok();
            let setup = Setup {
                tools: engine.tools(conv).map(<[_]>::to_vec).unwrap_or_default(),
                vars: engine.template_vars(conv).cloned().unwrap_or_default(),
            };
            self.by_name.insert(name.to_string(), conv);
            self.add_session(conv, messages, Some(name.to_string()), setup);
        }
        Ok(conv)
    }

    /// Takes back the user message a turn that did not happen had added to `conv`'s session
    /// (the engine rolled the turn back), so that a client resending its history continues
    /// the conversation where it was.
    pub fn unsend(&mut self, conv: ConversationId) {
        let Some(s) = self.map.get_mut(&conv) else {
            return;
        };
        let Some(m) = s.messages.as_mut() else {
            return;
        };
        while m
            .last()
            .is_some_and(|m| m.role == "user" || m.role == "tool")
        {
            m.pop();
        }
        if s.name.is_none() {
            self.by_content.insert(transcript_key(m, &s.setup), conv);
        }
    }

    /// Forgets how to find a conversation.
    fn unlink(&mut self, conv: ConversationId) {
        let Some(s) = self.map.remove(&conv) else {
            return;
        };
        self.idle.remove(&(s.last_used, conv));
        if let Some(key) = s.messages.as_deref().map(|m| transcript_key(m, &s.setup))
            && self.by_content.get(&key) == Some(&conv)
        {
            self.by_content.remove(&key);
        }
        if let Some(n) = &s.name {
            self.by_name.remove(n);
        }
    }

    /// Closes a conversation (deleting a stored one when `ended`), or only drops this
    /// engine's copy of a stored one that has not ended, so that it can be resumed (here or
    /// on another engine).
    /// A stored conversation's removal, if one was queued, is returned to be waited on.
    pub fn close(
        &mut self,
        engine: &mut Engine,
        conv: ConversationId,
        ended: bool,
    ) -> Result<Option<Removing>> {
        let keep = self.stored && !ended && named(engine, conv);
        self.unlink(conv);
        match keep {
            true => engine.detach(conv).map(|()| None),
            false => engine.close_removing(conv),
        }
    }

    /// [`Sessions::close`], for a conversation that may already be gone.
    pub fn forget(&mut self, engine: &mut Engine, conv: ConversationId, ended: bool) {
        let _ = self.close(engine, conv, ended);
    }

    /// Closes the least recently used idle sessions past `max`.
    pub fn close_old(&mut self, engine: &mut Engine) {
        while self.map.len() > self.max {
            match self.idle.first().map(|&(_, c)| c) {
                Some(c) => self.forget(engine, c, false),
                None => return,
            }
        }
    }
}

/// Whether `s` continues with a chat whose history, as sent, is `sent`: its transcript, or
/// nothing or its opening system messages alone (a named conversation's next messages).
fn continues(s: &Session, sent: &[Message], setup: &Setup) -> bool {
    let Some(held) = s.messages.as_deref() else {
        return false;
    };
    s.setup == *setup
        && (held == sent
            || sent.is_empty()
            // A client that resends its system message with each new one (a common habit):
            // the message it opened with, not a new history.
            || (sent.iter().all(|m| m.role == "system") && held.starts_with(sent)))
}

/// Whether `conv` is stored under a name.
pub(super) fn named(engine: &Engine, conv: ConversationId) -> bool {
    engine
        .durability(conv)
        .is_ok_and(|d| d != Durability::NotStored)
}

/// A message as a client sends it back, to find its session by: an assistant's thought left
/// out, since clients return an answer's `content` with or without its `reasoning_content`;
/// for a thinking model's template (`thinks`), a thought a client returns inside the content
/// (`<think>...</think>answer`, as a server without a reasoning parser answered it) too. A
/// call's arguments are compared as JSON, not as text: Anthropic's clients return them as an
/// object (`tool_use.input`), which the server writes back without the model's spacing.
fn as_sent(thinks: bool, mut m: Message) -> Message {
    if m.role == "assistant" {
        m.reasoning_content = None;
        if let Some((_, answer)) = crate::chat::split_thought(&m.content).filter(|_| thinks) {
            m.content = answer;
        }
        for c in &mut m.tool_calls {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&c.arguments) {
                c.arguments = v.to_string();
            }
        }
    }
    m
}

/// The key of a chat transcript (and what its template renders beside it) in
/// `Sessions::by_content`.
pub(super) fn transcript_key(messages: &[Message], setup: &Setup) -> u64 {
    let mut h = DefaultHasher::new();
    for m in messages {
        m.role.hash(&mut h);
        m.content.hash(&mut h);
        for c in &m.tool_calls {
            (&c.id, &c.name, &c.arguments).hash(&mut h);
        }
        m.tool_call_id.hash(&mut h);
    }
    for t in &setup.tools {
        t.to_string().hash(&mut h);
    }
    for (k, v) in &setup.vars {
        (k, v.to_string()).hash(&mut h);
    }
    h.finish()
}

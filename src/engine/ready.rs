//! A new conversation's first turn, prepared off the engine thread. Templating and tokenizing
//! a whole history (a client that sends megabytes of it, or twenty thousand items) takes the
//! time of many steps, which every stream would wait for on the engine's thread. A
//! [`TurnPreparer`] does it on any thread from what opens the conversation; the engine takes
//! the result for the turn of the conversation it was made for ([`Engine::submit_ready`]),
//! and prepares any other turn itself, so a mismatch costs time, never a wrong prompt.

use std::sync::Arc;

use super::turn::{self, PreparedTurn, TurnLimits};
use super::{ConversationOptions, Engine, RequestId, SamplingParams, Turn};
use crate::conversation::Conversation;
use crate::ids::ConversationId;
use crate::model::{Message, Model};
use crate::Result;

/// A conversation as [`Engine::open`] opens it from `options`: the system prompt, then the
/// history, with its tools, template variables and the host's attributes.
pub(super) fn opened(options: ConversationOptions) -> Conversation {
    let mut messages: Vec<Message> = options
        .system
        .map(|s| vec![Message::new("system", s)])
        .unwrap_or_default();
    messages.extend(options.history);
    Conversation::new(messages)
        .with_tools(options.tools)
        .with_template_vars(options.template_vars)
        .with_attributes(options.attributes)
}

/// Prepares first turns on any thread ([`Engine::turn_preparer`]): the engine's model and
/// limits, cheap to clone.
#[derive(Clone, Debug)]
pub struct TurnPreparer {
    model: Arc<Model>,
    limits: TurnLimits,
}

/// A first turn prepared off the engine thread, for [`Engine::submit_ready`]: what it was
/// made for, and the tokens (or the refusal) [`Engine::submit`] would have come to.
#[derive(Debug)]
pub struct ReadyTurn {
    conv: Conversation,
    turn: Turn,
    limits: TurnLimits,
    max_reply: usize,
    prepared: Option<Result<PreparedTurn>>,
}

impl TurnPreparer {
    /// The first turn `turn` of a conversation opened with `options`, sampled with `params`,
    /// templated, tokenized and checked against the window here.
    pub fn first_turn(
        &self,
        options: ConversationOptions,
        turn: Turn,
        params: &SamplingParams,
    ) -> ReadyTurn {
        let conv = opened(options);
        let mut limits = self.limits;
        limits.overflow = params.overflow.unwrap_or(limits.overflow);
        let prepared = turn::prepare(&self.model, &conv, turn.clone(), &limits, params.max_tokens);
        ReadyTurn {
            conv,
            turn,
            limits,
            max_reply: params.max_tokens,
            prepared: Some(prepared),
        }
    }
}

impl ReadyTurn {
    /// The prepared turn, if this was made for `turn` of `conv` under `limits`: a conversation
    /// with nothing fed yet and the same transcript, tools and variables. A prepared prompt
    /// is handed to every such turn (the forks of a request with several choices); a refusal
    /// once.
    pub(super) fn take_for(
        &mut self,
        conv: &Conversation,
        turn: &Turn,
        limits: &TurnLimits,
        max_reply: usize,
    ) -> Option<Result<PreparedTurn>> {
        let same = conv.tokens().is_empty()
            && *turn == self.turn
            && *limits == self.limits
            && max_reply == self.max_reply
            && conv.messages() == self.conv.messages()
            && conv.tools() == self.conv.tools()
            && conv.template_vars() == self.conv.template_vars();
        match self.prepared.as_ref()? {
            _ if !same => None,
            Ok(p) => Some(Ok(p.clone())),
            Err(_) => self.prepared.take(),
        }
    }
}

impl Engine {
    /// Prepares first turns on other threads, for [`Engine::submit_ready`].
    pub fn turn_preparer(&self) -> TurnPreparer {
        TurnPreparer {
            model: Arc::clone(&self.model),
            limits: self.limits,
        }
    }

    /// [`Engine::submit`], with the turn `ready` prepared if it was made for this one (`conv`
    /// just opened with the options it was given, `turn` and `params` alike); otherwise the
    /// turn is prepared here, as `submit` does.
    ///
    /// # Errors
    /// As [`Engine::submit`].
    pub fn submit_ready(
        &mut self,
        conv: ConversationId,
        turn: Turn,
        params: SamplingParams,
        ready: &mut ReadyTurn,
    ) -> Result<RequestId> {
        let id = self.shared.next_request_id();
        let now = std::time::Instant::now();
        self.submit_with(id, conv, turn, params, now, Some(ready))?;
        Ok(id)
    }
}

//! A turn's text to tokens. The template's markup is tokenized with special tokens
//! recognised; what users wrote (every message's content) as plain text, so a user who types
//! `<|im_end|><|im_start|>assistant` gets those characters, never a forged turn boundary. The
//! contents are found in the rendering by [`ChatTemplate::content_spans`]; a template that
//! changes contents as it renders them, or whose vocabulary prefixes a space marker to every
//! piece of text (SentencePiece with `add_space_prefix`), is tokenized whole, and then a
//! content that holds a special token's text is refused rather than read as markup.

use std::ops::Range;

use crate::chat::{common_prefix, ChatTemplate, TemplateExtras};
use crate::conversation::{Conversation, Mark};
use crate::engine::Turn;
use crate::model::{Message, Model};
use crate::{Error, Result};

/// A turn's tokens and text as the continuation of a history.
pub(super) struct Encoded {
    pub prompt: Vec<u32>,
    pub text: String,
    /// The messages the turn adds to the transcript.
    pub messages: Vec<Message>,
    pub mark: Option<Mark>,
}

/// The messages a turn adds, or `None` for a turn of raw tokens.
pub(super) fn turn_messages(turn: &Turn) -> Option<Vec<Message>> {
    match turn {
        Turn::Tokens(_) => None,
        Turn::User(text) => Some(vec![Message::new("user", text.clone())]),
        Turn::Messages(m) => Some(m.clone()),
    }
}

/// What `conv`'s template renders beside its messages: its tools and its variables.
pub(super) fn extras(conv: &Conversation) -> TemplateExtras<'_> {
    TemplateExtras {
        tools: conv.tools(),
        vars: Some(conv.template_vars()),
    }
}

/// Encodes `turn` after a history of `history` tokens whose transcript is `messages` and
/// `seen`, the template rendering `extras` (its tools and variables). A turn's messages are tokenized in two parts, split
/// where their own rendering begins, so that the split is a [`Mark`] (a later cut point);
/// templates mark message starts with special tokens, so the parts tokenize as the whole
/// would.
pub(super) fn encode(
    model: &Model,
    messages: &[Message],
    extras: TemplateExtras<'_>,
    seen: &str,
    history: usize,
    turn: &Turn,
) -> Result<Encoded> {
    let at_end = Mark {
        tokens: history,
        text: seen.len(),
        messages: messages.len(),
    };
    let Some(new) = turn_messages(turn) else {
        let ids = match turn {
            Turn::Tokens(ids) => ids,
            _ => &Vec::new(),
        };
        return Ok(Encoded {
            prompt: ids.clone(),
            text: model.decode(ids)?,
            messages: Vec::new(),
            mark: Some(at_end),
        });
    };
    let Some(t) = model.template() else {
        return encode_plain(model, history, turn, new, at_end);
    };
    let mut all = messages.to_vec();
    all.extend(new.iter().cloned());
    // A vocabulary that prefixes a space marker to every piece of text would put one at each
    // boundary between pieces: its turns are tokenized whole, as they render.
    let whole = model.prefixes_space();
    let rendering = Rendering::new(t, &all, extras, whole, true)?;
    let common = common_prefix(&rendering.text, seen);
    let new_text = rendering.text[common..].to_string();
    // The rendering of the earlier messages, past what the model has seen, is the tail of
    // the previous turn; the new messages begin after it.
    let split = (!whole)
        .then(|| t.render_with(messages, extras, false).ok())
        .flatten()
        .and_then(|before| {
            let tail = before.strip_prefix(seen)?;
            new_text.starts_with(tail).then_some(tail.len())
        });
    let end = rendering.text.len();
    let Some(split) = split else {
        return Ok(Encoded {
            prompt: rendering.tokens(model, common..end, &all)?,
            text: new_text,
            messages: new,
            mark: None,
        });
    };
    let mut prompt = rendering.tokens(model, common..common + split, &all)?;
    let mark = Mark {
        tokens: history + prompt.len(),
        text: seen.len() + split,
        messages: messages.len(),
    };
    prompt.extend(rendering.tokens(model, common + split..end, &all)?);
    Ok(Encoded {
        prompt,
        text: new_text,
        messages: new,
        mark: Some(mark),
    })
}

/// The tokens of `messages` rendered by `model`'s chat template, as a conversation opened with
/// them feeds its first turn: the template's markup with special tokens recognised, every
/// message's content as plain text (what users type never becomes a control token). What
/// vLLM's `/tokenize` of messages answers.
///
/// # Errors
/// [`Error::Unsupported`] for a model without a chat template; the template's and the
/// tokenizer's errors; [`Error::InvalidParams`] as a turn of these messages would be refused.
pub fn chat_tokens(
    model: &Model,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<u32>> {
    chat_tokens_with(model, messages, &[], None, add_generation_prompt)
}

/// [`chat_tokens`] of a conversation opened with `tools` and the template variables `vars`
/// ([`super::ConversationOptions`]), which the template renders beside the messages: what a
/// client's count of a request's prompt tokens asks for (Anthropic's `count_tokens`).
///
/// # Errors
/// As [`chat_tokens`].
pub fn chat_tokens_with(
    model: &Model,
    messages: &[Message],
    tools: &[serde_json::Value],
    vars: Option<&serde_json::Map<String, serde_json::Value>>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>> {
    let Some(t) = model.template() else {
        return model
            .render_chat(messages, add_generation_prompt)
            .map(|_| Vec::new());
    };
    let rendering = Rendering::new(
        t,
        messages,
        TemplateExtras { tools, vars },
        model.prefixes_space(),
        add_generation_prompt,
    )?;
    rendering.tokens(model, 0..rendering.text.len(), messages)
}

/// The tokens a conversation opened with `messages` (its template rendering `extras`, with the
/// generation prompt) feeds for the bytes `range` of that rendering: markup with special
/// tokens, contents as plain text. `range` must begin at a point where such a conversation
/// splits its tokens (a control token, a mark).
///
/// # Errors
/// As [`chat_tokens`].
pub(super) fn fresh_tokens(
    model: &Model,
    template: &ChatTemplate,
    messages: &[Message],
    extras: TemplateExtras<'_>,
    range: Range<usize>,
) -> Result<Vec<u32>> {
    let rendering = Rendering::new(template, messages, extras, model.prefixes_space(), true)?;
    let range = range.start.min(rendering.text.len())..range.end.min(rendering.text.len());
    rendering.tokens(model, range, messages)
}

/// A user turn for a model without a chat template: its text alone (after the BOS token, at
/// the start of the history).
fn encode_plain(
    model: &Model,
    history: usize,
    turn: &Turn,
    messages: Vec<Message>,
    at_end: Mark,
) -> Result<Encoded> {
    let Turn::User(text) = turn else {
        return Err(Error::InvalidParams {
            param: "messages",
            reason: "a turn of messages needs a chat template".into(),
        });
    };
    let bos = model.bos_token_id().filter(|_| history == 0);
    let mut prompt: Vec<u32> = bos.into_iter().collect();
    prompt.extend(model.encode_text(text)?);
    Ok(Encoded {
        prompt,
        text: text.clone(),
        messages,
        mark: Some(at_end),
    })
}

/// The template's rendering of a conversation, with where its messages' contents lie.
struct Rendering {
    text: String,
    /// The contents' byte ranges in `text`, in order; `None` if the template changed them.
    contents: Option<Vec<Range<usize>>>,
}

impl Rendering {
    /// With `whole`, the contents are not located: the text is tokenized in one piece.
    fn new(
        template: &ChatTemplate,
        messages: &[Message],
        extras: TemplateExtras<'_>,
        whole: bool,
        add_generation_prompt: bool,
    ) -> Result<Self> {
        let spans = match whole {
            true => None,
            false => template.content_spans(messages, extras, add_generation_prompt)?,
        };
        Ok(match spans {
            Some((text, spans)) => Self {
                text,
                contents: Some(spans),
            },
            None => Self {
                text: template.render_with(messages, extras, add_generation_prompt)?,
                contents: None,
            },
        })
    }

    /// The tokens of `text[range]`: markup with special tokens, contents as plain text.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] when the contents could not be told from the markup and one
    /// of `messages` holds a special token's text; tokenizer errors.
    fn tokens(&self, model: &Model, range: Range<usize>, messages: &[Message]) -> Result<Vec<u32>> {
        let Some(contents) = &self.contents else {
            if let Some(special) = special_text_in(model, messages) {
                return Err(Error::InvalidParams {
                    param: "messages",
                    reason: format!(
                        "a message holds the text of the control token {special:?}, which \
                         this model's chat template does not let pensieve keep as plain text"
                    ),
                });
            }
            return model.encode(&self.text[range]);
        };
        let mut out = Vec::new();
        let mut at = range.start;
        for c in contents {
            let (start, end) = (c.start.max(range.start), c.end.min(range.end));
            if start >= end {
                continue;
            }
            if at < start {
                out.extend(model.encode(&self.text[at..start])?);
            }
            out.extend(model.encode_text(&self.text[start..end])?);
            at = end;
        }
        if at < range.end {
            out.extend(model.encode(&self.text[at..range.end])?);
        }
        Ok(out)
    }
}

/// The text of a special token that one of `messages` contains, if any.
fn special_text_in(model: &Model, messages: &[Message]) -> Option<String> {
    let specials = model.tokenizer().get_added_tokens_decoder();
    specials
        .values()
        .filter(|t| t.special && !t.content.is_empty())
        .find(|t| messages.iter().any(|m| m.content.contains(&t.content)))
        .map(|t| t.content.clone())
}

//! OpenAI's harmony format (gpt-oss): a reply is messages, each a header (`<|start|>assistant`,
//! `<|channel|>NAME`, a recipient ` to=functions.X`, `<|constrain|>json`) then `<|message|>`
//! and its content, ended by `<|end|>` (or the reply's end at `<|return|>` / `<|call|>`, which
//! end generation and so are not in the text). The `analysis` channel is the thought; `final`
//! and `commentary` are the answer. Headers and terminators are markup, in neither.

use super::partial_tag;

const MESSAGE: &str = "<|message|>";
/// What ends a message's content: its terminators, or the next message's header.
const ENDS: [&str; 5] = [
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|start|>",
    "<|channel|>",
];

/// Where the text read goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing read yet: markup, or a reply without any (all answer).
    Start,
    /// A header, until `<|message|>`.
    Header,
    /// A message's content, of the thought or of the answer.
    Content { thought: bool },
}

/// Splits a harmony reply given piece by piece into thought and answer.
#[derive(Clone, Debug)]
pub(super) struct Split {
    state: State,
    held: String,
    pub(super) thought_seen: bool,
}

impl Split {
    pub(super) fn new() -> Self {
        Self {
            state: State::Start,
            held: String::new(),
            thought_seen: false,
        }
    }

    /// Takes the next piece; returns what it adds to the thought and to the answer.
    pub(super) fn push(&mut self, piece: &str) -> (String, String) {
        self.held.push_str(piece);
        let (mut thought, mut answer) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let lead = self.held.trim_start();
                    if lead.is_empty() || ENDS.iter().any(|t| t.starts_with(lead)) {
                        return (thought, answer);
                    }
                    self.state = match ENDS.iter().any(|t| lead.starts_with(t)) {
                        true => State::Header,
                        false => State::Content { thought: false },
                    };
                }
                State::Header => {
                    let Some(at) = self.held.find(MESSAGE) else {
                        return (thought, answer);
                    };
                    let header = &self.held[..at];
                    let is_thought = header.contains("<|channel|>analysis");
                    self.thought_seen |= is_thought;
                    self.held.drain(..at + MESSAGE.len());
                    self.state = State::Content {
                        thought: is_thought,
                    };
                }
                State::Content {
                    thought: to_thought,
                } => {
                    let end = (ENDS.iter())
                        .filter_map(|t| self.held.find(t).map(|at| (at, *t)))
                        .min();
                    let out = match end {
                        Some((at, _)) => at,
                        None => {
                            let keep = (ENDS.iter())
                                .map(|t| partial_tag(&self.held, t))
                                .max()
                                .unwrap_or(0);
                            self.held.len() - keep
                        }
                    };
                    let text: String = self.held.drain(..out).collect();
                    match to_thought {
                        true => thought.push_str(&text),
                        false => answer.push_str(&text),
                    }
                    let Some((_, tag)) = end else {
                        return (thought, answer);
                    };
                    // A terminator is dropped; a header's first tag stays, to be read.
                    if !matches!(tag, "<|start|>" | "<|channel|>") {
                        self.held.drain(..tag.len());
                    }
                    self.state = State::Header;
                }
            }
        }
    }

    /// The end of the reply: held content goes where it was heading; an unfinished header
    /// is dropped.
    pub(super) fn finish(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        match self.state {
            State::Content { thought: true } => (rest, String::new()),
            State::Content { thought: false } | State::Start => (String::new(), rest),
            State::Header => (String::new(), String::new()),
        }
    }
}

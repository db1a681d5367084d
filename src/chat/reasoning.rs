//! Thinking models' replies: a thought in `<think>...</think>` before the answer (DeepSeek R1
//! and its distills, Qwen3, QwQ), told apart from the answer whole or as it streams.
//!
//! Two rules are kept apart on purpose. The *transcript* rule ([`split_thought`]) is the
//! templates': a reply that holds `</think>` is its thought up to it and its answer after it
//! (R1's template renders `content.split('</think>')[-1]`). The *answer* rules
//! ([`ReasoningParser`]) are what clients of vLLM and llama-server get back as
//! `reasoning_content`: they also decide what an unfinished thought is.

mod harmony;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The thought and the answer of a reply that closes its thought (`</think>`): the text
/// before the first `</think>` (an opening `<think>` dropped) and the text after it, as
/// generated. `None` for a reply without one.
pub fn split_thought(reply: &str) -> Option<(String, String)> {
    let (thought, answer) = reply.split_once(CLOSE)?;
    let thought = thought.trim_start().strip_prefix(OPEN).unwrap_or(thought);
    Some((thought.to_string(), answer.to_string()))
}

/// Whether a chat template writes thoughts: its source names `</think>`.
pub(crate) fn template_thinks(source: &str) -> bool {
    source.contains(CLOSE)
}

/// How an answer's `reasoning_content` is told from its `content`, as vLLM's parsers of the
/// same names do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReasoningParser {
    /// DeepSeek R1 and its distills: the reply is thought until `</think>` (the template's
    /// generation prompt may already hold `<think>`); a reply that never closes its thought
    /// is all thought.
    DeepseekR1,
    /// Qwen3 and QwQ: a thought only when the reply opens one with `<think>`; a reply without
    /// it is all answer (thinking turned off).
    Qwen3,
    /// gpt-oss's harmony format: the `analysis` channel's messages are the thought, the
    /// `final` and `commentary` channels' the answer, headers and terminators neither.
    GptOss,
}

impl ReasoningParser {
    /// The parser of this name (`deepseek-r1`, `qwen3`), as `--reasoning-parser` takes it.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "deepseek-r1" => Some(Self::DeepseekR1),
            "qwen3" => Some(Self::Qwen3),
            // vLLM's name for it too.
            "gpt-oss" | "openai_gptoss" => Some(Self::GptOss),
            _ => None,
        }
    }

    /// The names [`Self::from_name`] takes.
    pub const NAMES: [&'static str; 3] = ["deepseek-r1", "qwen3", "gpt-oss"];

    /// A whole reply's thought (`None` when it has none) and answer.
    pub fn split(self, reply: &str) -> (Option<String>, String) {
        let mut stream = self.stream();
        let (mut thought, mut answer) = stream.push(reply);
        let (t, a) = stream.finish();
        thought.push_str(&t);
        answer.push_str(&a);
        let thought = (stream.thought_seen()).then_some(thought);
        (thought, answer)
    }

    /// A splitter for a reply that arrives in pieces.
    pub fn stream(self) -> ReasoningStream {
        ReasoningStream {
            parser: self,
            state: State::Start,
            held: String::new(),
            thought: false,
            harmony: (self == Self::GptOss).then(harmony::Split::new),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing told yet: an opening `<think>` may still come.
    Start,
    Thought,
    Answer,
}

/// Splits a streamed reply into thought and answer text, piece by piece. Text that may be the
/// beginning of a tag is held until the next piece tells.
#[derive(Clone, Debug)]
pub struct ReasoningStream {
    parser: ReasoningParser,
    state: State,
    /// Text not yet handed out: a possible tag's beginning.
    held: String,
    /// Whether any of the reply was taken as thought.
    thought: bool,
    /// The harmony format's splitter, for [`ReasoningParser::GptOss`].
    harmony: Option<harmony::Split>,
}

impl ReasoningStream {
    /// Takes the next piece of the reply; returns what it adds to the thought and to the
    /// answer.
    pub fn push(&mut self, piece: &str) -> (String, String) {
        if let Some(h) = &mut self.harmony {
            return h.push(piece);
        }
        self.held.push_str(piece);
        let (mut thought, mut answer) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let lead = self.held.trim_start();
                    if let Some(rest) = lead.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thought;
                        self.thought = true;
                    } else if OPEN.starts_with(lead) {
                        return (thought, answer);
                    } else {
                        self.state = match self.parser {
                            ReasoningParser::DeepseekR1 => State::Thought,
                            ReasoningParser::Qwen3 | ReasoningParser::GptOss => State::Answer,
                        };
                        self.thought |= self.state == State::Thought;
                    }
                }
                State::Thought => match self.held.find(CLOSE) {
                    Some(at) => {
                        thought.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                    }
                    None => {
                        let keep = partial_tag(&self.held, CLOSE);
                        let out = self.held.len() - keep;
                        thought.push_str(&self.held[..out]);
                        self.held.drain(..out);
                        return (thought, answer);
                    }
                },
                State::Answer => {
                    answer.push_str(&self.held);
                    self.held.clear();
                    return (thought, answer);
                }
            }
        }
    }

    /// The end of the reply: what was held goes where it was heading.
    pub fn finish(&mut self) -> (String, String) {
        if let Some(h) = &mut self.harmony {
            return h.finish();
        }
        let rest = std::mem::take(&mut self.held);
        match self.state {
            State::Thought => (rest, String::new()),
            State::Start if self.parser == ReasoningParser::DeepseekR1 && !rest.is_empty() => {
                self.thought = true;
                (rest, String::new())
            }
            _ => (String::new(), rest),
        }
    }

    /// Whether the reply held a thought (so far).
    pub fn thought_seen(&self) -> bool {
        self.harmony
            .as_ref()
            .map_or(self.thought, |h| h.thought_seen)
    }
}

/// The length of the longest end of `text` that begins `tag` (held back: the tag may be
/// arriving).
pub(super) fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_splits_the_same_whole_and_in_any_pieces() {
        let reply = "<think>\nThe user greets; answer briefly.\n</think>\n\nHello!";
        for parser in [ReasoningParser::DeepseekR1, ReasoningParser::Qwen3] {
            let whole = parser.split(reply);
            assert_eq!(
                whole,
                (
                    Some("\nThe user greets; answer briefly.\n".into()),
                    "\n\nHello!".into()
                )
            );
            for size in 1..reply.len() {
                let mut s = parser.stream();
                let (mut t, mut a) = (String::new(), String::new());
                let bytes = reply.as_bytes();
                for piece in bytes.chunks(size) {
                    let (dt, da) = s.push(std::str::from_utf8(piece).unwrap());
                    t.push_str(&dt);
                    a.push_str(&da);
                }
                let (dt, da) = s.finish();
                t.push_str(&dt);
                a.push_str(&da);
                assert_eq!((Some(t), a), whole, "pieces of {size} bytes");
            }
        }
    }

    #[test]
    fn the_parsers_differ_on_replies_without_tags() {
        // R1's generation prompt may open the thought itself: the reply starts inside it.
        let r1 = ReasoningParser::DeepseekR1;
        assert_eq!(
            r1.split("Let me see.</think>Yes."),
            (Some("Let me see.".into()), "Yes.".into())
        );
        assert_eq!(
            r1.split("Still thinking"),
            (Some("Still thinking".into()), String::new())
        );
        // Qwen3 with thinking off answers without tags.
        let q = ReasoningParser::Qwen3;
        assert_eq!(q.split("Yes."), (None, "Yes.".into()));
        assert_eq!(
            q.split("<think>cut by the length"),
            (Some("cut by the length".into()), String::new())
        );
        assert_eq!(ReasoningParser::from_name("qwen3"), Some(q));
        assert_eq!(ReasoningParser::from_name("o1"), None);
    }

    #[test]
    fn harmony_replies_split_by_channel_whole_and_in_any_pieces() {
        let p = ReasoningParser::GptOss;
        let reply = "<|channel|>analysis<|message|>User asks <b>; check.<|end|><|start|>assistant\
                     <|channel|>final<|message|>It is < 3 <|x|> sunny.";
        let whole = p.split(reply);
        assert_eq!(
            whole,
            (
                Some("User asks <b>; check.".into()),
                "It is < 3 <|x|> sunny.".into()
            )
        );
        for size in 1..reply.len() {
            let mut s = p.stream();
            let (mut t, mut a) = (String::new(), String::new());
            let mut rest = reply;
            while !rest.is_empty() {
                let mut cut = size.min(rest.len());
                while !rest.is_char_boundary(cut) {
                    cut += 1;
                }
                let (dt, da) = s.push(&rest[..cut]);
                t.push_str(&dt);
                a.push_str(&da);
                rest = &rest[cut..];
            }
            let (dt, da) = s.finish();
            t.push_str(&dt);
            a.push_str(&da);
            assert_eq!((Some(t), a), whole, "pieces of {size} bytes");
        }
        // A preamble on the commentary channel is answer; a call's header is markup; a reply
        // cut inside its thought is all thought; one without markup is all answer.
        assert_eq!(
            p.split("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"),
            (None, "Checking.{}".into())
        );
        assert_eq!(
            p.split("<|channel|>analysis<|message|>Hmm"),
            (Some("Hmm".into()), String::new())
        );
        assert_eq!(p.split("Plain."), (None, "Plain.".into()));
        assert_eq!(ReasoningParser::from_name("openai_gptoss"), Some(p));
    }

    #[test]
    fn the_transcript_keeps_what_the_templates_keep() {
        assert_eq!(
            split_thought("<think>\nhm\n</think>\n\nHi"),
            Some(("\nhm\n".into(), "\n\nHi".into()))
        );
        assert_eq!(split_thought("no thought"), None);
        assert!(template_thinks("{{ content.split('</think>')[-1] }}"));
        assert!(!template_thinks("{{ content }}"));
    }
}

//! Chat text: what turns messages into a prompt and a reply back into messages, beside the
//! model rather than inside it. The model's own Jinja template renders a conversation
//! (`template`); tool calls are written in a template family's format and read back from a
//! reply, whole or as it streams (`tools`, `tool_stream`); a thinking model's thought is told
//! from its answer (`reasoning`); a reply can be held to a JSON schema, a regular expression
//! or a grammar (`grammar`).
//!
//! Nothing here reaches the numeric model (weights, kernels, the graph): a template and the
//! parsers work on text, the grammar on the vocabulary it is handed (checked in
//! `tests/layering.rs`).

mod grammar;
mod reasoning;
mod template;
mod tool_stream;
mod tools;

pub use grammar::Constraint;
pub(crate) use grammar::{Grammars, Guide, Vocab};
pub use reasoning::{split_thought, ReasoningParser, ReasoningStream};
pub use template::{common_prefix, ChatTemplate, TemplateExtras, BUILTIN_TEMPLATES};
pub use tool_stream::{ToolDelta, ToolStream};
pub use tools::ToolFormat;

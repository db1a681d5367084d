//! A Messages reply's content blocks as it arrives (a thinking block for the thought, text
//! blocks for the answer, a tool_use block per call), and the stream events that tell them:
//! each block's `content_block_start`, its deltas, its `content_block_stop`.

use serde_json::{json, Value};

enum Kind {
    Thinking,
    Text,
    /// The reply's call `index` (the engine's count).
    ToolUse {
        index: usize,
        id: String,
        name: String,
    },
}

struct Block {
    kind: Kind,
    /// The thought's, the answer's, or the call's input's JSON text so far.
    text: String,
}

impl Block {
    /// The block as a whole message holds it.
    fn json(&self) -> Value {
        match &self.kind {
            Kind::Thinking => json!({"type": "thinking", "thinking": self.text, "signature": ""}),
            Kind::Text => json!({"type": "text", "text": self.text}),
            Kind::ToolUse { id, name, .. } => {
                // A call's input is an object; a model's malformed arguments never parse as
                // a call, so this holds one.
                let input = serde_json::from_str::<Value>(&self.text)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    /// The block as its `content_block_start` opens it: empty.
    fn start(&self) -> Value {
        match &self.kind {
            Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Kind::Text => json!({"type": "text", "text": ""}),
            Kind::ToolUse { id, name, .. } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": {}})
            }
        }
    }

    /// The delta that adds `text` to the block.
    fn delta(&self, text: &str) -> Value {
        match &self.kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Kind::Text => json!({"type": "text_delta", "text": text}),
            Kind::ToolUse { .. } => json!({"type": "input_json_delta", "partial_json": text}),
        }
    }
}

/// The content blocks so far, and the events not yet sent.
pub struct Blocks {
    blocks: Vec<Block>,
    /// Whether the last block still takes text.
    open: bool,
    /// Whether a reply may make several calls (else its first only is kept).
    parallel: bool,
    /// Whitespace of the answer not yet in a block: a text block opens with the first text
    /// that is more (the line a model writes before its calls makes no block).
    held: String,
    events: Vec<Value>,
}

impl Blocks {
    pub fn new(parallel: bool) -> Self {
        Self {
            blocks: Vec::new(),
            open: false,
            parallel,
            held: String::new(),
            events: Vec::new(),
        }
    }

    /// Text of the reply's thought.
    pub fn thought(&mut self, text: &str) {
        if !text.is_empty() {
            self.text_of(|k| matches!(k, Kind::Thinking), || Kind::Thinking, text);
        }
    }

    /// Text of the reply's answer.
    pub fn answer(&mut self, text: &str) {
        let open =
            self.open && matches!(self.blocks.last(), Some(b) if matches!(b.kind, Kind::Text));
        if !open && text.trim().is_empty() {
            self.held.push_str(text);
            return;
        }
        let text = format!("{}{text}", std::mem::take(&mut self.held));
        self.text_of(|k| matches!(k, Kind::Text), || Kind::Text, &text);
    }

    /// The start of the reply's call `index`.
    pub fn call(&mut self, index: usize, id: &str, name: &str) {
        if index > 0 && !self.parallel {
            return;
        }
        self.close();
        self.held.clear();
        self.open(Kind::ToolUse {
            index,
            id: id.into(),
            name: name.into(),
        });
    }

    /// A fragment of call `index`'s input.
    pub fn arguments(&mut self, index: usize, fragment: &str) {
        let open = self.blocks.last().filter(|_| self.open);
        if matches!(open.map(|b| &b.kind), Some(Kind::ToolUse { index: i, .. }) if *i == index) {
            self.extend(fragment);
        }
    }

    /// The end of the reply.
    pub fn finish(&mut self) {
        self.close();
    }

    /// Whether the reply calls a tool.
    pub fn calls(&self) -> bool {
        (self.blocks.iter()).any(|b| matches!(b.kind, Kind::ToolUse { .. }))
    }

    /// The blocks, as a whole message's `content`.
    pub fn content(&self) -> Vec<Value> {
        self.blocks.iter().map(Block::json).collect()
    }

    /// The events made since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// `text` for the open block if `is` holds of it, else for a new block of `kind`.
    fn text_of(&mut self, is: impl Fn(&Kind) -> bool, kind: impl Fn() -> Kind, text: &str) {
        if !(self.open && self.blocks.last().is_some_and(|b| is(&b.kind))) {
            self.close();
            self.open(kind());
        }
        self.extend(text);
    }

    fn open(&mut self, kind: Kind) {
        let block = Block {
            kind,
            text: String::new(),
        };
        let index = self.blocks.len();
        self.events.push(
            json!({"type": "content_block_start", "index": index, "content_block": block.start()}),
        );
        self.blocks.push(block);
        self.open = true;
    }

    fn extend(&mut self, text: &str) {
        let index = self.blocks.len() - 1;
        if let Some(b) = self.blocks.last_mut().filter(|_| !text.is_empty()) {
            b.text.push_str(text);
            let delta = b.delta(text);
            (self.events)
                .push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
        }
    }

    fn close(&mut self) {
        if std::mem::take(&mut self.open) {
            let index = self.blocks.len() - 1;
            (self.events).push(json!({"type": "content_block_stop", "index": index}));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thought_text_and_calls_make_blocks_in_order_with_their_events() {
        let mut b = Blocks::new(true);
        b.thought("Use the tool.");
        b.answer("\n");
        b.call(0, "call_1", "weather");
        b.arguments(0, "{\"city\": ");
        b.arguments(0, "\"Paris\"}");
        b.call(1, "call_2", "time");
        b.arguments(1, "{}");
        b.finish();
        let content = b.content();
        assert_eq!(content.len(), 3, "{content:?}");
        assert_eq!(content[0]["type"], "thinking");
        assert_eq!(content[1]["input"], json!({"city": "Paris"}));
        assert_eq!(content[2]["name"], "time");
        assert!(b.calls());
        let kinds: Vec<String> = (b.take_events().iter())
            .map(|e| e["type"].as_str().unwrap_or_default().to_string())
            .collect();
        let starts = kinds.iter().filter(|k| *k == "content_block_start").count();
        let stops = kinds.iter().filter(|k| *k == "content_block_stop").count();
        assert_eq!((starts, stops), (3, 3));
        assert_eq!(kinds.last().map(String::as_str), Some("content_block_stop"));
    }

    #[test]
    fn without_parallel_calls_only_the_first_is_kept() {
        let mut b = Blocks::new(false);
        b.answer("Sure.");
        b.call(0, "a", "f");
        b.arguments(0, "{}");
        b.call(1, "b", "g");
        b.arguments(1, "{}");
        b.finish();
        let content = b.content();
        assert_eq!(content.len(), 2);
        assert_eq!(content[0], json!({"type": "text", "text": "Sure."}));
    }
}

//! A conversation's transcript as the Conversations API's items, and what the server keeps
//! with it in the engine's attributes ([`Kept`]): its creation time, its metadata and its
//! items' ids.
//!
//! An item's id names that item for its life: the ids of the items an edit leaves are stored
//! with the conversation, and a new item (added, or a turn's input and reply) takes the id
//! of the next number in the conversation's sequence, a digest of the conversation's id and
//! that number. The sequence only grows, so a deleted item's id never names another, and
//! equal items have distinct ids whatever is deleted around them.

use serde_json::{json, Map, Value};

use crate::model::Message;

/// Where an item lies in the transcript: a message's text, or one of its calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Part {
    Text,
    Call(usize),
}

/// An item of a transcript: the message it is part of, which part, and the item (with its
/// id).
pub type Item = (usize, Part, Value);

/// What the server keeps with a conversation of the Conversations API.
#[derive(Clone, Debug, PartialEq)]
pub struct Kept {
    pub created_at: u64,
    /// OpenAI's metadata: an object of strings.
    pub metadata: Value,
    /// The ids of the transcript's first items, in order; the items past them are numbered
    /// from `next` on.
    ids: Vec<String>,
    next: u64,
}

impl Kept {
    /// A new conversation's, made at `created_at`.
    pub fn new(created_at: u64, metadata: Value) -> Self {
        Self {
            created_at,
            metadata,
            ids: Vec::new(),
            next: 0,
        }
    }

    /// What the conversation's attributes hold (what is missing or malformed taken as new:
    /// made at `now`, no metadata, items numbered from 0).
    pub fn read(attributes: &Map<String, Value>, now: u64) -> Self {
        let items = attributes.get("items");
        let ids = items.and_then(|i| i["ids"].as_array());
        Self {
            created_at: (attributes.get("created_at").and_then(Value::as_u64)).unwrap_or(now),
            metadata: (attributes.get("metadata").filter(|m| m.is_object()))
                .cloned()
                .unwrap_or_else(|| json!({})),
            ids: (ids.into_iter().flatten())
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            next: items.and_then(|i| i["next"].as_u64()).unwrap_or(0),
        }
    }

    /// As the conversation's attributes.
    pub fn attributes(&self) -> Map<String, Value> {
        let mut a = Map::new();
        a.insert("created_at".into(), json!(self.created_at));
        a.insert("metadata".into(), self.metadata.clone());
        a.insert("items".into(), json!({"ids": self.ids, "next": self.next}));
        a
    }

    /// The items of `messages` (the transcript of the conversation `id`) with their ids.
    pub fn items(&self, id: &str, messages: &[Message]) -> Vec<Item> {
        let mut out = parts(messages);
        let mut next = self.next;
        for (i, (_, _, item)) in out.iter_mut().enumerate() {
            item["id"] = match self.ids.get(i) {
                Some(stored) => json!(stored),
                None => {
                    let prefix = match item["type"].as_str() {
                        Some("function_call") => "fc",
                        Some("function_call_output") => "fco",
                        _ => "msg",
                    };
                    next += 1;
                    json!(numbered(id, prefix, next - 1))
                }
            };
        }
        out
    }

    /// The same, with the ids of every item of `messages` stored, so that an edit that
    /// shifts them (a deletion) leaves each its id.
    pub fn settled(&self, id: &str, messages: &[Message]) -> Self {
        let items = self.items(id, messages);
        let added = items.len().saturating_sub(self.ids.len()) as u64;
        Self {
            ids: (items.iter())
                .map(|(.., v)| v["id"].as_str().unwrap_or_default().to_string())
                .collect(),
            next: self.next + added,
            ..self.clone()
        }
    }

    /// The same with the metadata `metadata`.
    pub fn with_metadata(self, metadata: Value) -> Self {
        Self { metadata, ..self }
    }

    /// The same without the stored id of item `i` (which an edit deleted).
    pub fn without(mut self, i: usize) -> Self {
        if i < self.ids.len() {
            self.ids.remove(i);
        }
        self
    }
}

/// The id of item number `n` of the conversation `id`.
fn numbered(id: &str, prefix: &str, n: u64) -> String {
    let mut h = blake3::Hasher::new();
    for part in [id.as_bytes(), prefix.as_bytes(), &n.to_le_bytes()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    format!("{prefix}_{}", &h.finalize().to_hex()[..32])
}

/// The items of a transcript without ids, each with the message and part it is, in order.
fn parts(messages: &[Message]) -> Vec<Item> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role == "tool" {
            let call = m.tool_call_id.clone().unwrap_or_default();
            let item = json!({"type": "function_call_output", "call_id": call,
                "output": m.content, "status": "completed"});
            out.push((i, Part::Text, item));
            continue;
        }
        if !m.content.is_empty() || m.tool_calls.is_empty() {
            let kind = match m.role.as_str() {
                "assistant" => "output_text",
                _ => "input_text",
            };
            let mut text = json!({"type": kind, "text": m.content});
            if kind == "output_text" {
                text["annotations"] = json!([]);
            }
            let item = json!({"type": "message", "role": m.role, "content": [text],
                "status": "completed"});
            out.push((i, Part::Text, item));
        }
        for (k, c) in m.tool_calls.iter().enumerate() {
            let item = json!({"type": "function_call", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"});
            out.push((i, Part::Call(k), item));
        }
    }
    out
}

/// Appends `new` to `messages`, a call joining the assistant message before it as input
/// items do.
pub fn append(messages: &mut Vec<Message>, new: Vec<Message>) {
    for m in new {
        match messages.last_mut() {
            Some(last)
                if last.role == "assistant"
                    && m.role == "assistant"
                    && m.content.is_empty()
                    && !m.tool_calls.is_empty() =>
            {
                last.tool_calls.extend(m.tool_calls)
            }
            _ => messages.push(m),
        }
    }
}

/// `messages` without the part `part` of message `at` (one item): a message left with
/// nothing, or a tool's result, goes whole.
pub fn remove(messages: &mut Vec<Message>, at: usize, part: Part) {
    let Some(m) = messages.get_mut(at) else {
        return;
    };
    match part {
        Part::Call(k) if k < m.tool_calls.len() => {
            m.tool_calls.remove(k);
        }
        Part::Call(_) => {}
        Part::Text => m.content.clear(),
    }
    if (m.content.is_empty() && m.tool_calls.is_empty()) || m.role == "tool" {
        messages.remove(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ToolCall;

    fn transcript() -> Vec<Message> {
        vec![
            Message::new("user", "Hi"),
            Message::new("assistant", "Looking.")
                .with_tool_calls(vec![ToolCall::new("c1", "f", "{}")]),
            Message::new("tool", "42").answering("c1"),
            Message::new("user", "Hi"),
        ]
    }

    fn ids(items: &[Item]) -> Vec<String> {
        (items.iter())
            .map(|(.., v)| v["id"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    #[test]
    fn every_text_and_call_is_an_item_with_a_distinct_id() {
        let kept = Kept::new(0, json!({}));
        let all = kept.items("conv_a", &transcript());
        let kinds: Vec<&str> = (all.iter())
            .map(|(.., v)| v["type"].as_str().unwrap_or(""))
            .collect();
        let want = [
            "message",
            "message",
            "function_call",
            "function_call_output",
            "message",
        ];
        assert_eq!(kinds, want);
        let distinct: std::collections::HashSet<String> = ids(&all).into_iter().collect();
        assert_eq!(distinct.len(), 5, "two equal user messages still differ");
        assert_ne!(ids(&kept.items("conv_b", &transcript())), ids(&all));
    }

    #[test]
    fn an_id_names_one_item_for_its_life() {
        let mut messages = transcript();
        let mut kept = Kept::new(0, json!({}));
        let before = ids(&kept.items("conv_a", &messages));
        // Deleting the first "Hi" leaves every other item its id: the second "Hi" does not
        // take the first one's.
        kept = kept.settled("conv_a", &messages).without(0);
        remove(&mut messages, 0, Part::Text);
        let after = ids(&kept.items("conv_a", &messages));
        assert_eq!(after, before[1..]);
        // What is added later, even equal to what was deleted, takes a new id.
        append(&mut messages, vec![Message::new("user", "Hi")]);
        let added = ids(&kept.items("conv_a", &messages));
        assert_eq!(added[..4], before[1..]);
        assert!(
            !before.contains(&added[4]),
            "{added:?} reuses one of {before:?}"
        );
        // Stored and read back, the ids are the same.
        let read = Kept::read(&kept.settled("conv_a", &messages).attributes(), 7);
        assert_eq!(ids(&read.items("conv_a", &messages)), added);
        assert_eq!(read.created_at, 0);
    }
}

//! A response's output items as its reply arrives (a reasoning item for the thought, a message
//! for the answer's text, a function call per tool call), and the stream events that tell
//! them: each item's `response.output_item.added`, its deltas, and its `...done` events.

use serde_json::{json, Value};

enum Kind {
    Reasoning,
    Message,
    /// The reply's call `index` (the engine's count), `call_id` as its output names it.
    Call {
        index: usize,
        call_id: String,
        name: String,
    },
    /// A compaction of the context before the reply, its `encrypted_content` the text.
    Compaction,
}

struct Item {
    id: String,
    kind: Kind,
    /// The thought's, the answer's, or the call's arguments' text so far.
    text: String,
    /// The answer's tokens' log-probabilities (OpenAI's `logprobs` entries), where asked for.
    logprobs: Vec<Value>,
}

/// The output items so far, and the events not yet sent.
pub struct Output {
    items: Vec<Item>,
    /// Whether the last item still takes text.
    open: bool,
    /// Whether a reply may make several calls (else its first only is kept).
    parallel: bool,
    /// What the items' ids share: the response's random part, so that they are unique.
    base: String,
    events: Vec<Value>,
}

impl Output {
    /// The output of the response `response_id`.
    pub fn new(parallel: bool, response_id: &str) -> Self {
        let base = response_id.strip_prefix("resp_").unwrap_or(response_id);
        Self {
            items: Vec::new(),
            open: false,
            parallel,
            base: base.to_string(),
            events: Vec::new(),
        }
    }

    /// A compaction item of `content` (`encrypted_content`), whole: the context was compacted
    /// before the reply.
    pub fn compaction(&mut self, content: &str) {
        self.close("completed");
        self.open(Kind::Compaction);
        self.extend(content);
        self.close("completed");
    }

    /// Text of the reply's thought.
    pub fn thought(&mut self, text: &str) {
        if !text.is_empty() {
            self.text_of(|k| matches!(k, Kind::Reasoning), || Kind::Reasoning, text);
        }
    }

    /// Text of the reply's answer.
    pub fn answer(&mut self, text: &str) {
        self.answer_with(text, Vec::new());
    }

    /// Text of the reply's answer, made by tokens of these log-probabilities (entries as
    /// `logprobs::entries` writes them).
    pub fn answer_with(&mut self, text: &str, logprobs: Vec<Value>) {
        if !text.is_empty() {
            self.text_of(|k| matches!(k, Kind::Message), || Kind::Message, text);
            self.log(logprobs);
        }
    }

    /// The start of the reply's call `index`.
    pub fn call(&mut self, index: usize, call_id: &str, name: &str) {
        if index > 0 && !self.parallel {
            return;
        }
        self.close("completed");
        let kind = Kind::Call {
            index,
            call_id: call_id.into(),
            name: name.into(),
        };
        self.open(kind);
    }

    /// A fragment of call `index`'s arguments.
    pub fn arguments(&mut self, index: usize, fragment: &str) {
        let open = self.items.last().filter(|_| self.open);
        if matches!(open.map(|i| &i.kind), Some(Kind::Call { index: i, .. }) if *i == index) {
            self.extend(fragment);
        }
    }

    /// The end of the reply: its last item ends with `status` (`completed`, `incomplete`).
    pub fn finish(&mut self, status: &str) {
        self.close(status);
    }

    /// The output items, the last with `status`.
    pub fn items(&self, status: &str) -> Vec<Value> {
        let last = self.items.len().saturating_sub(1);
        let each =
            |(i, item): (usize, &Item)| item.json(if i == last { status } else { "completed" });
        self.items.iter().enumerate().map(each).collect()
    }

    /// The events made since the last call (without their sequence numbers).
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    /// `text` for the open item if `is` holds of it, else for a new item of `kind`.
    fn text_of(&mut self, is: impl Fn(&Kind) -> bool, kind: impl Fn() -> Kind, text: &str) {
        if !(self.open && self.items.last().is_some_and(|i| is(&i.kind))) {
            self.close("completed");
            self.open(kind());
        }
        self.extend(text);
    }

    fn open(&mut self, kind: Kind) {
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call { .. } => "fc",
            Kind::Compaction => "cmp",
        };
        let item = Item {
            id: format!("{prefix}_{}{:04x}", self.base, self.items.len()),
            kind,
            text: String::new(),
            logprobs: Vec::new(),
        };
        let output_index = self.items.len();
        self.event(
            "response.output_item.added",
            json!({"output_index": output_index, "item": item.json("in_progress")}),
        );
        if let Kind::Message = item.kind {
            let mut data = item.at(output_index);
            data["part"] = json!({"type": "output_text", "text": "", "annotations": []});
            self.event("response.content_part.added", data);
        }
        self.items.push(item);
        self.open = true;
    }

    /// Adds `text` to the open item.
    fn extend(&mut self, text: &str) {
        let Some(output_index) = self.items.len().checked_sub(1) else {
            return;
        };
        let item = &mut self.items[output_index];
        item.text.push_str(text);
        let mut data = item.at(output_index);
        data["delta"] = json!(text);
        let kind = match item.kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            Kind::Message => {
                data["logprobs"] = json!([]);
                "response.output_text.delta"
            }
            Kind::Call { .. } => {
                data.as_object_mut().map(|o| o.remove("content_index"));
                "response.function_call_arguments.delta"
            }
            // Made whole: no delta tells it.
            Kind::Compaction => return,
        };
        self.event(kind, data);
    }

    /// Adds `logprobs` to the open message and to the delta event just made for its text.
    fn log(&mut self, logprobs: Vec<Value>) {
        if logprobs.is_empty() {
            return;
        }
        if let Some(event) = self.events.last_mut() {
            event["logprobs"] = json!(logprobs);
        }
        if let Some(item) = self.items.last_mut() {
            item.logprobs.extend(logprobs);
        }
    }

    /// Ends the open item, if there is one, with `status`.
    fn close(&mut self, status: &str) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let Some(output_index) = self.items.len().checked_sub(1) else {
            return;
        };
        let item = &self.items[output_index];
        let mut done = Vec::new();
        let mut data = item.at(output_index);
        match &item.kind {
            Kind::Reasoning => {
                data["text"] = json!(item.text);
                done.push(("response.reasoning_text.done", data));
            }
            Kind::Message => {
                let mut part = data.clone();
                data["text"] = json!(item.text);
                data["logprobs"] = json!(item.logprobs);
                done.push(("response.output_text.done", data));
                part["part"] = item.text_part();
                done.push(("response.content_part.done", part));
            }
            Kind::Call { name, .. } => {
                data.as_object_mut().map(|o| o.remove("content_index"));
                data["name"] = json!(name);
                data["arguments"] = json!(item.text);
                done.push(("response.function_call_arguments.done", data));
            }
            Kind::Compaction => {}
        }
        let whole = json!({"output_index": output_index, "item": item.json(status)});
        done.push(("response.output_item.done", whole));
        for (kind, data) in done {
            self.event(kind, data);
        }
    }

    fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        self.events.push(data);
    }
}

impl Item {
    /// The item as the response's `output` lists it.
    fn json(&self, status: &str) -> Value {
        match &self.kind {
            Kind::Reasoning => json!({"id": self.id, "type": "reasoning", "status": status,
                "summary": [], "content": [{"type": "reasoning_text", "text": self.text}]}),
            Kind::Message => json!({"id": self.id, "type": "message", "status": status,
                "role": "assistant", "content": [self.text_part()]}),
            Kind::Call { call_id, name, .. } => json!({"id": self.id, "type": "function_call",
                "status": status, "call_id": call_id, "name": name, "arguments": self.text}),
            Kind::Compaction => json!({"id": self.id, "type": "compaction",
                "encrypted_content": self.text}),
        }
    }

    /// A message's `output_text` part (with its `logprobs` where they were asked for).
    fn text_part(&self) -> Value {
        let mut part = json!({"type": "output_text", "text": self.text, "annotations": []});
        if !self.logprobs.is_empty() {
            part["logprobs"] = json!(self.logprobs);
        }
        part
    }

    /// An event's fields naming this item (its place in the output) and its content part.
    fn at(&self, output_index: usize) -> Value {
        json!({"item_id": self.id, "output_index": output_index, "content_index": 0})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(events: &[Value]) -> Vec<&str> {
        events.iter().filter_map(|e| e["type"].as_str()).collect()
    }

    #[test]
    fn a_thought_an_answer_and_calls_are_items_each_told_by_its_events() {
        let mut out = Output::new(true, "resp_test");
        out.thought("Need ");
        out.thought("the file.");
        out.answer("Reading.");
        out.call(0, "call_a", "read");
        out.arguments(0, "{\"path\":");
        out.arguments(0, " \"a.py\"}");
        out.call(1, "call_b", "ls");
        out.arguments(1, "{}");
        out.finish("completed");
        let events = out.take_events();
        assert_eq!(
            kinds(&events),
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(events[1]["delta"], "Need ");
        assert_eq!(events[3]["text"], "Need the file.");
        assert_eq!(events[7]["delta"], "Reading.");
        assert_eq!(events[14]["arguments"], "{\"path\": \"a.py\"}");
        assert_eq!(events[14]["name"], "read");
        // Every event names its item, and each item's index is its place in the output.
        let items = out.items("completed");
        for e in &events {
            let i = e["output_index"].as_u64().unwrap_or(0) as usize;
            let named = e.get("item_id").or(e["item"].get("id"));
            assert_eq!(named, Some(&items[i]["id"]), "{e}");
        }
        assert_eq!(items[0]["content"][0]["text"], "Need the file.");
        assert_eq!(items[1]["content"][0]["text"], "Reading.");
        assert_eq!(items[2]["call_id"], "call_a");
        assert_eq!(items[3]["arguments"], "{}");
    }

    #[test]
    fn one_call_only_without_parallel_calls_and_the_last_item_takes_the_end_s_status() {
        let mut out = Output::new(false, "resp_test");
        out.call(0, "call_a", "read");
        out.arguments(0, "{}");
        out.call(1, "call_b", "ls");
        out.arguments(1, "{\"x\": 1}");
        out.finish("incomplete");
        let items = out.items("incomplete");
        assert_eq!(items.len(), 1, "{items:?}");
        assert_eq!(items[0]["arguments"], "{}");
        assert_eq!(items[0]["status"], "incomplete");
        let events = out.take_events();
        assert_eq!(events.last().unwrap()["item"]["status"], "incomplete");
        // Nothing at all is no item.
        let mut out = Output::new(true, "resp_test");
        out.answer("");
        out.finish("completed");
        assert!(out.items("completed").is_empty() && out.take_events().is_empty());
    }
}

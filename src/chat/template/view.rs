//! Messages as templates see them: OpenAI's shape (`role`, `content` always a string as the
//! templates that search or split it need, `tool_calls` with `function.name` and
//! `function.arguments`, `tool_call_id`, `reasoning_content`). A call's arguments are the
//! object they parse to, which `tojson` writes back exactly as the model wrote them (so a
//! history's calls render as they were generated, and their KV is kept); text for templates
//! that concatenate them.

use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, Value};

use crate::message::{Message, ToolCall};

/// A call's arguments: the map they parse to, and their text as the model wrote it.
#[derive(Debug)]
pub(super) struct Arguments {
    pub text: String,
    map: Value,
}

impl Object for Arguments {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.map.get_item(key).ok().filter(|v| !v.is_undefined())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        match self.map.try_iter() {
            Ok(keys) => Enumerator::Values(keys.collect()),
            Err(_) => Enumerator::Empty,
        }
    }
}

/// `m` as templates see it; calls' arguments as text with `arguments_as_text`.
pub(super) fn message(m: &Message, arguments_as_text: bool) -> Value {
    let mut fields = vec![
        ("role", Value::from(m.role.as_str())),
        ("content", Value::from(m.content.as_str())),
    ];
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = (m.tool_calls.iter())
            .map(|c| call(c, arguments_as_text))
            .collect();
        fields.push(("tool_calls", Value::from(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    if let Some(thought) = &m.reasoning_content {
        fields.push(("reasoning_content", Value::from(thought.as_str())));
    }
    map(fields)
}

fn call(c: &ToolCall, as_text: bool) -> Value {
    let text = || Value::from(c.arguments.as_str());
    let arguments = match serde_json::from_str::<serde_json::Value>(&c.arguments) {
        _ if as_text => text(),
        Ok(v @ serde_json::Value::Object(_)) => Value::from_object(Arguments {
            text: c.arguments.clone(),
            map: Value::from_serialize(&v),
        }),
        Ok(v) => Value::from_serialize(&v),
        Err(_) => text(),
    };
    let function = map(vec![
        ("name", Value::from(c.name.as_str())),
        ("arguments", arguments),
    ]);
    map(vec![
        ("id", Value::from(c.id.as_str())),
        ("type", Value::from("function")),
        ("function", function),
    ])
}

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::from_iter(fields.into_iter().map(|(k, v)| (k.to_string(), v)))
}

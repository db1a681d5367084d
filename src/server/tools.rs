//! Tool calling on the wire: the `tools` a chat request offers, `tool_choice`, the calls an
//! assistant message carries (in requests and in answers), and `tool` messages.

use crate::chat::{Constraint, ToolFormat};
use crate::engine::SamplingParams;
use crate::model::{Message, ToolCall};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;

/// A call as OpenAI's messages carry it.
#[derive(Deserialize, Debug)]
pub struct WireCall {
    pub id: String,
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    pub function: WireFunction,
}

#[derive(Deserialize, Debug)]
pub struct WireFunction {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

fn function() -> String {
    "function".into()
}

impl WireCall {
    /// Bytes of text the call carries into the conversation.
    pub fn text_bytes(&self) -> usize {
        self.function.name.len() + self.function.arguments.len()
    }

    pub fn to_call(&self) -> Result<ToolCall, ApiError> {
        if self.kind != "function" {
            return Err(ApiError::bad(format!(
                "unsupported tool call type {:?}",
                self.kind
            )));
        }
        Ok(ToolCall::new(
            &self.id,
            &self.function.name,
            &self.function.arguments,
        ))
    }
}

/// The tools a request offers the model, checked (`function` entries with a name), and the
/// constraint `tool_choice` puts on the reply: none for `"auto"`; `"none"` offers no tools;
/// `"required"` or a named function holds the reply to one call (of any tool, or of that
/// one) in the template's format, `format`.
pub fn offered(
    tools: &[Value],
    choice: Option<&Value>,
    format: Option<ToolFormat>,
) -> Result<(Vec<Value>, Option<Constraint>), ApiError> {
    for t in tools {
        let name = t["function"]["name"].as_str();
        if t["type"] != "function" || name.is_none() {
            return Err(ApiError::bad(
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
        // OpenAI's rule (with dots, which MCP servers' tools carry): a name goes into the
        // prompt and the call grammar as text, where markup would be read as the template's.
        let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        if let Some(n) = name.filter(|n| n.is_empty() || n.len() > 64 || !n.chars().all(valid)) {
            return Err(ApiError::bad(format!(
                "tool name {n:?}: 1 to 64 letters, digits, underscores, dashes or dots"
            )));
        }
    }
    let forced: Vec<&Value> = match choice {
        None => return Ok((tools.to_vec(), None)),
        Some(Value::String(c)) if c == "auto" => return Ok((tools.to_vec(), None)),
        // Listed still, so the prompt keeps its KV; the turn is text only (`text_only`).
        Some(Value::String(c)) if c == "none" => return Ok((tools.to_vec(), None)),
        Some(Value::String(c)) if c == "required" => tools.iter().collect(),
        Some(named) if named["type"] == "function" => {
            let name = &named["function"]["name"];
            let tool = tools.iter().find(|t| &t["function"]["name"] == name);
            vec![tool.ok_or_else(|| ApiError::bad(format!("tool_choice names no tool: {name}")))?]
        }
        Some(other) => return Err(ApiError::bad(format!("tool_choice {other} is not valid"))),
    };
    if forced.is_empty() {
        return Err(ApiError::bad("tool_choice \"required\" needs tools"));
    }
    let Some(format) = format else {
        return Err(ApiError::bad("this model's chat template takes no tools"));
    };
    Ok((
        tools.to_vec(),
        Some(Constraint::Lark(one_call(format, &forced))),
    ))
}

/// Whether `tool_choice` makes the reply text only ([`SamplingParams::text_only`]): the
/// tools stay in the prompt, no call is read out of the reply.
pub fn text_only(choice: Option<&Value>) -> bool {
    choice.is_some_and(|c| c == "none")
}

/// The constraint on a reply with `tools` offered, as OpenAI holds a reply with both tools
/// and a response format: a call `tool_choice` forces (from [`offered`]) holds the reply
/// alone, since the format is for the answer after the calls; with calls unforced, the
/// reply is either one call of the tools in the template's `format` or an answer that
/// follows the format (`params.constraint`, a response format or `guided_*`).
///
/// # Errors
/// A 400 for a `guided_grammar` beside unforced tools: a grammar of the client's own cannot
/// be joined with the calls' (a schema, a regular expression or a choice can).
pub fn hold(
    params: &mut SamplingParams,
    forced: Option<Constraint>,
    tools: &[Value],
    format: Option<ToolFormat>,
) -> Result<(), ApiError> {
    if forced.is_some() {
        params.constraint = forced;
        return Ok(());
    }
    if params.text_only {
        return Ok(());
    }
    let (Some(answer), Some(format)) = (&params.constraint, format) else {
        return Ok(());
    };
    if tools.is_empty() {
        return Ok(());
    }
    let answer = match answer {
        Constraint::JsonObject => r#"%json {"type": "object"}"#.to_string(),
        Constraint::JsonSchema(schema) => format!("%json {schema}"),
        Constraint::Regex(r) => format!("/{}/", r.replace('/', "\\/")),
        Constraint::Lark(_) => {
            return Err(ApiError::bad(
                "guided_grammar cannot hold a reply that may call tools: force a call with \
                 tool_choice, or give a schema",
            ))
        }
    };
    let all: Vec<&Value> = tools.iter().collect();
    let call = one_call(format, &all);
    // Every call grammar opens with its `start` rule, renamed to be one alternative.
    let call = call.replacen("start:", "pensieve_call:", 1);
    params.constraint = Some(Constraint::Lark(format!(
        "start: pensieve_call | pensieve_answer\npensieve_answer: {answer}\n{call}"
    )));
    Ok(())
}

/// A grammar (Lark, opening with its `start` rule) of one call of one of `tools`, with arguments of its schema, as `format`
/// writes it: a `<tool_call>` element (Hermes), a one-call `[TOOL_CALLS]` list (Mistral), or
/// the reply as one object with `parameters` (Llama 3).
fn one_call(format: ToolFormat, tools: &[&Value]) -> String {
    match format {
        ToolFormat::Qwen3Coder => return xml_call(tools),
        ToolFormat::MistralArgs
        | ToolFormat::DeepSeekV3
        | ToolFormat::DeepSeekV31
        | ToolFormat::Harmony => return named_call(format, tools),
        _ => {}
    }
    let arguments_key = match format {
        ToolFormat::Llama3Json => "parameters",
        _ => "arguments",
    };
    let mut defs = serde_json::Map::new();
    let calls: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let f = &t["function"];
            let arguments = match &f["parameters"] {
                Value::Null => json!({"type": "object"}),
                p => hoist(p, &format!("tool{i}"), &mut defs),
            };
            json!({"type": "object", "properties": {
                "name": {"const": f["name"]}, arguments_key: arguments},
                "required": ["name", arguments_key], "additionalProperties": false})
        })
        .collect();
    let mut schema = json!({ "anyOf": calls });
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    let start = match format {
        ToolFormat::Mistral => r#"start: "[TOOL_CALLS][" call "]""#,
        ToolFormat::Llama3Json => "start: call",
        _ => r#"start: "<tool_call>\n" call "\n</tool_call>""#,
    };
    format!("{start}\ncall: %json {schema}")
}

/// A call of one of `tools` in a format that writes the function's name as text before its
/// arguments' object (of the tool's schema): Mistral's `[TOOL_CALLS]NAME[ARGS]{...}`, or
/// DeepSeek's list of one call (V3 fences the object as JSON, V3.1 does not).
fn named_call(format: ToolFormat, tools: &[&Value]) -> String {
    const DEEPSEEK_OPEN: &str = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>";
    const DEEPSEEK_CLOSE: &str = "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let (open, close) = match format {
        ToolFormat::DeepSeekV3 => (DEEPSEEK_OPEN, format!("\n```{DEEPSEEK_CLOSE}")),
        ToolFormat::DeepSeekV31 => (DEEPSEEK_OPEN, DEEPSEEK_CLOSE.to_string()),
        // The reply opens after the prompt's `<|start|>assistant`: a commentary message to the
        // function, written as the template renders calls (the recipient in the role), so the
        // next turn's prompt reuses it; `<|call|>` ends generation after it.
        ToolFormat::Harmony => (" to=functions.", String::new()),
        _ => ("[TOOL_CALLS]", String::new()),
    };
    let quoted = |s: &str| Value::String(s.to_string()).to_string();
    let calls: Vec<String> = (0..tools.len()).map(|i| format!("call{i}")).collect();
    let close = match close.is_empty() {
        true => String::new(),
        false => quoted(&close),
    };
    let mut rules = vec![format!(
        "start: {} ({}) {close}",
        quoted(open),
        calls.join(" | "),
    )];
    for (i, t) in tools.iter().enumerate() {
        let f = &t["function"];
        let mut defs = serde_json::Map::new();
        let mut schema = match &f["parameters"] {
            Value::Null => json!({"type": "object"}),
            p => hoist(p, &format!("tool{i}"), &mut defs),
        };
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        let name = f["name"].as_str().unwrap_or_default();
        let head = match format {
            ToolFormat::DeepSeekV3 => format!("function<｜tool▁sep｜>{name}\n```json\n"),
            ToolFormat::DeepSeekV31 => format!("{name}<｜tool▁sep｜>"),
            ToolFormat::Harmony => format!("{name}<|channel|>commentary json<|message|>"),
            _ => format!("{name}[ARGS]"),
        };
        rules.push(format!("call{i}: {} %json {schema}", quoted(&head)));
    }
    rules.join("\n")
}

/// Qwen3-Coder's call of one of `tools`: a `<function=...>` element of its name, whose
/// `<parameter=...>` elements name its parameters, any number in any order (required ones
/// are the model's to give). Each value follows its schema's type: digits for integers and
/// numbers, `true`/`false`, JSON of the schema for objects and arrays, and one line for
/// strings and the rest (a grammar cannot look ahead for `</parameter>`, so a string may not
/// span lines here, as it may when the model calls unforced). A tool without listed
/// parameters takes any names, each value a line.
fn xml_call(tools: &[&Value]) -> String {
    const LINE: &str = r"/([^\n<]|<[^\/\n])*/";
    let quoted = |s: &str| Value::String(s.to_string()).to_string();
    let calls: Vec<String> = (0..tools.len()).map(|i| format!("call{i}")).collect();
    let mut rules = vec![format!(
        r#"start: "<tool_call>\n" ({}) "</tool_call>""#,
        calls.join(" | ")
    )];
    for (i, t) in tools.iter().enumerate() {
        let f = &t["function"];
        let name = f["name"].as_str().unwrap_or_default();
        let props = f["parameters"]["properties"].as_object();
        let mut params = Vec::new();
        for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
            let value = match schema["type"].as_str() {
                Some("integer") => r"/-?[0-9]+/".to_string(),
                Some("number") => r"/-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?/".to_string(),
                Some("boolean") => r#""true" | "false""#.to_string(),
                Some("object" | "array") => format!("%json {schema}"),
                _ => LINE.to_string(),
            };
            let open = quoted(&format!("<parameter={key}>\n"));
            rules.push(format!("p{i}_{j}: {open} ({value}) \"\\n</parameter>\\n\""));
            params.push(format!("p{i}_{j}"));
        }
        if params.is_empty() {
            rules.push(format!(
                "p{i}_any: \"<parameter=\" /[A-Za-z_][A-Za-z0-9_]*/ \">\\n\" {LINE} \"\\n</parameter>\\n\""
            ));
            params.push(format!("p{i}_any"));
        }
        rules.push(format!(
            "call{i}: {} ({})* \"</function>\\n\"",
            quoted(&format!("<function={name}>\n")),
            params.join(" | ")
        ));
    }
    rules.join("\n")
}

/// A tool's parameter schema made to stand inside the schema of every call: its definitions
/// (`$defs`, `definitions`, as pydantic writes them) move to the root's `$defs` under names
/// prefixed by `tool` (two tools may define the same name), and its references follow them
/// (`#/$defs/X`, `#/definitions/X`), or point into its own copy there (`#` for itself, and any
/// other pointer into it: `#/properties/...`, a property's own `$defs`). Without this a
/// reference would point at the combined schema's root, where nothing is defined.
fn hoist(parameters: &Value, tool: &str, defs: &mut serde_json::Map<String, Value>) -> Value {
    let mut own = parameters.clone();
    let mut found = serde_json::Map::new();
    if let Some(o) = own.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = o.remove(key) {
                found.extend(d);
            }
        }
    }
    let root = format!("{tool}__self");
    let recursive = std::cell::Cell::new(false);
    let hoisted: std::collections::HashSet<String> = found.keys().cloned().collect();
    let rename = |r: &str| -> Option<String> {
        let path = r.strip_prefix('#')?;
        // A definition moved to the root, or a pointer further into one.
        let defs = (path.strip_prefix("/$defs/")).or_else(|| path.strip_prefix("/definitions/"));
        if let Some(p) = defs {
            let (name, rest) = p
                .split_once('/')
                .map_or((p, ""), |(n, _)| (n, &p[n.len()..]));
            if hoisted.contains(name) {
                return Some(format!("#/$defs/{tool}__{name}{rest}"));
            }
        }
        // The tool itself, or any pointer into it (`#/properties/...`, a property's own
        // `$defs`): they point into its copy among the root's definitions.
        recursive.set(true);
        Some(format!("#/$defs/{root}{path}"))
    };
    fn rewrite(v: &mut Value, rename: &dyn Fn(&str) -> Option<String>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get_mut("$ref")
                    && let Some(new) = rename(r)
                {
                    *r = new;
                }
                o.values_mut().for_each(|x| rewrite(x, rename));
            }
            Value::Array(a) => a.iter_mut().for_each(|x| rewrite(x, rename)),
            _ => {}
        }
    }
    rewrite(&mut own, &rename);
    for (name, mut def) in found {
        rewrite(&mut def, &rename);
        defs.insert(format!("{tool}__{name}"), def);
    }
    if recursive.get() {
        defs.insert(root, own.clone());
    }
    own
}

/// An assistant message's `message` (or stream `delta`) body: its text (null when it only
/// calls tools) and its calls, at most one unless `parallel`.
/// A thinking model's thought, which the engine keeps apart, comes as `reasoning_content`.
pub fn message_json(m: &Message, parallel: bool) -> Value {
    let mut v = calls_json(m, parallel);
    if let Some(thought) = &m.reasoning_content {
        v["reasoning_content"] = json!(thought);
    }
    v
}

/// An assistant message's `message` body for a request that offered `functions` (the legacy
/// form of tools): its first call as `function_call`.
pub fn legacy_message_json(m: &Message) -> Value {
    match m.tool_calls.first() {
        None => json!({"role": "assistant", "content": m.content}),
        Some(c) => {
            let content = (!m.content.is_empty()).then_some(m.content.as_str());
            json!({"role": "assistant", "content": content,
                "function_call": {"name": c.name, "arguments": c.arguments}})
        }
    }
}

/// `functions` (the legacy form of `tools`) as `tools`, and `function_call` as `tool_choice`;
/// a request may use one form or the other.
///
/// # Errors
/// A 400 for a request that uses both forms.
pub fn from_legacy(
    tools: &[Value],
    choice: Option<&Value>,
    functions: Option<&[Value]>,
    function_call: Option<&Value>,
) -> Result<(Vec<Value>, Option<Value>), ApiError> {
    if functions.is_none() && function_call.is_none() {
        return Ok((tools.to_vec(), choice.cloned()));
    }
    if !tools.is_empty() || choice.is_some() {
        return Err(ApiError::bad(
            "functions and function_call are the legacy form of tools and tool_choice: \
             give one form",
        ));
    }
    let tools = functions
        .into_iter()
        .flatten()
        .map(|f| json!({"type": "function", "function": f}))
        .collect();
    let choice = function_call.map(|c| match c {
        Value::Object(o) => json!({"type": "function", "function": {"name": o.get("name")}}),
        other => other.clone(),
    });
    Ok((tools, choice))
}

fn calls_json(m: &Message, parallel: bool) -> Value {
    if m.tool_calls.is_empty() {
        return json!({"role": "assistant", "content": m.content});
    }
    let keep = if parallel { m.tool_calls.len() } else { 1 };
    let calls: Vec<Value> = m.tool_calls[..keep]
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect();
    let content = (!m.content.is_empty()).then_some(m.content.as_str());
    json!({"role": "assistant", "content": content, "tool_calls": calls})
}

//! Structured output on the wire: `response_format`, or vLLM's `guided_*` fields, as the
//! constraint the engine holds a reply to (decoding constrained by llguidance, see
//! `crate::chat::Constraint`).

use crate::chat::Constraint;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;

/// `response_format`: free text, any JSON object, or JSON valid under a schema.
#[derive(Deserialize, Debug)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    /// The format's name, as OpenAI requires one: letters, digits, `_` and `-`, at most 64.
    pub name: String,
    /// Taken and unused: it describes the format to a model, which the schema holds here.
    #[serde(default, rename = "description")]
    _description: Option<IgnoredAny>,
    pub schema: Option<Value>,
    /// Taken and unused: the reply always follows the schema exactly.
    #[serde(default, rename = "strict")]
    _strict: Option<IgnoredAny>,
}

impl ResponseFormat {
    /// The constraint it puts on the reply.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        if let Self::JsonSchema { json_schema } = self {
            let n = &json_schema.name;
            let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if n.is_empty() || n.len() > 64 || !n.chars().all(ok) {
                return Err(ApiError::bad(
                    "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
                ));
            }
        }
        Ok(match self {
            Self::Text => None,
            Self::JsonObject => Some(Constraint::JsonObject),
            Self::JsonSchema { json_schema } => Some(match &json_schema.schema {
                Some(s) => Constraint::JsonSchema(s.clone()),
                None => Constraint::JsonObject,
            }),
        })
    }
}

/// vLLM's guided decoding fields; at most one may be given.
#[derive(Deserialize, Debug, Default)]
pub struct Guided {
    /// JSON valid under this schema.
    guided_json: Option<Value>,
    /// Text matching this regular expression, whole.
    guided_regex: Option<String>,
    /// Exactly one of these strings.
    guided_choice: Option<Vec<String>>,
    /// Text of this grammar, in llguidance's Lark dialect (vLLM takes the dialect of its
    /// backend's grammar engine; Lark is one of them).
    guided_grammar: Option<String>,
}

impl Guided {
    /// The constraint the field puts on the reply, if one is given.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let given = [
            self.guided_json.is_some(),
            self.guided_regex.is_some(),
            self.guided_choice.is_some(),
            self.guided_grammar.is_some(),
        ];
        if given.iter().filter(|&&g| g).count() > 1 {
            return Err(ApiError::bad(
                "at most one guided_* field may hold the reply",
            ));
        }
        Ok(if let Some(schema) = &self.guided_json {
            // vLLM takes the schema as an object or as its JSON text.
            Some(match schema {
                Value::String(text) => Constraint::JsonSchema(
                    serde_json::from_str(text)
                        .map_err(|e| ApiError::bad(format!("guided_json: {e}")))?,
                ),
                schema => Constraint::JsonSchema(schema.clone()),
            })
        } else if let Some(regex) = &self.guided_regex {
            Some(Constraint::Regex(regex.clone()))
        } else if let Some(choices) = &self.guided_choice {
            if choices.is_empty() {
                return Err(ApiError::bad("guided_choice needs at least one choice"));
            }
            let each: Vec<String> = choices.iter().map(|c| escaped(c)).collect();
            Some(Constraint::Regex(format!("({})", each.join("|"))))
        } else {
            self.guided_grammar.clone().map(Constraint::Lark)
        })
    }
}

/// `text` as a regular expression that matches it literally.
fn escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        // The characters `regex::escape` escapes (the syntax llguidance's regexes share).
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

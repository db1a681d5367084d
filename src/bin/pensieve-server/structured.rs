//! Structured output on the wire: `response_format` as the constraint the engine holds a
//! reply to (decoding constrained by llguidance, see `pensieve::model::Constraint`).

use pensieve::model::Constraint;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

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

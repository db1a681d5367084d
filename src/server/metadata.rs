//! OpenAI's `metadata`, on every route that takes it (`/v1/conversations` and its update,
//! `/v1/responses`, `/v1/chat/completions`): at most 16 pairs of string keys of at most 64
//! characters and string values of at most 512, as OpenAI documents it. Anything else is a 400
//! naming the field, so a client learns here what OpenAI would refuse, and what a server keeps
//! per conversation stays bounded.

use serde_json::Value;

use super::error::ApiError;

/// Most pairs.
pub const MAX_PAIRS: usize = 16;
/// Longest key, in characters.
pub const MAX_KEY: usize = 64;
/// Longest value, in characters.
pub const MAX_VALUE: usize = 512;

/// `metadata` (null, or an object within OpenAI's limits), or a 400 naming it and the limit
/// it breaks.
///
/// # Errors
/// The 400.
pub fn check(metadata: &Value) -> Result<(), ApiError> {
    let bad = |why: String| Err(ApiError::bad(format!("metadata: {why}")).with_param("metadata"));
    let pairs = match metadata {
        Value::Null => return Ok(()),
        Value::Object(pairs) => pairs,
        _ => return bad("must be an object of string values".into()),
    };
    if pairs.len() > MAX_PAIRS {
        return bad(format!("at most {MAX_PAIRS} pairs ({} given)", pairs.len()));
    }
    for (key, value) in pairs {
        let shown: String = key.chars().take(16).collect();
        if key.chars().count() > MAX_KEY {
            return bad(format!("key {shown:?}... is over {MAX_KEY} characters"));
        }
        match value.as_str() {
            None => return bad(format!("the value of {shown:?} is not a string")),
            Some(v) if v.chars().count() > MAX_VALUE => {
                return bad(format!(
                    "the value of {shown:?} is over {MAX_VALUE} characters"
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_limits_are_held_by_characters() {
        assert!(check(&json!(null)).is_ok());
        assert!(check(&json!({"a": "b"})).is_ok());
        let full: serde_json::Map<String, Value> = (0..MAX_PAIRS)
            .map(|i| {
                (
                    "k".repeat(MAX_KEY - 2) + &format!("{i:02}"),
                    json!("é".repeat(MAX_VALUE)),
                )
            })
            .collect();
        assert!(check(&Value::Object(full.clone())).is_ok());
        let mut more = full;
        more.insert("x".into(), json!("y"));
        for bad in [
            Value::Object(more),
            json!({"k".repeat(MAX_KEY + 1): "v"}),
            json!({"k": "v".repeat(MAX_VALUE + 1)}),
            json!({"k": 1}),
            json!(["k"]),
        ] {
            let e = check(&bad).err().map(|e| (e.status.as_u16(), e.param));
            assert_eq!(e, Some((400, Some("metadata".into()))), "{bad}");
        }
    }
}

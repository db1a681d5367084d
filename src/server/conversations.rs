//! OpenAI's Conversations API on the engine's named conversations: `/v1/conversations` (create
//! with items, retrieve, update metadata, delete) and its items (list, add, retrieve, delete);
//! `conversation` on `/v1/responses` continues one.
//!
//! A conversation is the named chat conversation of its id (`conv_` and 128 random bits), so
//! it keeps its KV across turns, restarts and a fleet as any named conversation does: its
//! items are that conversation's transcript, read back as items. Adding or deleting items
//! gives the conversation a new history ([`crate::service::Service::rewrite`]): its next turn
//! is what a stateless server computes on the new items, with the KV of the prefix the two
//! histories share reused by content. An item's id is a digest of the conversation's id, the
//! item and how many equal items come before it, so ids stay put when other items are added
//! or deleted. Metadata and the creation time live in this server's memory: after a restart
//! (or on another server of a fleet) a conversation answers with empty metadata.

use std::collections::HashMap;
use std::sync::Arc;

use crate::model::Message;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::Tenant;
use super::error::ApiError;
use super::random_id::random_id;
use super::responses::input::Input;
use super::{now_s, AppState};

/// What the server keeps of a conversation beside its transcript.
#[derive(Clone, Debug)]
struct Meta {
    created_at: u64,
    metadata: Value,
}

/// The conversations this server made or served: their metadata and creation times.
#[derive(Clone, Default)]
pub struct Registry(Arc<Mutex<HashMap<String, Meta>>>);

impl Registry {
    fn get(&self, id: &str) -> Option<Meta> {
        self.0.lock().get(id).cloned()
    }
}

/// Most items one request may add, and most metadata keys (OpenAI's limits).
const MAX_ITEMS: usize = 20;
const MAX_METADATA_KEYS: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    #[serde(default)]
    items: Option<Vec<Value>>,
    #[serde(default)]
    metadata: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateBody {
    metadata: Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ItemsBody {
    items: Vec<Value>,
}

/// `GET .../items`'s query: OpenAI's paging (`after` an item id, `limit` 1 to 100, `order`
/// `asc` or `desc`) and `include`, whose values add nothing here.
#[derive(Deserialize)]
pub struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
    #[serde(rename = "include[]", default)]
    _include: Option<String>,
    #[serde(default, rename = "include")]
    _include_plain: Option<String>,
}

fn body<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes = if bytes.is_empty() {
        b"{}" as &[u8]
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad(format!("invalid request body: {e}")))
}

fn missing(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no conversation {id:?}"))
}

fn check_metadata(metadata: &Value) -> Result<(), ApiError> {
    match metadata {
        Value::Null => Ok(()),
        Value::Object(o) if o.len() <= MAX_METADATA_KEYS && o.values().all(Value::is_string) => {
            Ok(())
        }
        _ => Err(ApiError::bad(format!(
            "metadata must be an object of at most {MAX_METADATA_KEYS} string values"
        ))),
    }
}

/// Items (as `/v1/responses` takes them as input) as messages.
fn messages_of(items: Vec<Value>) -> Result<Vec<Message>, ApiError> {
    if items.len() > MAX_ITEMS {
        return Err(ApiError::bad(format!(
            "at most {MAX_ITEMS} items may be added at once"
        )));
    }
    let input: Input = serde_json::from_value(Value::Array(items))
        .map_err(|e| ApiError::bad(format!("invalid items: {e}")))?;
    let mut messages = Vec::new();
    input.append_to(&mut messages)?;
    Ok(messages)
}

/// The transcript of `tenant`'s conversation `id`: the named conversation's, or none yet for one made
/// here without items. A 404 when neither holds it.
async fn transcript(s: &AppState, tenant: &Tenant, id: &str) -> Result<Vec<Message>, ApiError> {
    if !id.starts_with("conv_") {
        return Err(missing(id));
    }
    match s.service.resume(&tenant.name(id)).await {
        Ok(conv) => s.service.messages(conv).await.map_err(|_| missing(id)),
        Err(_) if s.conversations.get(&tenant.name(id)).is_some() => Ok(Vec::new()),
        Err(e) if matches!(e.kind(), crate::ErrorKind::Unavailable) => {
            Err(ApiError::from_engine(&e))
        }
        Err(_) => Err(missing(id)),
    }
}

/// The conversation object of `tenant`'s `id`.
fn object(s: &AppState, tenant: &Tenant, id: &str) -> Value {
    let meta = s.conversations.get(&tenant.name(id));
    let created = meta.as_ref().map_or_else(now_s, |m| m.created_at);
    let metadata = meta.map_or(json!({}), |m| m.metadata);
    json!({"id": id, "object": "conversation", "created_at": created, "metadata": metadata})
}

/// `POST /v1/conversations`.
pub async fn create(State(s): State<AppState>, tenant: Tenant, bytes: Bytes) -> Response {
    let made = async {
        let b: CreateBody = body(&bytes)?;
        let metadata = b.metadata.unwrap_or(json!({}));
        check_metadata(&metadata)?;
        let messages = messages_of(b.items.unwrap_or_default())?;
        let id = random_id("conv_")?;
        if !messages.is_empty() {
            rewrite(&s, &tenant, &id, messages).await?;
        }
        let meta = Meta {
            created_at: now_s(),
            metadata,
        };
        s.conversations.0.lock().insert(tenant.name(&id), meta);
        Ok::<_, ApiError>(object(&s, &tenant, &id))
    };
    answer(made.await)
}

/// Gives `tenant`'s conversation `id` the history `messages`.
async fn rewrite(
    s: &AppState,
    tenant: &Tenant,
    id: &str,
    messages: Vec<Message>,
) -> Result<(), ApiError> {
    (s.service.rewrite(&tenant.name(id), messages).await).map_err(|e| ApiError::from_engine(&e))
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Response {
    answer(
        transcript(&s, &tenant, &id)
            .await
            .map(|_| object(&s, &tenant, &id)),
    )
}

/// `POST /v1/conversations/{id}`: new metadata.
pub async fn update(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Response {
    let updated = async {
        let b: UpdateBody = body(&bytes)?;
        check_metadata(&b.metadata)?;
        transcript(&s, &tenant, &id).await?;
        let mut registry = s.conversations.0.lock();
        let meta = registry.entry(tenant.name(&id)).or_insert_with(|| Meta {
            created_at: now_s(),
            metadata: json!({}),
        });
        meta.metadata = b.metadata;
        drop(registry);
        Ok(object(&s, &tenant, &id))
    };
    answer(updated.await)
}

/// `DELETE /v1/conversations/{id}`: the named conversation is closed and removed from the
/// store.
pub async fn delete(State(s): State<AppState>, tenant: Tenant, Path(id): Path<String>) -> Response {
    let deleted = async {
        transcript(&s, &tenant, &id).await?;
        match s.service.resume(&tenant.name(&id)).await {
            Ok(conv) => (s.service.close(conv).await).map_err(|e| ApiError::from_engine(&e))?,
            // Created and never continued: nothing stored.
            Err(e) if e.kind() == crate::ErrorKind::NotFound => {}
            Err(e) => return Err(ApiError::from_engine(&e)),
        }
        s.conversations.0.lock().remove(&tenant.name(&id));
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    };
    answer(deleted.await)
}

/// Where an item lies in the transcript: a message's text, or one of its calls.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Part {
    Text,
    Call(usize),
}

/// The items of a transcript, each with the message and part it is, in order.
fn items(id: &str, messages: &[Message]) -> Vec<(usize, Part, Value)> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut item_id = |prefix: &str, key: String| {
        let n = seen.entry(key.clone()).or_insert(0);
        *n += 1;
        let mut h = blake3::Hasher::new();
        for part in [id, prefix, &key, &n.to_string()] {
            h.update(&(part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        format!("{prefix}_{}", &h.finalize().to_hex()[..32])
    };
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role == "tool" {
            let call = m.tool_call_id.clone().unwrap_or_default();
            let key = format!("{call}\u{0}{}", m.content);
            let item = json!({"id": item_id("fco", key), "type": "function_call_output",
                "call_id": call, "output": m.content, "status": "completed"});
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
            let key = format!("{}\u{0}{}", m.role, m.content);
            let item = json!({"id": item_id("msg", key), "type": "message", "role": m.role,
                "content": [text], "status": "completed"});
            out.push((i, Part::Text, item));
        }
        for (k, c) in m.tool_calls.iter().enumerate() {
            let key = format!("{}\u{0}{}\u{0}{}", c.id, c.name, c.arguments);
            let item = json!({"id": item_id("fc", key), "type": "function_call",
                "call_id": c.id, "name": c.name, "arguments": c.arguments,
                "status": "completed"});
            out.push((i, Part::Call(k), item));
        }
    }
    out
}

/// A page of items as OpenAI lists them.
fn list(data: Vec<Value>, has_more: bool) -> Value {
    let first = data.first().map(|i| i["id"].clone());
    let last = data.last().map(|i| i["id"].clone());
    json!({"object": "list", "data": data, "first_id": first, "last_id": last,
        "has_more": has_more})
}

/// `GET /v1/conversations/{id}/items`.
pub async fn list_items(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
    Query(q): Query<ListQuery>,
) -> Response {
    let listed = async {
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(ApiError::bad("limit must be in [1, 100]"));
        }
        let messages = transcript(&s, &tenant, &id).await?;
        let mut all: Vec<Value> = items(&id, &messages).into_iter().map(|(.., v)| v).collect();
        match q.order.as_deref() {
            None | Some("desc") => all.reverse(),
            Some("asc") => {}
            Some(o) => return Err(ApiError::bad(format!("order {o:?}: asc or desc"))),
        }
        let start = match &q.after {
            Some(after) => match all.iter().position(|i| i["id"] == after.as_str()) {
                Some(p) => p + 1,
                None => return Err(ApiError::bad(format!("after: no item {after:?}"))),
            },
            None => 0,
        };
        let rest = all.split_off(start.min(all.len()));
        let has_more = rest.len() > limit;
        Ok(list(rest.into_iter().take(limit).collect(), has_more))
    };
    answer(listed.await)
}

/// `POST /v1/conversations/{id}/items`: items added at the end.
pub async fn add_items(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
    bytes: Bytes,
) -> Response {
    let added = async {
        let b: ItemsBody = body(&bytes)?;
        let new = messages_of(b.items)?;
        let mut messages = transcript(&s, &tenant, &id).await?;
        let before = items(&id, &messages).len();
        append(&mut messages, new);
        rewrite(&s, &tenant, &id, messages.clone()).await?;
        let all = items(&id, &messages);
        Ok(list(
            all.into_iter().skip(before).map(|(.., v)| v).collect(),
            false,
        ))
    };
    answer(added.await)
}

/// Appends `new` to `messages`, a call joining the assistant message before it as input
/// items do.
fn append(messages: &mut Vec<Message>, new: Vec<Message>) {
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

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn retrieve_item(
    State(s): State<AppState>,
    tenant: Tenant,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let found = async {
        let messages = transcript(&s, &tenant, &id).await?;
        let all = items(&id, &messages);
        let hit = all.into_iter().find(|(.., v)| v["id"] == item.as_str());
        hit.map(|(.., v)| v).ok_or_else(|| no_item(&item))
    };
    answer(found.await)
}

fn no_item(item: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no item {item:?}"))
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: the conversation without that item
/// (answered with the conversation object, as OpenAI answers).
pub async fn delete_item(
    State(s): State<AppState>,
    tenant: Tenant,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let deleted = async {
        let mut messages = transcript(&s, &tenant, &id).await?;
        let all = items(&id, &messages);
        let (at, part) = all
            .iter()
            .find(|(.., v)| v["id"] == item.as_str())
            .map(|&(i, p, _)| (i, p))
            .ok_or_else(|| no_item(&item))?;
        let m = &mut messages[at];
        match part {
            Part::Call(k) => {
                m.tool_calls.remove(k);
            }
            Part::Text => m.content.clear(),
        }
        let empty = m.content.is_empty() && m.tool_calls.is_empty();
        if empty || m.role == "tool" {
            messages.remove(at);
        }
        rewrite(&s, &tenant, &id, messages).await?;
        Ok(object(&s, &tenant, &id))
    };
    answer(deleted.await)
}

/// The `conversation` of a `/v1/responses` request (its id, or `{"id": ...}`), checked to
/// exist: its id, and the transcript it continues (`tenant`'s).
pub async fn continued(
    s: &AppState,
    tenant: &Tenant,
    conversation: &Value,
) -> Result<(String, Vec<Message>), ApiError> {
    let id = match conversation {
        Value::String(id) => id.clone(),
        Value::Object(o) => match o.get("id") {
            Some(Value::String(id)) => id.clone(),
            _ => return Err(ApiError::bad("conversation must be an id or {\"id\": ...}")),
        },
        _ => return Err(ApiError::bad("conversation must be an id or {\"id\": ...}")),
    };
    let messages = transcript(s, tenant, &id).await?;
    Ok((id, messages))
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

    #[test]
    fn every_text_and_call_is_an_item_with_a_stable_distinct_id() {
        let m = transcript();
        let all = items("conv_a", &m);
        let kinds: Vec<&str> = all
            .iter()
            .map(|(.., v)| v["type"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "message",
                "function_call",
                "function_call_output",
                "message"
            ]
        );
        let ids: std::collections::HashSet<&str> = all
            .iter()
            .map(|(.., v)| v["id"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(ids.len(), 5, "two equal user messages still differ");
        // Deleting the first message leaves the others' ids as they were, but for the equal
        // message after it, which is now the first of its kind.
        let fewer = items("conv_a", &m[1..]);
        for id in fewer.iter().take(3).map(|(.., v)| &v["id"]) {
            assert!(all.iter().any(|(.., v)| &v["id"] == id));
        }
        assert_ne!(items("conv_b", &m)[0].2["id"], all[0].2["id"]);
    }
}

//! OpenAI's Conversations API on the engine's named conversations: `/v1/conversations` (create
//! with items, retrieve, update metadata, delete) and its items (list, add, retrieve, delete);
//! `conversation` on `/v1/responses` continues one.
//!
//! A conversation is the named chat conversation of its id (`conv_` and 128 random bits), so
//! it keeps its KV across turns, restarts and a fleet as any named conversation does: its
//! items are that conversation's transcript, read back as items. Its creation time, metadata
//! and items' ids are kept with it in the engine's attributes ([`items::Kept`]), so they are
//! stored, resumed and evicted with it: the server holds no table of its own, and an empty
//! conversation is stored as one.
//!
//! Every route is one [`crate::service::Service::edit`] of the conversation: read, change and
//! write on the engine thread under the same ownership as a turn, so concurrent edits all land
//! in some order (a turn running on it makes them a 409 to retry), a deletion that answered 200
//! is final, and a change is answered once the store has it (a 503 while it cannot take it,
//! nothing changed). Adding or deleting items gives the conversation a new history: its next
//! turn is what a stateless server computes on the new items, with the KV of the prefix the
//! two histories share reused by content.

mod items;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::Tenant;
use super::error::ApiError;
use super::metadata;
use super::random_id::random_id;
use super::responses::input::Input;
use super::{now_s, AppState};
use crate::model::Message;
use crate::service::{Change, Record};
use items::{append, remove, Kept};

/// Most items one request may add (OpenAI's limit).
const MAX_ITEMS: usize = 20;

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
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad(format!("invalid request body: {e}")))?;
    serde_path_to_error::deserialize(value).map_err(|e| ApiError::body_type(&e))
}

/// The 404 of a conversation `id` that does not exist.
pub(super) fn missing(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no conversation {id:?}"))
}

fn no_item(item: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no item {item:?}"))
}

/// Items (as `/v1/responses` takes them as input) as messages.
fn messages_of(items: Vec<Value>) -> Result<Vec<Message>, ApiError> {
    if items.len() > MAX_ITEMS {
        return Err(
            ApiError::bad(format!("items: at most {MAX_ITEMS} may be added at once"))
                .with_param("items"),
        );
    }
    let input: Input = serde_json::from_value(Value::Array(items))
        .map_err(|e| ApiError::bad(format!("items: {e}")).with_param("items"))?;
    let mut messages = Vec::new();
    input.append_to(&mut messages)?;
    Ok(messages)
}

/// A conversation as an edit reads it: its record and what the server keeps with it.
struct Read<'a> {
    record: &'a Record,
    kept: Kept,
}

/// The edit of `tenant`'s conversation `id` that `decide` makes of it as it is read (a 404
/// when there is none), as one operation ([`crate::service::Service::edit`]); what `decide`
/// answers.
async fn edit<T, F>(s: &AppState, tenant: &Tenant, id: &str, decide: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: Fn(Read<'_>) -> Result<(Change, T), ApiError> + Send + Sync + 'static,
{
    if !id.starts_with("conv_") {
        return Err(missing(id));
    }
    let name = tenant.name(id);
    let shown = id.to_string();
    let edited = s.service.edit(&name, move |record| {
        let record = record.ok_or_else(|| missing(&shown))?;
        let kept = Kept::read(&record.attributes, now_s());
        decide(Read { record, kept })
    });
    match edited.await {
        Ok(answer) => answer,
        Err(e) if e.kind() == crate::ErrorKind::NotFound => Err(missing(id)),
        Err(e) => Err(ApiError::from_engine(&e)),
    }
}

/// The conversation object of `id`.
fn object(id: &str, kept: &Kept) -> Value {
    json!({"id": id, "object": "conversation", "created_at": kept.created_at,
        "metadata": kept.metadata})
}

/// The history `messages` with what `kept` holds, as a change.
fn rewrite(messages: Vec<Message>, kept: &Kept) -> Change {
    Change::Rewrite(Record::new(messages, kept.attributes()))
}

fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/conversations`: stored at once, items or none.
pub async fn create(State(s): State<AppState>, tenant: Tenant, bytes: Bytes) -> Response {
    let made = async {
        let b: CreateBody = body(&bytes)?;
        let metadata = b.metadata.filter(|m| !m.is_null()).unwrap_or(json!({}));
        metadata::check(&metadata)?;
        let messages = messages_of(b.items.unwrap_or_default())?;
        let id = random_id("conv_")?;
        let kept = Kept::new(now_s(), metadata).settled(&id, &messages);
        let made = object(&id, &kept);
        let new = Record::new(messages, kept.attributes());
        // 128 random bits: nothing holds the name yet.
        let conflict = || ApiError::new(StatusCode::CONFLICT, "the new id is taken; retry");
        let name = tenant.name(&id);
        let edited = s.service.edit(&name, move |held| match held {
            None => Ok((Change::Rewrite(new.clone()), made.clone())),
            Some(_) => Err(conflict()),
        });
        edited.await.map_err(|e| ApiError::from_engine(&e))?
    };
    answer(made.await)
}

/// `GET /v1/conversations/{id}`.
pub async fn retrieve(
    State(s): State<AppState>,
    tenant: Tenant,
    Path(id): Path<String>,
) -> Response {
    let shown = id.clone();
    let read = edit(&s, &tenant, &id, move |r| {
        Ok((Change::Keep, object(&shown, &r.kept)))
    });
    answer(read.await)
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
        metadata::check(&b.metadata)?;
        let metadata = match b.metadata {
            Value::Null => json!({}),
            m => m,
        };
        let shown = id.clone();
        edit(&s, &tenant, &id, move |r| {
            let kept = r.kept.with_metadata(metadata.clone());
            Ok((Change::Attributes(kept.attributes()), object(&shown, &kept)))
        })
        .await
    };
    answer(updated.await)
}

/// `DELETE /v1/conversations/{id}`: the named conversation is closed and removed from the
/// store, answered once the removal is written.
pub async fn delete(State(s): State<AppState>, tenant: Tenant, Path(id): Path<String>) -> Response {
    let shown = id.clone();
    let deleted = edit(&s, &tenant, &id, move |_| {
        let gone = json!({"id": shown, "object": "conversation.deleted", "deleted": true});
        Ok((Change::Remove, gone))
    });
    answer(deleted.await)
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
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    let listed = async {
        // A query that does not parse is a 400 in OpenAI's JSON shape, as every other error.
        let Query(q) =
            query.map_err(|e| ApiError::bad(format!("invalid query: {}", e.body_text())))?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(ApiError::bad("limit must be in [1, 100]").with_param("limit"));
        }
        let descending = match q.order.as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(o) => {
                let e = ApiError::bad(format!("order {o:?}: asc or desc"));
                return Err(e.with_param("order"));
            }
        };
        let shown = id.clone();
        let mut all: Vec<Value> = edit(&s, &tenant, &id, move |r| {
            let all = r.kept.items(&shown, &r.record.messages);
            Ok((Change::Keep, all.into_iter().map(|(.., v)| v).collect()))
        })
        .await?;
        if descending {
            all.reverse();
        }
        let start = match &q.after {
            Some(after) => match all.iter().position(|i| i["id"] == after.as_str()) {
                Some(p) => p + 1,
                None => {
                    let e = ApiError::bad(format!("after: no item {after:?}"));
                    return Err(e.with_param("after"));
                }
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
        let shown = id.clone();
        edit(&s, &tenant, &id, move |r| {
            let mut messages = r.record.messages.clone();
            let before = r.kept.items(&shown, &messages).len();
            append(&mut messages, new.clone());
            let kept = r.kept.settled(&shown, &messages);
            let all = kept.items(&shown, &messages);
            let added = all.into_iter().skip(before).map(|(.., v)| v).collect();
            Ok((rewrite(messages, &kept), list(added, false)))
        })
        .await
    };
    answer(added.await)
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub async fn retrieve_item(
    State(s): State<AppState>,
    tenant: Tenant,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let shown = id.clone();
    let found = edit(&s, &tenant, &id, move |r| {
        let all = r.kept.items(&shown, &r.record.messages);
        let hit = all.into_iter().find(|(.., v)| v["id"] == item.as_str());
        let found = hit.map(|(.., v)| v).ok_or_else(|| no_item(&item))?;
        Ok((Change::Keep, found))
    });
    answer(found.await)
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: the conversation without that item
/// (answered with the conversation object, as OpenAI answers).
pub async fn delete_item(
    State(s): State<AppState>,
    tenant: Tenant,
    Path((id, item)): Path<(String, String)>,
) -> Response {
    let shown = id.clone();
    let deleted = edit(&s, &tenant, &id, move |r| {
        let mut messages = r.record.messages.clone();
        let all = r.kept.items(&shown, &messages);
        let found = all.iter().position(|(.., v)| v["id"] == item.as_str());
        let i = found.ok_or_else(|| no_item(&item))?;
        let (at, part, _) = all[i];
        let kept = r.kept.settled(&shown, &messages).without(i);
        remove(&mut messages, at, part);
        Ok((rewrite(messages, &kept), object(&shown, &kept)))
    });
    answer(deleted.await)
}

/// The `conversation` of a `/v1/responses` request (its id, or `{"id": ...}`), checked to
/// exist: its id, and the transcript it continues (`tenant`'s).
pub async fn continued(
    s: &AppState,
    tenant: &Tenant,
    conversation: &Value,
) -> Result<(String, Vec<Message>), ApiError> {
    let bad = || {
        let e = ApiError::bad("conversation must be an id or {\"id\": ...}");
        Err(e.with_param("conversation"))
    };
    let id = match conversation {
        Value::String(id) => id.clone(),
        Value::Object(o) => match o.get("id") {
            Some(Value::String(id)) => id.clone(),
            _ => return bad(),
        },
        _ => return bad(),
    };
    let messages = edit(s, tenant, &id, |r| {
        Ok((Change::Keep, r.record.messages.clone()))
    })
    .await?;
    Ok((id, messages))
}

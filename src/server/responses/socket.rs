//! OpenAI's WebSocket mode of the Responses API: `GET /v1/responses` upgraded to a socket on
//! which a client sends `response.create` events (a create request's fields; `stream` is
//! implied) and receives each response's events as the HTTP stream carries them, with the
//! `stream_id` the create event gave. Responses of one `stream_id` (a lane) run in order;
//! lanes run side by side, so one socket carries an agent's parallel conversations and forks.
//!
//! A response made on a socket is kept under its id while the socket is open, `store: false`
//! ones too, so that the socket's next turn continues it by `previous_response_id` (its KV
//! reused as every stored response's is); those not to be stored are removed when the socket
//! closes.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{Message as Frame, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::auth::Tenant;
use super::super::error::ApiError;
use super::super::AppState;
use super::{events, remove, start, Keep};

/// `GET /v1/responses` with an upgrade: the socket.
pub async fn connect(ws: WebSocketUpgrade, State(s): State<AppState>, tenant: Tenant) -> Response {
    ws.on_upgrade(move |socket| serve(socket, s, tenant))
}

/// The error event of a request the socket refused (`status` as HTTP would answer it).
fn error_event(e: &ApiError, lane: Option<&str>) -> Value {
    let kind = match e.status.as_u16() {
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let mut v = json!({"type": "error", "status": e.status.as_u16(), "error": {"type": kind,
        "code": e.code(), "message": e.message, "param": e.param}});
    if let Some(l) = lane {
        v["stream_id"] = json!(l);
    }
    v
}

/// Reads the socket's events, hands each create to its lane, and, once it closes, removes the
/// responses made on it that were not to be stored.
async fn serve(socket: WebSocket, s: AppState, tenant: Tenant) {
    let (mut sink, mut source) = socket.split();
    let (out, mut outgoing) = mpsc::unbounded_channel::<Value>();
    let writer = tokio::spawn(async move {
        while let Some(v) = outgoing.recv().await {
            if sink.send(Frame::Text(v.to_string().into())).await.is_err() {
                break;
            }
        }
    });
    let unstored = Arc::new(Mutex::new(Vec::new()));
    let mut lanes: HashMap<Option<String>, mpsc::UnboundedSender<Value>> = HashMap::new();
    let mut running = Vec::new();
    while let Some(Ok(frame)) = source.next().await {
        let text = match frame {
            Frame::Text(t) => t.to_string(),
            Frame::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
            Frame::Close(_) => break,
            _ => continue,
        };
        let mut event = match serde_json::from_str::<Value>(&text) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                let e = ApiError::bad("a socket's event is a JSON object");
                let _ = out.send(error_event(&e, None));
                continue;
            }
        };
        let lane = event["stream_id"].as_str().map(str::to_string);
        if event["type"] != "response.create" {
            let e = ApiError::bad(format!(
                "an event of type {}: `response.create` only here",
                event["type"]
            ))
            .with_param("type");
            let _ = out.send(error_event(&e, lane.as_deref()));
            continue;
        }
        if let Some(o) = event.as_object_mut() {
            o.remove("type");
            o.remove("stream_id");
            o.remove("stream");
        }
        let queue = lanes.entry(lane.clone()).or_insert_with(|| {
            let (queue, creates) = mpsc::unbounded_channel();
            let at = (s.clone(), tenant.clone());
            let run = self::lane(at, lane, creates, out.clone(), unstored.clone());
            running.push(tokio::spawn(run));
            queue
        });
        let _ = queue.send(event);
    }
    // The lanes finish what was sent before the close, then end.
    drop(lanes);
    for lane in running {
        let _ = lane.await;
    }
    drop(out);
    let _ = writer.await;
    let ids = std::mem::take(&mut *unstored.lock());
    for id in ids {
        if let Err(e) = remove(&s, &tenant, &id).await {
            tracing::warn!(response = id, error = %e.message, "a socket's unstored response stayed");
        }
    }
}

/// A lane: its creates run one after the other, each response's events sent as they come.
async fn lane(
    (s, tenant): (AppState, Tenant),
    lane: Option<String>,
    mut creates: mpsc::UnboundedReceiver<Value>,
    out: mpsc::UnboundedSender<Value>,
    unstored: Arc<Mutex<Vec<String>>>,
) {
    while let Some(create) = creates.recv().await {
        let keep = match create["store"] == false {
            true => Keep::ForTheSocket,
            false => Keep::AsAsked,
        };
        let run = match create["background"] == true {
            true => Err(ApiError::bad("a socket's responses stream: no background")
                .with_param("background")),
            false => start(&s, &tenant, create.to_string().as_bytes(), keep).await,
        };
        let run = match run {
            Ok(run) => run,
            Err(e) => {
                let _ = out.send(error_event(&e, lane.as_deref()));
                continue;
            }
        };
        if keep == Keep::ForTheSocket {
            unstored.lock().push(run.framing.id.clone());
        }
        let mut events = std::pin::pin!(events(run, s.clone(), tenant.clone()));
        while let Some(mut e) = events.next().await {
            // A failure after the start, in the socket's shape.
            if e["type"] == "error" && e.get("error").is_none() {
                e = json!({"type": "error", "sequence_number": e["sequence_number"],
                    "error": {"type": "server_error", "code": e["code"],
                    "message": e["message"], "param": e["param"]}});
            }
            if let Some(l) = &lane {
                e["stream_id"] = json!(l);
            }
            if out.send(e).is_err() {
                return;
            }
        }
    }
}

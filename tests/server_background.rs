//! `background: true` on `/v1/responses`, as OpenAI's clients use it: answered at once,
//! polled with `GET` until it ends (the same reply as in the foreground), cancelled with
//! `POST .../cancel`, and a finished one answered after a restart from the store.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::server::{post, request, start};
use serde_json::{json, Value};

/// Polls response `id` until it leaves `in_progress` (the turn runs on the engine; the
/// deadline only bounds a broken server).
fn poll(base: &str, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (status, r) = request("GET", base, &format!("/v1/responses/{id}"), "");
        assert_eq!(status, 200, "{r}");
        if r["status"] != "in_progress" || Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(r: &Value) -> &str {
    r["output"][0]["content"][0]["text"].as_str().unwrap()
}

#[test]
fn real_model_a_background_response_is_polled_cancelled_and_kept_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let server = start(&["--store", store]);
    let b = &server.base;
    let body = json!({"input": "Name three colours.", "max_output_tokens": 24,
        "temperature": 0});
    let (status, foreground) = post(b, "/v1/responses", &body.to_string());
    assert_eq!(status, 200, "{foreground}");
    let mut background = body.clone();
    background["background"] = json!(true);
    let (status, queued) = post(b, "/v1/responses", &background.to_string());
    assert_eq!(
        (status, &queued["status"]),
        (200, &json!("in_progress")),
        "{queued}"
    );
    assert_eq!(queued["background"], true);
    let id = queued["id"].as_str().unwrap().to_string();
    let done = poll(b, &id);
    assert_eq!(text(&done), text(&foreground), "{done}");
    assert!(
        done["usage"]["output_tokens"].as_u64().unwrap() > 0,
        "{done}"
    );
    // Cancelling one that ended answers it as it ended.
    let (status, again) = post(b, &format!("/v1/responses/{id}/cancel"), "{}");
    assert_eq!(
        (status, &again["status"]),
        (200, &done["status"]),
        "{again}"
    );

    // A long one, cancelled while it runs, stays cancelled.
    let long = json!({"input": "Count to a thousand.", "max_output_tokens": 4000,
        "temperature": 0, "background": true});
    let (_, running) = post(b, "/v1/responses", &long.to_string());
    let long_id = running["id"].as_str().unwrap().to_string();
    let (status, cancelled) = post(b, &format!("/v1/responses/{long_id}/cancel"), "{}");
    assert_eq!(
        (status, &cancelled["status"]),
        (200, &json!("cancelled")),
        "{cancelled}"
    );
    assert_eq!(poll(b, &long_id)["status"], "cancelled");

    // Refused: streamed and in the background at once; not stored.
    for extra in [json!({"stream": true}), json!({"store": false})] {
        let mut bad = background.clone();
        bad.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, e) = post(b, "/v1/responses", &bad.to_string());
        assert_eq!(status, 400, "{bad}: {e}");
    }

    // A finished background response is a stored response: answered after a restart.
    drop(server);
    let server = start(&["--store", store]);
    let (status, after) = request("GET", &server.base, &format!("/v1/responses/{id}"), "");
    assert_eq!(status, 200, "{after}");
    assert_eq!(text(&after), text(&foreground));
}

//! `background: true` on `/v1/responses`: the request is answered at once (status
//! `in_progress`), its turn runs on, and the response is polled with `GET
//! /v1/responses/{id}` and cancelled with `POST /v1/responses/{id}/cancel`.
//!
//! The responses in the background live in this server's memory until they end; a finished
//! one is then a stored response as any other (the conversation of its id, in the store when
//! there is one, so it is answered after a restart). One in flight when the server stops is
//! cancelled with it. The finished objects are kept here too, the latest
//! [`KEPT`] of them, so that a poll answers with the usage a stored response does not keep.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::task::AbortHandle;

/// Finished background responses kept whole.
const KEPT: usize = 4096;

enum Entry {
    /// Running: the object as it began, and the task to abort to cancel it.
    Running { object: Value, task: AbortHandle },
    /// Ended: its final object.
    Done(Value),
}

#[derive(Default)]
struct Table {
    entries: HashMap<String, Entry>,
    /// The ended ones, oldest first.
    done: VecDeque<String>,
}

/// The background responses of a server, by their engine name (tenant and id).
#[derive(Clone, Default)]
pub struct Background(Arc<Mutex<Table>>);

impl Background {
    /// A response started in the background as `object`, run by `task`.
    pub fn started(&self, name: String, object: Value, task: AbortHandle) {
        let mut t = self.0.lock();
        t.entries.insert(name, Entry::Running { object, task });
    }

    /// The response `name` ended as `object` (a cancelled one stays cancelled).
    pub fn ended(&self, name: &str, object: Value) {
        let mut t = self.0.lock();
        if let Some(e @ Entry::Running { .. }) = t.entries.get_mut(name) {
            *e = Entry::Done(object);
            t.done.push_back(name.to_string());
        }
        while t.done.len() > KEPT {
            if let Some(old) = t.done.pop_front() {
                t.entries.remove(&old);
            }
        }
    }

    /// The object of background response `name` as it stands, if it is one.
    pub fn get(&self, name: &str) -> Option<Value> {
        match self.0.lock().entries.get(name)? {
            Entry::Running { object, .. } => Some(object.clone()),
            Entry::Done(object) => Some(object.clone()),
        }
    }

    /// Cancels background response `name`: its turn stops, and it ends `cancelled`. One that
    /// had ended stays as it ended. `None` if it is none of these.
    pub fn cancel(&self, name: &str) -> Option<Value> {
        let mut t = self.0.lock();
        let entry = t.entries.get_mut(name)?;
        if let Entry::Running { object, task } = entry {
            task.abort();
            let mut cancelled = object.clone();
            cancelled["status"] = json!("cancelled");
            *entry = Entry::Done(cancelled);
            t.done.push_back(name.to_string());
        }
        match t.entries.get(name)? {
            Entry::Done(object) | Entry::Running { object, .. } => Some(object.clone()),
        }
    }

    /// Forgets `name` (its stored response is being deleted), cancelling it if it runs;
    /// whether it was one.
    pub fn forget(&self, name: &str) -> bool {
        match self.0.lock().entries.remove(name) {
            Some(Entry::Running { task, .. }) => {
                task.abort();
                true
            }
            Some(Entry::Done(_)) => true,
            None => false,
        }
    }
}

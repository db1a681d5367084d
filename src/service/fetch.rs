//! Reading the store for a named conversation before its command reaches the engine thread:
//! a slow store (a Redis that stalls) then holds up that request alone, never the turns the
//! engine thread is running.

use tokio::sync::oneshot;

use super::Service;
use crate::engine::Fetched;

impl Service {
    /// What the store holds of `name`, read on a thread of its own; `None` without a name or
    /// a store, or if the thread could not start (the engine thread then reads it).
    pub(super) async fn fetched(&self, name: Option<&str>) -> Option<Fetched> {
        let (reader, name) = (self.inner.reader.clone()?, name?.to_string());
        let (tx, rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("pensieve-fetch".into())
            .spawn(move || {
                let _ = tx.send(reader.fetch(&name));
            })
            .ok()?;
        rx.await.ok()
    }
}

//! Reading the store for a named conversation before its command reaches the engine thread:
//! a slow store (a Redis that stalls) then holds up that request alone, never the turns the
//! engine thread is running.

use tokio::sync::oneshot;

use super::Service;
use crate::engine::{Fetched, Registration, ResumeReader};

impl Service {
    /// What the store holds of `name`, read on a thread of its own; `None` without a name or
    /// a store, or if the thread could not start (the engine thread then reads it).
    pub(super) async fn fetched(&self, name: Option<&str>) -> Option<Fetched> {
        let name = name?.to_string();
        self.read_store(move |reader| reader.fetch(&name)).await
    }

    /// Who registered `name` in the store, read on a thread of its own; `None` as for
    /// [`Self::fetched`].
    pub(super) async fn registered(&self, name: Option<&str>) -> Option<Registration> {
        let name = name?.to_string();
        self.read_store(move |reader| reader.registration(&name))
            .await
    }

    /// `read` run on a thread of its own with the store's reader.
    async fn read_store<T: Send + 'static>(
        &self,
        read: impl FnOnce(&ResumeReader) -> T + Send + 'static,
    ) -> Option<T> {
        let reader = self.inner.reader.clone()?;
        on_own_thread("pensieve-fetch", move || read(&reader)).await
    }
}

/// `work` run on a thread of its own named `name`, so that the engine thread never waits for
/// it; `None` if the thread could not start.
pub(super) async fn on_own_thread<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(work());
        })
        .ok()?;
    rx.await.ok()
}

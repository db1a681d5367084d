//! The handlers' side of the engine thread: submitting (refused past the queue limit),
//! cancelling, and the guards that make every counted thing come back. A queue place is a
//! [`Slot`] that travels with its request (handler, channel, engine thread) and is given back
//! when dropped, on every path: refused, finished, cancelled, or the client gone at any point.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use axum::http::StatusCode;
use parking_lot::Mutex;
use pensieve::engine::{RequestId, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::oneshot;

use super::{Command, Job, Snapshot, Submission, Update};
use crate::api::ApiError;

/// One place in the queue; given back when dropped.
#[derive(Debug)]
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Submits requests (refusing past the queue limit) and cancels them.
#[derive(Clone)]
pub struct Handle {
    pub(super) tx: Sender<Command>,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) max_in_flight: usize,
    pub snapshot: Arc<Mutex<Snapshot>>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// False once the engine thread has died (a bug): `/health` then fails.
    pub healthy: Arc<AtomicBool>,
}

/// Cancels its request when dropped before `disarm` (the client went away).
pub struct CancelOnDrop {
    tx: Sender<Command>,
    request: RequestId,
    armed: bool,
}

impl CancelOnDrop {
    pub fn request(&self) -> RequestId {
        self.request
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // The engine thread gone means the server is stopping: nothing to cancel.
            let _ = self.tx.send(Command::Cancel(self.request));
        }
    }
}

impl Handle {
    /// Queues `job`; its updates arrive on the returned channel. 429 when `max_in_flight`
    /// requests are already queued or running.
    pub async fn submit(
        &self,
        job: Job,
        params: SamplingParams,
    ) -> Result<(CancelOnDrop, UnboundedReceiver<Update>), ApiError> {
        let busy = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.in_flight.clone());
        if busy >= self.max_in_flight {
            self.snapshot.lock().requests_rejected += 1;
            return Err(ApiError::busy(
                StatusCode::TOO_MANY_REQUESTS,
                format!("the queue is full ({busy} requests in flight); retry later"),
                1,
            ));
        }
        let (updates, rx) = unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let stopped =
            || ApiError::busy(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping", 1);
        let sent = self.tx.send(Command::Submit(Box::new(Submission {
            job,
            params,
            reply,
            updates,
            slot,
        })));
        let request = match sent {
            Ok(()) => accepted.await.unwrap_or_else(|_| Err(stopped()))?,
            Err(_) => return Err(stopped()),
        };
        Ok((
            CancelOnDrop {
                tx: self.tx.clone(),
                request,
                armed: true,
            },
            rx,
        ))
    }

    /// Stops taking requests; those in flight run on.
    pub fn drain(&self) {
        let _ = self.tx.send(Command::Drain);
    }

    /// Cancels what still runs, writes what the store was promised, and ends the engine
    /// thread.
    pub fn stop(&self) {
        let _ = self.tx.send(Command::Stop);
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

//! How the server stops. The first SIGINT, SIGTERM or SIGHUP (the terminal it ran in closed;
//! the server has no configuration to reload) begins its leave: for `--shutdown-grace-s` it
//! serves on while `/health` answers 503, so that the routers in front take it out of their
//! rotation before it stops taking requests (a rolling restart then fails none). Then, or at
//! once when the engine thread died, it stops accepting connections and requests; turns in flight run on for the drain deadline; then,
//! or at a second signal, what still runs is cancelled (cancelled turns leave no trace), the
//! store is flushed and the engine thread joined. Connections still open then (a half-sent
//! request, a client that never reads) are dropped with the runtime.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::service::Service;
use tokio::sync::Notify;

/// Why the server began to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Signal,
    EngineDied,
}

/// SIGINT, SIGTERM and SIGHUP, caught from the moment [`Signals::listen`] returns: made
/// before the address is printed, so that a supervisor (or a test) that signals as soon as
/// it reads the address finds the server draining, not killed by the default action.
pub struct Signals {
    #[cfg(unix)]
    streams: Option<[tokio::signal::unix::Signal; 3]>,
}

impl Signals {
    /// Starts catching the signals (inside the runtime).
    pub fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let kinds = [
                SignalKind::interrupt(),
                SignalKind::terminate(),
                SignalKind::hangup(),
            ];
            let streams = match kinds.map(signal) {
                [Ok(a), Ok(b), Ok(c)] => Some([a, b, c]),
                _ => None,
            };
            Self { streams }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// Waits for the first of them.
    pub async fn recv(self) {
        #[cfg(unix)]
        if let Some([mut int, mut term, mut hup]) = self.streams {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                _ = hup.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Waits for a signal or the engine thread's death.
pub async fn cause(service: Service, signals: Signals) -> Cause {
    tokio::select! {
        () = signals.recv() => Cause::Signal,
        () = service.died() => Cause::EngineDied,
    }
}

/// Whether the server is leaving (its health answered as failed while it still serves).
#[derive(Clone, Debug, Default)]
pub struct Leaving(Arc<AtomicBool>);

impl Leaving {
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Announces the leave and serves on for `grace`, or until a second signal.
    pub async fn wait_out(&self, grace: Duration) {
        if grace.is_zero() {
            return;
        }
        self.0.store(true, Ordering::Relaxed);
        tracing::info!(
            ?grace,
            "leaving: /health answers 503, requests are still served"
        );
        tokio::select! {
            () = tokio::time::sleep(grace) => {}
            () = Signals::listen().recv() => {}
        }
    }
}

/// Resolves once stopping has begun (`began`) and then the drain deadline passed or a second
/// signal came.
pub async fn deadline(began: Arc<Notify>, drain: Duration) {
    began.notified().await;
    tokio::select! {
        () = tokio::time::sleep(drain) => {
            tracing::warn!("drain deadline passed: cancelling the turns still running")
        }
        () = Signals::listen().recv() => {
            tracing::warn!("second signal: cancelling the turns still running")
        }
    }
}

//! How the server stops. The first SIGINT, SIGTERM or SIGHUP (the terminal it ran in closed;
//! the server has no configuration to reload) or the engine thread dying stops
//! accepting connections and requests; turns in flight run on for the drain deadline; then,
//! or at a second signal, what still runs is cancelled (cancelled turns leave no trace), the
//! store is flushed and the engine thread joined. Connections still open then (a half-sent
//! request, a client that never reads) are dropped with the runtime.

use std::sync::Arc;
use std::time::Duration;

use pensieve::service::Service;
use tokio::sync::Notify;

/// Why the server began to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Signal,
    EngineDied,
}

/// Waits for SIGINT, SIGTERM or SIGHUP.
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(mut term), Ok(mut hup)) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Waits for a signal or the engine thread's death.
pub async fn cause(service: Service) -> Cause {
    tokio::select! {
        () = signal() => Cause::Signal,
        () = service.died() => Cause::EngineDied,
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
        () = signal() => tracing::warn!("second signal: cancelling the turns still running"),
    }
}

//! Accepting connections, with the guards `axum::serve` has no setting for: a deadline on
//! reading each request's head (a client that sends half a header is cut off, and a kept-alive
//! connection whose next request does not begin in time is closed), and a bound on open
//! connections (past it, new ones wait in the listen backlog until one closes). Request bodies
//! have their own deadline (tower-http, in `main.rs`).

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

/// The connection guards.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// How long a client may take to send a request's head, counted from when the connection
    /// is ready for it (so also how long a kept-alive connection may stay idle).
    pub header_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` resolves; then accepts nothing more, lets each
/// connection finish the request it is serving, and returns once every connection is closed.
///
/// # Errors
/// The listener failing for good (not a connection that fails: that one is dropped).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let (closing, closed) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut stop = pin!(stop);
    loop {
        while connections.try_join_next().is_some() {}
        let place = tokio::select! {
            place = places.clone().acquire_owned() => place.map_err(std::io::Error::other)?,
            () = &mut stop => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, a connection reset before it was taken: the
                // listener is fine, try again shortly.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let (builder, mut closed) = (builder.clone(), closed.clone());
        connections.spawn(async move {
            let _place = place;
            let mut conn =
                pin!(builder.serve_connection_with_upgrades(TokioIo::new(stream), service));
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = closed.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = closing.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

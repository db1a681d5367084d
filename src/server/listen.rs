//! Accepting connections, with the guards `axum::serve` has no setting for: a deadline on
//! reading each request's head (a client that sends half a header is cut off, and a kept-alive
//! connection whose next request does not begin in time is closed), a deadline on each write
//! a client leaves unread (`deadline::WriteDeadline`), a bound on open connections (past it,
//! new ones wait in the listen backlog until one closes) and a share of them per client
//! address (past it, that client's new connections are answered 429 unless one of its others
//! closes within a second). With every place taken, a new connection closes the oldest one
//! that has not sent a request yet ([`Fresh`]), so connections that open and say nothing (from
//! however many addresses) cannot keep a client that sends requests waiting for their header
//! deadline. Request bodies have their own deadline (`body`). HTTP/1.1 only:
//! HTTP/2's streams and flow-control windows would need deadlines of their own, and a
//! connection is told apart before hyper's header deadline applies (an idle one, or one that
//! sent a preface, held its place).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::IpAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::task::JoinSet;

use super::deadline::WriteDeadline;

/// The connection guards.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections one client address may hold at once.
    pub per_client: usize,
    /// How long a client may take to send a request's head, counted from when the connection
    /// is ready for it (so also how long a kept-alive connection may stay idle).
    pub header_timeout: Duration,
    /// How long a write may wait for the client to read.
    pub write_timeout: Duration,
}

/// The connections each client address holds; a [`Share`] counts one while it lives.
#[derive(Default)]
struct Shares {
    held: Mutex<HashMap<IpAddr, usize>>,
    /// Told whenever a share is given back.
    freed: Notify,
}

/// How long a connection past its client's share waits for one of the client's others to
/// close: a client that closes a connection and opens the next at once is not refused for
/// the close this server has not seen yet.
const SHARE_GRACE: Duration = Duration::from_secs(1);

/// One connection of a client, given back when dropped (whatever ends the connection).
struct Share {
    shares: Arc<Shares>,
    client: IpAddr,
}

impl Shares {
    /// A place for a connection of `client`, if it holds fewer than `limit`.
    fn take(self: &Arc<Self>, client: IpAddr, limit: usize) -> Option<Share> {
        let mut held = self.held.lock();
        let n = held.entry(client).or_default();
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(Share {
            shares: Arc::clone(self),
            client,
        })
    }

    /// [`Shares::take`], waiting up to `grace` for one of the client's connections to close.
    async fn take_within(
        self: &Arc<Self>,
        client: IpAddr,
        limit: usize,
        grace: Duration,
    ) -> Option<Share> {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            // Registered before the check, so that a share given back in between wakes it.
            let freed = self.freed.notified();
            if let Some(share) = self.take(client, limit) {
                return Some(share);
            }
            tokio::time::timeout_at(deadline, freed).await.ok()?;
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock();
        if let Some(n) = held.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.client);
            }
        }
        self.shares.freed.notify_waiters();
    }
}

/// The open connections that have not sent a request yet, oldest first: those a new
/// connection may close when every place is taken.
#[derive(Default)]
struct Fresh(Mutex<VecDeque<Opened>>);

/// A connection in [`Fresh`]: whether it has sent a request, and how to close it (gone once the
/// connection is).
struct Opened {
    served: Arc<AtomicBool>,
    close: Weak<Notify>,
}

impl Opened {
    fn idle(&self) -> bool {
        !self.served.load(Ordering::Relaxed) && self.close.strong_count() > 0
    }
}

impl Fresh {
    /// Registers a new connection: `served` turns true at its first request, `close` asks it
    /// to close. Entries of connections that were served or are gone are dropped as they come
    /// to the front, and all at once when the list outgrows `bound` (so it stays within a few
    /// times the connections open).
    fn push(&self, served: Arc<AtomicBool>, close: &Arc<Notify>, bound: usize) {
        let mut q = self.0.lock();
        while q.front().is_some_and(|o| !o.idle()) {
            q.pop_front();
        }
        if q.len() > 2 * bound {
            q.retain(Opened::idle);
        }
        q.push_back(Opened {
            served,
            close: Arc::downgrade(close),
        });
    }

    /// Asks the oldest connection that has not sent a request to close; whether there was one.
    fn close_oldest(&self) -> bool {
        let mut q = self.0.lock();
        while let Some(o) = q.pop_front() {
            if let (true, Some(close)) = (o.idle(), o.close.upgrade()) {
                close.notify_one();
                return true;
            }
        }
        false
    }
}

/// A connection's service that notes its first request (see [`Fresh`]).
#[derive(Clone)]
struct Noting<S> {
    inner: S,
    served: Arc<AtomicBool>,
}

impl<S: tower_service::Service<R>, R> tower_service::Service<R> for Noting<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.served.store(true, Ordering::Relaxed);
        self.inner.call(request)
    }
}

/// Answers a connection past its client's share with a 429 and closes it (within a second:
/// a client that does not read the refusal gets nothing more).
async fn refuse(mut stream: TcpStream, limit: usize) {
    let body = super::error::ApiError::busy(
        axum::http::StatusCode::TOO_MANY_REQUESTS,
        format!("this client already holds {limit} connections, its share of this server's"),
        1,
    )
    .body()
    .to_string();
    let answer = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
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
    // HTTP/1 only, from the first byte: telling HTTP/1 from HTTP/2 first would read a
    // connection's opening bytes with no deadline, so a client that sends nothing (or a byte,
    // or an HTTP/2 preface) would hold its place for good. The header timeout then counts
    // from the connection's start.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let shares = Arc::new(Shares::default());
    let fresh = Fresh::default();
    let (closing, closed) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut stop = pin!(stop);
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors, a connection reset before it was taken: the
                // listener is fine, try again shortly.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // Every place taken: the oldest connection that never sent a request makes room, or
        // this one waits (and the listener with it) until one closes.
        let place = match places.clone().try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                fresh.close_oldest();
                tokio::select! {
                    place = places.clone().acquire_owned() => {
                        place.map_err(std::io::Error::other)?
                    }
                    () = &mut stop => break,
                }
            }
        };
        // A stream's events are small writes: each goes out at once, not held for the
        // previous one's acknowledgement (Nagle's algorithm).
        let _ = stream.set_nodelay(true);
        let served = Arc::new(AtomicBool::new(false));
        let close = Arc::new(Notify::new());
        fresh.push(served.clone(), &close, limits.max_connections);
        let service = TowerToHyperService::new(Noting {
            inner: app.clone(),
            served,
        });
        let shares = Arc::clone(&shares);
        let (builder, mut closed) = (builder.clone(), closed.clone());
        connections.spawn(async move {
            let limit = limits.per_client;
            let Some(share) = shares.take_within(peer.ip(), limit, SHARE_GRACE).await else {
                let _place = place;
                refuse(stream, limit).await;
                return;
            };
            // The share goes back before the place: a connection the place lets in must find
            // its client's count already lowered.
            let _held = (share, place);
            let io = TokioIo::new(WriteDeadline::new(stream, limits.write_timeout));
            // Upgrades too: the Responses API's WebSocket mode.
            let mut conn = pin!(builder.serve_connection(io, service).with_upgrades());
            tokio::select! {
                _ = conn.as_mut() => return,
                // Another connection took its place before it sent a request.
                () = close.notified() => return,
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

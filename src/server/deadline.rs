//! A deadline on writing to a client: hyper has none, so a client that never reads a large
//! answer (or a stream) would hold its connection, and the turn behind it, for good. A write
//! that has waited this long for the client to make room fails, which closes the connection
//! and so cancels what it was answering. Any progress starts the wait again, so a slow reader
//! that keeps reading is served.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A connection whose writes fail after waiting `limit` for the client to read.
pub struct WriteDeadline<S> {
    inner: S,
    limit: Duration,
    /// Since when a write has been waiting, as the timer that ends the wait.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            waiting: None,
        }
    }

    /// What a write that `poll` gave: progress clears the wait; waiting starts it, or fails
    /// once it has lasted `limit`.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.waiting = None;
            return poll;
        }
        let limit = self.limit;
        let timer = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client left the answer unread past the write deadline",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.watch(cx, poll)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let poll = Pin::new(&mut this.inner).poll_flush(cx);
        this.watch(cx, poll)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_never_reads_fails_at_the_deadline_and_progress_restarts_it() {
        // A pipe of 64 bytes stands for a socket whose buffers the client does not drain.
        let (near, far) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_secs(5));
        w.write_all(&[0u8; 64]).await.unwrap();
        let started = tokio::time::Instant::now();
        let err = w.write_all(&[0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        drop(far);
        // A reader that keeps up is served: each read makes room before the deadline.
        let (near, mut far2) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(near, Duration::from_secs(5));
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let mut total = 0;
            while total < 640 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                total += tokio::io::AsyncReadExt::read(&mut far2, &mut buf)
                    .await
                    .unwrap();
            }
        });
        w.write_all(&[0u8; 640]).await.unwrap();
        reader.await.unwrap();
    }
}

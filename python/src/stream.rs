//! A turn as Python sees it: a `TurnStream` that iterates the reply's text as it is generated
//! (`for` or `async for`), then holds how it ended; a whole `Reply`; a turn's `TurnStats`.

use std::sync::Arc;

use pyo3::exceptions::{PyStopAsyncIteration, PyTimeoutError};
use pyo3::prelude::*;

use pensieve::service::{Service, TurnEnd, TurnEvent};
use pensieve::{FinishReason, RequestId};

use crate::errors::{raise, to_py, UnavailableError};
use crate::options::Json;
use crate::{awaitable, block_on};

/// A turn's numbers (times in seconds).
#[pyclass(frozen, get_all, module = "pensieve")]
#[derive(Clone, Debug)]
pub struct TurnStats {
    /// Tokens of the new turn (after the template).
    pub prompt_tokens: usize,
    /// History tokens whose KV was found in the cache (any tier).
    pub reused_tokens: usize,
    /// Of those, tokens found in the host tier.
    pub reused_from_host_tokens: usize,
    /// Of those, tokens read back from the store.
    pub reused_from_store_tokens: usize,
    /// Tokens run through the model other than one-token decode steps: the new prompt,
    /// uncomputed history and recomputed tokens.
    pub prefilled_tokens: usize,
    /// Tokens whose KV had been dropped and was recomputed.
    pub recomputed_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// From submission to the first generated token.
    pub ttft: f64,
    /// From submission to the end of the turn.
    pub latency: f64,
    /// From submission to the first step that ran the turn.
    pub queue_time: f64,
}

#[pymethods]
impl TurnStats {
    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

impl From<&pensieve::TurnStats> for TurnStats {
    fn from(s: &pensieve::TurnStats) -> Self {
        Self {
            prompt_tokens: s.prompt_tokens,
            reused_tokens: s.reused_tokens,
            reused_from_host_tokens: s.reused_from_host_tokens,
            reused_from_store_tokens: s.reused_from_store_tokens,
            prefilled_tokens: s.prefilled_tokens,
            recomputed_tokens: s.recomputed_tokens,
            output_tokens: s.output_tokens,
            ttft: s.ttft.as_secs_f64(),
            latency: s.latency.as_secs_f64(),
            queue_time: s.queue_time.as_secs_f64(),
        }
    }
}

/// A finish reason's name: `stop` (end of turn), `stop_string`, `length` (`max_tokens`),
/// `context_full`, `cancelled`, `failed`.
fn reason_name(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::StopString => "stop_string",
        FinishReason::Length => "length",
        FinishReason::ContextFull => "context_full",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Failed(_) => "failed",
        _ => "other",
    }
}

/// A whole reply.
#[pyclass(frozen, module = "pensieve")]
pub struct Reply {
    /// The reply's text.
    #[pyo3(get)]
    text: String,
    /// Its token ids.
    #[pyo3(get)]
    tokens: Vec<u32>,
    end: TurnEnd,
}

#[pymethods]
impl Reply {
    /// Why the turn ended (see `TurnStream.finish_reason`).
    #[getter]
    fn finish_reason(&self) -> &'static str {
        reason_name(&self.end.reason)
    }

    /// The turn's numbers.
    #[getter]
    fn stats(&self) -> TurnStats {
        (&self.end.stats).into()
    }

    /// The reply as the assistant's message dict (with `tool_calls` when it calls tools,
    /// `reasoning_content` when the model thinks), as the conversation records it.
    #[getter]
    fn message(&self) -> PyResult<Option<Json>> {
        self.end.message.as_ref().map(Json::new).transpose()
    }

    fn __repr__(&self) -> String {
        format!(
            "Reply(text={:?}, finish_reason={:?})",
            self.text,
            reason_name(&self.end.reason)
        )
    }
}

impl Reply {
    /// The reply of a turn that ended, or its failure as an exception.
    pub fn new(reply: pensieve::service::Reply) -> PyResult<Self> {
        if let FinishReason::Failed(e) = &reply.end.reason {
            return Err(to_py(e));
        }
        Ok(Self {
            text: reply.text,
            tokens: reply.tokens,
            end: reply.end,
        })
    }
}

/// What a stream has given so far.
#[derive(Default)]
struct Progress {
    text: String,
    tokens: Vec<u32>,
    end: Option<TurnEnd>,
}

/// A running turn: iterate it (`for piece in stream`, or `async for`) for the reply's text
/// piece by piece; once it ends, `finish_reason`, `stats` and `message` say how. Dropping it
/// unread, or `cancel()`, cancels the turn.
#[pyclass(frozen, module = "pensieve")]
pub struct TurnStream {
    events: Arc<tokio::sync::Mutex<Option<pensieve::service::TurnStream>>>,
    progress: Arc<parking_lot::Mutex<Progress>>,
    service: Service,
    request: RequestId,
}

impl TurnStream {
    pub fn new(stream: pensieve::service::TurnStream, service: Service) -> Self {
        Self {
            request: stream.request(),
            events: Arc::new(tokio::sync::Mutex::new(Some(stream))),
            progress: Arc::default(),
            service,
        }
    }

    /// The next piece of text, or `None` at the end (a failed turn raises its error).
    fn next_piece(&self) -> impl std::future::Future<Output = PyResult<Option<String>>> + Send {
        let (events, progress) = (self.events.clone(), self.progress.clone());
        async move {
            let mut events = events.lock().await;
            while let Some(stream) = events.as_mut() {
                match stream.next_event().await {
                    Some(TurnEvent::Token { token, text, .. }) => {
                        let mut p = progress.lock();
                        p.tokens.push(token);
                        p.text.push_str(&text);
                        return Ok(Some(text));
                    }
                    Some(TurnEvent::Finished(end)) => {
                        *events = None;
                        let failed = match &end.reason {
                            FinishReason::Failed(e) => Some(to_py(e)),
                            _ => None,
                        };
                        progress.lock().end = Some(end);
                        return failed.map_or(Ok(None), Err);
                    }
                    // The calls are in the message the turn ends with.
                    Some(_) => {}
                    None => {
                        *events = None;
                        return Err(UnavailableError::new_err(
                            "the engine stopped before the turn ended",
                        ));
                    }
                }
            }
            Ok(None)
        }
    }

    /// Reads the stream to its end.
    fn drain(&self) -> impl std::future::Future<Output = PyResult<()>> + Send {
        let next = self.clone_handle();
        async move {
            while next.next_piece().await?.is_some() {}
            Ok(())
        }
    }

    fn clone_handle(&self) -> Self {
        Self {
            events: self.events.clone(),
            progress: self.progress.clone(),
            service: self.service.clone(),
            request: self.request,
        }
    }

    /// Cancels the turn and reads its stream to the end.
    fn cancelled(&self) -> impl std::future::Future<Output = PyResult<()>> + Send {
        let (service, request, drain) = (self.service.clone(), self.request, self.drain());
        async move {
            // A turn that already ended has nothing to cancel: its end is read below.
            match service.cancel(request).await {
                Ok(()) | Err(pensieve::Error::UnknownRequest(_)) => {}
                Err(e) => return Err(raise(e)),
            }
            drain.await
        }
    }
}

#[pymethods]
impl TurnStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        block_on(py, self.next_piece())
    }

    fn __aiter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let next = self.next_piece();
        awaitable(py, async move {
            next.await?.ok_or_else(|| PyStopAsyncIteration::new_err(()))
        })
    }

    /// Cancels the turn and waits for its end: the conversation is left as it was before the
    /// turn. A turn that already ended keeps its end. From `asyncio`, `await acancel()`.
    fn cancel(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, self.cancelled())
    }

    /// `cancel()` as an awaitable.
    fn acancel<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.cancelled())
    }

    /// Reads the rest of the turn and returns the whole text; with `timeout` (seconds), raises
    /// `TimeoutError` if it has not ended by then.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<String> {
        let drain = self.drain();
        block_on(py, async move {
            match timeout {
                None => drain.await,
                Some(s) => tokio::time::timeout(std::time::Duration::from_secs_f64(s), drain)
                    .await
                    .map_err(|_| PyTimeoutError::new_err("the turn has not ended"))?,
            }
        })?;
        Ok(self.text())
    }

    /// The text so far.
    #[getter]
    fn text(&self) -> String {
        self.progress.lock().text.clone()
    }

    /// The token ids so far.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.progress.lock().tokens.clone()
    }

    /// Why the turn ended, `None` while it runs: `stop` (the model ended its turn),
    /// `stop_string`, `length` (`max_tokens`), `context_full`, `cancelled`, `failed`.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.progress
            .lock()
            .end
            .as_ref()
            .map(|e| reason_name(&e.reason))
    }

    /// The turn's numbers, `None` while it runs.
    #[getter]
    fn stats(&self) -> Option<TurnStats> {
        self.progress.lock().end.as_ref().map(|e| (&e.stats).into())
    }

    /// The reply as the assistant's message dict, once it ended with it.
    #[getter]
    fn message(&self) -> PyResult<Option<Json>> {
        let progress = self.progress.lock();
        let message = progress.end.as_ref().and_then(|e| e.message.as_ref());
        message.map(Json::new).transpose()
    }
}

//! `Conversation` and `AsyncConversation`: one conversation of an engine, its KV kept between
//! turns. A turn is a user's text or messages, with sampling parameters as keyword
//! arguments; `send` streams it, `ask` waits for the whole reply.

use std::future::Future;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use pensieve::ConversationId;

use crate::engine::Core;
use crate::errors::raise;
use crate::options::{sampling, turn, Json};
use crate::stream::{Reply, TurnStream};
use crate::{awaitable, block_on};

/// A conversation of an engine: what both faces call.
#[derive(Clone)]
pub struct Handle {
    core: Core,
    id: ConversationId,
}

impl Handle {
    pub fn new(core: Core, id: ConversationId) -> Self {
        Self { core, id }
    }

    fn send(
        &self,
        content: &Bound<'_, PyAny>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<impl Future<Output = PyResult<TurnStream>> + Send + 'static> {
        let (turn, params) = (turn(content)?, sampling(kwargs)?);
        let (service, id) = (self.core.service.clone(), self.id);
        Ok(async move {
            let stream = service.submit(id, turn, params).await.map_err(raise)?;
            Ok(TurnStream::new(stream, service))
        })
    }

    fn ask(
        &self,
        content: &Bound<'_, PyAny>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<impl Future<Output = PyResult<Reply>> + Send + 'static> {
        let (turn, params) = (turn(content)?, sampling(kwargs)?);
        let (service, id) = (self.core.service.clone(), self.id);
        Ok(async move {
            let stream = service.submit(id, turn, params).await.map_err(raise)?;
            Reply::new(stream.reply().await.map_err(raise)?)
        })
    }

    fn fork(&self, turns: Option<usize>) -> impl Future<Output = PyResult<Self>> + Send {
        let (core, id) = (self.core.clone(), self.id);
        async move {
            let fork = core.service.fork(id, turns).await.map_err(raise)?;
            Ok(Self::new(core, fork))
        }
    }

    fn messages(&self) -> impl Future<Output = PyResult<Json>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { Json::new(&service.messages(id).await.map_err(raise)?) }
    }

    fn tokens(&self) -> impl Future<Output = PyResult<Vec<u32>>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { service.tokens(id).await.map_err(raise) }
    }

    fn set_name(&self, name: String) -> impl Future<Output = PyResult<()>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { service.name(id, name).await.map_err(raise) }
    }

    fn pin(&self, pinned: bool) -> impl Future<Output = PyResult<()>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { service.pin(id, pinned).await.map_err(raise) }
    }

    fn expect_resume(&self, seconds: f64) -> PyResult<impl Future<Output = PyResult<()>> + Send> {
        let after = Duration::try_from_secs_f64(seconds)
            .map_err(|e| PyValueError::new_err(format!("expect_resume: {e}")))?;
        let (service, id) = (self.core.service.clone(), self.id);
        Ok(async move { service.expect_resume(id, after).await.map_err(raise) })
    }

    fn detach(&self) -> impl Future<Output = PyResult<()>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { service.detach(id).await.map_err(raise) }
    }

    fn close(&self) -> impl Future<Output = PyResult<()>> + Send {
        let (service, id) = (self.core.service.clone(), self.id);
        async move { service.close(id).await.map_err(raise) }
    }

    fn repr(&self, class: &str) -> String {
        format!("{class}({})", self.id.as_u64())
    }
}

/// A conversation, called from blocking code.
#[pyclass(frozen, module = "pensieve")]
pub struct Conversation(pub Handle);

#[pymethods]
impl Conversation {
    /// Its number, unique in its engine.
    #[getter]
    fn id(&self) -> u64 {
        self.0.id.as_u64()
    }

    /// Starts a turn: `content` is the user's text or a list of message dicts (tool results);
    /// the keyword arguments are sampling parameters (`max_tokens`, `temperature`, `top_p`,
    /// `top_k`, `min_p`, `seed`, `stop`, ...). Iterate the stream for the reply's text.
    #[pyo3(signature = (content, **sampling))]
    fn send(
        &self,
        py: Python<'_>,
        content: &Bound<'_, PyAny>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<TurnStream> {
        block_on(py, self.0.send(content, sampling)?)
    }

    /// A turn's whole reply (see `send`).
    #[pyo3(signature = (content, **sampling))]
    fn ask(
        &self,
        py: Python<'_>,
        content: &Bound<'_, PyAny>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Reply> {
        block_on(py, self.0.ask(content, sampling)?)
    }

    /// A new conversation with this one's history (its first `turns` turns), sharing its KV.
    #[pyo3(signature = (turns=None))]
    fn fork(&self, py: Python<'_>, turns: Option<usize>) -> PyResult<Self> {
        block_on(py, self.0.fork(turns)).map(Self)
    }

    /// The messages so far, as OpenAI's dicts.
    fn messages(&self, py: Python<'_>) -> PyResult<Json> {
        block_on(py, self.0.messages())
    }

    /// The token ids so far.
    fn tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        block_on(py, self.0.tokens())
    }

    /// Names it: the store keeps it under the name, for `Engine.resume`.
    fn set_name(&self, py: Python<'_>, name: String) -> PyResult<()> {
        block_on(py, self.0.set_name(name))
    }

    /// Pins its KV on the device (or unpins it).
    #[pyo3(signature = (pinned=true))]
    fn pin(&self, py: Python<'_>, pinned: bool) -> PyResult<()> {
        block_on(py, self.0.pin(pinned))
    }

    /// Says it comes back in about `seconds`: its KV is brought back ahead of the turn.
    fn expect_resume(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        block_on(py, self.0.expect_resume(seconds)?)
    }

    /// Lets go of it here; a named conversation stays in the store for `Engine.resume` (its KV
    /// too in a Redis store; a folder store keeps only its messages, and a resume recomputes
    /// them).
    fn detach(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, self.0.detach())
    }

    /// Ends it, and deletes it from the store.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, self.0.close())
    }

    fn __repr__(&self) -> String {
        self.0.repr("Conversation")
    }
}

/// A conversation, called from `asyncio`: `Conversation`'s calls as awaitables.
#[pyclass(frozen, module = "pensieve")]
pub struct AsyncConversation(pub Handle);

#[pymethods]
impl AsyncConversation {
    /// Its number, unique in its engine.
    #[getter]
    fn id(&self) -> u64 {
        self.0.id.as_u64()
    }

    /// Starts a turn (see `Conversation.send`); `async for` the reply's text.
    #[pyo3(signature = (content, **sampling))]
    fn send<'py>(
        &self,
        py: Python<'py>,
        content: &Bound<'py, PyAny>,
        sampling: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.send(content, sampling)?)
    }

    /// A turn's whole reply.
    #[pyo3(signature = (content, **sampling))]
    fn ask<'py>(
        &self,
        py: Python<'py>,
        content: &Bound<'py, PyAny>,
        sampling: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.ask(content, sampling)?)
    }

    /// A new conversation with this one's history (see `Conversation.fork`).
    #[pyo3(signature = (turns=None))]
    fn fork<'py>(&self, py: Python<'py>, turns: Option<usize>) -> PyResult<Bound<'py, PyAny>> {
        let fork = self.0.fork(turns);
        awaitable(py, async move { fork.await.map(Self) })
    }

    /// The messages so far.
    fn messages<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.messages())
    }

    /// The token ids so far.
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.tokens())
    }

    /// Names it (see `Conversation.set_name`).
    fn set_name<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.set_name(name))
    }

    /// Pins its KV on the device (or unpins it).
    #[pyo3(signature = (pinned=true))]
    fn pin<'py>(&self, py: Python<'py>, pinned: bool) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.pin(pinned))
    }

    /// Says it comes back in about `seconds`.
    fn expect_resume<'py>(&self, py: Python<'py>, seconds: f64) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.expect_resume(seconds)?)
    }

    /// Lets go of it here (see `Conversation.detach`).
    fn detach<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.detach())
    }

    /// Ends it, and deletes it from the store.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.close())
    }

    fn __repr__(&self) -> String {
        self.0.repr("AsyncConversation")
    }
}

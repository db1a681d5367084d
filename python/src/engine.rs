//! `Engine` and `AsyncEngine`: a model loaded and its engine on a thread of its own
//! (`pensieve::service`), configured by `pensieve-server`'s flags as keyword arguments.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use pensieve::service::{Service, ServiceConfig};

use crate::conversation::{AsyncConversation, Conversation, Handle};
use crate::errors::raise;
use crate::options::{engine_options, opening};
use crate::{awaitable, block_on};

/// The service both faces call.
#[derive(Clone)]
pub struct Core {
    pub service: Service,
}

impl Core {
    /// Loads the model and starts the engine's thread, the interpreter released meanwhile.
    fn load(py: Python<'_>, model: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let options = engine_options(model, options)?;
        let service = py
            .detach(|| {
                let model = options.engine.load_model()?;
                let config = options.engine.engine_config(&options.store);
                let engine = pensieve::Engine::with_model(model, config)?;
                Service::spawn(engine, ServiceConfig::default())
            })
            .map_err(raise)?;
        Ok(Self { service })
    }

    fn open(
        &self,
        system: Option<String>,
        name: Option<String>,
        messages: Option<&Bound<'_, PyAny>>,
        tools: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<impl std::future::Future<Output = PyResult<Handle>> + Send + 'static> {
        let options = opening(system, name, messages, tools)?;
        let core = self.clone();
        Ok(async move {
            let id = core.service.open(options).await.map_err(raise)?;
            Ok(Handle::new(core, id))
        })
    }

    fn resume(&self, name: String) -> impl std::future::Future<Output = PyResult<Handle>> + Send {
        let core = self.clone();
        async move {
            let id = core.service.resume(&name).await.map_err(raise)?;
            Ok(Handle::new(core, id))
        }
    }

    fn stored(&self) -> impl std::future::Future<Output = PyResult<Vec<String>>> + Send {
        let service = self.service.clone();
        async move { service.stored_conversations().await.map_err(raise) }
    }

    fn tokenize(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        (self.service.model().encode_prompt(text, add_special)).map_err(raise)
    }

    fn detokenize(&self, tokens: Vec<u32>) -> PyResult<String> {
        self.service.model().decode(&tokens).map_err(raise)
    }

    fn stats(&self) -> EngineStats {
        let s = self.service.stats();
        let e = &s.engine;
        EngineStats {
            steps: e.steps,
            turns_finished: e.turns_finished,
            prefilled_tokens: e.prefilled_tokens,
            generated_tokens: e.generated_tokens,
            recomputed_tokens: e.recomputed_tokens,
            reused_device_tokens: e.reused_device_tokens,
            reused_host_tokens: e.reused_host_tokens,
            reused_store_tokens: e.reused_store_tokens,
            shared_tokens: e.shared_tokens,
            drafted_tokens: e.drafted_tokens,
            accepted_tokens: e.accepted_tokens,
            device_slots_used: e.device_slots_used,
            device_slots_total: e.device_slots_total,
            host_bytes_used: e.host_bytes_used,
            conversations: s.conversations,
            in_flight: s.in_flight,
        }
    }

    /// Cancels what runs, writes what the store was promised and ends the engine's thread.
    fn shutdown(&self) -> impl std::future::Future<Output = PyResult<()>> + Send {
        let service = self.service.clone();
        async move {
            let stopped = tokio::task::spawn_blocking(move || service.shutdown()).await;
            stopped
                .map_err(|e| crate::errors::InternalError::new_err(e.to_string()))?
                .map_err(raise)
        }
    }
}

/// The engine's totals since it started, and its state now.
#[pyclass(frozen, get_all, module = "pensieve")]
#[derive(Clone, Debug)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Turns ended.
    pub turns_finished: u64,
    /// Tokens whose KV was computed from their text.
    pub prefilled_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Of the prefilled, history the cache had dropped.
    pub recomputed_tokens: u64,
    /// History tokens served from the device tier.
    pub reused_device_tokens: u64,
    /// From the host tier.
    pub reused_host_tokens: u64,
    /// From the store.
    pub reused_store_tokens: u64,
    /// Tokens whose KV another conversation's equal content gave.
    pub shared_tokens: u64,
    /// Tokens drafted by speculative decoding.
    pub drafted_tokens: u64,
    /// Of those, accepted.
    pub accepted_tokens: u64,
    /// KV slots of the device pool in use.
    pub device_slots_used: usize,
    /// KV slots of the device pool.
    pub device_slots_total: usize,
    /// Bytes of the host tier in use.
    pub host_bytes_used: usize,
    /// Conversations open.
    pub conversations: usize,
    /// Turns queued or running.
    pub in_flight: usize,
}

#[pymethods]
impl EngineStats {
    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// An engine, called from blocking code: `Engine(model="default", **options)` with the
/// options `pensieve-server --help` lists as keyword arguments (`store="dir"`,
/// `device_tokens=4096`, ...).
#[pyclass(frozen, module = "pensieve")]
pub struct Engine(Core);

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (model="default", **options))]
    fn new(py: Python<'_>, model: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Core::load(py, model, options).map(Self)
    }

    /// Opens a conversation (named: kept in the store under that name, resumable).
    #[pyo3(signature = (*, system=None, name=None, messages=None, tools=None))]
    fn open(
        &self,
        py: Python<'_>,
        system: Option<String>,
        name: Option<String>,
        messages: Option<Bound<'_, PyAny>>,
        tools: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Conversation> {
        let opened = self
            .0
            .open(system, name, messages.as_ref(), tools.as_ref())?;
        block_on(py, opened).map(Conversation)
    }

    /// Continues a named conversation, from this engine or from its store.
    fn resume(&self, py: Python<'_>, name: String) -> PyResult<Conversation> {
        block_on(py, self.0.resume(name)).map(Conversation)
    }

    /// The names of the conversations the store holds.
    fn stored_conversations(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        block_on(py, self.0.stored())
    }

    /// The engine's totals and state.
    fn stats(&self) -> EngineStats {
        self.0.stats()
    }

    /// Token ids of a raw prompt, with the begin token (and end token) where the vocabulary
    /// asks for them unless `add_special` is false; a turn of them continues the text as a
    /// base model does (`Conversation.send(ids)`).
    #[pyo3(signature = (text, add_special=true))]
    fn tokenize(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        self.0.tokenize(text, add_special)
    }

    /// The text of token ids.
    fn detokenize(&self, tokens: Vec<u32>) -> PyResult<String> {
        self.0.detokenize(tokens)
    }

    /// Cancels what runs, writes what the store was promised and stops the engine.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, self.0.shutdown())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.shutdown(py)
    }
}

/// An engine, called from `asyncio`: `Engine`'s calls as awaitables.
#[pyclass(frozen, module = "pensieve")]
pub struct AsyncEngine(Core);

#[pymethods]
impl AsyncEngine {
    #[new]
    #[pyo3(signature = (model="default", **options))]
    fn new(py: Python<'_>, model: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        Core::load(py, model, options).map(Self)
    }

    /// Opens a conversation (see `Engine.open`).
    #[pyo3(signature = (*, system=None, name=None, messages=None, tools=None))]
    fn open<'py>(
        &self,
        py: Python<'py>,
        system: Option<String>,
        name: Option<String>,
        messages: Option<Bound<'py, PyAny>>,
        tools: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let opened = self
            .0
            .open(system, name, messages.as_ref(), tools.as_ref())?;
        awaitable(py, async move { opened.await.map(AsyncConversation) })
    }

    /// Continues a named conversation (see `Engine.resume`).
    fn resume<'py>(&self, py: Python<'py>, name: String) -> PyResult<Bound<'py, PyAny>> {
        let resumed = self.0.resume(name);
        awaitable(py, async move { resumed.await.map(AsyncConversation) })
    }

    /// The names of the conversations the store holds.
    fn stored_conversations<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.stored())
    }

    /// The engine's totals and state.
    fn stats(&self) -> EngineStats {
        self.0.stats()
    }

    /// Token ids of a raw prompt, with the begin token (and end token) where the vocabulary
    /// asks for them unless `add_special` is false; a turn of them continues the text as a
    /// base model does (`Conversation.send(ids)`).
    #[pyo3(signature = (text, add_special=true))]
    fn tokenize(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        self.0.tokenize(text, add_special)
    }

    /// The text of token ids.
    fn detokenize(&self, tokens: Vec<u32>) -> PyResult<String> {
        self.0.detokenize(tokens)
    }

    /// Stops the engine (see `Engine.shutdown`).
    fn shutdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, self.0.shutdown())
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let engine = slf.clone().unbind();
        awaitable(slf.py(), async move { Ok(engine) })
    }

    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _kind: Option<Bound<'py, PyAny>>,
        _value: Option<Bound<'py, PyAny>>,
        _traceback: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.shutdown(py)
    }
}

//! pensieve as a Python package (`import pensieve`): the engine on its own thread behind
//! `pensieve::service`, with a blocking face (`Engine`, `Conversation`) and an `asyncio` one
//! (`AsyncEngine`, `AsyncConversation`) over the same calls, each turn a `TurnStream` that
//! iterates its text either way, errors as exceptions named by their `ErrorKind`, and the
//! OpenAI-compatible server (`serve`).
//!
//! Every call that waits (a model load, a turn's next token, a store read) releases the
//! interpreter, so other Python threads run meanwhile.

use std::future::Future;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyCFunction;

mod conversation;
mod engine;
mod errors;
mod options;
mod server;
mod stream;

/// The package's tokio runtime: the one `pyo3_async_runtimes` drives awaitables on.
fn runtime() -> &'static tokio::runtime::Runtime {
    pyo3_async_runtimes::tokio::get_runtime()
}

/// Runs `fut` to its end on the package's runtime, with the interpreter released meanwhile.
fn block_on<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    T: Send,
    F: Future<Output = PyResult<T>> + Send,
{
    py.detach(|| runtime().block_on(fut))
}

/// `fut` as a coroutine for `asyncio`, run on the package's runtime once awaited. A
/// coroutine, as an `async def` gives, rather than `pyo3_async_runtimes`' future, which wants
/// an event loop running where it is made: `asyncio.run(conversation.ask(...))` works.
fn awaitable<T, F>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    T: for<'py> IntoPyObject<'py> + Send + 'static,
    F: Future<Output = PyResult<T>> + Send + 'static,
{
    static LATER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let later = LATER.get_or_try_init(py, || {
        let code = c"async def later(make):\n    return await make()\n";
        let module = PyModule::from_code(py, code, c"pensieve/_later.py", c"pensieve._later")?;
        PyResult::Ok(module.getattr("later")?.unbind())
    })?;
    let fut = parking_lot::Mutex::new(Some(fut));
    let make = PyCFunction::new_closure(py, None, None, move |args, _| {
        let fut = (fut.lock().take())
            .ok_or_else(|| PyRuntimeError::new_err("a coroutine awaited twice"))?;
        pyo3_async_runtimes::tokio::future_into_py(args.py(), fut).map(Bound::unbind)
    })?;
    later.bind(py).call1((make,))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::AsyncEngine>()?;
    m.add_class::<engine::EngineStats>()?;
    m.add_class::<conversation::Conversation>()?;
    m.add_class::<conversation::AsyncConversation>()?;
    m.add_class::<stream::TurnStream>()?;
    m.add_class::<stream::Reply>()?;
    m.add_class::<stream::TurnStats>()?;
    m.add_function(wrap_pyfunction!(server::serve, m)?)?;
    errors::register(m)
}

//! The OpenAI-compatible server from Python: `pensieve.serve(port=8000, ...)` runs
//! `pensieve-server` in the calling process until SIGINT or SIGTERM.

use pensieve::server::ServeError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::options::flags;

/// Serves until SIGINT or SIGTERM (and their drain), with `pensieve-server`'s flags as
/// keyword arguments (`port=0`: any free port; the address is printed on start) and `args`
/// as more of its command line. `help=True` prints the flags.
#[pyfunction]
#[pyo3(signature = (*args, **options))]
pub fn serve(
    py: Python<'_>,
    args: Vec<String>,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let mut argv = vec!["pensieve-server".to_string()];
    argv.extend(args);
    argv.extend(flags(options)?);
    let served = py.detach(|| pensieve::server::run(argv));
    let Err(e) = served else { return Ok(()) };
    match e {
        // `--help` and `--version` print and return.
        ServeError::Args(e) if !e.use_stderr() => e
            .print()
            .map_err(|e| PyRuntimeError::new_err(e.to_string())),
        ServeError::Args(e) => Err(PyValueError::new_err(e.render().to_string())),
        ServeError::Flag(why) => Err(PyValueError::new_err(why)),
        ServeError::Engine(e) => Err(crate::errors::to_py(&e)),
        e => Err(PyRuntimeError::new_err(e.to_string())),
    }
}

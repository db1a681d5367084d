//! pensieve's errors as Python exceptions: one class per `ErrorKind` under `PensieveError`,
//! each with the kind's name as its `kind` attribute, so that a caller catches what it can do
//! something about (`CapacityError`: retry later) or everything at once.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use pensieve::{Error, ErrorKind};

create_exception!(
    pensieve,
    PensieveError,
    PyException,
    "A failure of pensieve; `kind` names its kind (`invalid_input`, `not_found`, ...)."
);
create_exception!(
    pensieve,
    InvalidInputError,
    PensieveError,
    "The request or configuration is wrong; it fails the same way until it is changed."
);
create_exception!(
    pensieve,
    NotFoundError,
    PensieveError,
    "What the request names does not exist (a conversation, a stored name)."
);
create_exception!(
    pensieve,
    ConflictError,
    PensieveError,
    "The request clashes with the state it finds (a turn in progress, a name taken)."
);
create_exception!(
    pensieve,
    CapacityError,
    PensieveError,
    "A capacity limit: retry later, or with less."
);
create_exception!(
    pensieve,
    UnavailableError,
    PensieveError,
    "The store or the engine is unavailable for now: retry later."
);
create_exception!(
    pensieve,
    ModelError,
    PensieveError,
    "The model's files cannot be used (missing, malformed, unsupported)."
);
create_exception!(
    pensieve,
    IoError,
    PensieveError,
    "A file could not be read or written."
);
create_exception!(
    pensieve,
    InternalError,
    PensieveError,
    "A bug in pensieve, never the caller's doing."
);

/// `e` as the exception of its kind, its message followed by the causes it does not already
/// name.
pub fn to_py(e: &Error) -> PyErr {
    let message = with_causes(e);
    match e.kind() {
        ErrorKind::InvalidInput => InvalidInputError::new_err(message),
        ErrorKind::NotFound => NotFoundError::new_err(message),
        ErrorKind::Conflict => ConflictError::new_err(message),
        ErrorKind::Capacity => CapacityError::new_err(message),
        ErrorKind::Unavailable => UnavailableError::new_err(message),
        ErrorKind::Model => ModelError::new_err(message),
        ErrorKind::Io => IoError::new_err(message),
        _ => InternalError::new_err(message),
    }
}

/// `to_py` taking the error by value, for `map_err`.
#[expect(clippy::needless_pass_by_value)]
pub fn raise(e: Error) -> PyErr {
    to_py(&e)
}

fn with_causes(e: &Error) -> String {
    let mut message = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !message.contains(&text) {
            message = format!("{message}: {text}");
        }
        cause = c.source();
    }
    message
}

/// Adds the classes to the module, each with its `kind`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let classes = [
        (py.get_type::<PensieveError>(), None),
        (py.get_type::<InvalidInputError>(), Some("invalid_input")),
        (py.get_type::<NotFoundError>(), Some("not_found")),
        (py.get_type::<ConflictError>(), Some("conflict")),
        (py.get_type::<CapacityError>(), Some("capacity")),
        (py.get_type::<UnavailableError>(), Some("unavailable")),
        (py.get_type::<ModelError>(), Some("model")),
        (py.get_type::<IoError>(), Some("io")),
        (py.get_type::<InternalError>(), Some("internal")),
    ];
    for (class, kind) in classes {
        class.setattr("kind", kind)?;
        m.add(class.name()?, class)?;
    }
    Ok(())
}

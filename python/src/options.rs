//! What Python passes, as the engine takes it: an engine's options (the flags of
//! `pensieve-server`, as keyword arguments), a turn's sampling parameters, a conversation's
//! opening and a turn's content. Anything not understood is an error naming it, never
//! ignored.

use clap::Parser;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyString};

use pensieve::cli::{EngineArgs, StoreArgs};
use pensieve::{ConversationOptions, Message, SamplingParams, Turn};

use crate::errors::InvalidInputError;

/// The engine's options: `pensieve-server`'s engine and store flags.
#[derive(Parser, Debug)]
#[command(name = "pensieve.Engine", no_binary_name = true)]
pub struct EngineOptions {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// Keyword arguments as flags: `device_tokens=4096` is `--device-tokens 4096`, `True` a bare
/// flag, `False` and `None` no flag.
pub fn flags(options: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<String>> {
    let mut args = Vec::new();
    for (key, value) in options.into_iter().flat_map(|o| o.iter()) {
        let key: String = key.extract()?;
        let flag = format!("--{}", key.replace('_', "-"));
        if value.is_none() {
            continue;
        }
        if let Ok(on) = value.cast::<PyBool>() {
            if on.is_true() {
                args.push(flag);
            }
            continue;
        }
        args.push(flag);
        args.push(value.str()?.to_string());
    }
    Ok(args)
}

/// The engine's options from keyword arguments, refused with clap's message.
pub fn engine_options(model: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<EngineOptions> {
    let mut args = vec!["--model".to_string(), model.to_string()];
    args.extend(flags(options)?);
    EngineOptions::try_parse_from(args)
        .map_err(|e| InvalidInputError::new_err(format!("engine options: {}", e.render())))
}

/// The sampling parameters a turn's keyword arguments name (the rest as
/// `SamplingParams::default()` has them: greedy, 256 tokens at most).
pub fn sampling(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<SamplingParams> {
    let mut p = SamplingParams::default();
    for (key, value) in kwargs.into_iter().flat_map(|o| o.iter()) {
        let key: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        match key.as_str() {
            "max_tokens" => p.max_tokens = value.extract()?,
            "min_tokens" => p.min_tokens = value.extract()?,
            "temperature" => p.temperature = value.extract()?,
            "top_p" => p.top_p = Some(value.extract()?),
            "top_k" => p.top_k = Some(value.extract()?),
            "min_p" => p.min_p = value.extract()?,
            "seed" => p.seed = value.extract()?,
            "presence_penalty" => p.presence_penalty = value.extract()?,
            "frequency_penalty" => p.frequency_penalty = value.extract()?,
            "repetition_penalty" => p.repetition_penalty = value.extract()?,
            "ignore_eos" => p.ignore_eos = value.extract()?,
            "stop" => {
                p.stop_strings = match value.cast::<PyString>() {
                    Ok(one) => vec![one.to_string()],
                    Err(_) => value.extract()?,
                }
            }
            "stop_token_ids" => p.stop_token_ids = value.extract()?,
            "logit_bias" => {
                let bias: Vec<(u32, f32)> = value.cast::<PyDict>()?.items().extract()?;
                p.logit_bias = bias;
            }
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "unknown sampling parameter {key:?} (known: {})",
                    SAMPLING.join(", ")
                )))
            }
        }
    }
    Ok(p)
}

/// The sampling parameters `sampling` takes.
pub const SAMPLING: [&str; 14] = [
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "logit_bias",
];

/// Python values through JSON: messages and tool definitions are OpenAI's dicts.
fn from_python<T: serde::de::DeserializeOwned>(
    value: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<T> {
    let json: String = (value.py().import("json")?)
        .call_method1("dumps", (value,))?
        .extract()?;
    serde_json::from_str(&json).map_err(|e| InvalidInputError::new_err(format!("{what}: {e}")))
}

/// A value (messages, a message) on its way to Python as the dicts and lists its JSON is.
pub struct Json(String);

impl Json {
    /// `value` as JSON.
    pub fn new<T: serde::Serialize>(value: &T) -> PyResult<Self> {
        serde_json::to_string(value)
            .map(Self)
            .map_err(|e| InvalidInputError::new_err(format!("not representable: {e}")))
    }
}

impl<'py> IntoPyObject<'py> for Json {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?.call_method1("loads", (self.0,))
    }
}

/// A conversation's opening: a system prompt, a name to keep it (and resume it) by, earlier
/// messages, and the tools its template offers.
pub fn opening(
    system: Option<String>,
    name: Option<String>,
    messages: Option<&Bound<'_, PyAny>>,
    tools: Option<&Bound<'_, PyAny>>,
) -> PyResult<ConversationOptions> {
    let mut options = ConversationOptions::default();
    if let Some(system) = system {
        options = options.system(system);
    }
    if let Some(name) = name {
        options = options.name(name);
    }
    if let Some(messages) = messages {
        options = options.history(from_python(messages, "messages")?);
    }
    if let Some(tools) = tools {
        options = options.tools(from_python(tools, "tools")?);
    }
    Ok(options)
}

/// A turn: a user's text, messages (OpenAI's dicts: tool results, several at once), or token
/// ids.
pub fn turn(content: &Bound<'_, PyAny>) -> PyResult<Turn> {
    if let Ok(text) = content.cast::<PyString>() {
        return Ok(Turn::user(text.to_string()));
    }
    if let Ok(list) = content.cast::<PyList>() {
        // Token ids (`Engine.tokenize`'s): a raw prompt, as a base model continues text.
        if !list.is_empty() && list.iter().all(|x| x.extract::<u32>().is_ok()) {
            return Ok(Turn::Tokens(content.extract()?));
        }
        let messages: Vec<Message> = from_python(content, "messages")?;
        return Ok(Turn::Messages(messages));
    }
    Err(PyTypeError::new_err(
        "a turn is a str (the user's text), a list of message dicts, or a list of token ids",
    ))
}

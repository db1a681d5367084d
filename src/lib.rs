//! # pensieve
//!
//! Embeddable stateful multi-turn LLM inference. A host application loads a model, and the
//! engine keeps every conversation's KV state across turns so that a new turn prefills only its
//! new tokens. This crate is built bottom-up:
//!
//! - `attention` (feature `internals`): the multi-query attention op over non-contiguous KV
//!   slots (prefill and decode rows in one call), with a fast CPU kernel and a naive
//!   reference, and the KV pool it reads; like the transformer's forward pass, public only for
//!   pensieve's own tests and benchmarks, outside the semver promise;
//! - [`kv`]: KV bookkeeping below the engine (tiers, eviction; its cost model is public);
//! - [`model`]: Llama-family models (GGUF or safetensors, local or from the Hugging Face hub)
//!   and their tokenizer;
//! - [`chat`]: chat text: templates, tool calls, reasoning, grammars;
//! - [`engine`]: the stateful engine that hosts drive with `step()`;
//! - [`workload`]: multi-turn workloads (ShareGPT, traces) for replay benchmarks;
//! - `service` (feature `service`): the engine on its own thread behind an async, cloneable
//!   handle, each turn a stream of events, and chats continued by their content;
//! - `cli` (feature `cli`): the flags pensieve's tools share;
//! - `server` (feature `server`): `pensieve-server`, an OpenAI-compatible HTTP server over
//!   `service`, as a program and as a function a host may call.
//!
//! The types most hosts need are at the root (`pensieve::Engine`, `pensieve::Turn`, ...).
//! See `docs/ARCHITECTURE.md` for the design and `docs/BENCHMARKS.md` for measurements.

#[cfg(feature = "internals")]
pub mod attention;
#[cfg(not(feature = "internals"))]
mod attention;
pub mod chat;
#[cfg(feature = "cli")]
pub mod cli;
mod conversation;
mod cpu;
pub mod engine;
mod error;
mod ids;
#[cfg(feature = "cuda")]
mod kernels;
pub mod kv;
mod math;
mod message;
pub mod model;
mod persist;
mod scheduler;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "service")]
pub mod service;
mod setters;
pub mod workload;

pub use error::{Error, ErrorKind, Result};

// What most hosts name, at the root: the engine, its configuration, a conversation's turns
// and their events, the model, and (feature `service`) the async front.
pub use engine::{
    ConversationId, ConversationOptions, Engine, EngineConfig, Event, FinishReason, RequestId,
    SamplingParams, StoreConfig, Turn, TurnStats,
};
pub use model::{Message, Model};
#[cfg(feature = "service")]
pub use service::{Chat, Service, ServiceConfig, TurnEvent};

/// The README's and the library guide's examples, compiled by `cargo test --doc` so that
/// they stay what the API takes.
#[cfg(doctest)]
mod documentation {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/LIBRARY.md")]
    struct Library;
}

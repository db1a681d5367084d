//! pensieve
pub mod attention;
mod error;
pub use error::{Error, Result};

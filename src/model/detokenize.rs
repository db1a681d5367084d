//! Streaming detokenization: text deltas per generated token that never split a UTF-8
//! character (byte-level BPE tokens can end mid-character).

use tokenizers::Tokenizer;

use crate::{Error, Result};

/// A UTF-8 character spans at most 4 bytes, hence at most 4 byte-level tokens.
const MAX_HELD: usize = 4;

/// Turns a stream of token ids into text deltas.
///
/// Holds tokens back while their text ends in an incomplete character, so each delta is valid
/// text and the deltas concatenate to the decoded reply. Cost per token: `O(1)`.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    held: Vec<u32>,
}

impl IncrementalDecoder {
    /// A decoder with no tokens yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tokens held because the text they end with is not yet a whole character.
    pub fn pending(&self) -> usize {
        self.held.len()
    }

    /// Adds `id` and returns the text it completes (possibly empty).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for ids outside the vocabulary.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.held.push(id);
        let text = tokenizer
            .decode(&self.held, false)
            .map_err(Error::Tokenizer)?;
        // A genuine U+FFFD in the text is released once no character could still be pending.
        if text.ends_with('\u{FFFD}') && self.held.len() < MAX_HELD {
            return Ok(String::new());
        }
        self.held.clear();
        Ok(text)
    }
}

//! How byte-level BPE vocabularies split text before merging, per GGUF `tokenizer.ggml.pre`:
//! the regexes of llama.cpp's `llama-vocab.cpp` (its own rewrites of each model's
//! `tokenizer.json` pattern, which its tests check against the reference tokenizers), split
//! with the matches kept, then mapped to byte-level symbols.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::{Error, Result};

/// Llama 3's pattern; Qwen2's is the same with single digits.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (o200k) pattern.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken pattern.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` values supported.
const PRE_TOKENIZERS: [&str; 12] = [
    "default",
    "gpt-2",
    "smollm",
    "starcoder",
    "refact",
    "codeshell",
    "llama-bpe",
    "llama3",
    "qwen2",
    "deepseek-r1-qwen",
    "gpt-4o",
    "tekken",
];

/// A vocabulary's splitting rules.
pub(super) struct Rules {
    pub pre_tokenizer: PreTokenizerWrapper,
    /// Whether a whole split that is a token is taken as it is, before merging (Llama 3).
    pub ignore_merges: bool,
}

/// The rules of `tokenizer.ggml.pre` = `pre`.
///
/// # Errors
/// [`Error::InvalidModel`] naming the key, the value and what is supported.
pub(super) fn rules(pre: &str) -> Result<Rules> {
    let byte_level = ByteLevel::new(false, true, false);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(Error::Tokenizer)?;
        Ok(Sequence::new(vec![split.into(), byte_level.into()]).into())
    };
    let (pre_tokenizer, ignore_merges) = match pre {
        // llama.cpp: "\p{N}" then the GPT-2 pattern.
        "smollm" | "starcoder" | "refact" | "codeshell" => (
            Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            false,
        ),
        "gpt-2" | "default" => (ByteLevel::new(false, true, true).into(), false),
        "llama-bpe" | "llama3" => (split(LLAMA3)?, true),
        "qwen2" | "deepseek-r1-qwen" => (split(QWEN2)?, false),
        "gpt-4o" => (split(GPT4O)?, false),
        "tekken" => (split(TEKKEN)?, false),
        other => {
            return Err(Error::invalid_model(
                "tokenizer.ggml.pre",
                format!(
                    "'{other}' is not supported (supported: {}); a tokenizer.json beside the \
                     model (or --tokenizer FILE) can be used instead",
                    PRE_TOKENIZERS.join(", ")
                ),
            ))
        }
    };
    Ok(Rules {
        pre_tokenizer,
        ignore_merges,
    })
}

//! Tokenizers built from what a model file ships: a GGUF file's `tokenizer.ggml.*` metadata, or
//! a Hugging Face `tokenizer.json`.
//!
//! For GGUF `gpt2`-type vocabularies we rebuild the byte-level BPE ourselves rather than use
//! candle's helper, which adds a space prefix that this family does not use. The
//! pre-tokenization follows llama.cpp's per-`tokenizer.ggml.pre` table: for `smollm` (and the
//! other StarCoder-style vocabularies) digits split individually, then the GPT-2 byte-level
//! regex without prefix space.

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::{Error, Result};

/// GGUF `token_type` of control tokens (`<|im_start|>`, ...), which must never be split.
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `token_type` of user-defined tokens, matched whole like control tokens.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Pre-tokenizer families of GGUF `tokenizer.ggml.pre` that we reproduce exactly.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = ByteLevel::new(false, true, true);
    match pre {
        // llama.cpp: "\p{N}" then the GPT-2 pattern.
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            Ok(Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into())
        }
        // Plain GPT-2 byte-level.
        "gpt-2" | "default" => Ok(byte_level.into()),
        other => Err(Error::Tokenizer(format!(
            "GGUF pre-tokenizer '{other}' is not supported; load the model's tokenizer.json instead"
        ))),
    }
}

/// Builds the tokenizer described by a GGUF file's metadata.
///
/// # Errors
/// [`Error::Tokenizer`] when the vocabulary type or pre-tokenizer is unsupported or the
/// metadata is malformed.
pub fn tokenizer_from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    let md = &content.metadata;
    let bad = |key: &str, why: &dyn std::fmt::Display| Error::Tokenizer(format!("{key}: {why}"));
    let string = |key: &str| -> Result<String> {
        md.get(key)
            .ok_or_else(|| bad(key, &"missing"))?
            .to_string()
            .cloned()
            .map_err(|e| bad(key, &e))
    };
    let strings = |key: &str| -> Result<Vec<String>> {
        md.get(key)
            .ok_or_else(|| bad(key, &"missing"))?
            .to_vec()
            .map_err(|e| bad(key, &e))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| bad(key, &e)))
            .collect()
    };
    let kind = string("tokenizer.ggml.model")?;
    if kind != "gpt2" {
        return Err(Error::Tokenizer(format!(
            "GGUF tokenizer model '{kind}' is not supported (only byte-level BPE 'gpt2')"
        )));
    }
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(bad(
                "tokenizer.ggml.merges",
                &format!("malformed merge '{m}'"),
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|e| bad("tokenizer.ggml.token_type", &e))?
            .iter()
            .map(|t| t.to_i32().map_err(|e| bad("tokenizer.ggml.token_type", &e)))
            .collect::<Result<_>>()?,
        None => Vec::new(),
    };
    let pre = string("tokenizer.ggml.pre").unwrap_or_else(|_| "default".into());

    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(&pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .map(|(tok, _)| AddedToken::from(tok.clone(), true))
        .collect();
    tokenizer.add_special_tokens(&special);
    Ok(tokenizer)
}

/// Loads a Hugging Face `tokenizer.json`.
///
/// # Errors
/// [`Error::Tokenizer`] for unreadable or malformed files.
pub fn tokenizer_from_file(path: &std::path::Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

//! Tokenizers built from what a model file ships: a GGUF file's `tokenizer.ggml.*` metadata, or
//! a Hugging Face `tokenizer.json`.
//!
//! GGUF vocabularies come in two kinds, rebuilt here as `tokenizers` pipelines that give
//! llama.cpp's token ids:
//! - `gpt2`: byte-level BPE over the file's merges, split first by the pre-tokenizer regex
//!   llama.cpp uses for the file's `tokenizer.ggml.pre` (`pretokenize.rs`);
//! - `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma). llama.cpp merges the adjacent pair
//!   whose joined piece has the highest score; as BPE merges that is every split of every
//!   piece into two pieces of the vocabulary, ranked by the joined piece's score. Spaces become
//!   `▁` (with one in front when `add_space_prefix`), and text outside the vocabulary falls
//!   back to its bytes' `<0xNN>` tokens.
//!
//! Control and unknown tokens are special (matched in text only where the caller parses
//! special tokens); user-defined tokens are matched in any text, as llama.cpp does.

mod pretokenize;

use std::collections::HashMap;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, Tokenizer};

use crate::{Error, Result};

/// GGUF `token_type` of unknown-text tokens.
const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// GGUF `token_type` of control tokens (`<|im_start|>`, `<bos>` ...).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `token_type` of user-defined tokens, matched whole in any text.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// SentencePiece's space marker.
const SPACE: &str = "\u{2581}";

/// The GGUF vocabulary kinds supported, as `tokenizer.ggml.model` names them.
const TOKENIZER_MODELS: [&str; 2] = ["gpt2", "llama"];

/// Typed refusal of a metadata value.
fn refuse(key: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid_model(key, why)
}

/// The `tokenizer.ggml.*` metadata, read and checked.
struct Vocabulary<'a> {
    md: &'a HashMap<String, gguf_file::Value>,
}

impl Vocabulary<'_> {
    fn value(&self, key: &str) -> Result<&gguf_file::Value> {
        self.md.get(key).ok_or_else(|| refuse(key, "missing"))
    }

    fn string(&self, key: &str) -> Result<String> {
        self.value(key)?
            .to_string()
            .cloned()
            .map_err(|e| refuse(key, e))
    }

    fn list<T>(
        &self,
        key: &str,
        item: impl Fn(&gguf_file::Value) -> candle_core::Result<T>,
    ) -> Result<Vec<T>> {
        self.value(key)?
            .to_vec()
            .map_err(|e| refuse(key, e))?
            .iter()
            .map(|v| item(v).map_err(|e| refuse(key, e)))
            .collect()
    }

    fn flag(&self, key: &str) -> Option<bool> {
        self.md.get(key).and_then(|v| v.to_bool().ok())
    }
}

/// Builds the tokenizer described by a GGUF file's metadata.
///
/// # Errors
/// [`Error::InvalidModel`] naming the key when the vocabulary kind or pre-tokenizer is not
/// supported (with what is) or the metadata is malformed.
pub fn tokenizer_from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    let v = Vocabulary {
        md: &content.metadata,
    };
    let kind = v.string("tokenizer.ggml.model")?;
    let tokens = v.list("tokenizer.ggml.tokens", |x| x.to_string().cloned())?;
    let types: Vec<i32> = match content.metadata.get("tokenizer.ggml.token_type") {
        Some(_) => v.list("tokenizer.ggml.token_type", gguf_file::Value::to_i32)?,
        None => Vec::new(),
    };
    let mut tokenizer = match kind.as_str() {
        "gpt2" => {
            let merges = v
                .list("tokenizer.ggml.merges", |x| x.to_string().cloned())?
                .into_iter()
                .map(|m| match m.split_once(' ') {
                    Some((a, b)) => Ok((a.to_string(), b.to_string())),
                    None => Err(refuse(
                        "tokenizer.ggml.merges",
                        format!("malformed merge '{m}'"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            let pre = v
                .string("tokenizer.ggml.pre")
                .unwrap_or_else(|_| "default".into());
            byte_level_bpe(&tokens, merges, &pre)?
        }
        "llama" => {
            let scores = v.list("tokenizer.ggml.scores", gguf_file::Value::to_f32)?;
            if scores.len() != tokens.len() {
                return Err(refuse(
                    "tokenizer.ggml.scores",
                    format!("{} scores for {} tokens", scores.len(), tokens.len()),
                ));
            }
            let unknown = content
                .metadata
                .get("tokenizer.ggml.unknown_token_id")
                .and_then(|x| x.to_u32().ok())
                .and_then(|i| tokens.get(i as usize));
            let space_prefix = v.flag("tokenizer.ggml.add_space_prefix").unwrap_or(true);
            sentencepiece(&tokens, &scores, unknown, space_prefix)?
        }
        other => {
            return Err(refuse(
                "tokenizer.ggml.model",
                format!(
                    "'{other}' is not supported (supported: {})",
                    TOKENIZER_MODELS.join(", ")
                ),
            ))
        }
    };
    let added = |want: &[i32]| -> Vec<&String> {
        tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| want.contains(t))
            .map(|(tok, _)| tok)
            .collect()
    };
    let special: Vec<AddedToken> = added(&[TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN])
        .into_iter()
        .map(|t| AddedToken::from(t.clone(), true))
        .collect();
    tokenizer.add_special_tokens(&special);
    let user: Vec<AddedToken> = added(&[TOKEN_TYPE_USER_DEFINED])
        .into_iter()
        .map(|t| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tokenizer.add_tokens(&user);
    Ok(tokenizer)
}

fn vocab_of(tokens: &[String]) -> Vocab {
    // A repeated piece keeps its first id, as llama.cpp's text-to-token map does.
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    vocab
}

fn byte_level_bpe(
    tokens: &[String],
    merges: Vec<(String, String)>,
    pre: &str,
) -> Result<Tokenizer> {
    let rules = pretokenize::rules(pre)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_of(tokens), merges)
        .ignore_merges(rules.ignore_merges)
        .build()
        .map_err(Error::Tokenizer)?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(rules.pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece BPE as merges: every split of every piece into two pieces of the
/// vocabulary, the joined piece's score first (ties: lower id, then shorter left part).
fn sentencepiece(
    tokens: &[String],
    scores: &[f32],
    unknown: Option<&String>,
    space_prefix: bool,
) -> Result<Tokenizer> {
    let vocab = vocab_of(tokens);
    let mut ranked: Vec<(f32, u32, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        for (split, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(split);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                ranked.push((scores[id], id as u32, split));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = ranked
        .into_iter()
        .map(|(_, id, split)| {
            let (l, r) = tokens[id as usize].split_at(split);
            (l.to_string(), r.to_string())
        })
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unknown {
        builder = builder.unk_token(unk.clone());
    }
    let bpe = builder.build().map_err(Error::Tokenizer)?;
    let mut tokenizer = Tokenizer::new(bpe);
    let to_marker = Replace::new(" ", SPACE).map_err(Error::Tokenizer)?;
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if space_prefix {
        normalizers.push(Prepend::new(SPACE.into()).into());
    }
    normalizers.push(to_marker.into());
    tokenizer.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    let from_marker = Replace::new(SPACE, " ").map_err(Error::Tokenizer)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        from_marker.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// Loads a Hugging Face `tokenizer.json`.
///
/// # Errors
/// [`Error::Tokenizer`] for unreadable or malformed files.
pub fn tokenizer_from_file(path: &std::path::Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| Error::invalid_model(path.display().to_string(), e))
}

//! Constrained decoding on llguidance (the grammar engine llama.cpp and mistral.rs use): a
//! reply held to a JSON schema, any JSON object, a regular expression or a Lark grammar. At
//! each step the constraint masks the tokens that cannot continue a match; once the match is
//! complete only the end of the reply is allowed.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::{Error, Result};

/// What a reply must match.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this schema (`{"type": "json_schema", ...}`).
    JsonSchema(Value),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect: `%json {...}` embeds a schema).
    Lark(String),
}

impl Constraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({
                "type": "object"
            })),
            Self::JsonSchema(s) => TopLevelGrammar::from_json_schema(s.clone()),
            Self::Regex(r) => TopLevelGrammar::from_regex(r),
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The model's vocabulary as llguidance reads it, built at the first constrained turn (a
/// trie of every token's bytes: tens of milliseconds).
#[derive(Default)]
pub(crate) struct Grammars(OnceLock<std::result::Result<ParserFactory, String>>);

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammars")
    }
}

/// What the grammar engine reads of a model's vocabulary.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Vocab<'a> {
    pub tokenizer: &'a Tokenizer,
    /// Tokens the model scores (the tokenizer may list fewer).
    pub size: usize,
    pub eos: &'a [u32],
}

/// A vocabulary for llguidance: its trie, and our tokenizer for the text it must tokenize.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Bytes the grammar forces may end inside a character (the first bytes of `｜`): the
    /// text's whole characters go through the tokenizer and the rest byte by byte through
    /// the trie, never as a replacement character.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            match self.tokenizer.encode_fast(text, false) {
                Ok(e) => e.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

impl Grammars {
    /// The guide of `constraint` on `vocab` (the vocabulary these grammars were built for,
    /// or are built for now).
    ///
    /// # Errors
    /// [`Error::InvalidParams`] for a constraint that does not compile (a malformed schema,
    /// regular expression or grammar); [`Error::Unsupported`] when the vocabulary cannot be
    /// read as bytes.
    pub fn guide(&self, vocab: Vocab, constraint: &Constraint) -> Result<Guide> {
        let parser = self
            .factory(vocab)?
            .create_parser(constraint.grammar())
            .map_err(|e| invalid(format!("it does not compile: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(invalid(format!("it does not compile: {e}"))),
            None => Ok(Guide { matcher }),
        }
    }

    fn factory(&self, vocab: Vocab) -> Result<&ParserFactory> {
        let built = self.0.get_or_init(|| {
            let json = vocab
                .tokenizer
                .to_string(false)
                .map_err(|e| e.to_string())?;
            let json: Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
            let mut tokens =
                llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
            let size = vocab.size.max(tokens.len());
            tokens.resize(size, Vec::new());
            let first = vocab.eos.first().copied().unwrap_or(u32::MAX);
            let trie = TokTrie::from(&TokRxInfo::new(size as u32, first), &tokens)
                .with_eos_tokens(vocab.eos);
            let env: TokEnv = Arc::new(Vocabulary {
                trie,
                tokenizer: vocab.tokenizer.clone(),
            });
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.set_stderr_log_level(0);
            Ok(factory)
        });
        built.as_ref().map_err(|e| {
            Error::Unsupported(format!(
                "constrained decoding on this model's vocabulary: {e}"
            ))
        })
    }
}

/// A turn's constraint as it runs.
pub(crate) struct Guide {
    matcher: Matcher,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Guide")
    }
}

impl Guide {
    /// Masks (to -inf) the logits of tokens that cannot continue the match.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] if the match cannot go on (no token is allowed).
    pub fn restrict(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = self.matcher.compute_mask_or_eos().map_err(failed)?;
        let mut any = false;
        for (i, x) in logits.iter_mut().enumerate() {
            match mask.is_allowed(i as TokenId) {
                true => any |= x.is_finite() || *x == f32::INFINITY,
                false => *x = f32::NEG_INFINITY,
            }
        }
        match any {
            true => Ok(()),
            false => Err(failed("no token can continue the match")),
        }
    }

    /// Advances the match by the sampled `token`.
    ///
    /// # Errors
    /// [`Error::InvalidParams`] if the token breaks the match (it was not masked).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(failed)
    }
}

fn failed(e: impl std::fmt::Display) -> Error {
    invalid(format!("the reply could not follow it: {e}"))
}

fn invalid(reason: String) -> Error {
    Error::InvalidParams {
        param: "constraint",
        reason,
    }
}

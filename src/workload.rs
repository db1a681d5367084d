//! Multi-turn workloads for replay benchmarks: ShareGPT conversations and JSON-lines traces.
//!
//! The Pensieve and AttentionStore papers measure on ShareGPT: real user turns, and the reply
//! length of the original assistant as the forced output length. [`read_sharegpt`] reads the
//! dataset's JSON array tolerantly (the published file is cut short mid-record: everything
//! before the cut is kept); [`read_trace`] reads a trace whose turns already carry their output
//! lengths.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::default_cache_dir;
use crate::{Error, Result};

/// Where `scripts/fetch-assets --tests` puts ShareGPT V3 (it may not exist yet).
pub fn default_sharegpt_path() -> PathBuf {
    default_cache_dir().join("sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json")
}

/// One user turn of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnSpec {
    /// The user's message.
    pub user: String,
    /// Tokens the reply is forced to have.
    pub output_tokens: usize,
}

/// One conversation of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct ConversationSpec {
    /// Identifier from the source.
    pub id: String,
    /// Arrival time in seconds from the start of the run, when the source fixes it.
    pub arrival_s: Option<f64>,
    /// Turns, in causal order.
    pub turns: Vec<TurnSpec>,
}

/// A ShareGPT conversation as user → assistant pairs of text.
#[derive(Clone, Debug, PartialEq)]
pub struct ShareGptConversation {
    /// The record's `id`.
    pub id: String,
    /// `(user, assistant)` texts, in order.
    pub turns: Vec<(String, String)>,
}

impl ShareGptConversation {
    /// The first `max_turns` turns as a workload conversation, each reply's length counted by
    /// `count_tokens` (the model's tokenizer) and capped at `max_output`.
    ///
    /// # Errors
    /// Whatever `count_tokens` returns.
    pub fn to_spec(
        &self,
        max_turns: usize,
        max_output: usize,
        mut count_tokens: impl FnMut(&str) -> Result<usize>,
    ) -> Result<ConversationSpec> {
        let turns = self
            .turns
            .iter()
            .take(max_turns)
            .map(|(user, reply)| {
                Ok(TurnSpec {
                    user: user.clone(),
                    output_tokens: count_tokens(reply)?.clamp(1, max_output.max(1)),
                })
            })
            .collect::<Result<_>>()?;
        Ok(ConversationSpec {
            id: self.id.clone(),
            arrival_s: None,
            turns,
        })
    }
}

/// What [`read_sharegpt`] found.
#[derive(Clone, Debug)]
pub struct ShareGpt {
    /// Conversations with at least the requested number of turns, in file order.
    pub conversations: Vec<ShareGptConversation>,
    /// Records read in all.
    pub records: usize,
    /// Whether the file ended inside a record (the rest of the file was still used).
    pub truncated: bool,
}

#[derive(Deserialize)]
struct RawRecord {
    #[serde(default)]
    id: String,
    #[serde(default)]
    conversations: Vec<RawMessage>,
}

#[derive(Deserialize)]
struct RawMessage {
    from: String,
    value: String,
}

/// Reads a ShareGPT JSON file (an array of `{"id", "conversations": [{"from", "value"}]}`)
/// and keeps the conversations with at least `min_turns` user → assistant turns.
///
/// A turn is a `human` message followed by a `gpt` message; a conversation is cut at the first
/// place that breaks this alternation or has an empty user message, so every kept turn has its
/// full causal history. A file cut short inside a record keeps everything before it.
///
/// # Errors
/// [`Error::Io`] if unreadable; [`Error::InvalidWorkload`] if not a JSON array or a record is
/// malformed before the end of the file.
pub fn read_sharegpt(path: &Path, min_turns: usize) -> Result<ShareGpt> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let invalid = |reason: String| Error::InvalidWorkload {
        what: path.display().to_string(),
        reason,
    };
    let skip_ws = |pos: &mut usize| {
        while bytes.get(*pos).is_some_and(u8::is_ascii_whitespace) {
            *pos += 1;
        }
    };
    let mut pos = 0;
    skip_ws(&mut pos);
    if bytes.get(pos) != Some(&b'[') {
        return Err(invalid("expected a JSON array".into()));
    }
    pos += 1;
    let mut found = ShareGpt {
        conversations: Vec::new(),
        records: 0,
        truncated: false,
    };
    loop {
        skip_ws(&mut pos);
        match bytes.get(pos) {
            None => {
                found.truncated = true;
                break;
            }
            Some(b']') => break,
            Some(_) => {}
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<RawRecord>();
        let record = match stream.next() {
            Some(Ok(r)) => r,
            Some(Err(e)) if e.is_eof() => {
                found.truncated = true;
                break;
            }
            Some(Err(e)) => {
                return Err(invalid(format!(
                    "record {} at byte {pos}: {e}",
                    found.records
                )))
            }
            None => {
                found.truncated = true;
                break;
            }
        };
        pos += stream.byte_offset();
        found.records += 1;
        let turns = turn_pairs(&record.conversations);
        if turns.len() >= min_turns.max(1) {
            found.conversations.push(ShareGptConversation {
                id: record.id,
                turns,
            });
        }
        skip_ws(&mut pos);
        if bytes.get(pos) == Some(&b',') {
            pos += 1;
        }
    }
    Ok(found)
}

fn turn_pairs(messages: &[RawMessage]) -> Vec<(String, String)> {
    let mut turns = Vec::new();
    for pair in messages.chunks(2) {
        match pair {
            [u, a] if u.from == "human" && a.from == "gpt" && !u.value.trim().is_empty() => {
                turns.push((u.value.clone(), a.value.clone()));
            }
            _ => break,
        }
    }
    turns
}

#[derive(Deserialize, Serialize)]
struct TraceRecord {
    id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    arrival_s: Option<f64>,
    turns: Vec<TraceTurn>,
}

#[derive(Deserialize, Serialize)]
struct TraceTurn {
    user: String,
    output_tokens: usize,
}

/// Reads a JSON-lines trace: one conversation per line,
/// `{"id": str, "arrival_s": float (optional), "turns": [{"user": str, "output_tokens": int}]}`.
/// Blank lines are skipped.
///
/// # Errors
/// [`Error::Io`] if unreadable; [`Error::InvalidWorkload`] naming the line for a malformed
/// record, a conversation without turns, an empty user message, zero output tokens or a
/// negative or non-finite arrival time.
pub fn read_trace(path: &Path) -> Result<Vec<ConversationSpec>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let invalid = |reason: String| Error::InvalidWorkload {
            what: format!("{}:{}", path.display(), i + 1),
            reason,
        };
        let r: TraceRecord = serde_json::from_str(line).map_err(|e| invalid(e.to_string()))?;
        if r.turns.is_empty() {
            return Err(invalid("no turns".into()));
        }
        if r.turns.iter().any(|t| t.user.trim().is_empty()) {
            return Err(invalid("empty user message".into()));
        }
        if r.turns.iter().any(|t| t.output_tokens == 0) {
            return Err(invalid("output_tokens must be at least 1".into()));
        }
        if r.arrival_s.is_some_and(|a| !a.is_finite() || a < 0.0) {
            return Err(invalid(
                "arrival_s must be a finite, non-negative number".into(),
            ));
        }
        out.push(ConversationSpec {
            id: r.id,
            arrival_s: r.arrival_s,
            turns: r
                .turns
                .into_iter()
                .map(|t| TurnSpec {
                    user: t.user,
                    output_tokens: t.output_tokens,
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Writes `convs` as a JSON-lines trace that [`read_trace`] reads back: the exact turns and
/// forced lengths of a workload, for replaying it elsewhere (another engine's client).
///
/// # Errors
/// [`Error::Io`] if the file cannot be written.
pub fn write_trace(path: &Path, convs: &[ConversationSpec]) -> Result<()> {
    let mut text = String::new();
    for c in convs {
        let record = TraceRecord {
            id: c.id.clone(),
            arrival_s: c.arrival_s,
            turns: c
                .turns
                .iter()
                .map(|t| TraceTurn {
                    user: t.user.clone(),
                    output_tokens: t.output_tokens,
                })
                .collect(),
        };
        let line = serde_json::to_string(&record).map_err(|e| Error::InvalidWorkload {
            what: c.id.clone(),
            reason: e.to_string(),
        })?;
        text.push_str(&line);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

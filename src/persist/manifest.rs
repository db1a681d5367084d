//! A named conversation as stored: its layout, how it is checked when read, built from a
//! conversation when written, and turned back into one when resumed.

use serde::{Deserialize, Serialize};

use crate::conversation::{Conversation, Mark};
use crate::kv::{Address, BuildManifest, StoreError};
use crate::message::Message;

/// Version of the manifest layout; manifests of another version are not resumed.
const MANIFEST_VERSION: u32 = 1;

/// A named conversation as stored.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Manifest {
    version: u32,
    /// `<writer>-<revision>`: which engine wrote this state. Serialized right after the
    /// version, where the store's compare-and-set finds it.
    #[serde(default)]
    stamp: String,
    name: String,
    /// Tokens whose KV has been computed (the chunks cover them).
    computed: usize,
    tokens: Vec<u32>,
    messages: Vec<Message>,
    /// The tools its template lists.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tools: Vec<serde_json::Value>,
    /// The variables its template reads.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    template_vars: serde_json::Map<String, serde_json::Value>,
    /// The host's own data kept with it.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    attributes: serde_json::Map<String, serde_json::Value>,
    seen_text: String,
    /// Where turns begin (cut points for context overflow).
    #[serde(default)]
    marks: Vec<Mark>,
    /// Per chunk, the hex address of its file, if it has one.
    chunks: Vec<Option<String>>,
    /// Incremented by every write of this conversation's manifest, by whichever engine.
    #[serde(default)]
    revision: u64,
}

/// A stored conversation taken back: the conversation, how many of its tokens have KV, and
/// per chunk the file its tokens name (`None` where the manifest lists none, or another).
#[derive(Debug)]
pub(crate) struct Restored {
    pub conversation: Conversation,
    pub computed: usize,
    pub files: Vec<Option<Address>>,
    /// The content addresses of its chunks of computed tokens.
    pub addresses: Vec<Address>,
}

impl Manifest {
    /// A manifest of this layout whose tokens fit `vocab`, or what is wrong with it.
    pub fn parse(bytes: &[u8], vocab: usize) -> std::result::Result<Self, String> {
        if bytes.is_empty() {
            return Err("its manifest is empty".into());
        }
        let m = serde_json::from_slice::<Self>(bytes)
            .map_err(|e| format!("its manifest is cut short or not a manifest ({e})"))?;
        if m.version != MANIFEST_VERSION {
            return Err(format!(
                "its manifest has layout version {}, not {MANIFEST_VERSION}",
                m.version
            ));
        }
        if m.computed > m.tokens.len() {
            return Err(format!(
                "its manifest is inconsistent: KV of {} tokens over {} tokens",
                m.computed,
                m.tokens.len()
            ));
        }
        if let Some(t) = m.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "its manifest is inconsistent: token {t} is not in the vocabulary of {vocab}"
            ));
        }
        Ok(m)
    }

    /// The manifest of `conv` as its revision `revision`, stamped `stamp`, with KV of
    /// `computed` tokens (a queued turn's shared chunks may run ahead of the history: those
    /// are not stored yet); its chunk list is filled in by [`Manifest::build`].
    pub fn of(conv: &Conversation, computed: usize, stamp: String, revision: u64) -> Self {
        Self {
            version: MANIFEST_VERSION,
            stamp,
            name: conv.name().unwrap_or_default().to_string(),
            computed: computed.min(conv.tokens().len()),
            tokens: conv.tokens().to_vec(),
            messages: conv.messages().to_vec(),
            tools: conv.tools().to_vec(),
            template_vars: conv.template_vars().clone(),
            attributes: conv.attributes().clone(),
            seen_text: conv.seen_text().to_string(),
            marks: conv.marks().to_vec(),
            chunks: Vec::new(),
            revision,
        }
    }

    /// What builds its bytes on the store's writer, listing of `chunks` (each chunk's file
    /// and, while queued, its write) those whose write succeeded.
    pub fn build(mut self, chunks: Vec<Option<(Address, Option<u64>)>>) -> BuildManifest {
        Box::new(move |written| {
            self.chunks = (chunks.into_iter())
                .map(|c| c.and_then(|(a, write)| write.is_none_or(written).then(|| a.hex())))
                .collect();
            serde_json::to_vec(&self).map_err(|e| StoreError::Invalid(e.to_string()))
        })
    }

    /// The conversation's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it holds a later state than `conv`, a copy of the same conversation: a later
    /// revision, or the same one written by another engine while the copy's own write was
    /// refused (`copy_refused`).
    pub fn newer_than(&self, conv: &Conversation, copy_refused: bool) -> bool {
        self.revision > conv.revision() || (self.stamp != conv.stamp() && copy_refused)
    }

    /// The content addresses of the chunks of its computed tokens, cut by `chunk`.
    fn addresses(&self, chunk: usize) -> Vec<Address> {
        Address::of_chunks(&self.tokens[..self.computed], chunk)
    }

    /// The chunks its list names whose address its tokens confirm (a narrow file's as its
    /// chunk's), each with its KV-tokens.
    pub fn saved_chunks(&self, chunk: usize) -> Vec<(Address, usize)> {
        (self.chunks.iter().zip(self.addresses(chunk)).enumerate())
            .filter_map(|(i, (got, want))| {
                let got = got.as_deref().and_then(Address::from_hex)?;
                (got.wide() == want).then(|| (got, chunk.min(self.computed - i * chunk)))
            })
            .collect()
    }

    /// The conversation it stores, with its KV's chunks cut by `chunk`. A file counts only if
    /// it is the one the tokens name: a manifest and files that disagree (edited, or from an
    /// interrupted save) cost a recompute, never wrong KV.
    pub fn restore(self, chunk: usize) -> Restored {
        let addresses = self.addresses(chunk);
        let files = (self.chunks.iter().zip(&addresses))
            .map(|(got, want)| {
                got.as_deref()
                    .and_then(Address::from_hex)
                    .filter(|a| a.wide() == *want)
            })
            .collect();
        let mut conversation = Conversation::restore(
            self.name,
            self.tokens,
            self.messages,
            self.seen_text,
            self.marks,
        )
        .with_tools(self.tools)
        .with_template_vars(self.template_vars)
        .with_attributes(self.attributes);
        conversation.set_stored(self.revision, self.stamp);
        Restored {
            conversation,
            computed: self.computed,
            files,
            addresses,
        }
    }
}

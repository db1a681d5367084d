//! The chunk file format of the store, and the content addresses chunks are named by.
//!
//! A chunk file is a fixed-size header, a table of one checksum per layer, and the chunk's KV
//! bytes (the layout [`crate::attention::KvPool`] copies out:
//! `[layer][k, v][token][kv heads x head dim]`):
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `PNSVKV\r\n` |
//! | 4 | format version (little-endian, as every integer) |
//! | 32 | model fingerprint: model, weight format, KV type and chunk size |
//! | 4 x 3 | layers, KV heads, head dim |
//! | 4 | bytes per KV value |
//! | 8 | conversation that wrote it (informative: content addresses are shared) |
//! | 4 | chunk index |
//! | 4 | tokens in the chunk |
//! | 32 | content address: a hash chained over the token ids up to the chunk's last |
//! | 8 | payload length |
//! | 32 | BLAKE3 of the layer table below |
//! | 32 | BLAKE3 of every header byte before it |
//! | 32 x layers | the layer table: BLAKE3 of each layer's K and V bytes |
//!
//! One checksum per layer lets a restore use layer 0 while later layers are still being read
//! (the pipelined restore): each layer is checked before anything reads it.
//!
//! A file is accepted only if every field matches what the reader expects: a file of another
//! model, format or shape, of other tokens (a renamed or swapped file) or with any flipped or
//! missing byte is refused with the [`Fault`] that names why, so its KV is recomputed and never
//! used.

use std::fmt;

/// Bytes of a chunk file's header.
pub(crate) const HEADER_BYTES: usize = 8 + 4 + 32 + 12 + 4 + 8 + 4 + 4 + 32 + 8 + 32 + 32;

const MAGIC: [u8; 8] = *b"PNSVKV\r\n";

/// The bit of an address's last byte that marks a narrow file ([`Address::narrow`]).
const NARROW_BIT: u8 = 0x80;

/// Version of the layout above; a file of another version is refused.
pub const FORMAT_VERSION: u32 = 3;

/// A 32-byte BLAKE3 digest naming a chunk by its content: the token ids from the start of the
/// conversation up to and including the chunk's last token. KV at a position depends on every
/// token before it, so equal addresses (under one model fingerprint) mean equal KV.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Address(pub [u8; 32]);

impl Address {
    /// The address of the chunk holding `tokens`, following the chunk addressed `prev` (the
    /// all-zero address before the first chunk; a narrow address chains as its chunk's).
    pub fn chain(prev: &Address, tokens: &[u32]) -> Address {
        let mut h = blake3::Hasher::new();
        h.update(&prev.wide().0);
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        Address(*h.finalize().as_bytes()).wide()
    }

    /// The address of the file of this chunk's narrow KV: only the layers that attend to the
    /// whole history, without the sliding-window layers' (a chunk out of every window it
    /// will be read through). Told apart by one bit of the digest, so the tables, manifests
    /// and keys that name files say which kind each is without a field of their own.
    pub fn narrow(self) -> Address {
        let mut a = self;
        a.0[31] |= NARROW_BIT;
        a
    }

    /// The address of the chunk's whole KV (every layer's).
    pub fn wide(self) -> Address {
        let mut a = self;
        a.0[31] &= !NARROW_BIT;
        a
    }

    /// Whether this names a chunk's narrow file ([`Address::narrow`]).
    pub fn is_narrow(&self) -> bool {
        self.0[31] & NARROW_BIT != 0
    }

    /// Addresses of every chunk of `chunk` tokens (the last one possibly partial) of `tokens`.
    pub fn of_chunks(tokens: &[u32], chunk: usize) -> Vec<Address> {
        Self::chained(Address::default(), tokens, chunk)
    }

    /// [`Address::of_chunks`] of the chunks that follow the chunk addressed `prev`.
    pub fn chained(prev: Address, tokens: &[u32], chunk: usize) -> Vec<Address> {
        let mut prev = prev;
        tokens
            .chunks(chunk.max(1))
            .map(|c| {
                prev = Address::chain(&prev, c);
                prev
            })
            .collect()
    }

    /// Lowercase hex, the file name stem.
    pub fn hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses [`Address::hex`].
    pub fn from_hex(s: &str) -> Option<Address> {
        let bytes = s.as_bytes();
        if bytes.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks(2).enumerate() {
            let s = std::str::from_utf8(pair).ok()?;
            out[i] = u8::from_str_radix(s, 16).ok()?;
        }
        Some(Address(out))
    }
}

impl fmt::Debug for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Address({})", &self.hex()[..16])
    }
}

/// Names longer than this are stored under a digest: a file name must stay under the file
/// system's 255 bytes.
const MAX_NAME_IN_KEY: usize = 64;

/// How a conversation's name appears in its manifest's file name or key: its bytes in hex,
/// or for a long name `d-` and the BLAKE3 digest of it in hex (the name itself is inside the
/// manifest, so listing and resuming read it from there).
pub(crate) fn name_key(name: &str) -> String {
    match name.len() > MAX_NAME_IN_KEY {
        true => format!("d-{}", blake3::hash(name.as_bytes()).to_hex()),
        false => hex(name.as_bytes()),
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What every chunk file of one store must match: the model and the KV layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkFormat {
    /// Digest of the model's identity (configuration, weights sample), weight format, KV type
    /// and chunk size: KV computed under another fingerprint is never loaded.
    pub fingerprint: [u8; 32],
    /// Decoder layers.
    pub layers: u32,
    /// Layers a narrow file holds ([`Address::narrow`]): those without a sliding window,
    /// `layers` for a model with none.
    pub narrow_layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Bytes per stored KV value (2 or 4), or [`ChunkFormat::Q8_0`] and [`ChunkFormat::Q4_0`]
    /// for KV in llama.cpp's `q8_0` and `q4_0` blocks (34 and 18 bytes per 32 values).
    pub value_bytes: u32,
}

impl ChunkFormat {
    /// [`ChunkFormat::value_bytes`] of KV in `q8_0` blocks: no float width, so files of any
    /// other precision are told apart by their header.
    pub const Q8_0: u32 = 0x5138;
    /// [`ChunkFormat::value_bytes`] of KV in `q4_0` blocks.
    pub const Q4_0: u32 = 0x5134;

    /// The format of the file at `address`: a narrow file holds only its narrow layers.
    pub fn of(&self, address: &Address) -> ChunkFormat {
        match address.is_narrow() {
            true => ChunkFormat {
                layers: self.narrow_layers,
                ..*self
            },
            false => *self,
        }
    }

    /// Bytes of one head's K (or V) row of one token.
    pub fn head_row_bytes(&self) -> usize {
        let d = self.head_dim as usize;
        match self.value_bytes {
            Self::Q8_0 => d / 32 * 34,
            Self::Q4_0 => d / 32 * 18,
            width => d * width as usize,
        }
    }

    /// Bytes before the payload: the header and the layer table.
    pub fn head_bytes(&self) -> usize {
        HEADER_BYTES + 32 * self.layers as usize
    }

    /// Payload bytes of one layer of a chunk of `tokens` KV-tokens.
    pub fn layer_bytes(&self, tokens: usize) -> usize {
        self.payload_bytes(tokens) / (self.layers as usize).max(1)
    }

    /// Payload bytes of a chunk of `tokens` KV-tokens.
    pub fn payload_bytes(&self, tokens: usize) -> usize {
        2 * tokens * self.layers as usize * self.kv_heads as usize * self.head_row_bytes()
    }
}

/// Which chunk a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChunkId {
    pub conversation: u64,
    pub index: u32,
    pub tokens: u32,
    pub address: Address,
}

/// Why a chunk file was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The file is absent.
    Missing,
    /// Shorter or longer than its header says.
    Truncated,
    /// Not a chunk file, another format version, or a header whose checksum fails.
    BadHeader,
    /// Written under another model fingerprint or KV layout.
    Foreign,
    /// Holds another chunk than the one asked for (other tokens: a renamed or swapped file).
    WrongContent,
    /// The payload's checksum fails.
    Corrupt,
    /// The store failed to read it (the file system's or the network's failure kind).
    Io(std::io::ErrorKind),
}

impl std::error::Error for Fault {}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::Missing => "missing",
            Fault::Truncated => "truncated",
            Fault::BadHeader => "bad header",
            Fault::Foreign => "another model or layout",
            Fault::WrongContent => "another chunk's content",
            Fault::Corrupt => "payload checksum mismatch",
            Fault::Io(kind) => return write!(f, "read error ({kind})"),
        })
    }
}

/// A little-endian writer over a byte buffer.
struct Put<'a>(&'a mut Vec<u8>);

impl Put<'_> {
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// A little-endian reader over a header; every read is bounds-checked.
struct Get<'a>(&'a [u8]);

impl Get<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

/// The header and layer table of a chunk of `payload` bytes.
pub(crate) fn encode_header(format: &ChunkFormat, id: &ChunkId, payload: &[u8]) -> Vec<u8> {
    let layer = (payload.len() / (format.layers as usize).max(1)).max(1);
    let table: Vec<u8> = payload
        .chunks(layer)
        .flat_map(|l| *blake3::hash(l).as_bytes())
        .collect();
    let mut out = Vec::with_capacity(HEADER_BYTES + table.len());
    Put(&mut out)
        .bytes(&MAGIC)
        .u32(FORMAT_VERSION)
        .bytes(&format.fingerprint)
        .u32(format.layers)
        .u32(format.kv_heads)
        .u32(format.head_dim)
        .u32(format.value_bytes)
        .u64(id.conversation)
        .u32(id.index)
        .u32(id.tokens)
        .bytes(&id.address.0)
        .u64(payload.len() as u64)
        .bytes(blake3::hash(&table).as_bytes());
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out.extend_from_slice(&table);
    out
}

/// A parsed header: which chunk, its payload length and the checksum of its layer table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub id: ChunkId,
    pub payload_len: u64,
    pub checksum: [u8; 32],
}

/// Parses and checks a header against the store's `format`.
///
/// # Errors
/// [`Fault::Truncated`] for fewer than [`HEADER_BYTES`], [`Fault::BadHeader`],
/// [`Fault::Foreign`].
pub(crate) fn decode_header(format: &ChunkFormat, bytes: &[u8]) -> Result<Header, Fault> {
    let bytes = bytes.get(..HEADER_BYTES).ok_or(Fault::Truncated)?;
    let (body, sum) = bytes.split_at(HEADER_BYTES - 32);
    if blake3::hash(body).as_bytes() != sum {
        return Err(Fault::BadHeader);
    }
    let mut g = Get(body);
    let parse = |g: &mut Get| -> Option<(ChunkFormat, Header)> {
        if g.take::<8>()? != MAGIC || g.u32()? != FORMAT_VERSION {
            return None;
        }
        let found = ChunkFormat {
            fingerprint: g.take()?,
            layers: g.u32()?,
            // Not in the header: what the address says.
            narrow_layers: format.narrow_layers,
            kv_heads: g.u32()?,
            head_dim: g.u32()?,
            value_bytes: g.u32()?,
        };
        let id = ChunkId {
            conversation: g.u64()?,
            index: g.u32()?,
            tokens: g.u32()?,
            address: Address(g.take()?),
        };
        let header = Header {
            id,
            payload_len: g.u64()?,
            checksum: g.take()?,
        };
        Some((found, header))
    };
    let (found, header) = parse(&mut g).ok_or(Fault::BadHeader)?;
    if found != *format {
        return Err(Fault::Foreign);
    }
    Ok(header)
}

/// Checks a header read from a file against the chunk at `address` of `tokens` tokens, and
/// the layer table that follows it (`head`: the file's first [`ChunkFormat::head_bytes`]);
/// returns the table.
///
/// # Errors
/// The [`Fault`] that refuses it.
pub(crate) fn decode_head<'a>(
    format: &ChunkFormat,
    head: &'a [u8],
    address: &Address,
    tokens: usize,
) -> Result<&'a [u8], Fault> {
    let header = decode_header(format, head)?;
    if header.id.address != *address || header.id.tokens as usize != tokens {
        return Err(Fault::WrongContent);
    }
    if header.payload_len != format.payload_bytes(tokens) as u64 {
        return Err(Fault::Truncated);
    }
    let table = head
        .get(HEADER_BYTES..format.head_bytes())
        .ok_or(Fault::Truncated)?;
    if blake3::hash(table).as_bytes() != &header.checksum {
        return Err(Fault::Corrupt);
    }
    Ok(table)
}

/// Checks layer `i`'s bytes against the layer `table`.
///
/// # Errors
/// [`Fault::Corrupt`] if they differ from what was written.
pub(crate) fn check_layer(table: &[u8], i: usize, bytes: &[u8]) -> Result<(), Fault> {
    match table.get(32 * i..32 * (i + 1)) {
        Some(sum) if blake3::hash(bytes).as_bytes() == sum => Ok(()),
        _ => Err(Fault::Corrupt),
    }
}

/// Checks a whole file (header, layer table and payload) holding the chunk at `address` of
/// `tokens` tokens and returns its payload.
///
/// # Errors
/// The [`Fault`] that refuses it.
pub(crate) fn decode_chunk<'a>(
    format: &ChunkFormat,
    file: &'a [u8],
    address: &Address,
    tokens: usize,
) -> Result<&'a [u8], Fault> {
    let table = decode_head(format, file, address, tokens)?;
    let payload = &file[format.head_bytes()..];
    if payload.len() != format.payload_bytes(tokens) {
        return Err(Fault::Truncated);
    }
    let layer = format.layer_bytes(tokens).max(1);
    for (i, bytes) in payload.chunks(layer).enumerate() {
        check_layer(table, i, bytes)?;
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format() -> ChunkFormat {
        ChunkFormat {
            fingerprint: [7; 32],
            layers: 2,
            narrow_layers: 1,
            kv_heads: 1,
            head_dim: 2,
            value_bytes: 2,
        }
    }

    fn file(tokens: &[u32]) -> (Vec<u8>, Address) {
        let address = Address::chain(&Address::default(), tokens);
        let id = ChunkId {
            conversation: 3,
            index: 0,
            tokens: tokens.len() as u32,
            address,
        };
        let payload: Vec<u8> = (0..format().payload_bytes(tokens.len()) as u8).collect();
        let mut f = encode_header(&format(), &id, &payload);
        f.extend_from_slice(&payload);
        (f, address)
    }

    #[test]
    fn a_whole_file_reads_back() {
        let (f, a) = file(&[1, 2, 3]);
        assert_eq!(f.len(), HEADER_BYTES + 2 * 32 + 48);
        let payload = decode_chunk(&format(), &f, &a, 3).unwrap();
        assert_eq!(payload, &(0..48).collect::<Vec<u8>>()[..]);
    }

    #[test]
    fn every_damage_is_refused_with_its_fault() {
        let (f, a) = file(&[1, 2, 3]);
        let fmt = format();
        for i in 0..f.len() {
            let mut bad = f.clone();
            bad[i] ^= 0x10;
            // The header's own checksum covers the header; the layer table's checksum (in the
            // header) the table; each table entry its layer.
            let want = if i < HEADER_BYTES {
                Fault::BadHeader
            } else {
                Fault::Corrupt
            };
            assert_eq!(decode_chunk(&fmt, &bad, &a, 3), Err(want), "byte {i}");
        }
        for cut in [0, 10, HEADER_BYTES, HEADER_BYTES + 40, f.len() - 1] {
            let got = decode_chunk(&fmt, &f[..cut], &a, 3);
            assert_eq!(got, Err(Fault::Truncated), "cut at {cut}");
        }
        let (other, b) = file(&[1, 2, 4]);
        assert_eq!(decode_chunk(&fmt, &other, &a, 3), Err(Fault::WrongContent));
        assert!(decode_chunk(&fmt, &other, &b, 3).is_ok());
        let foreign = ChunkFormat {
            fingerprint: [8; 32],
            ..fmt
        };
        assert_eq!(decode_chunk(&foreign, &f, &a, 3), Err(Fault::Foreign));
    }

    #[test]
    fn addresses_chain_over_the_whole_prefix() {
        let a = Address::of_chunks(&[1, 2, 3, 4, 5], 2);
        let b = Address::of_chunks(&[9, 2, 3, 4, 5], 2);
        assert_eq!(a.len(), 3);
        // The second chunks hold the same tokens but follow different prefixes.
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(Address::from_hex(&a[2].hex()), Some(a[2]));
        assert_eq!(Address::from_hex("zz"), None);
    }
}

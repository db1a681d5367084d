//! A GGUF file's header, read by our own reader: candle's stops at the first tensor of a type
//! it does not know, and gpt-oss files keep their experts in MXFP4 (type 39), which only the
//! packed formats hold. The header is returned as candle's [`gguf_file::Content`] for the types
//! candle reads, beside the tensors of the others.

use std::collections::HashMap;
use std::io::{BufReader, Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::{self, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;

use crate::{Error, Result};

/// GGML's type id of MXFP4 (`GGML_TYPE_MXFP4`).
const MXFP4_ID: u32 = 39;
/// The tensor types candle reads, by GGML id.
const CANDLE_TYPES: [(u32, GgmlDType); 15] = [
    (0, GgmlDType::F32),
    (1, GgmlDType::F16),
    (2, GgmlDType::Q4_0),
    (3, GgmlDType::Q4_1),
    (6, GgmlDType::Q5_0),
    (7, GgmlDType::Q5_1),
    (8, GgmlDType::Q8_0),
    (9, GgmlDType::Q8_1),
    (10, GgmlDType::Q2K),
    (11, GgmlDType::Q3K),
    (12, GgmlDType::Q4K),
    (13, GgmlDType::Q5K),
    (14, GgmlDType::Q6K),
    (15, GgmlDType::Q8K),
    (30, GgmlDType::BF16),
];

/// A GGUF tensor's type: one candle reads, or MXFP4 (4-bit E2M1 codes with an E8M0 exponent
/// per 32 values, 17 bytes), which only the packed formats hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GgufType {
    /// A type candle reads.
    Ggml(GgmlDType),
    /// MXFP4.
    Mxfp4,
}

impl GgufType {
    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            GgufType::Ggml(t) => t.block_size(),
            GgufType::Mxfp4 => 32,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgufType::Ggml(t) => t.type_size(),
            GgufType::Mxfp4 => 17,
        }
    }
}

/// A tensor of a type candle does not read: its shape (rows last, as candle lists dimensions)
/// and offset from the start of the tensor data.
#[derive(Clone, Debug)]
pub struct OtherTensor {
    /// Its type.
    pub dtype: GgufType,
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Bytes from the start of the tensor data.
    pub offset: u64,
}

/// A GGUF file's header.
#[derive(Debug)]
pub struct GgufHeader {
    /// The metadata and the tensors of types candle reads.
    pub content: gguf_file::Content,
    /// The tensors of the other types, by name.
    pub others: HashMap<String, OtherTensor>,
}

impl GgufHeader {
    /// Reads the header at the start of `reader`.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for a file that is not GGUF, a header cut short or with
    /// lengths past the file's end, or a tensor type neither candle nor the packed formats
    /// read; [`Error::Io`] if the file cannot be read.
    pub fn read<R: Read + Seek>(reader: &mut R) -> Result<Self> {
        let size = reader
            .seek(SeekFrom::End(0))
            .and_then(|_| reader.stream_position())
            .map_err(|e| Error::io("GGUF file", e))?;
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|e| Error::io("GGUF file", e))?;
        let mut r = Cursor {
            inner: BufReader::new(reader),
            at: 0,
            size,
            wide: true,
        };
        if r.bytes(4)? != b"GGUF" {
            return Err(bad("not a GGUF file (no GGUF magic)"));
        }
        let magic = match r.u32()? {
            1 => VersionedMagic::GgufV1,
            2 => VersionedMagic::GgufV2,
            3 => VersionedMagic::GgufV3,
            v => return Err(bad(format!("GGUF version {v} is not supported"))),
        };
        r.wide = magic != VersionedMagic::GgufV1;
        let (tensors, entries) = (r.len(17)?, r.len(13)?);
        let mut metadata = HashMap::with_capacity(entries);
        for _ in 0..entries {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind, 0)?;
            metadata.insert(key, value);
        }
        let mut tensor_infos = HashMap::with_capacity(tensors);
        let mut others = HashMap::new();
        for _ in 0..tensors {
            let name = r.string()?;
            let dims = r.u32()?;
            if dims > 4 {
                return Err(bad(format!("tensor {name}: {dims} dimensions")));
            }
            let mut shape = (0..dims).map(|_| r.dim()).collect::<Result<Vec<usize>>>()?;
            shape.reverse();
            let (id, offset) = (r.u32()?, r.u64()?);
            if let Some(&(_, ggml_dtype)) = CANDLE_TYPES.iter().find(|(i, _)| *i == id) {
                let shape = candle_core::Shape::from(shape);
                let info = gguf_file::TensorInfo {
                    ggml_dtype,
                    shape,
                    offset,
                };
                tensor_infos.insert(name, info);
            } else if id == MXFP4_ID {
                let dtype = GgufType::Mxfp4;
                let info = OtherTensor {
                    dtype,
                    shape,
                    offset,
                };
                others.insert(name, info);
            } else {
                return Err(bad(format!(
                    "tensor {name}: GGML type {id} is not supported"
                )));
            }
        }
        let alignment = match metadata.get("general.alignment").map(Value::to_u32) {
            Some(Ok(a)) if a > 0 => u64::from(a),
            Some(_) => return Err(bad("general.alignment is not a positive integer")),
            None => 32,
        };
        let content = gguf_file::Content {
            magic,
            metadata,
            tensor_infos,
            tensor_data_offset: r.at.div_ceil(alignment) * alignment,
        };
        Ok(Self { content, others })
    }

    /// Every tensor's name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        (self.content.tensor_infos.keys())
            .chain(self.others.keys())
            .map(String::as_str)
    }

    /// Tensor `name`'s type, dimensions (outermost first) and offset in the file.
    pub fn tensor(&self, name: &str) -> Option<(GgufType, &[usize], u64)> {
        let data = self.content.tensor_data_offset;
        match self.content.tensor_infos.get(name) {
            Some(t) => Some((GgufType::Ggml(t.ggml_dtype), t.shape.dims(), t.offset)),
            None => (self.others.get(name)).map(|t| (t.dtype, &t.shape[..], t.offset)),
        }
        .map(|(t, dims, offset)| (t, dims, data.saturating_add(offset)))
    }
}

fn bad(why: impl std::fmt::Display) -> Error {
    Error::invalid_model("GGUF header", why)
}

/// The header's bytes, read in order, every length checked against what is left of the file.
struct Cursor<R> {
    inner: R,
    at: u64,
    size: u64,
    /// Lengths are u64 (GGUF 2 and 3), not u32 (1).
    wide: bool,
}

impl<R: Read> Cursor<R> {
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        if self.at.saturating_add(n as u64) > self.size {
            return Err(bad(format!("cut short at byte {}", self.at)));
        }
        let mut v = vec![0; n];
        (self.inner.read_exact(&mut v)).map_err(|e| Error::io("GGUF file", e))?;
        self.at += n as u64;
        Ok(v)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let v = self.bytes(N)?;
        v.try_into().map_err(|_| bad("short read"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count as GGUF writes it: u64, or u32 in version 1.
    fn count(&mut self) -> Result<u64> {
        match self.wide {
            true => self.u64(),
            false => Ok(u64::from(self.u32()?)),
        }
    }

    /// A tensor's dimension (its values are in the data, not the header: not bounded by it).
    fn dim(&mut self) -> Result<usize> {
        let n = self.count()?;
        usize::try_from(n).map_err(|_| bad(format!("a dimension of {n}")))
    }

    /// A length of items of at least `min` bytes each, refused if they cannot fit in the rest
    /// of the file (so a corrupt length allocates nothing).
    fn len(&mut self, min: u64) -> Result<usize> {
        let n = self.count()?;
        if n.saturating_mul(min) > self.size - self.at {
            return Err(bad(format!("a length of {n} at byte {}", self.at)));
        }
        usize::try_from(n).map_err(|_| bad(format!("a length of {n}")))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len(1)?;
        let mut v = self.bytes(n)?;
        // Writers sometimes end strings with NULs, which GGUF does not count as text.
        while v.last() == Some(&0) {
            v.pop();
        }
        String::from_utf8(v).map_err(|_| bad(format!("a string at byte {} not UTF-8", self.at)))
    }

    fn value(&mut self, kind: u32, depth: usize) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(u8::from_le_bytes(self.array()?)),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 if depth < 2 => {
                let inner = self.u32()?;
                let n = self.len(1)?;
                let items = (0..n).map(|_| self.value(inner, depth + 1));
                Value::Array(items.collect::<Result<_>>()?)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            k => return Err(bad(format!("metadata value type {k} at byte {}", self.at))),
        })
    }
}

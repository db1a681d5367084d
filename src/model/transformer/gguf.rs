//! A GGUF file's tensors, read one at a time as the model is built: linear weights packed a
//! panel of rows at a time, so the file is never held whole a second time.

use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;

use super::load::linear_from_q;
use super::{Linear, WeightFormat};
use crate::model::packed::{Isa, PackedLinear};
use crate::{Error, Result};

/// A GGUF file's tensors, read one at a time as the model is built.
pub(super) struct GgufTensors<'a, R> {
    pub(super) content: &'a gguf_file::Content,
    pub(super) reader: RefCell<&'a mut R>,
    pub(super) device: &'a Device,
    /// Whether linear weights are packed (the packed format on the CPU).
    pub(super) packed: bool,
}

impl<R: Read + Seek> GgufTensors<'_, R> {
    /// Tensor `name`, read whole.
    pub(super) fn qtensor(&self, name: &str) -> Result<QTensor> {
        let mut reader = self.reader.borrow_mut();
        self.content
            .tensor(&mut **reader, name, self.device)
            .map_err(|e| Error::invalid_model(name, e))
    }

    /// Matrix `name` packed in its own codes, read a panel of rows at a time where its type
    /// allows (so the file is never held whole a second time), else read whole.
    pub(super) fn packed(&self, name: &str) -> Result<PackedLinear> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::invalid_model(name, "missing tensor"))?;
        let dtype = info.ggml_dtype;
        if !PackedLinear::streams(dtype) {
            return PackedLinear::from_qtensor(&self.qtensor(name)?);
        }
        let (n, k) = info.shape.dims2()?;
        let size = (n * k / dtype.block_size() * dtype.type_size()) as u64;
        let start = self.content.tensor_data_offset.saturating_add(info.offset);
        let mut reader = self.reader.borrow_mut();
        let io = |e: std::io::Error| Error::invalid_model(name, e);
        let end = reader.seek(SeekFrom::End(0)).map_err(io)?;
        if start.saturating_add(size) > end {
            return Err(Error::invalid_model(
                name,
                format!("{size} bytes at offset {start}, past the end of the file ({end})"),
            ));
        }
        PackedLinear::from_gguf(dtype, n, k, &mut |at, len, buf| {
            buf.resize(len, 0);
            reader
                .seek(SeekFrom::Start(start + at as u64))
                .map_err(io)?;
            reader.read_exact(buf).map_err(io)?;
            Ok(())
        })
        .map_err(|e| Error::invalid_model(name, e))
    }

    /// Linear layer `name` in `format`.
    pub(super) fn linear(&self, name: &str, format: WeightFormat) -> Result<Linear> {
        if self.packed {
            return Ok(Linear::Packed(self.packed(name)?, Isa::detect()));
        }
        linear_from_q(self.qtensor(name)?, format, self.device)
    }
}

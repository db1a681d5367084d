//! Loading a GGUF file: its tensors read one at a time as the model is built, linear weights
//! packed a panel of rows at a time, so the file is never held whole a second time.

use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::QTensor;
use candle_core::Device;

use super::load::{linear_from_q, loaded, packs};
use super::names::{check_tensors, Part, Scheme};
use super::{device, Embedding, Layer, Linear, Transformer, WeightFormat};
use crate::model::config::ModelConfig;
use crate::model::gguf::{GgufHeader, GgufType};
use crate::model::packed::{Isa, PackedLinear};
use crate::{Error, Result};

/// A Llama 3.x GGUF's RoPE frequency factors.
const ROPE_FREQS: &str = "rope_freqs.weight";
/// A Phi-3 GGUF's LongRoPE factors, for the window it was trained with and past it.
const ROPE_SHORT: &str = "rope_factors_short.weight";
const ROPE_LONG: &str = "rope_factors_long.weight";

/// A GGUF file's tensors, read one at a time as the model is built.
pub(super) struct GgufTensors<'a, R> {
    pub(super) header: &'a GgufHeader,
    pub(super) reader: RefCell<&'a mut R>,
    /// Where tensors are read to: the CPU where they go on to `codes`.
    pub(super) device: &'a Device,
    /// Whether linear weights are packed (the packed format on the CPU).
    pub(super) packed: bool,
    /// The device linear weights go to in their own codes (the packed format off the CPU).
    pub(super) codes: Option<&'a Device>,
}

impl<'a, R: Read + Seek> GgufTensors<'a, R> {
    /// Tensor `name`, read whole.
    pub(super) fn qtensor(&self, name: &str) -> Result<QTensor> {
        if let Some(t) = self.header.others.get(name) {
            return Err(Error::invalid_model(name, only_packed(t.dtype)));
        }
        let mut reader = self.reader.borrow_mut();
        self.header
            .content
            .tensor(&mut **reader, name, self.device)
            .map_err(|e| Error::invalid_model(name, e))
    }

    /// Matrix `name` packed in its own codes, read a panel of rows at a time where its type
    /// allows (so the file is never held whole a second time), else read whole.
    pub(super) fn packed(&self, name: &str) -> Result<PackedLinear> {
        let (dtype, dims, start) = self.info(name)?;
        if !PackedLinear::streams(dtype) {
            return PackedLinear::from_qtensor(&self.qtensor(name)?);
        }
        match *dims {
            [n, k] => self.packed_at(name, dtype, (n, k), start),
            _ => Err(Error::invalid_model(
                name,
                format!("shape {dims:?}, not a matrix"),
            )),
        }
    }

    /// Linear layer `name` in `format`.
    pub(super) fn linear(&self, name: &str, format: WeightFormat) -> Result<Linear> {
        match (self.packed, self.codes) {
            (true, _) => Ok(Linear::Packed(self.packed(name)?, Isa::detect())),
            (false, Some(gpu)) if self.header.others.contains_key(name) => Ok(Linear::Candle(
                device::packed_as_f16(name, &self.packed(name)?, gpu)?,
            )),
            (false, Some(gpu)) => Ok(Linear::Candle(device::gguf_linear(
                name,
                &self.qtensor(name)?,
                gpu,
            )?)),
            (false, None) => linear_from_q(self.qtensor(name)?, format, self.device),
        }
    }

    /// `part` of tensor `name` in `format`: an expert's matrix of stacked ones (`[experts,
    /// rows, columns]`, one after another) or rows of a matrix. Only its own bytes are read.
    pub(super) fn part(&self, name: &str, part: Part, format: WeightFormat) -> Result<Linear> {
        let (dtype, dims, start) = self.info(name)?;
        let (k, row_bytes) = {
            let k = *dims.last().unwrap_or(&0);
            (k, k / dtype.block_size() * dtype.type_size())
        };
        let (first, n) = match (part, dims) {
            (Part::Expert(e), &[experts, n, _]) if e < experts => (e * n, n),
            (Part::Rows { start, len }, &[n, _]) if start + len <= n => (start, len),
            (part, dims) => {
                return Err(Error::invalid_model(
                    name,
                    format!("{part:?} is not a part of a tensor of shape {dims:?}"),
                ))
            }
        };
        let start = start.saturating_add((first * row_bytes) as u64);
        if self.packed && PackedLinear::streams(dtype) {
            return Ok(Linear::Packed(
                self.packed_at(name, dtype, (n, k), start)?,
                Isa::detect(),
            ));
        }
        let GgufType::Ggml(ggml) = dtype else {
            return match self.codes {
                Some(gpu) => Ok(Linear::Candle(device::packed_as_f16(
                    name,
                    &self.packed_at(name, dtype, (n, k), start)?,
                    gpu,
                )?)),
                None => Err(Error::invalid_model(name, only_packed(dtype))),
            };
        };
        let mut raw = Vec::new();
        self.read_at(name, start, n * row_bytes)?(0, n * row_bytes, &mut raw)?;
        let q = qtensor_from_ggml(ggml, &raw, vec![n, k], self.device)
            .map_err(|e| Error::invalid_model(name, e))?;
        match (self.packed, self.codes) {
            (true, _) => Ok(Linear::Packed(
                PackedLinear::from_qtensor(&q)?,
                Isa::detect(),
            )),
            (false, Some(gpu)) => Ok(Linear::Candle(device::gguf_linear(name, &q, gpu)?)),
            (false, None) => linear_from_q(q, format, self.device),
        }
    }

    /// Tensor `name`'s type, dimensions and first byte in the file.
    fn info(&self, name: &str) -> Result<(GgufType, &'a [usize], u64)> {
        (self.header.tensor(name)).ok_or_else(|| Error::invalid_model(name, "missing tensor"))
    }

    /// The `(rows, columns)` matrix of `dtype` at byte `start` of the file, packed a panel of
    /// rows at a time.
    fn packed_at(
        &self,
        name: &str,
        dtype: GgufType,
        (n, k): (usize, usize),
        start: u64,
    ) -> Result<PackedLinear> {
        let size = n * k / dtype.block_size() * dtype.type_size();
        PackedLinear::from_gguf(dtype, n, k, &mut self.read_at(name, start, size)?)
            .map_err(|e| Error::invalid_model(name, e))
    }

    /// A reader of the `size` bytes at `start` of the file (`(offset, len, buf)`: `len` bytes
    /// at `offset` of them into `buf`), checked to lie within the file.
    fn read_at(
        &self,
        name: &str,
        start: u64,
        size: usize,
    ) -> Result<impl FnMut(usize, usize, &mut Vec<u8>) -> Result<()> + use<'_, 'a, R>> {
        let io = |e: std::io::Error| Error::invalid_model(name, e);
        let end = (self.reader.borrow_mut().seek(SeekFrom::End(0))).map_err(io)?;
        if start.saturating_add(size as u64) > end {
            return Err(Error::invalid_model(
                name,
                format!("{size} bytes at offset {start}, past the end of the file ({end})"),
            ));
        }
        let name = name.to_string();
        Ok(move |at: usize, len: usize, buf: &mut Vec<u8>| {
            let io = |e: std::io::Error| Error::invalid_model(&name, e);
            let mut reader = self.reader.borrow_mut();
            buf.resize(len, 0);
            reader
                .seek(SeekFrom::Start(start + at as u64))
                .map_err(io)?;
            reader.read_exact(buf).map_err(io)?;
            Ok(())
        })
    }
}

/// Why a tensor of `dtype` cannot be read but by the packed format.
fn only_packed(dtype: GgufType) -> String {
    format!("{dtype:?} is only read by the packed format")
}

impl Transformer {
    /// Loads a GGUF file of a supported architecture, after checking from its index that it
    /// holds exactly the tensors the graph reads.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for other architectures, missing or unused tensors, or corrupt
    /// data.
    pub fn from_gguf<R: Read + Seek>(
        header: &GgufHeader,
        reader: &mut R,
        format: WeightFormat,
        device: &Device,
    ) -> Result<Self> {
        let content = &header.content;
        let mut config = ModelConfig::from_gguf(content)?;
        // An output projection of a type candle does not read is still the file's own.
        config.tie_word_embeddings &= !header.others.contains_key(Scheme::Gguf.globals().output);
        check_tensors(&config, Scheme::Gguf, header.names())?;
        let codes = (format == WeightFormat::Packed && !device.is_cpu()).then_some(device);
        let file = GgufTensors {
            header,
            reader: RefCell::new(reader),
            device: if codes.is_some() {
                &Device::Cpu
            } else {
                device
            },
            packed: packs(format, device),
            codes,
        };
        let factors = |name: &str| -> Result<Option<Vec<f32>>> {
            match content.tensor_infos.contains_key(name) {
                true => {
                    let t = file.qtensor(name)?.dequantize(&Device::Cpu)?;
                    Ok(Some(t.flatten_all()?.to_vec1::<f32>()?))
                }
                false => Ok(None),
            }
        };
        if let Some(f) = factors(ROPE_FREQS)? {
            config.rope.freq_factors = Some(f);
            config.validate()?;
        }
        if let (Some(short), Some(long)) = (factors(ROPE_SHORT)?, factors(ROPE_LONG)?) {
            config.gguf_longrope(content, short, long)?;
        }
        let g = Scheme::Gguf.globals();
        let (embed, lm_head) = match (file.packed, config.tie_word_embeddings) {
            (true, true) => (Embedding::Packed(None), file.linear(g.embed, format)?),
            (true, false) => (
                Embedding::Packed(Some(file.packed(g.embed)?)),
                file.linear(g.output, format)?,
            ),
            (false, tied) => {
                let head = file.linear(if tied { g.embed } else { g.output }, format)?;
                let table = match (codes, tied) {
                    (Some(_), true) => Embedding::of(&head),
                    (Some(_), false) => Embedding::of(&file.linear(g.embed, format)?),
                    (None, _) => Embedding::Table(file.qtensor(g.embed)?.dequantize(device)?),
                };
                (table, head)
            }
        };
        let vector = |name: String| Ok(file.qtensor(&name)?.dequantize(device)?);
        let norm = vector(g.norm.to_string())?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            layers.push(Layer::load(
                &config,
                Scheme::Gguf,
                i,
                |name| Ok(name.to_string()),
                |name, part| match part {
                    Part::Whole => file.linear(&name, format),
                    part => file.part(&name, part, format),
                },
                vector,
            )?);
            loaded(i + 1, config.num_layers);
        }
        Self::assemble(config, embed, layers, norm, lm_head, device)?.with_format(format, device)
    }
}

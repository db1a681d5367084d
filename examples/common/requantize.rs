//! A GGUF file's matrices re-quantized by candle into another GGUF type (what
//! `llama-quantize` does), for measuring and testing the formats people download on the one
//! model whose weights are at hand.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;

/// The GGUF types by the names `llama-quantize` gives them.
pub const TYPES: [(&str, GgmlDType); 13] = [
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q5_0", GgmlDType::Q5_0),
    ("q5_1", GgmlDType::Q5_1),
    ("q8_0", GgmlDType::Q8_0),
    ("q2_k", GgmlDType::Q2K),
    ("q3_k", GgmlDType::Q3K),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
    ("f16", GgmlDType::F16),
    ("bf16", GgmlDType::BF16),
    ("f32", GgmlDType::F32),
];

/// The type named `name` (as in [`TYPES`]).
pub fn dtype(name: &str) -> Option<GgmlDType> {
    TYPES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|&(_, t)| t)
}

/// The type llama.cpp's quantizer falls back to for rows that are not a whole number of
/// `target`'s blocks (SmolLM2's width, 576, is not a multiple of a K-quant's 256).
pub fn fallback(target: GgmlDType) -> GgmlDType {
    match target {
        GgmlDType::Q2K | GgmlDType::Q3K | GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q5K => GgmlDType::Q5_1,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => other,
    }
}

/// Writes `src` to `dst` with every matrix in `target` (or its [`fallback`]); vectors keep
/// their type, metadata is copied.
///
/// # Errors
/// candle's, for unreadable files or failed quantization.
pub fn requantize(src: &Path, dst: &Path, target: GgmlDType) -> candle_core::Result<()> {
    let mut file = std::fs::File::open(src)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let q = content.tensor(&mut file, name, &Device::Cpu)?;
        let dims = q.shape().dims().to_vec();
        let requantized = match dims.as_slice() {
            [_, k] => {
                let dtype = if k.is_multiple_of(target.block_size()) {
                    target
                } else {
                    fallback(target)
                };
                QTensor::quantize(&q.dequantize(&Device::Cpu)?, dtype)?
            }
            _ => q,
        };
        tensors.push((name.clone(), requantized));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let part = dst.with_extension("gguf.part");
    let mut out = std::fs::File::create(&part)?;
    gguf_file::write(&mut out, &metadata, &tensors)?;
    std::fs::rename(&part, dst)?;
    Ok(())
}

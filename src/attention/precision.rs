//! How KV values are stored: the pool's element type, and the bytes every tier below it holds.

use candle_core::DType;

use super::codes::Codes;

/// How KV values are stored, in the device pool and in every tier below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvPrecision {
    /// IEEE half precision: half the bytes of f32, so twice the conversations per byte of
    /// every tier and half the bytes attention reads per step. The default (llama.cpp and
    /// vLLM keep 16-bit KV too); the attention kernel widens values to f32 exactly.
    #[default]
    F16,
    /// f32, as the model computes them.
    F32,
    /// bfloat16: f32's range in 16 bits, for models trained in it (on the CPU attention
    /// widens the pool to f32 on each read, so prefer f16 there).
    Bf16,
    /// 8 bits: llama.cpp's `q8_0` blocks (a scale per 32 values: 34 bytes where f16 takes 64),
    /// quantized once as each token's K and V are written and kept so in every tier (host,
    /// chunk files, Redis); attention reads the codes (the CPU kernel and the CUDA kernel).
    /// Heads in blocks of 32. On a GPU the codes are formed there as tokens are written (the
    /// host's bytes); the GPU path has run under the emulator only so far.
    Q8,
    /// 4 bits: llama.cpp's `q4_0` blocks (18 bytes per 32 values, 28% of f16), as
    /// [`KvPrecision::Q8`] otherwise.
    Q4,
}

impl KvPrecision {
    /// The pool's tensor type (`U8` for blocks of codes).
    pub fn dtype(self) -> DType {
        match self {
            KvPrecision::F16 => DType::F16,
            KvPrecision::F32 => DType::F32,
            KvPrecision::Bf16 => DType::BF16,
            KvPrecision::Q8 | KvPrecision::Q4 => DType::U8,
        }
    }

    /// Bytes of one head's K (or V) row of one token, for heads of `head_dim` values.
    pub fn head_row_bytes(self, head_dim: usize) -> usize {
        match self.codes() {
            Some(c) => c.row_bytes(head_dim),
            None => head_dim * self.dtype().size_in_bytes(),
        }
    }

    /// The blocks of codes it keeps, if it quantizes.
    pub(crate) fn codes(self) -> Option<Codes> {
        match self {
            KvPrecision::Q8 => Some(Codes::Q8),
            KvPrecision::Q4 => Some(Codes::Q4),
            _ => None,
        }
    }
}

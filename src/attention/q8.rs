//! KV in 8 bits: llama.cpp's `q8_0` blocks. Each head's row of `head_dim` values is cut into
//! blocks of [`QK`]; a block is its scale `d` (f16, little-endian) and [`QK`] signed codes,
//! value = `d · code`. A pool of this layout is a `U8` tensor `[n_slots, n_kv_heads,
//! row_bytes(head_dim)]`, and the bytes a tier holds (host, chunk files, Redis) are those
//! bytes: 34 per 32 values, 53% of f16.
//!
//! Quantizing is done once, when a token's K and V are written; the kernel reads the codes
//! and widens `d · code` in f32 (exact: one correctly rounded product), so every path, and the
//! reference that widens the whole pool first, sees the same values.

use candle_core::{DType, Tensor};
use half::f16;

use crate::{Error, Result};

/// Values per block.
pub(crate) const QK: usize = 32;
/// Bytes per block: the f16 scale, then the codes.
pub(crate) const BLOCK_BYTES: usize = 2 + QK;

/// Bytes of one head's row of `head_dim` values.
pub(crate) fn row_bytes(head_dim: usize) -> usize {
    head_dim / QK * BLOCK_BYTES
}

/// Whether heads of `head_dim` values cut into whole blocks.
pub(crate) fn fits(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(QK)
}

/// Appends `x` (whole blocks) as blocks, as llama.cpp's reference quantizer does: `d =
/// max|x| / 127`, codes `round(x / d)` (half away from zero) with the unrounded `d`, `d` kept
/// as f16.
pub(crate) fn quantize(x: &[f32], out: &mut Vec<u8>) {
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
}

/// The scale of the block at the start of `block`.
#[inline(always)]
pub(crate) fn scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// Appends the values of `bytes` (whole blocks).
pub(crate) fn dequantize(bytes: &[u8], out: &mut Vec<f32>) {
    for block in bytes.chunks_exact(BLOCK_BYTES) {
        let d = scale(block);
        out.extend(block[2..].iter().map(|&c| f32::from(c as i8) * d));
    }
}

/// A `U8` pool of `q8_0` rows widened to f32 `[n_slots, n_kv_heads, head_dim]`: how the paths
/// without a kernel of their own (the gather path, the reference) read it.
///
/// # Errors
/// [`Error::InvalidBatch`] if its rows are not whole blocks; [`Error::Candle`] on device errors.
pub(crate) fn widen(pool: &Tensor) -> Result<Tensor> {
    let (slots, heads, bytes) = pool.dims3()?;
    if !bytes.is_multiple_of(BLOCK_BYTES) {
        return Err(Error::InvalidBatch(format!(
            "a q8_0 pool's rows of {bytes} bytes are not whole blocks"
        )));
    }
    let head_dim = bytes / BLOCK_BYTES * QK;
    let codes = pool.flatten_all()?.to_vec1::<u8>()?;
    let mut values = Vec::with_capacity(slots * heads * head_dim);
    dequantize(&codes, &mut values);
    Ok(Tensor::from_vec(
        values,
        (slots, heads, head_dim),
        pool.device(),
    )?)
}

/// `pool` as the kernels without a `q8_0` reader take it: widened to f32 if it is `U8`.
pub(crate) fn readable(pool: &Tensor) -> Result<Tensor> {
    match pool.dtype() {
        DType::U8 => widen(pool),
        _ => Ok(pool.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_within_half_a_step_and_zeros_stay_zero() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let mut bytes = Vec::new();
        quantize(&x, &mut bytes);
        assert_eq!(bytes.len(), row_bytes(64));
        let mut back = Vec::new();
        dequantize(&bytes, &mut back);
        for (b, xs) in back.chunks(QK).zip(x.chunks(QK)) {
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (y, v) in b.iter().zip(xs) {
                // Half a step, plus the scale's f16 rounding over 127 steps.
                assert!((y - v).abs() <= amax / 127.0 * 0.57, "{y} {v}");
            }
        }
        let mut zeros = Vec::new();
        quantize(&[0.0; QK], &mut zeros);
        let mut z = Vec::new();
        dequantize(&zeros, &mut z);
        assert!(z.iter().all(|&v| v == 0.0));
        assert!(fits(64) && fits(256) && !fits(48) && !fits(0));
    }
}

//! KV in 8 and 4 bits: llama.cpp's `q8_0` and `q4_0` blocks. Each head's row of `head_dim`
//! values is cut into blocks of [`QK`]; a block is its scale `d` (f16, little-endian) and its
//! codes: `q8_0`, 32 signed bytes, value = `d · q` (34 bytes where f16 takes 64); `q4_0`, 16
//! bytes of two 4-bit codes each (values `j` and `j + 16` of the block in byte `j`'s low and
//! high nibble), value = `d · (q - 8)` (18 bytes). A pool of either is a `U8` tensor
//! `[n_slots, n_kv_heads, row bytes]`, and the bytes a tier holds (host, chunk files, Redis)
//! are those bytes.
//!
//! Quantizing is done once, when a token's K and V are written, after the turn ([`TURN`]) that
//! spreads a head's outliers (llama.cpp's, for heads of a multiple of 64); the kernel reads the
//! codes and widens `d · q` in f32 (exact: one correctly rounded product of exact operands), so
//! every path, and the reference that widens the whole pool first, sees the same values.

use candle_core::{DType, Tensor};
use half::f16;

use super::{Attend, Dims};
use crate::Result;

/// Values per block.
pub(crate) const QK: usize = 32;

/// A layout of KV codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codes {
    /// llama.cpp's `q8_0`.
    Q8,
    /// llama.cpp's `q4_0`.
    Q4,
}

impl Codes {
    /// Bytes per block: the f16 scale, then the codes.
    pub fn block_bytes(self) -> usize {
        match self {
            Codes::Q8 => 2 + QK,
            Codes::Q4 => 2 + QK / 2,
        }
    }

    /// Bytes of one head's row of `head_dim` values.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        head_dim / QK * self.block_bytes()
    }

    /// Whether heads of `head_dim` values cut into whole blocks.
    pub fn fits(head_dim: usize) -> bool {
        head_dim > 0 && head_dim.is_multiple_of(QK)
    }

    /// The layout whose rows for heads of `head_dim` take `row_bytes` bytes.
    pub fn of_row(head_dim: usize, row_bytes: usize) -> Option<Codes> {
        let fits = |c: Codes| Self::fits(head_dim) && c.row_bytes(head_dim) == row_bytes;
        [Codes::Q8, Codes::Q4].into_iter().find(|&c| fits(c))
    }

    /// Appends `x` (whole blocks) as blocks, as llama.cpp's reference quantizers do. `q8_0`:
    /// `d = max|x| / 127`, codes `round(x / d)`. `q4_0`: `d = m / -8` for `m` the value of
    /// largest magnitude, codes `min(15, trunc(x / d + 8.5))`. Both divide by the unrounded `d`
    /// and keep it as f16.
    pub fn quantize(self, x: &[f32], out: &mut Vec<u8>) {
        for block in x.chunks_exact(QK) {
            match self {
                Codes::Q8 => {
                    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
                }
                Codes::Q4 => {
                    let max = block.iter().fold(0f32, |m, &v| match v.abs() > m.abs() {
                        true => v,
                        false => m,
                    });
                    let d = max / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                    let (lo, hi) = block.split_at(QK / 2);
                    out.extend(lo.iter().zip(hi).map(|(&a, &b)| code(a) | code(b) << 4));
                }
            }
        }
    }

    /// Appends the values of `bytes` (whole blocks).
    pub fn dequantize(self, bytes: &[u8], out: &mut Vec<f32>) {
        for block in bytes.chunks_exact(self.block_bytes()) {
            let d = scale(block);
            let codes = &block[2..];
            match self {
                Codes::Q8 => out.extend(codes.iter().map(|&c| f32::from(c as i8) * d)),
                Codes::Q4 => {
                    let nibble = |q: u8| f32::from(q as i8 - 8) * d;
                    out.extend(codes.iter().map(|&c| nibble(c & 15)));
                    out.extend(codes.iter().map(|&c| nibble(c >> 4)));
                }
            }
        }
    }

    /// A `U8` pool of these codes for heads of `head_dim` widened to f32 `[n_slots,
    /// n_kv_heads, head_dim]`: how the paths without a reader of their own (the gather path,
    /// the reference) read it.
    ///
    /// # Errors
    /// [`crate::Error::Candle`] on device errors.
    pub fn widen(self, pool: &Tensor, head_dim: usize) -> Result<Tensor> {
        let (slots, heads, _) = pool.dims3()?;
        let codes = pool.flatten_all()?.to_vec1::<u8>()?;
        let mut values = Vec::with_capacity(slots * heads * head_dim);
        self.dequantize(&codes, &mut values);
        Ok(Tensor::from_vec(
            values,
            (slots, heads, head_dim),
            pool.device(),
        )?)
    }
}

/// Values per block of a head a pool of codes stores turned by the Walsh-Hadamard matrix
/// (heads of a multiple of 64 values), as llama.cpp does for a quantized cache: a few outlier
/// dimensions spread over the block, so that one block's scale no longer has to span them.
/// K and V are both turned in blocks of 64; the queries are turned as the keys (scores are
/// unchanged: the matrix is orthonormal) and the output turned back (it is its own inverse).
/// llama.cpp turns K in the largest power of two that divides the head; on Gemma 3 270M
/// (heads of 256) that lost more to 4-bit KV than blocks of 64 (perplexity +16.6% against
/// +12.7% over f16 KV; docs/BENCHMARKS.md).
pub(crate) const TURN: usize = 64;

/// Whether a pool of codes of heads of `head_dim` values stores them turned.
pub(crate) fn turned(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(TURN)
}

/// `t` (any shape whose last dimension is whole heads) with every block of [`TURN`] values
/// along its last dimension turned by the orthonormal Hadamard matrix.
///
/// # Errors
/// [`crate::Error::Candle`] on device errors.
fn turn(t: &Tensor) -> Result<Tensor> {
    let mut values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    turn_heads(&mut values);
    Ok(Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(t.dtype())?)
}

/// `attend` run on `q` turned as the pool `dims` describes turns its keys (if it holds codes
/// of turned heads), and its output turned back: the attention of `q` over the unturned K and
/// V, up to rounding.
///
/// # Errors
/// `attend`'s; [`crate::Error::Candle`] on device errors.
pub(crate) fn rotated<E: From<crate::Error>>(
    q: &Tensor,
    dims: Dims,
    attend: impl FnOnce(&Tensor) -> std::result::Result<Tensor, E>,
) -> std::result::Result<Tensor, E> {
    match dims.codes.is_some() && turned(dims.head_dim) {
        true => Ok(turn(&attend(&turn(q)?)?)?),
        false => attend(q),
    }
}

/// The queries and the call the paths that read values (the gather path, the reference, the
/// CUDA kernel) take over a pool of `q8_0` codes, so that they score as the CPU kernel scores
/// in integers (`cpu/codes.rs`, llama.cpp's CPU path for a quantized K cache): `q` times the
/// call's scale, in blocks of 32 quantized to 8 bits as the matmuls quantize activations
/// ([`crate::cpu::quantize_block`]) and widened back (`a · s`, in f32), under a scale of 1.
/// Over other pools (`q4_0` included: its keys meet f32 queries), `q` and `how` as they are.
///
/// # Errors
/// [`crate::Error::Candle`] on device errors.
pub(crate) fn scored_as_codes<'a>(
    q: &Tensor,
    dims: Dims,
    how: Attend<'a>,
) -> Result<(Tensor, Attend<'a>)> {
    if dims.codes != Some(Codes::Q8) {
        return Ok((q.clone(), how));
    }
    let mut values = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let isa = crate::cpu::Isa::detect();
    let mut codes = [0i8; QK];
    for block in values.chunks_exact_mut(QK) {
        block.iter_mut().for_each(|v| *v *= how.scale);
        let Ok(x) = <&[f32; QK]>::try_from(&*block) else {
            continue;
        };
        let (s, _) = crate::cpu::quantize_block(isa, x, &mut codes);
        for (v, &a) in block.iter_mut().zip(&codes) {
            *v = f32::from(a) * s;
        }
    }
    let q = Tensor::from_vec(values, q.shape(), q.device())?.to_dtype(q.dtype())?;
    Ok((q, Attend { scale: 1.0, ..how }))
}

/// Turns every block of [`TURN`] values of `values` (whole heads) by the Hadamard matrix, in
/// place: how a pool's rows are stored, and turned back (the matrix is its own inverse).
pub(crate) fn turn_heads(values: &mut [f32]) {
    values.chunks_exact_mut(TURN).for_each(hadamard);
}

/// Turns `x` (a power of two of values) by the orthonormal Walsh-Hadamard matrix of its size
/// (Sylvester's: entries `±1/sqrt(n)`, its own inverse), in place: the fast transform's
/// butterflies in a fixed order, then the scale.
fn hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= scale);
}

/// The scale of the block at the start of `block`.
#[inline(always)]
pub(crate) fn scale(block: &[u8]) -> f32 {
    f16::from_le_bytes([block[0], block[1]]).to_f32()
}

/// `pool` as the paths without a reader of codes take it: widened to f32 if it holds
/// `codes` (heads of `head_dim`).
pub(crate) fn readable(pool: &Tensor, codes: Option<Codes>, head_dim: usize) -> Result<Tensor> {
    match (codes, pool.dtype()) {
        (Some(c), DType::U8) => c.widen(pool, head_dim),
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
        // The most a value moves, in steps of the block's scale: half a step and the scale's
        // f16 rounding; `q4_0` clips the side opposite its largest value at 7 steps (one more).
        for (codes, steps, most) in [(Codes::Q8, 127.0, 0.57), (Codes::Q4, 8.0, 1.07)] {
            let mut bytes = Vec::new();
            codes.quantize(&x, &mut bytes);
            assert_eq!(bytes.len(), codes.row_bytes(64));
            assert_eq!(Codes::of_row(64, bytes.len()), Some(codes));
            let mut back = Vec::new();
            codes.dequantize(&bytes, &mut back);
            for (b, xs) in back.chunks(QK).zip(x.chunks(QK)) {
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (y, v) in b.iter().zip(xs) {
                    assert!((y - v).abs() <= amax / steps * most, "{codes:?}: {y} {v}");
                }
            }
            let mut zeros = Vec::new();
            codes.quantize(&[0.0; QK], &mut zeros);
            let mut z = Vec::new();
            codes.dequantize(&zeros, &mut z);
            assert!(z.iter().all(|&v| v == 0.0));
        }
        assert!(Codes::fits(64) && Codes::fits(256) && !Codes::fits(48) && !Codes::fits(0));
        assert_eq!(Codes::of_row(64, 128), None);
    }

    #[test]
    fn the_turn_is_orthonormal_and_its_own_inverse() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        for n in [64, 128, 256] {
            let mut y = x[..n].to_vec();
            hadamard(&mut y);
            let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((norm(&y) / norm(&x[..n]) - 1.0).abs() < 1e-5);
            // Row 0 of the matrix is the mean's direction.
            let sum: f32 = x[..n].iter().sum();
            assert!((y[0] - sum / (n as f32).sqrt()).abs() < 1e-3);
            hadamard(&mut y);
            for (a, b) in y.iter().zip(&x[..n]) {
                assert!((a - b).abs() < 1e-4, "{a} {b}");
            }
        }
        assert!(turned(64) && turned(128) && turned(256) && turned(192));
        assert!(!turned(96) && !turned(32) && !turned(0));
    }
}

//! Re-laying a conversation's KV after the span `cut` of its history is dropped (context
//! overflow, AttentionStore §3.5): every later token moves `cut.len()` positions back, across
//! chunk boundaries, and its key is rotated back by as many positions. RoPE rotates each pair
//! of a key's dimensions by `position * frequency`, and rotations compose, so turning a cached
//! key by `-cut.len() * frequency` gives the key of the same content at its new position
//! without the model. Values carry no position and move as they are.

use std::ops::Range;

use candle_core::DType;
use half::{bf16, f16};

use super::{unsupported, KvPool};
use crate::attention::codes::{turn_heads, Codes};
use crate::Result;

/// RoPE's rotation of a key by a fixed number of positions.
#[derive(Clone, Debug)]
pub struct KeyRotation {
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Pairs `(2i, 2i+1)` rather than `(i, i + d/2)`.
    interleaved: bool,
}

impl KeyRotation {
    /// The rotation by `delta` positions of keys embedded with inverse frequencies `inv_freq`
    /// (`head_dim / 2` of them).
    pub fn new(inv_freq: &[f32], interleaved: bool, delta: i64) -> Self {
        // In f64: the angle of a long shift is large, and its rounding would turn every key.
        let angles: Vec<f64> = inv_freq.iter().map(|&f| delta as f64 * f as f64).collect();
        Self {
            cos: angles.iter().map(|a| a.cos() as f32).collect(),
            sin: angles.iter().map(|a| a.sin() as f32).collect(),
            interleaved,
        }
    }

    /// Dimensions per head.
    fn head_dim(&self) -> usize {
        2 * self.cos.len()
    }

    /// Rotates one head's key in place.
    fn apply(&self, head: &mut [f32]) {
        let half = self.cos.len();
        for i in 0..half {
            let (a, b) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x, y) = (head[a], head[b]);
            head[a] = x * self.cos[i] - y * self.sin[i];
            head[b] = y * self.cos[i] + x * self.sin[i];
        }
    }
}

impl KvPool {
    /// The chunks from index `first` on of a history from which positions `cut` were
    /// dropped, holding its first `computed` tokens, built from `old`: the bytes of the
    /// chunks from `first` on before the cut (as [`Self::read_slots`] lays them out; `None`
    /// where a chunk's KV is gone). Each token comes from its old place, its keys turned by
    /// its layer's rotation in `rotations` (which should be by `-cut.len()` positions) when it
    /// moved. A new chunk is `None` when one of its tokens' old KV is gone.
    ///
    /// # Errors
    /// [`crate::Error::InvalidBatch`] for a pool type other than f32, f16, bf16 and codes, or
    /// rotations of another head size or layer count than the pool's.
    pub fn shift_chunks(
        &self,
        first: usize,
        chunk: usize,
        old: &[Option<&[u8]>],
        cut: Range<usize>,
        computed: usize,
        rotations: &[KeyRotation],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let dtype = self.dtype();
        let width = dtype.size_in_bytes();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::U8) {
            return Err(unsupported(dtype));
        }
        let layers = self.k.len();
        // Rotations turn values: a q8_0 row's are widened, turned and quantized again.
        let values = self.values;
        let fits = |r: &KeyRotation| r.head_dim() > 0 && values.is_multiple_of(r.head_dim());
        if rotations.len() != layers || !rotations.iter().all(fits) {
            return Err(crate::Error::InvalidBatch(format!(
                "{} rotations (heads of {:?}) do not fit {layers} layers of rows of {}",
                rotations.len(),
                rotations.first().map(KeyRotation::head_dim),
                self.row
            )));
        }
        let row_bytes = self.row_bytes();
        let token_bytes = self.token_bytes();
        let old_len = |c: &[u8]| c.len() / token_bytes.max(1);
        let mut scratch = Vec::with_capacity(values);
        let mut out = Vec::new();
        for j in first..computed.div_ceil(chunk) {
            let len = (computed - j * chunk).min(chunk);
            let mut bytes = vec![0u8; len * token_bytes];
            let mut whole = true;
            for o in 0..len {
                let p = j * chunk + o;
                let q = if p < cut.start { p } else { p + cut.len() };
                let src = old
                    .get(q / chunk - first)
                    .copied()
                    .flatten()
                    .filter(|c| q % chunk < old_len(c));
                let Some(src) = src else {
                    whole = false;
                    break;
                };
                let (src_len, qo) = (old_len(src), q % chunk);
                for (l, rotation) in rotations.iter().enumerate() {
                    let head = rotation.head_dim();
                    for part in 0..2 {
                        let at = |n: usize, i: usize| ((l * 2 + part) * n + i) * row_bytes;
                        let from = &src[at(src_len, qo)..at(src_len, qo) + row_bytes];
                        let to = &mut bytes[at(len, o)..at(len, o) + row_bytes];
                        to.copy_from_slice(from);
                        if part == 0 && q != p {
                            load(to, dtype, self.codes, &mut scratch);
                            // Keys stored turned (codes) are turned back for RoPE, then again.
                            let turn = |s: &mut Vec<f32>| {
                                if self.turned {
                                    turn_heads(s);
                                }
                            };
                            turn(&mut scratch);
                            scratch
                                .chunks_exact_mut(head)
                                .for_each(|h| rotation.apply(h));
                            turn(&mut scratch);
                            store(&scratch, dtype, self.codes, to);
                        }
                    }
                }
            }
            debug_assert_eq!(bytes.len() % width, 0);
            out.push(whole.then_some(bytes));
        }
        Ok(out)
    }
}

/// Widens a row of little-endian values of `dtype` (or blocks of `codes`) into `out`,
/// replacing what it held.
fn load(bytes: &[u8], dtype: DType, codes: Option<Codes>, out: &mut Vec<f32>) {
    out.clear();
    if let Some(c) = codes {
        return c.dequantize(bytes, out);
    }
    match dtype {
        DType::F16 => {
            out.extend((bytes.chunks_exact(2)).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()))
        }
        DType::BF16 => {
            out.extend((bytes.chunks_exact(2)).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()))
        }
        _ => out
            .extend((bytes.chunks_exact(4)).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
    }
}

/// Narrows `values` back into a row of little-endian values of `dtype` (or blocks of `codes`).
fn store(values: &[f32], dtype: DType, codes: Option<Codes>, bytes: &mut [u8]) {
    if let Some(c) = codes {
        let mut out = Vec::with_capacity(bytes.len());
        c.quantize(values, &mut out);
        return bytes.copy_from_slice(&out);
    }
    match dtype {
        DType::F16 => bytes
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(b, v)| b.copy_from_slice(&f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => bytes
            .chunks_exact_mut(2)
            .zip(values)
            .for_each(|(b, v)| b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        _ => bytes
            .chunks_exact_mut(4)
            .zip(values)
            .for_each(|(b, v)| b.copy_from_slice(&v.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::attention::KvShape;

    const SHAPE: KvShape = KvShape {
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 8,
    };

    fn inv_freq() -> Vec<f32> {
        (0..4)
            .map(|i| 1.0 / 10_000f32.powf(i as f32 / 4.0))
            .collect()
    }

    /// Keys of `content` (per token, one row) embedded at `positions` with candle's RoPE.
    fn embed(content: &Tensor, positions: &[u32], interleaved: bool) -> Tensor {
        let f = Tensor::new(inv_freq(), &Device::Cpu).unwrap();
        let p = Tensor::new(positions, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let angles = p
            .unsqueeze(1)
            .unwrap()
            .broadcast_mul(&f.unsqueeze(0).unwrap());
        let angles = angles.unwrap().reshape((positions.len(), 1, 4)).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let x = content.reshape((positions.len(), 2, 1, 8)).unwrap();
        let y = if interleaved {
            candle_nn::rotary_emb::rope_i(&x, &cos, &sin).unwrap()
        } else {
            candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap()
        };
        y.reshape((positions.len(), 2, 8)).unwrap()
    }

    #[test]
    fn moved_keys_equal_keys_embedded_at_their_new_positions() {
        let (chunk, n, cut) = (4usize, 13usize, 3..9usize);
        for interleaved in [false, true] {
            let pool =
                KvPool::new(SHAPE, 32, crate::attention::KvPrecision::F32, &Device::Cpu).unwrap();
            let content = Tensor::randn(0f32, 1.0, (n, 16), &Device::Cpu).unwrap();
            let value = Tensor::randn(0f32, 1.0, (n, 2, 8), &Device::Cpu).unwrap();
            let old_pos: Vec<u32> = (0..n as u32).collect();
            let keys = embed(&content, &old_pos, interleaved);
            let index = pool.write_index(&old_pos, &Device::Cpu).unwrap();
            for layer in 0..2 {
                pool.write(layer, &index, &keys, &value).unwrap();
            }
            let chunks: Vec<Vec<u8>> = (0..n.div_ceil(chunk))
                .map(|c| {
                    pool.read_slots(c * chunk, (n - c * chunk).min(chunk))
                        .unwrap()
                })
                .collect();
            // Chunk 0 is untouched by the cut; the rest start at chunk 0 of `old` anyway.
            let old: Vec<Option<&[u8]>> = chunks.iter().map(|c| Some(c.as_slice())).collect();
            let rotation: Vec<KeyRotation> = (0..2)
                .map(|_| KeyRotation::new(&inv_freq(), interleaved, -(cut.len() as i64)))
                .collect();
            let kept = n - cut.len();
            let new = pool
                .shift_chunks(0, chunk, &old, cut.clone(), kept, &rotation)
                .unwrap();
            assert_eq!(new.len(), kept.div_ceil(chunk));
            let target =
                KvPool::new(SHAPE, 32, crate::attention::KvPrecision::F32, &Device::Cpu).unwrap();
            for (c, bytes) in new.iter().enumerate() {
                target
                    .write_slots(c * chunk, bytes.as_ref().unwrap())
                    .unwrap();
            }
            // The reference: the kept tokens' content embedded at 0..kept.
            let keep: Vec<u32> = (0..n as u32)
                .filter(|p| !cut.contains(&(*p as usize)))
                .collect();
            let idx = Tensor::new(keep.as_slice(), &Device::Cpu).unwrap();
            let want_k = embed(
                &content.index_select(&idx, 0).unwrap(),
                &old_pos[..kept],
                interleaved,
            );
            let want_v = value.index_select(&idx, 0).unwrap();
            for layer in 0..2 {
                let (k, v) = target.layer(layer).unwrap();
                let dk = (k.narrow(0, 0, kept).unwrap() - &want_k)
                    .unwrap()
                    .abs()
                    .unwrap();
                let dk: f32 = dk.max_all().unwrap().to_scalar().unwrap();
                assert!(dk < 1e-4, "key error {dk}");
                let dv = (v.narrow(0, 0, kept).unwrap() - &want_v)
                    .unwrap()
                    .abs()
                    .unwrap();
                assert_eq!(dv.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
            }
            // A gone chunk leaves the new chunks that need it gone, and only those.
            // New chunk 0 holds old positions 0..3 and 9, chunk 1 old 10..13: losing old
            // chunk 3 (position 12) loses new chunk 1 only.
            let mut holed = old.clone();
            holed[3] = None;
            let new = pool
                .shift_chunks(0, chunk, &holed, cut.clone(), kept, &rotation)
                .unwrap();
            assert!(new[0].is_some());
            assert!(new[1].is_none());
        }
    }

    #[test]
    fn moved_keys_stored_in_8_bits_are_turned_back_for_rope_and_again() {
        let shape = KvShape {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 64,
        };
        let inv: Vec<f32> = (0..32)
            .map(|i| 1.0 / 10_000f32.powf(i as f32 / 32.0))
            .collect();
        let (chunk, n, cut) = (4usize, 12usize, 2..6usize);
        let content: Vec<f32> = (0..n * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        // A key of content row `row` embedded at position `p`.
        let at = |row: usize, p: usize| {
            let mut k = content[row * 64..][..64].to_vec();
            KeyRotation::new(&inv, false, p as i64).apply(&mut k);
            k
        };
        let keys: Vec<f32> = (0..n).flat_map(|p| at(p, p)).collect();
        let keys = Tensor::from_vec(keys, (n, 1, 64), &Device::Cpu).unwrap();
        let kv = crate::attention::KvPrecision::Q8;
        let pool = KvPool::new(shape, 16, kv, &Device::Cpu).unwrap();
        let slots: Vec<u32> = (0..n as u32).collect();
        let index = pool.write_index(&slots, &Device::Cpu).unwrap();
        pool.write(0, &index, &keys, &keys).unwrap();
        let chunks: Vec<Vec<u8>> = (0..n.div_ceil(chunk))
            .map(|c| pool.read_slots(c * chunk, chunk).unwrap())
            .collect();
        let old: Vec<Option<&[u8]>> = chunks.iter().map(|c| Some(c.as_slice())).collect();
        let kept = n - cut.len();
        let back = [KeyRotation::new(&inv, false, -(cut.len() as i64))];
        let new = (pool.shift_chunks(0, chunk, &old, cut.clone(), kept, &back)).unwrap();
        let row = kv.head_row_bytes(64);
        for (c, bytes) in new.iter().enumerate() {
            let bytes = bytes.as_ref().unwrap();
            let len = bytes.len() / (2 * row);
            for (o, k) in bytes[..len * row].chunks_exact(row).enumerate() {
                let p = c * chunk + o;
                let q = if p < cut.start { p } else { p + cut.len() };
                let mut got = Vec::new();
                Codes::Q8.dequantize(k, &mut got);
                turn_heads(&mut got);
                let want = at(q, p);
                let err = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                // Quantized twice, each within half a step of 1/127 of the turned key.
                assert!(err < 0.03, "token {p} (was {q}): {err}");
            }
        }
    }
}

//! GGUF block layouts (as llama.cpp's `ggml-common.h` defines them), read into the codes and
//! factors of the integer kernel's forms.

use candle_core::quantized::GgmlDType;
use half::f16;

use super::quant::{Bits, Form, QuantWeights, RawBlock, QK, SUPER};
use super::{ReadBytes, NR};
use crate::model::gguf::GgufType;
use crate::{Error, Result};

/// How one GGUF type is read: its bytes per block of `values` weights, the kernel's code
/// width and form, and how block `sub` (of 32 values) of a file block fills a [`RawBlock`].
struct Layout {
    block: usize,
    values: usize,
    bits: Bits,
    form: Form,
    read: fn(&[u8], usize, &mut RawBlock),
}

/// The layout of `dtype`, if the integer kernel keeps it.
fn layout(dtype: GgufType) -> Option<Layout> {
    let GgufType::Ggml(dtype) = dtype else {
        return Some(Layout {
            block: 17,
            values: QK,
            bits: Bits::Fp4,
            form: Form::Exponent,
            read: mxfp4,
        });
    };
    let (block, values, bits, form, read): (_, _, _, _, fn(&[u8], usize, &mut RawBlock)) =
        match dtype {
            GgmlDType::Q4_0 => (18, QK, Bits::Four, Form::Block, q4_0),
            GgmlDType::Q4_1 => (20, QK, Bits::Four, Form::Block, q4_1),
            GgmlDType::Q5_0 => (22, QK, Bits::Five, Form::Block, q5_0),
            GgmlDType::Q5_1 => (24, QK, Bits::Five, Form::Block, q5_1),
            GgmlDType::Q8_0 => (34, QK, Bits::Eight, Form::Block, q8_0),
            GgmlDType::Q4K => (144, QK * SUPER, Bits::Four, Form::Super, q4_k),
            GgmlDType::Q5K => (176, QK * SUPER, Bits::Five, Form::Super, q5_k),
            GgmlDType::Q6K => (210, QK * SUPER, Bits::Six, Form::Halves, q6_k),
            _ => return None,
        };
    Some(Layout {
        block,
        values,
        bits,
        form,
        read,
    })
}

/// Whether the integer kernel keeps `dtype`'s codes.
pub(super) fn keeps(dtype: GgufType) -> bool {
    layout(dtype).is_some()
}

/// Packs the `[n, k]` matrix of GGUF type `dtype` in its codes, its bytes read a panel of
/// rows at a time through `read`.
///
/// # Errors
/// [`Error::InvalidModel`] for a type the kernel does not keep, a row that is not a whole
/// number of blocks, or factors out of their type's range; `read`'s errors.
pub(super) fn pack(
    dtype: GgufType,
    n: usize,
    k: usize,
    read: &mut ReadBytes,
) -> Result<QuantWeights> {
    let bad = |why: String| Error::invalid_model("packed weights", why);
    let l = layout(dtype).ok_or_else(|| bad(format!("{dtype:?} is not kept in its codes")))?;
    if !k.is_multiple_of(l.values) {
        return Err(bad(format!("{dtype:?} rows of {k}: not whole blocks")));
    }
    let row_bytes = k / l.values * l.block;
    let per = l.values / QK;
    let mut slab = Slab::new(n, row_bytes);
    QuantWeights::pack(n, k, l.bits, l.form, |row, b, out| {
        let bytes = slab.row(row, read)?;
        (l.read)(&bytes[(b / per) * l.block..][..l.block], b % per, out);
        Ok(())
    })
}

/// The rows of one panel of a matrix, read as the packer reaches them.
pub(super) struct Slab {
    n: usize,
    row_bytes: usize,
    first: Option<usize>,
    bytes: Vec<u8>,
}

impl Slab {
    pub(super) fn new(n: usize, row_bytes: usize) -> Self {
        Self {
            n,
            row_bytes,
            first: None,
            bytes: Vec::new(),
        }
    }

    /// Row `row`'s bytes, reading its panel's rows first if they are not held.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if `read` returns fewer bytes than asked; `read`'s errors.
    pub(super) fn row(&mut self, row: usize, read: &mut ReadBytes) -> Result<&[u8]> {
        let first = row - row % NR;
        if self.first != Some(first) {
            let len = NR.min(self.n - first) * self.row_bytes;
            read(first * self.row_bytes, len, &mut self.bytes)?;
            if self.bytes.len() < len {
                return Err(Error::invalid_model("packed weights", "tensor data short"));
            }
            self.first = Some(first);
        }
        Ok(&self.bytes[(row - first) * self.row_bytes..][..self.row_bytes])
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The 32 codes of a block whose 16 bytes `qs` hold values `j` and `j + 16` in the low and
/// high nibbles of byte `j`, with a fifth bit `l` at bit `l` of `high` where there is one.
fn nibbles(qs: &[u8], high: u32, out: &mut RawBlock) {
    for (j, &q) in qs.iter().enumerate().take(QK / 2) {
        out.codes[j] = q & 0x0F | ((high >> j) as u8 & 1) << 4;
        out.codes[j + QK / 2] = q >> 4 | ((high >> (j + QK / 2)) as u8 & 1) << 4;
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// `d`, 16 bytes of nibbles: `w = d · (q − 8)`.
fn q4_0(b: &[u8], _: usize, out: &mut RawBlock) {
    nibbles(&b[2..18], 0, out);
    out.d = f16_at(b, 0);
    out.m = -8.0 * out.d;
}

/// `d`, `m`, 16 bytes of nibbles: `w = d · q + m`.
fn q4_1(b: &[u8], _: usize, out: &mut RawBlock) {
    nibbles(&b[4..20], 0, out);
    (out.d, out.m) = (f16_at(b, 0), f16_at(b, 2));
}

/// `d`, 32 fifth bits, nibbles: `w = d · (q − 16)`.
fn q5_0(b: &[u8], _: usize, out: &mut RawBlock) {
    nibbles(&b[6..22], u32_at(b, 2), out);
    out.d = f16_at(b, 0);
    out.m = -16.0 * out.d;
}

/// `d`, `m`, 32 fifth bits, nibbles: `w = d · q + m`.
fn q5_1(b: &[u8], _: usize, out: &mut RawBlock) {
    nibbles(&b[8..24], u32_at(b, 4), out);
    (out.d, out.m) = (f16_at(b, 0), f16_at(b, 2));
}

/// The E8M0 exponent `e`, 16 bytes of E2M1 nibbles (as `Q4_0`'s): `w = FP4(q) · 2^(e − 127)`,
/// kept as the nibbles and the exponent (see [`super::quant::Factors::Exponent`]).
fn mxfp4(b: &[u8], _: usize, out: &mut RawBlock) {
    nibbles(&b[1..17], 0, out);
    out.sub[0] = i32::from(b[0]);
}

/// `d`, 32 signed bytes: `w = d · q`.
fn q8_0(b: &[u8], _: usize, out: &mut RawBlock) {
    out.codes.copy_from_slice(&b[2..34]);
    (out.d, out.m) = (f16_at(b, 0), 0.0);
}

/// The 6-bit scale and min of sub-block `j` of a `Q4_K`/`Q5_K` super-block's 12 bytes.
fn scale_min(s: &[u8], j: usize) -> (i32, i32) {
    let (sc, mn) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            s[j + 4] & 0x0F | (s[j - 4] >> 6) << 4,
            s[j + 4] >> 4 | (s[j] >> 6) << 4,
        )
    };
    (i32::from(sc), i32::from(mn))
}

/// `d`, `dmin`, 12 bytes of scales and mins, 128 bytes of nibbles (sub-blocks `2i` and
/// `2i + 1` in the low and high nibbles of bytes `32i..32i + 32`):
/// `w = d · sc · q − dmin · mn`.
fn q4_k(b: &[u8], sub: usize, out: &mut RawBlock) {
    let qs = &b[16 + 32 * (sub / 2)..][..QK];
    for (code, &q) in out.codes.iter_mut().zip(qs) {
        *code = if sub.is_multiple_of(2) {
            q & 0x0F
        } else {
            q >> 4
        };
    }
    k_factors(b, sub, out);
}

/// As `Q4_K`, with the fifth bit of value `l` of sub-block `s` at bit `s` of byte `l` of 32
/// bytes after the scales.
fn q5_k(b: &[u8], sub: usize, out: &mut RawBlock) {
    let (qh, qs) = (&b[16..48], &b[48 + 32 * (sub / 2)..][..QK]);
    for ((code, &q), &h) in out.codes.iter_mut().zip(qs).zip(qh) {
        let low = if sub.is_multiple_of(2) {
            q & 0x0F
        } else {
            q >> 4
        };
        *code = low | (h >> sub & 1) << 4;
    }
    k_factors(b, sub, out);
}

fn k_factors(b: &[u8], sub: usize, out: &mut RawBlock) {
    let (sc, mn) = scale_min(&b[4..16], sub);
    (out.d, out.m, out.sub) = (f16_at(b, 0), -f16_at(b, 2), [sc, mn]);
}

/// 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales (one per 16 values), `d`:
/// `w = d · sc · (q − 32)`. Value `v`: half `v / 128`, quarter `(v % 128) / 32`, lane `v % 32`.
fn q6_k(b: &[u8], sub: usize, out: &mut RawBlock) {
    let (half, quarter) = (sub / 4, sub % 4);
    let ql = &b[64 * half + 32 * (quarter % 2)..][..QK];
    let qh = &b[128 + 32 * half..][..QK];
    for ((code, &l), &h) in out.codes.iter_mut().zip(ql).zip(qh) {
        let low = if quarter < 2 { l & 0x0F } else { l >> 4 };
        *code = low | (h >> (2 * quarter) & 3) << 4;
    }
    let scale = |i: usize| i32::from(b[192 + i] as i8);
    out.sub = [scale(2 * sub), scale(2 * sub + 1)];
    (out.d, out.m) = (f16_at(b, 208), 0.0);
}

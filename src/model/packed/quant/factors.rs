//! How a block's codes become weights: the factors of each form, stored per panel.

use half::f16;

use super::QK;
use crate::model::packed::NR;

/// How a block's codes become weights (see the module's formulas). Layouts: `[panel][block]
/// [NR]` per block, `[panel][super-block][NR]` per super-block, `[panel][block][half][NR]`
/// per half.
#[derive(Debug)]
pub(in crate::model::packed) enum Factors {
    /// `w = q · d + m`, f16 `d`, `m` per block (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`).
    Block { d: Vec<f16>, m: Vec<f16> },
    /// `w = q · (D · sc) + M · mn`, 6-bit `sc`, `mn` per block and f32 `D`, `M` per
    /// super-block (`Q4_K`, `Q5_K`).
    Super {
        d: Vec<f32>,
        m: Vec<f32>,
        sc: Vec<u8>,
        mn: Vec<u8>,
    },
    /// `w = D · sc_h · (q − 32)`, an 8-bit `sc_h` per 16 values and f32 `D` per super-block
    /// (`Q6_K`).
    Halves { d: Vec<f32>, sc: Vec<i8> },
    /// `w = (q − 12) · 2^(e − 128)`, an E8M0 exponent `e` per block and codes read through
    /// [`FP4`] (MXFP4): the per-block form with `d = 2^(e − 128)` and `m = −12 d`, both
    /// computed exactly from the byte, so a packed block takes the file's 17 bytes.
    Exponent { e: Vec<u8> },
}

/// The E2M1 values of an MXFP4 nibble, doubled to integers and offset by 12 so that they are
/// unsigned (the first operand of `vpdpbusd` and `vpmaddubsw`): nibble `s eem` is
/// `(−1)^s · {0, 0.5, 1, 1.5, 2, 3, 4, 6}[eem]`.
pub(in crate::model::packed) const FP4: [u8; 16] =
    [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

/// `d = 2^(e − 128)` of an E8M0 exponent, built from its bits: `e << 23` is `2^(e − 127)` as
/// an f32 (0 for `e = 0`, whose `2^-128` no weight needs), halved exactly. Every path computes
/// it so, bit for bit.
pub(in crate::model::packed) fn exponent_scale(e: u8) -> f32 {
    f32::from_bits(u32::from(e) << 23) * 0.5
}

impl Factors {
    /// All-zero factors of `form` for `per_block` blocks and `per_super` super-blocks (each
    /// times `NR` rows).
    pub(super) fn zeros(form: Form, per_block: usize, per_super: usize) -> Self {
        match form {
            Form::Block => Factors::Block {
                d: vec![f16::ZERO; per_block],
                m: vec![f16::ZERO; per_block],
            },
            Form::Super => Factors::Super {
                d: vec![0.0; per_super],
                m: vec![0.0; per_super],
                sc: vec![0; per_block],
                mn: vec![0; per_block],
            },
            Form::Halves => Factors::Halves {
                d: vec![0.0; per_super],
                sc: vec![0; 2 * per_block],
            },
            Form::Exponent => Factors::Exponent {
                e: vec![0; per_block],
            },
        }
    }

    /// Stores `raw`'s factors as those of block `pb` (of its panel's blocks), row `c` of the
    /// panel, in super-block entry `sb`; why not, when one does not fit its type.
    pub(super) fn set(
        &mut self,
        raw: &RawBlock,
        pb: usize,
        c: usize,
        sb: usize,
    ) -> Result<(), String> {
        match self {
            Factors::Block { d, m } => {
                let (hd, hm) = (f16::from_f32(raw.d), f16::from_f32(raw.m));
                if hd.to_f32() != raw.d || hm.to_f32() != raw.m {
                    return Err(format!("block factors {} {} overflow f16", raw.d, raw.m));
                }
                d[pb * NR + c] = hd;
                m[pb * NR + c] = hm;
            }
            Factors::Super { d, m, sc, mn } => {
                (d[sb], m[sb]) = (raw.d, raw.m);
                let six = |v: i32| u8::try_from(v).ok().filter(|&v| v < 64);
                match (six(raw.sub[0]), six(raw.sub[1])) {
                    (Some(s), Some(n)) => (sc[pb * NR + c], mn[pb * NR + c]) = (s, n),
                    _ => return Err(format!("sub-scales {:?}", raw.sub)),
                }
            }
            Factors::Halves { d, sc } => {
                d[sb] = raw.d;
                for h in 0..2 {
                    sc[(2 * pb + h) * NR + c] = i8::try_from(raw.sub[h])
                        .map_err(|_| format!("sub-scales {:?}", raw.sub))?;
                }
            }
            Factors::Exponent { e } => {
                // 255 is E8M0's NaN.
                e[pb * NR + c] = u8::try_from(raw.sub[0])
                    .ok()
                    .filter(|&v| v < 255)
                    .ok_or_else(|| format!("E8M0 exponent {}", raw.sub[0]))?;
            }
        }
        Ok(())
    }
}

/// Which of [`Factors`] a format packs into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::model::packed) enum Form {
    Block,
    Super,
    Halves,
    Exponent,
}

/// One block of one weight row as read from the file.
pub(in crate::model::packed) struct RawBlock {
    /// Codes in `k` order: `0..2^bits` unsigned, two's-complement bytes for [`Bits::Eight`].
    pub(in crate::model::packed) codes: [u8; QK],
    /// [`Form::Block`]: the block's `d` and `m`; the others: the super-block's `D` and `M`.
    pub(in crate::model::packed) d: f32,
    pub(in crate::model::packed) m: f32,
    /// [`Form::Super`]: `sc` and `mn`; [`Form::Halves`]: the two halves' scales;
    /// [`Form::Exponent`]: the exponent byte, first.
    pub(in crate::model::packed) sub: [i32; 2],
}

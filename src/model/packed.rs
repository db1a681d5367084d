//! Packed linear weights and the one matmul every pass runs on the CPU, whatever its row count.
//!
//! `y = x · Wᵀ` for `x: [m, k]` (f32) and `W: [n, k]`. The weights are repacked at load into
//! panels of [`NR`] output columns, in about the bytes of the file. GGUF `Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K` and `Q6_K` keep their codes and scales and run the
//! integer kernel of `quant`: activations quantized to 8 bits per 32 values, integer dot
//! products per block (AVX-512 VNNI, AVX2, NEON `sdot`, or scalar). Float weights keep their type (f32,
//! f16, bf16) and run the FMA kernel of `float`, widened as they load; the GGUF types neither
//! kernel keeps (`Q2_K`, `Q3_K`) are dequantized to f32.
//!
//! **Batch invariance.** In both kernels an output `y[r][c]` depends on row `r` of `x` and the
//! weights only, through a sequence of operations fixed by `k`: neither the row count, a row's
//! place in its tile, the thread split (by column panels) nor the vector width changes it. A
//! row's outputs are bit-identical whether it runs alone or beside 1..N other rows, and every
//! instruction path gives the same bits as the scalar one.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;
use half::f16;
use rayon::prelude::*;

use crate::model::gguf::GgufType;
use crate::{Error, Result};

/// `$tile::<R, P>(args)` for a register tile of `$rows` rows spanning `$panels` panels (the
/// shapes [`tile_width`] hands out), in every kernel's vector paths.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! tile_shapes {
    ($rows:expr, $panels:expr, $tile:ident $(<$ty:ty>)? ($($arg:expr),*)) => {
        match ($rows, $panels) {
            (1, 4) => $tile::<$($ty,)? 1, 4>($($arg),*),
            (1, 2) => $tile::<$($ty,)? 1, 2>($($arg),*),
            (2, 2) => $tile::<$($ty,)? 2, 2>($($arg),*),
            (3, 2) => $tile::<$($ty,)? 3, 2>($($arg),*),
            (1, _) => $tile::<$($ty,)? 1, 1>($($arg),*),
            (2, _) => $tile::<$($ty,)? 2, 1>($($arg),*),
            (3, _) => $tile::<$($ty,)? 3, 1>($($arg),*),
            (4, _) => $tile::<$($ty,)? 4, 1>($($arg),*),
            (5, _) => $tile::<$($ty,)? 5, 1>($($arg),*),
            (6, _) => $tile::<$($ty,)? 6, 1>($($arg),*),
            (7, _) => $tile::<$($ty,)? 7, 1>($($arg),*),
            _ => $tile::<$($ty,)? 8, 1>($($arg),*),
        }
    };
}

mod float;
mod gguf;
mod op;
mod quant;

use float::{Elem, FloatWeights};
use half::bf16;
use quant::{QuantRows, QuantWeights};

pub(crate) use crate::cpu::Isa;

/// Output columns per panel: one 64-byte vector of f32 or of 32-bit dot products.
pub(crate) const NR: usize = 16;
/// Rows per register tile (8 on AVX-512's integer path).
const MR: usize = 6;
/// Rows whose activations stay in L2 while a work item's panels run over them (a multiple of
/// every tile height).
const ROW_CHUNK: usize = 96;
/// Most panels per work item.
const MAX_GROUP: usize = 8;

impl Isa {
    /// Rows per register tile of the integer kernel: AVX-512 has the registers for 8 (8
    /// accumulators and 8 dots), so a step of 8 decode rows is one tile, not 6 and 2; NEON's 32
    /// registers hold 8 rows of a quarter panel.
    fn quant_tile_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Amx => 8,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => 8,
            _ => MR,
        }
    }
}

/// How many panels a register tile of `rows` rows spans (of `left` remaining): few rows make
/// few independent accumulator chains, so the tile widens across panels.
fn tile_width(rows: usize, left: usize) -> usize {
    let width = match rows {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    };
    [4, 2, 1]
        .into_iter()
        .find(|&w| w <= width && w <= left)
        .unwrap_or(1)
}

/// The part of the output one work item writes, for one chunk of rows: panels
/// `first..first + panels` (of the whole matrix), rows `row0..row0 + rows`.
struct Tile<'a> {
    /// The item's output for the chunk, `[panel][row][NR]`.
    out: &'a mut [f32],
    panel_stride: usize,
    first: usize,
    panels: usize,
    row0: usize,
    rows: usize,
}

impl Tile<'_> {
    /// Index in `out` of the item's panel `j`, chunk row `r`.
    fn at(&self, j: usize, r: usize) -> usize {
        j * self.panel_stride + r * NR
    }
}

/// The weight values of every panel.
#[derive(Debug)]
enum Weights {
    Quant(QuantWeights),
    F32(FloatWeights<f32>),
    F16(FloatWeights<f16>),
    Bf16(FloatWeights<bf16>),
}

/// Reads `len` bytes at `offset` of a tensor's data into the buffer (replacing what it held).
pub type ReadBytes<'a> = dyn FnMut(usize, usize, &mut Vec<u8>) -> Result<()> + 'a;

/// Float weights of `N`-byte values, read a panel of rows at a time.
fn stream_floats<T: Elem, const N: usize>(
    n: usize,
    k: usize,
    read: &mut ReadBytes,
    from_le: fn([u8; N]) -> T,
) -> Result<FloatWeights<T>> {
    let mut packed = FloatWeights::zeros(n, k);
    let mut bytes = Vec::new();
    for first in (0..n).step_by(NR) {
        let len = NR.min(n - first) * k * N;
        read(first * k * N, len, &mut bytes)?;
        let values: Vec<T> = bytes
            .get(..len)
            .ok_or_else(|| Error::invalid_model("packed weights", "tensor data short"))?
            .chunks_exact(N)
            .map(|b| from_le(b.try_into().unwrap_or([0; N])))
            .collect();
        packed.fill(first, &values);
    }
    Ok(packed)
}

/// A linear layer's weights, packed for [`PackedLinear::matmul`].
#[derive(Debug)]
pub(crate) struct PackedLinear {
    n: usize,
    k: usize,
    weights: Weights,
}

impl PackedLinear {
    /// Whether [`Self::from_gguf`] takes GGUF type `dtype` (the quantizations the integer
    /// kernel keeps, and the float types); the others are dequantized by
    /// [`Self::from_qtensor`].
    pub fn streams(dtype: GgufType) -> bool {
        gguf::keeps(dtype)
            || matches!(
                dtype,
                GgufType::Ggml(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
            )
    }

    /// Packs a GGUF matrix of type `dtype` and shape `[n, k]` in its own codes (or float
    /// type), its bytes read through `read` a panel of rows at a time: the file is never held
    /// whole a second time.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for a type [`Self::streams`] refuses, or short or corrupt data;
    /// `read`'s errors.
    pub fn from_gguf(dtype: GgufType, n: usize, k: usize, read: &mut ReadBytes) -> Result<Self> {
        let weights = match dtype {
            dt if gguf::keeps(dt) => Weights::Quant(gguf::pack(dt, n, k, read)?),
            GgufType::Ggml(GgmlDType::F32) => {
                Weights::F32(stream_floats(n, k, read, f32::from_le_bytes)?)
            }
            GgufType::Ggml(GgmlDType::F16) => {
                Weights::F16(stream_floats(n, k, read, f16::from_le_bytes)?)
            }
            GgufType::Ggml(GgmlDType::BF16) => {
                Weights::Bf16(stream_floats(n, k, read, bf16::from_le_bytes)?)
            }
            _ => {
                return Err(Error::invalid_model(
                    "packed weights",
                    format!("{dtype:?} is read whole and dequantized"),
                ))
            }
        };
        Ok(Self { n, k, weights })
    }

    /// Packs a GGUF tensor of shape `[n, k]` held in memory: as [`Self::from_gguf`], other
    /// types (`Q2_K`, `Q3_K`, ...) dequantized to f32.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for a tensor that is not 2-D or whose data is short or corrupt.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (n, k) = q.shape().dims2()?;
        let dtype = GgufType::Ggml(q.dtype());
        if !Self::streams(dtype) {
            let w = q.dequantize(&candle_core::Device::Cpu)?;
            return Self::from_f32(&w.flatten_all()?.to_vec1::<f32>()?, n, k);
        }
        let data = q.data()?;
        Self::from_gguf(dtype, n, k, &mut |at, len, buf| {
            let bytes = data.get(at..at + len).ok_or_else(|| {
                Error::invalid_model("packed weights", "tensor data shorter than its shape")
            })?;
            buf.clear();
            buf.extend_from_slice(bytes);
            Ok(())
        })
    }

    /// Packs f32 weights `[n, k]` (row-major) as f32.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if `w` does not hold `n · k` values.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Result<Self> {
        Self::check_len(w.len(), n, k)?;
        Ok(Self {
            n,
            k,
            weights: Weights::F32(FloatWeights::pack(w, n, k)),
        })
    }

    /// Packs a `[n, k]` CPU tensor in its own float type (f32, f16, bf16; others as f32), as a
    /// checkpoint holds it.
    ///
    /// # Errors
    /// [`Error::Candle`] for a tensor that is not 2-D or not readable on the CPU.
    pub fn from_tensor(w: &Tensor) -> Result<Self> {
        let (n, k) = w.dims2()?;
        let flat = w.flatten_all()?;
        let weights = match w.dtype() {
            candle_core::DType::F16 => Weights::F16(FloatWeights::pack(&flat.to_vec1()?, n, k)),
            candle_core::DType::BF16 => Weights::Bf16(FloatWeights::pack(&flat.to_vec1()?, n, k)),
            _ => return Self::from_f32(&flat.to_dtype(candle_core::DType::F32)?.to_vec1()?, n, k),
        };
        Ok(Self { n, k, weights })
    }

    fn check_len(len: usize, n: usize, k: usize) -> Result<()> {
        if len == n * k {
            return Ok(());
        }
        Err(Error::invalid_model(
            "packed weights",
            format!("{len} values for a [{n}, {k}] matrix"),
        ))
    }

    /// Bytes the weights take (what one pass reads).
    pub fn bytes(&self) -> usize {
        match &self.weights {
            Weights::Quant(q) => q.bytes(),
            Weights::F32(f) => 4 * f.values.len(),
            Weights::F16(f) => 2 * f.values.len(),
            Weights::Bf16(f) => 2 * f.values.len(),
        }
    }

    /// The matrix's shape `[n, k]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Rows `rows` of the weights, dequantized: `[rows.len(), k]` row-major. An embedding
    /// table held packed is looked up this way, so it takes no second copy in f32.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for a row past `n`.
    pub fn rows(&self, rows: &[u32]) -> Result<Vec<f32>> {
        let k = self.k;
        let mut out = vec![0f32; rows.len() * k];
        for (&r, dst) in rows.iter().zip(out.chunks_exact_mut(k.max(1))) {
            let r = r as usize;
            if r >= self.n {
                return Err(Error::invalid_model(
                    "packed weights",
                    format!("row {r} of {}", self.n),
                ));
            }
            match &self.weights {
                Weights::Quant(q) => q.row(r, dst),
                Weights::F32(f) => f.row(r, dst),
                Weights::F16(f) => f.row(r, dst),
                Weights::Bf16(f) => f.row(r, dst),
            }
        }
        Ok(out)
    }

    /// `x · Wᵀ` for `x: [m, k]` row-major, plus `residual` (`[m, n]`) when given; returns
    /// `[m, n]` row-major.
    pub fn matmul(&self, x: &[f32], m: usize, residual: Option<&[f32]>, isa: Isa) -> Vec<f32> {
        row_major(&[self], x, m, &[residual], isa)
            .pop()
            .unwrap_or_default()
    }

    /// `x · Wᵢᵀ` for each of `linears` (all of `k` columns), in one parallel region over all
    /// their panels with the activations quantized once: the projections that read the same
    /// input (Q, K and V; gate and up) cost one fork and join, not one each.
    pub fn matmul_many(linears: &[&Self], x: &[f32], m: usize, isa: Isa) -> Vec<Vec<f32>> {
        row_major(linears, x, m, &[], isa)
    }
}

/// Each linear's output `[m, nᵢ]` row-major (plus its residual where given), from one
/// parallel region: each work item is a group of one matrix's panels (enough items to balance
/// the threads). Each chunk of rows runs over the group's panels while its activations are in
/// cache, into the item's own panel-major scratch, which the item then copies into its columns
/// of the rows: no second pass over the outputs, no buffer as large as them.
fn row_major(
    linears: &[&PackedLinear],
    x: &[f32],
    m: usize,
    residuals: &[Option<&[f32]>],
    isa: Isa,
) -> Vec<Vec<f32>> {
    let Some(k) = linears.first().map(|l| l.k) else {
        return Vec::new();
    };
    if m == 0 || linears.iter().any(|l| l.k != k || l.n == 0) {
        return linears.iter().map(|l| vec![0f32; m * l.n]).collect();
    }
    // Not zeroed: the items write every element (a pass's outputs are megabytes, and zeroing
    // them was 3-4% of a prefill).
    let mut outs: Vec<Vec<f32>> = linears
        .iter()
        .map(|l| Vec::with_capacity(m * l.n))
        .collect();
    let quant = linears
        .iter()
        .any(|l| matches!(l.weights, Weights::Quant(_)));
    let quantized = quant.then(|| QuantRows::new(&x[..m * k], m, k, isa));
    let panels: usize = linears.iter().map(|l| l.n.div_ceil(NR)).sum();
    let group = (panels / (4 * rayon::current_num_threads())).clamp(1, MAX_GROUP);
    let targets: Vec<Rows> = outs
        .iter_mut()
        .zip(linears)
        .enumerate()
        .map(|(i, (out, l))| Rows {
            out: out.spare_capacity_mut().as_mut_ptr().cast(),
            m,
            n: l.n,
            residual: residuals
                .get(i)
                .copied()
                .flatten()
                .filter(|r| r.len() >= m * l.n),
        })
        .collect();
    let items: Vec<(&PackedLinear, &Rows, usize)> = linears
        .iter()
        .zip(&targets)
        .flat_map(|(&l, rows)| (0..l.n.div_ceil(NR).div_ceil(group)).map(move |g| (l, rows, g)))
        .collect();
    items.into_par_iter().for_each(|(l, rows_out, g)| {
        let first = g * group;
        let panels = group.min(l.n.div_ceil(NR) - first);
        let mut scratch = vec![0f32; panels * ROW_CHUNK.min(m) * NR];
        for row0 in (0..m).step_by(ROW_CHUNK) {
            let rows = ROW_CHUNK.min(m - row0);
            let out = &mut scratch[..panels * rows * NR];
            let mut tile = Tile {
                out,
                panel_stride: rows * NR,
                first,
                panels,
                row0,
                rows,
            };
            match (&l.weights, &quantized) {
                (Weights::Quant(w), Some(a)) => w.run(a, &mut tile, isa),
                (Weights::F32(w), _) => w.run(x, &mut tile, isa),
                (Weights::F16(w), _) => w.run(x, &mut tile, isa),
                (Weights::Bf16(w), _) => w.run(x, &mut tile, isa),
                // Rows are quantized whenever a matrix is.
                (Weights::Quant(_), None) => {}
            }
            for (j, panel) in tile.out.chunks_exact_mut(rows * NR).enumerate() {
                let c = (first + j) * NR;
                for (r, values) in panel.chunks_exact(NR).enumerate() {
                    // SAFETY: the item's panels are its own: no other item writes columns
                    // `first * NR..(first + panels) * NR` of this matrix's rows, and nothing
                    // reads them until the region ends.
                    unsafe { rows_out.write(row0 + r, c, values) };
                }
                // The float kernel adds to what its tile holds (the integer one stores).
                if !matches!(l.weights, Weights::Quant(_)) {
                    panel.fill(0.0);
                }
            }
        }
    });
    for (out, l) in outs.iter_mut().zip(linears) {
        // SAFETY: the items wrote every element: together they cover every panel, so every
        // column below `n`, and each writes its columns of every row (`Rows::write`).
        unsafe { out.set_len(m * l.n) };
    }
    outs
}

/// A linear's `[m, n]` output as the work items of [`row_major`] write it, each its own columns
/// of every row, into memory not yet initialized.
struct Rows<'a> {
    out: *mut f32,
    m: usize,
    n: usize,
    residual: Option<&'a [f32]>,
}

// SAFETY: the pointer is to a buffer that outlives the parallel region, and the items write
// disjoint elements of it (see `Rows::write`).
unsafe impl Send for Rows<'_> {}
// SAFETY: as above.
unsafe impl Sync for Rows<'_> {}

impl Rows<'_> {
    /// Writes `values` (plus the residual's there) at row `r`, columns `c..`; values past the
    /// output are dropped.
    ///
    /// # Safety
    /// No other thread writes or reads those elements meanwhile.
    unsafe fn write(&self, r: usize, c: usize, values: &[f32]) {
        if r >= self.m || c >= self.n {
            return;
        }
        let values = &values[..values.len().min(self.n - c)];
        let at = r * self.n + c;
        // SAFETY: `at + values.len() <= m * n`, the buffer's capacity; exclusive access is the
        // caller's contract. Raw writes: the elements may not be initialized yet.
        unsafe {
            let dst = self.out.add(at);
            match self.residual {
                Some(res) => {
                    for (i, (&v, &x)) in values.iter().zip(&res[at..][..values.len()]).enumerate() {
                        dst.add(i).write(x + v);
                    }
                }
                None => std::ptr::copy_nonoverlapping(values.as_ptr(), dst, values.len()),
            }
        }
    }
}

#[cfg(test)]
mod tests;

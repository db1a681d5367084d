//! The packed matmul as candle ops: one linear (with an optional residual added in the same
//! pass), or several linears over the same input in one parallel region.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Storage, Tensor};

use super::{Isa, PackedLinear};
use crate::Result;

/// [`PackedLinear::matmul`] as a candle op on `x: [m, k]` (f32, CPU).
pub(crate) struct PackedMatmul<'a> {
    pub linear: &'a PackedLinear,
    pub isa: Isa,
}

impl PackedMatmul<'_> {
    /// The op on `x` (and `residual`), checked.
    fn run(
        &self,
        x: &CpuStorage,
        l: &Layout,
        residual: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        let n = self.linear.n;
        if k != self.linear.k {
            candle_core::bail!(
                "packed matmul: x [{m}, {k}] for weights [{n}, {}]",
                self.linear.k
            )
        }
        let x = f32_rows(x, l, "activations")?;
        let residual = match residual {
            Some((r, rl)) if rl.shape().dims() == [m, n] => Some(f32_rows(r, rl, "residual")?),
            Some((_, rl)) => {
                candle_core::bail!("packed matmul: residual {:?} for [{m}, {n}]", rl.shape())
            }
            None => None,
        };
        let y = self.linear.matmul(x, m, residual, self.isa);
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// The contiguous f32 values of an operand.
fn f32_rows<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("packed matmul takes f32 {what}")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("packed matmul takes contiguous {what}"),
    }
}

impl CustomOp1 for PackedMatmul<'_> {
    fn name(&self) -> &'static str {
        "pensieve-packed-matmul"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.run(x, l, None)
    }
}

impl CustomOp2 for PackedMatmul<'_> {
    fn name(&self) -> &'static str {
        "pensieve-packed-matmul-residual"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        l: &Layout,
        r: &CpuStorage,
        rl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.run(x, l, Some((r, rl)))
    }
}

impl PackedLinear {
    /// [`Self::matmul_many`] on `x: [m, k]` (CPU): one `[m, nᵢ]` tensor per linear.
    ///
    /// # Errors
    /// [`Error::Candle`] for another dtype or device, or linears of another width than `x`.
    pub fn forward_many(linears: &[&Self], x: &Tensor, isa: Isa) -> Result<Vec<Tensor>> {
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let (m, k) = x.dims2()?;
        if linears.iter().any(|l| l.k != k) {
            let e = format!("packed matmul: x [{m}, {k}] for weights of another width");
            return Err(candle_core::Error::Msg(e).into());
        }
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(candle_core::Error::Msg("packed matmul runs on the CPU".into()).into());
        };
        let rows = f32_rows(cpu, layout, "activations")?;
        Self::matmul_many(linears, rows, m, isa)
            .into_iter()
            .zip(linears)
            .map(|(y, l)| Ok(Tensor::from_vec(y, (m, l.n), x.device())?))
            .collect()
    }

    /// `x · Wᵀ` for `x: [m, k]` on the CPU, plus `residual` (`[m, n]`) when given.
    ///
    /// # Errors
    /// [`Error::Candle`] for another shape, dtype or device.
    pub fn forward(&self, x: &Tensor, residual: Option<&Tensor>, isa: Isa) -> Result<Tensor> {
        let f32_contiguous = |t: &Tensor| t.to_dtype(candle_core::DType::F32)?.contiguous();
        let x = f32_contiguous(x)?;
        let op = PackedMatmul { linear: self, isa };
        Ok(match residual {
            Some(r) => x.apply_op2_no_bwd(&f32_contiguous(r)?, &op)?,
            None => x.apply_op1_no_bwd(&op)?,
        })
    }
}

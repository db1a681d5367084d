//! Element-wise steps of the decoder fused into one parallel pass on our own thread pool.
//!
//! candle runs large element-wise ops on a second thread pool of its own whose workers spin
//! after each op, taking a core from the pass's rayon workers; the ops here run on rayon, so a
//! forward pass uses one pool.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::arch::Activation;
use crate::Result;

/// Elements per parallel task: fewer is not worth a task.
const ELEMENTS_PER_TASK: usize = 16 * 1024;

/// `act(gate) · up`, element-wise (SwiGLU or GeGLU, the gated MLP): in f32 on the CPU, rounded
/// as candle's `silu` or `gelu` then `mul` round it; on a GPU one kernel, rounded once.
///
/// # Errors
/// [`crate::Error::Candle`] when the shapes differ.
pub(super) fn gated(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    let fused = match gate.device() {
        Device::Cpu => gate.dtype() == DType::F32,
        // One kernel (`kernels/step.cu`) instead of two or more launches.
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            super::fused::runs_on(d)
                && matches!(gate.dtype(), DType::F32 | DType::F16 | DType::BF16)
        }
        _ => false,
    };
    if !fused {
        let (a, up) = match act {
            Activation::Silu => (gate.silu()?, up.clone()),
            Activation::GeluTanh => (gate.gelu()?, up.clone()),
            Activation::ClampedSwiglu => {
                let g = gate.minimum(CLAMP)?;
                let sigmoid = candle_nn::ops::sigmoid(&(&g * f64::from(ALPHA))?)?;
                ((g * sigmoid)?, (up.clamp(-CLAMP, CLAMP)? + 1.0)?)
            }
        };
        return Ok((a * up)?);
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    Ok(gate.apply_op2_no_bwd(&up, &Gated(act))?)
}

/// `sqrt(2 / pi)`, as candle's `gelu` spells it.
const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
/// gpt-oss's clamped SwiGLU: the sigmoid's slope and the clamp.
const ALPHA: f32 = 1.702;
const CLAMP: f32 = 7.0;

struct Gated(Activation);

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "pensieve-swiglu",
            Activation::GeluTanh => "pensieve-geglu",
            Activation::ClampedSwiglu => "pensieve-clamped-swiglu",
        }
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(g), CpuStorage::F32(u)) = (g, u) else {
            candle_core::bail!("swiglu takes f32 operands")
        };
        if gl.shape() != ul.shape() {
            candle_core::bail!("swiglu: gate {:?}, up {:?}", gl.shape(), ul.shape())
        }
        let (Some((g0, g1)), Some((u0, u1))) = (gl.contiguous_offsets(), ul.contiguous_offsets())
        else {
            candle_core::bail!("swiglu takes contiguous operands")
        };
        let act = self.0;
        let (g, u) = (&g[g0..g1], &u[u0..u1]);
        let mut out = vec![0f32; g.len()];
        out.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(g.par_chunks(ELEMENTS_PER_TASK))
            .zip(u.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|((o, g), u)| {
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = match act {
                        Activation::Silu => g / (1.0 + (-g).exp()) * u,
                        Activation::GeluTanh => {
                            0.5 * g
                                * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * g * (1.0 + 0.044715 * g * g)))
                                * u
                        }
                        Activation::ClampedSwiglu => {
                            let g = g.min(CLAMP);
                            g / (1.0 + (-ALPHA * g).exp()) * (u.clamp(-CLAMP, CLAMP) + 1.0)
                        }
                    };
                }
            });
        Ok((CpuStorage::F32(out), gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        super::fused::gated(self.0, g, gl, u, ul)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    /// Bit for bit what candle's `silu` or `gelu` then `mul` give, so the fused pass changes no
    /// logits.
    #[test]
    fn gated_equals_candles_activation_times_up() -> candle_core::Result<()> {
        let n = 7 * (super::ELEMENTS_PER_TASK / 2 + 3);
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let g = Tensor::from_vec(g, (n / 7, 7), &Device::Cpu)?;
        let u = Tensor::from_vec(u, (n / 7, 7), &Device::Cpu)?;
        let fused =
            super::gated(&g, &u, super::Activation::Silu).map_err(candle_core::Error::wrap)?;
        let reference = (g.silu()? * &u)?;
        let fused_gelu =
            super::gated(&g, &u, super::Activation::GeluTanh).map_err(candle_core::Error::wrap)?;
        let reference_gelu = (g.gelu()? * &u)?;
        let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
            Ok(t.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect())
        };
        assert_eq!(bits(&fused)?, bits(&reference)?);
        assert_eq!(bits(&fused_gelu)?, bits(&reference_gelu)?);
        // gpt-oss's: the fused loop against the same formula in candle's ops (the path of
        // other devices and types), past both clamps.
        let fused = super::gated(&g, &u, super::Activation::ClampedSwiglu)
            .map_err(candle_core::Error::wrap)?;
        let g7 = g.minimum(7f32)?;
        let sigmoid = candle_nn::ops::sigmoid(&(&g7 * 1.702)?)?;
        let reference = ((g7 * sigmoid)? * (u.clamp(-7f32, 7f32)? + 1.0)?)?;
        let diff = (fused - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }
}

//! Element-wise steps of the decoder fused into one parallel pass on our own thread pool.
//!
//! candle runs large element-wise ops on a second thread pool of its own whose workers spin
//! after each op, taking a core from the pass's rayon workers; the ops here run on rayon, so a
//! forward pass uses one pool.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::arch::Activation;
use super::Isa;
use crate::math::times_sigmoid;
use crate::Result;

/// Elements per parallel task: fewer is not worth a task.
const ELEMENTS_PER_TASK: usize = 16 * 1024;

/// `act(gate) · up`, element-wise (SwiGLU or GeGLU, the gated MLP): in f32 on the CPU, in one
/// vectorised loop whose bits are the same on every instruction path; on a GPU one kernel,
/// rounded once.
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
        let (act, isa) = (self.0, Isa::detect());
        let (g, u) = (&g[g0..g1], &u[u0..u1]);
        let mut out = vec![0f32; g.len()];
        out.par_chunks_mut(ELEMENTS_PER_TASK)
            .zip(g.par_chunks(ELEMENTS_PER_TASK))
            .zip(u.par_chunks(ELEMENTS_PER_TASK))
            .for_each(|((o, g), u)| gated_with(isa, act, o, g, u));
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

/// `o = act(g) · u` on `isa`'s vector registers. Each path compiles the same code
/// ([`gated_loop`]), whose operations are exactly rounded: the bits agree across paths.
fn gated_with(isa: Isa, act: Activation, o: &mut [f32], g: &[f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn avx512(act: Activation, o: &mut [f32], g: &[f32], u: &[f32]) {
            gated_loop(act, o, g, u);
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(act: Activation, o: &mut [f32], g: &[f32], u: &[f32]) {
            gated_loop(act, o, g, u);
        }
        match isa {
            // SAFETY: `isa` is one of `Isa::available()`'s, so the CPU has the features.
            Isa::Avx512 | Isa::Amx => return unsafe { avx512(act, o, g, u) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { avx2(act, o, g, u) },
            Isa::Scalar => {}
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    gated_loop(act, o, g, u);
}

/// The activations' loops, one per activation so that each vectorises.
#[inline(always)]
fn gated_loop(act: Activation, o: &mut [f32], g: &[f32], u: &[f32]) {
    let each = o.iter_mut().zip(g).zip(u);
    match act {
        Activation::Silu => each.for_each(|((o, &g), &u)| *o = times_sigmoid(g, g) * u),
        Activation::GeluTanh => each.for_each(|((o, &g), &u)| {
            let z = SQRT_TWO_OVER_PI * g * (1.0 + 0.044715 * g * g);
            *o = times_sigmoid(g, 2.0 * z) * u;
        }),
        Activation::ClampedSwiglu => each.for_each(|((o, &g), &u)| {
            let g = g.min(CLAMP);
            *o = times_sigmoid(g, ALPHA * g) * (u.clamp(-CLAMP, CLAMP) + 1.0);
        }),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::{Activation, Isa};

    /// Each activation in f64, from its definition (GELU through `tanh`, as candle and the
    /// checkpoints' `gelu_pytorch_tanh` write it).
    fn reference(act: Activation, g: f64, u: f64) -> f64 {
        match act {
            Activation::Silu => g / (1.0 + (-g).exp()) * u,
            Activation::GeluTanh => {
                let z = (2.0 / std::f64::consts::PI).sqrt() * g * (1.0 + 0.044715 * g * g);
                0.5 * g * (1.0 + z.tanh()) * u
            }
            Activation::ClampedSwiglu => {
                let g = g.min(7.0);
                g / (1.0 + (-1.702 * g).exp()) * (u.clamp(-7.0, 7.0) + 1.0)
            }
        }
    }

    /// The op against f64 within a few units in the last place, and the same bits on every
    /// instruction path this CPU has and at every offset in a loop (vector lanes or the tail).
    #[test]
    fn gated_matches_f64_with_the_same_bits_on_every_path() -> candle_core::Result<()> {
        let n = 7 * (super::ELEMENTS_PER_TASK / 2 + 3);
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let (gt, ut) = (
            Tensor::from_vec(g.clone(), (n / 7, 7), &Device::Cpu)?,
            Tensor::from_vec(u.clone(), (n / 7, 7), &Device::Cpu)?,
        );
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::ClampedSwiglu,
        ] {
            let op = super::gated(&gt, &ut, act).map_err(candle_core::Error::wrap)?;
            let op = op.flatten_all()?.to_vec1::<f32>()?;
            let scale = g
                .iter()
                .zip(&u)
                .map(|(g, u)| (g * u).abs())
                .fold(0f32, f32::max);
            for (i, &got) in op.iter().enumerate() {
                let want = reference(act, g[i].into(), u[i].into());
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= 2e-6 * want.abs() + 1e-7 * f64::from(scale),
                    "{act:?} at {}: {got} against {want}",
                    g[i]
                );
            }
            for isa in Isa::available() {
                let mut o = vec![0f32; n];
                super::gated_with(isa, act, &mut o, &g, &u);
                assert!(
                    o.iter().zip(&op).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?}"
                );
                // Offset by 3: every element moves to another lane, the last ones to the tail.
                let mut o = vec![0f32; n - 3];
                super::gated_with(isa, act, &mut o, &g[3..], &u[3..]);
                assert!(o
                    .iter()
                    .zip(&op[3..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
        Ok(())
    }

    /// The element-wise ops candle runs where the fused loop does not (other devices and
    /// types) compute the same function.
    #[test]
    fn candles_ops_agree_with_the_fused_loop() -> candle_core::Result<()> {
        let n = 4096;
        let g = Tensor::from_vec(
            (0..n).map(|i| (i as f32 * 0.37).sin() * 9.0).collect(),
            n,
            &Device::Cpu,
        )?;
        let u = Tensor::from_vec(
            (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect(),
            n,
            &Device::Cpu,
        )?;
        let g7 = g.minimum(7f32)?;
        let clamped = (&g7 * candle_nn::ops::sigmoid(&(&g7 * 1.702)?)?)?;
        for (act, candle) in [
            (Activation::Silu, (g.silu()? * &u)?),
            (Activation::GeluTanh, (g.gelu()? * &u)?),
            (
                Activation::ClampedSwiglu,
                (clamped * (u.clamp(-7f32, 7f32)? + 1.0)?)?,
            ),
        ] {
            let fused = super::gated(&g, &u, act).map_err(candle_core::Error::wrap)?;
            let diff = (fused - candle)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{act:?}: {diff}");
        }
        Ok(())
    }
}

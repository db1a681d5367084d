//! Weights on a device other than the CPU in the packed format: each tensor in its own codes
//! on candle's kernels for that device, so a model takes about its file's bytes there and a
//! decode step streams no more. GGUF quantizations stay quantized (candle's quantized matmul
//! and row lookup), float weights keep their type; a type no kernel there reads is converted
//! to f16 with a warning that names it, never silently to f32.

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Tensor};

use super::{Embedding, Linear};
use crate::model::packed::PackedLinear;
use crate::Result;

/// Whether candle's kernels on a device multiply (and look rows up in) `dtype` in its codes.
fn runs_in_its_codes(dtype: GgmlDType) -> bool {
    use GgmlDType::*;
    matches!(
        dtype,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// The GGUF tensor `name`, `q` (read on the CPU), as a linear layer's weights on `device`.
pub(super) fn gguf_linear(name: &str, q: &QTensor, device: &Device) -> Result<QMatMul> {
    let cpu = &Device::Cpu;
    // Only built by the arms that hold the tensor as f16.
    let f16 = || -> Result<QMatMul> {
        Ok(QMatMul::TensorF16(
            q.dequantize_f16(cpu)?.to_device(device)?,
        ))
    };
    Ok(match q.dtype() {
        d if runs_in_its_codes(d) && !kernels_run(d, device)? => {
            warn_converted(name, &format!("{d:?}"));
            f16()?
        }
        d if runs_in_its_codes(d) => {
            let dims = q.shape().dims().to_vec();
            QMatMul::QTensor(Arc::new(qtensor_from_ggml(d, &q.data()?, dims, device)?))
        }
        GgmlDType::F16 => f16()?,
        GgmlDType::BF16 => QMatMul::Tensor(
            q.dequantize(cpu)?
                .to_dtype(DType::BF16)?
                .to_device(device)?,
        ),
        GgmlDType::F32 => QMatMul::Tensor(q.dequantize(cpu)?.to_device(device)?),
        other => {
            warn_converted(name, &format!("{other:?}"));
            f16()?
        }
    })
}

/// The float matrix `w` (a checkpoint's, in its own type) as a linear layer's weights on its
/// device: f16 and bf16 stay as they are, anything else is held as f32.
pub(super) fn float_linear(w: Tensor) -> Result<QMatMul> {
    Ok(match w.dtype() {
        DType::F16 => QMatMul::TensorF16(w),
        DType::BF16 | DType::F32 => QMatMul::Tensor(w),
        _ => QMatMul::Tensor(w.to_dtype(DType::F32)?),
    })
}

/// `packed` (codes no kernel on `device` reads, such as MXFP4) as f16 weights there.
pub(super) fn packed_as_f16(name: &str, packed: &PackedLinear, device: &Device) -> Result<QMatMul> {
    warn_converted(name, "MXFP4");
    let (n, k) = packed.dims();
    let rows: Vec<u32> = (0..n as u32).collect();
    let w = Tensor::from_vec(packed.rows(&rows)?, (n, k), &Device::Cpu)?;
    Ok(QMatMul::TensorF16(
        w.to_dtype(DType::F16)?.to_device(device)?,
    ))
}

/// Whether candle's quantized kernels for `dtype` give the right products on `device`. They
/// are linked as machine code for the one architecture candle was built for
/// (`CUDA_COMPUTE_CAP`); on another a launch fails without an error and leaves its output
/// unwritten, so the model's outputs would be garbage. Checked once per device and type, on a
/// small product (one row and 16: the two kernels) and a row lookup, against the same codes
/// dequantized on the CPU.
fn kernels_run(dtype: GgmlDType, device: &Device) -> Result<bool> {
    type Checked = Vec<(candle_core::DeviceLocation, GgmlDType, bool)>;
    static CHECKED: parking_lot::Mutex<Checked> = parking_lot::Mutex::new(Vec::new());
    let at = device.location();
    if let Some(&(.., ok)) = CHECKED.lock().iter().find(|c| c.0 == at && c.1 == dtype) {
        return Ok(ok);
    }
    let (n, k) = (32, 256);
    let cpu = &Device::Cpu;
    let values = |len: usize, seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed) % 255) as f32 / 127.0 - 1.0)
            .collect()
    };
    let q = QTensor::quantize(&Tensor::from_vec(values(n * k, 1), (n, k), cpu)?, dtype)?;
    let w = q.dequantize(cpu)?;
    let on_device = qtensor_from_ggml(dtype, &q.data()?, vec![n, k], device)?;
    let mut ok = true;
    for rows in [1, 16] {
        let x = Tensor::from_vec(values(rows * k, 2), (rows, k), cpu)?;
        let want = x.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let got = x.to_device(device)?.apply_op1_no_bwd(&on_device)?;
        let got = got.to_device(cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        ok &= (want.iter().zip(&got)).all(|(a, b)| (a - b).abs() <= 5e-2 * scale);
    }
    let ids = Tensor::new(&[0u32, 7, 31], device)?;
    let rows = on_device.embedding(&ids)?.to_device(cpu)?;
    let want = w.index_select(&Tensor::new(&[0u32, 7, 31], cpu)?, 0)?;
    let off = (rows - want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    ok &= off <= 1e-3;
    if !ok {
        tracing::warn!(
            ?dtype,
            ?at,
            "candle's quantized kernels give wrong results on this GPU: they were built for \
             another architecture (rebuild with CUDA_COMPUTE_CAP set to this GPU's)"
        );
    }
    CHECKED.lock().push((at, dtype, ok));
    Ok(ok)
}

fn warn_converted(name: &str, dtype: &str) {
    tracing::warn!(
        tensor = name,
        dtype,
        "no kernel on this device reads the type in its codes: converted to f16 (2 bytes a weight)"
    );
}

/// The linear weights' common float type on a device, where every one is held as a float
/// tensor of one type: the activations then run in it (f16 or bf16 halve the residual
/// stream's bytes; every op there has kernels for both).
pub(super) fn common_float_type<'a>(held: impl IntoIterator<Item = &'a QMatMul>) -> Option<DType> {
    let mut common = None;
    for q in held {
        let dtype = match q {
            QMatMul::TensorF16(_) => DType::F16,
            QMatMul::Tensor(t) => t.dtype(),
            QMatMul::QTensor(_) => return None,
        };
        if *common.get_or_insert(dtype) != dtype {
            return None;
        }
    }
    common
}

/// `x · Wᵀ` with `q`, `x` converted to a float matrix's own type (and back) where they differ.
pub(super) fn forward(q: &QMatMul, x: &Tensor) -> Result<Tensor> {
    use candle_core::Module;
    match q {
        QMatMul::Tensor(w) if w.dtype() != x.dtype() => {
            Ok(q.forward(&x.to_dtype(w.dtype())?)?.to_dtype(x.dtype())?)
        }
        _ => Ok(q.forward(x)?),
    }
}

impl Embedding {
    /// The table of the output projection `head` (tied to it): its own tensor, shared.
    pub(super) fn of(head: &Linear) -> Self {
        match head {
            Linear::Candle(QMatMul::QTensor(q)) => Embedding::Codes(q.clone()),
            Linear::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                Embedding::Table(t.clone())
            }
            Linear::Packed(..) => Embedding::Packed(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check passes kernels that compute what they should: candle's CPU ones, which
    /// quantize activations to 8 bits as the GPU's do.
    #[test]
    fn the_kernel_check_passes_correct_kernels() {
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q6K,
        ] {
            assert!(kernels_run(dtype, &Device::Cpu).unwrap(), "{dtype:?}");
        }
    }
}

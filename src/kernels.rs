//! The CUDA kernels of `kernels/` as `build.rs` compiled them (one fatbin per source, embedded:
//! no process JIT-compiles them at start), loaded once per context and looked up once per
//! function: a step launches some of them once or twice per layer, and a lookup is a driver
//! call.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, DevicePtr};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Storage, Tensor};
use parking_lot::Mutex;

/// `kernels/attention.cu`: the multi-query attention over the pool's slots.
pub(crate) const ATTENTION: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/attention.fatbin"));
/// `kernels/step.cu`: a step's small ops fused.
pub(crate) const STEP: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/step.fatbin"));

/// A fatbin loaded in one context, and the functions looked up in it.
struct Loaded {
    ctx: usize,
    fatbin: usize,
    module: Arc<CudaModule>,
    functions: Vec<(String, CudaFunction)>,
}

static LOADED: Mutex<Vec<Loaded>> = Mutex::new(Vec::new());

/// The kernel `name` of `fatbin` (one of this module's) in `dev`'s context.
pub(crate) fn function(
    dev: &CudaDevice,
    fatbin: &'static [u8],
    name: &str,
) -> candle_core::Result<CudaFunction> {
    let ctx = dev.cuda_stream().context().clone();
    let key = (ctx.cu_ctx() as usize, fatbin.as_ptr() as usize);
    let mut loaded = LOADED.lock();
    let at = match loaded.iter().position(|l| (l.ctx, l.fatbin) == key) {
        Some(at) => at,
        None => {
            let module = ctx.load_module(Ptx::from_binary(fatbin.to_vec())).w()?;
            loaded.push(Loaded {
                ctx: key.0,
                fatbin: key.1,
                module,
                functions: Vec::new(),
            });
            loaded.len() - 1
        }
    };
    let l = &mut loaded[at];
    if let Some((_, f)) = l.functions.iter().find(|(n, _)| n == name) {
        return Ok(f.clone());
    }
    let f = l.module.load_function(name).w()?;
    l.functions.push((name.to_string(), f.clone()));
    Ok(f)
}

/// Whether `dev` issues every op on one stream, whichever thread issues it: a stream of its
/// own (as `pensieve::model::cuda_device` builds it) or the legacy
/// default one. candle's `Device::new_cuda` uses each thread's default stream instead, so the
/// ops of a step issued from two threads (the engine's and the pass's rayon worker) are
/// ordered only by cudarc's event tracking; on such a device it stays on, and the fused
/// kernels, which do not record cudarc's events, do not run.
pub(crate) fn own_stream(dev: &CudaDevice) -> bool {
    /// `CU_STREAM_PER_THREAD`, the handle of the calling thread's default stream.
    const PER_THREAD: usize = 0x2;
    dev.cuda_stream().cu_stream() as usize != PER_THREAD
}

/// The device address of the first value `l` covers in `s` (contiguous), and the kernels' name
/// of its type. Kernels launched through raw addresses record none of cudarc's events: they
/// run only where [`own_stream`] holds.
pub(crate) fn address(
    s: &CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(u64, &'static str)> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("{what} must be contiguous for the fused kernels")
    };
    let stream = s.device.cuda_stream();
    let (base, name, width) = match &s.slice {
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, "f32", 4),
        CudaStorageSlice::F16(x) => (x.device_ptr(&stream).0, "f16", 2),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, "bf16", 2),
        CudaStorageSlice::U32(x) => (x.device_ptr(&stream).0, "u32", 4),
        CudaStorageSlice::U8(x) => (x.device_ptr(&stream).0, "u8", 1),
        _ => bail!("{what}: the fused kernels do not take {:?}", s.dtype()),
    };
    Ok((base + (start * width) as u64, name))
}

/// [`address`] of a tensor a kernel reads or writes beside a custom op's operands.
pub(crate) fn tensor_address(t: &Tensor, what: &str) -> candle_core::Result<(u64, &'static str)> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => address(s, layout, what),
        _ => bail!("{what} is not on the GPU"),
    }
}

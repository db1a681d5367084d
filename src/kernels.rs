//! The CUDA kernels of `kernels/` as `build.rs` compiled them (one fatbin per source, embedded:
//! no process JIT-compiles them at start), loaded once per context and looked up once per
//! function: a step launches some of them once or twice per layer, and a lookup is a driver
//! call.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::WrapErr;
use candle_core::CudaDevice;
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

//! The pool's chunk copies on a GPU (Pensieve §4.3.2): a copy stream of its own, so that
//! swaps overlap the compute stream's work; host chunks in pinned memory, so that copies are
//! asynchronous DMA; and one event per layer, so that a pass waits for layer `l`'s restored
//! KV only when it reaches layer `l` (layer-wise pipelined swap-in).
//!
//! Ordering, all on the device, none on the host until a chunk's bytes are read:
//! 1. the copy stream waits for the compute stream's work so far (the KV it wrote);
//! 2. per layer: the swap-outs' device → host copies, then the swap-ins' host → device
//!    copies, then an event;
//! 3. the compute stream waits for layer `l`'s event before it writes or reads layer `l`
//!    ([`Mover::await_layer`]); a swap-out's bytes wait for the copy's end when read.
//!
//! Host buffers a swap-in reads stay alive until the copy stream has passed them: the next
//! step's copies (or the mover's drop) synchronize it first. A released chunk's buffer is
//! kept for the next swap-out (page-locking memory costs more than a copy), up to
//! `MAX_SPARE` buffers.
//!
//! These events are the only ordering the two streams need, so cudarc's own tracking is
//! turned off ([`untrack`]).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    result, sys, CudaEvent, CudaStream, DevicePtr, DriverError, PinnedHostSlice,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{Storage, Tensor};
use parking_lot::Mutex;

use super::Copier;
use crate::attention::codes::Codes;
use crate::kv::{ChunkBytes, ChunkUnavailable, HostBuffer};
use crate::{Error, Result};

/// Page-locked buffers of released chunks, for the next swap-outs: allocating page-locked
/// memory costs far more than filling it.
type Spare = Arc<Mutex<Vec<PinnedHostSlice<u8>>>>;

/// Most spare buffers kept; beyond it a released buffer is freed.
const MAX_SPARE: usize = 256;

/// The copy stream and this step's per-layer readiness.
#[derive(Debug)]
pub(super) struct Mover {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    /// Per layer: the event after this step's copies of that layer, until the compute
    /// stream has been told to wait for it.
    ready: Mutex<Vec<Option<CudaEvent>>>,
    /// Swap-in sources the copy stream may still be reading.
    in_flight: Mutex<Vec<Arc<ChunkBytes>>>,
    spare: Spare,
}

fn transfer(e: DriverError) -> Error {
    Error::Transfer(Box::new(e))
}

impl Mover {
    /// A copy stream beside `device`'s compute stream, for a pool of `layers` layers.
    pub(super) fn new(device: &CudaDevice, layers: usize) -> Result<Self> {
        let compute = device.cuda_stream();
        let copy = compute.context().new_stream().map_err(transfer)?;
        Ok(Self {
            compute,
            copy,
            ready: Mutex::new((0..layers).map(|_| None).collect()),
            in_flight: Mutex::new(Vec::new()),
            spare: Spare::default(),
        })
    }

    /// A page-locked buffer of at least `len` bytes: a spare one if one is large enough.
    fn buffer(&self, len: usize) -> Result<PinnedHostSlice<u8>> {
        let reused = {
            let mut spare = self.spare.lock();
            let fit = spare.iter().position(|b| b.len() >= len);
            fit.map(|i| spare.swap_remove(i))
        };
        match reused {
            Some(b) => Ok(b),
            // Plain page-locked memory (not write-combined): the host reads it back (to the
            // store tier, or to swap it in again).
            // SAFETY: every byte of a chunk is written by its copies before it is read.
            None => unsafe { self.copy.context().alloc_pinned_with_flags::<u8>(len, 0) }
                .map_err(transfer),
        }
    }
}

impl Copier for Mover {
    /// Makes the compute stream wait for this step's copies of `layer` (once per step).
    fn await_layer(&self, layer: usize, _: &Tensor, _: &Tensor) -> Result<()> {
        let event = self.ready.lock().get_mut(layer).and_then(Option::take);
        match event {
            Some(e) => self.compute.wait(&e).map_err(transfer),
            None => Ok(()),
        }
    }

    /// Enqueues one step's copies (see the module comment). Without `pipelined`, returns only
    /// when every copy is done.
    fn copy(
        &self,
        k: &[Tensor],
        v: &[Tensor],
        row_bytes: usize,
        outs: &[(usize, usize)],
        ins: Vec<(usize, Arc<ChunkBytes>)>,
        pipelined: bool,
    ) -> Result<Vec<ChunkBytes>> {
        // The last step's sources are done with once the stream has passed them.
        self.copy.synchronize().map_err(transfer)?;
        self.in_flight.lock().clear();
        if outs.is_empty() && ins.is_empty() {
            return Ok(Vec::new());
        }
        self.copy.join(&self.compute).map_err(transfer)?;
        let layers = k.len();
        let mut bufs = outs
            .iter()
            .map(|&(_, len)| self.buffer(2 * layers * len * row_bytes))
            .collect::<Result<Vec<PinnedHostSlice<u8>>>>()?;
        match self.enqueue(k, v, row_bytes, outs, &ins, &mut bufs, pipelined) {
            Ok(chunks) => {
                self.in_flight
                    .lock()
                    .extend(ins.into_iter().map(|(_, d)| d));
                Ok(chunks)
            }
            Err(e) => {
                // Copies already queued may still read `ins` and write the pinned buffers,
                // which are freed on return: not before the stream has passed them.
                let _ = self.copy.synchronize();
                Err(e)
            }
        }
    }
}

impl Mover {
    /// [`Copier::copy`] once its buffers are there; they become the returned chunks. On an error
    /// copies may be in flight, and the buffers stay with the caller.
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        k: &[Tensor],
        v: &[Tensor],
        row_bytes: usize,
        outs: &[(usize, usize)],
        ins: &[(usize, Arc<ChunkBytes>)],
        bufs: &mut Vec<PinnedHostSlice<u8>>,
        pipelined: bool,
    ) -> Result<Vec<ChunkBytes>> {
        let layers = k.len();
        let mut hosts = bufs
            .iter_mut()
            .map(|b| b.as_mut_slice().map_err(transfer))
            .collect::<Result<Vec<&mut [u8]>>>()?;
        let sources = ins
            .iter()
            .map(|(start, data)| Ok((*start, data.bytes()?)))
            .collect::<Result<Vec<(usize, &[u8])>>>()?;
        let stream = self.copy.cu_stream();
        let mut ready = Vec::with_capacity(layers);
        for (layer, (kl, vl)) in k.iter().zip(v).enumerate() {
            for (part, pool) in [kl, vl].into_iter().enumerate() {
                with_device_ptr(pool, &self.copy, |base| {
                    for (&(start, len), host) in outs.iter().zip(hosts.iter_mut()) {
                        let n = len * row_bytes;
                        let at = (2 * layer + part) * n;
                        let dst = &mut host[at..at + n];
                        let src = base + (start * row_bytes) as u64;
                        // SAFETY: `src..src + n` lies in the pool (ranges checked by the
                        // caller); `dst` is pinned memory that outlives the copy (its chunk
                        // waits for the copy's event before it is read or freed; on an error
                        // `copy` waits for the stream).
                        unsafe { result::memcpy_dtoh_async(dst, src, stream) }.map_err(transfer)?;
                    }
                    for &(start, bytes) in &sources {
                        let n = bytes.len() / (2 * layers);
                        let at = (2 * layer + part) * n;
                        let dst = base + (start * row_bytes) as u64;
                        // SAFETY: as above; the source stays in `in_flight` until the stream
                        // has passed it.
                        unsafe { result::memcpy_htod_async(dst, &bytes[at..at + n], stream) }
                            .map_err(transfer)?;
                    }
                    Ok(())
                })?;
            }
            ready.push(self.copy.record_event(None).map_err(transfer)?);
        }
        drop(hosts);
        if pipelined {
            *self.ready.lock() = ready.into_iter().map(Some).collect();
        } else {
            self.copy.synchronize().map_err(transfer)?;
        }
        let done = outs
            .iter()
            .map(|_| self.copy.record_event(None).map_err(transfer))
            .collect::<Result<Vec<CudaEvent>>>()?;
        let chunks = std::mem::take(bufs)
            .into_iter()
            .zip(outs)
            .zip(done)
            .map(|((buf, &(_, len)), done)| {
                ChunkBytes::device(Box::new(Pinned {
                    buf: Some(buf),
                    len: 2 * layers * len * row_bytes,
                    done,
                    spare: Arc::clone(&self.spare),
                }))
            })
            .collect::<Vec<_>>();
        Ok(chunks)
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        // Swap-in sources are freed with the mover: not before the stream has passed them.
        let _ = self.copy.synchronize();
    }
}

/// Runs `f` with the device address of `pool`'s first element, ordered after the pool's last
/// write on `stream`; the pool's read event is recorded on `stream` after `f` has queued its
/// copies (cudarc's tracking then sees them: a later writer on another stream waits, and the
/// memory is not freed under them). Writes into the pool through this address are ordered for
/// the compute stream by the mover's per-layer events instead.
fn with_device_ptr(
    pool: &Tensor,
    stream: &Arc<CudaStream>,
    f: impl FnOnce(sys::CUdeviceptr) -> Result<()>,
) -> Result<()> {
    let (storage, layout) = pool.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(Error::Unsupported(
            "GPU copies of a pool that is not on the GPU".into(),
        ));
    };
    let offset = (layout.start_offset() * pool.dtype().size_in_bytes()) as u64;
    match &cs.slice {
        CudaStorageSlice::F32(s) => {
            let (ptr, _recorded_on_drop) = s.device_ptr(stream);
            f(ptr + offset)
        }
        CudaStorageSlice::F16(s) => {
            let (ptr, _recorded_on_drop) = s.device_ptr(stream);
            f(ptr + offset)
        }
        CudaStorageSlice::BF16(s) => {
            let (ptr, _recorded_on_drop) = s.device_ptr(stream);
            f(ptr + offset)
        }
        CudaStorageSlice::U8(s) => {
            let (ptr, _recorded_on_drop) = s.device_ptr(stream);
            f(ptr + offset)
        }
        _ => Err(Error::Unsupported(format!(
            "GPU copies of a {:?} pool",
            pool.dtype()
        ))),
    }
}

/// Turns off cudarc's per-buffer event tracking on `device`'s context, for a device that
/// issues every op on one stream ([`crate::kernels::own_stream`]). Once a second stream exists
/// (the mover's), cudarc otherwise gives every allocation two events and waits on and records
/// them around every kernel argument: some ten driver calls per candle op, which made most of
/// a decode step's host time. The pool orders its streams itself (the module comment):
/// every compute-stream access to the pool goes through [`KvPool::layer`]'s wait
/// (`await_copies`), the copy stream joins the compute stream before its copies, host buffers
/// stay alive until their copies pass, and the mover drops (waiting for its stream) before the
/// pool's tensors. No other buffer crosses streams.
///
/// [`KvPool::layer`]: super::KvPool::layer
pub(super) fn untrack(device: &CudaDevice) {
    // SAFETY: see above; cudarc requires the caller to order the streams' uses of shared
    // buffers, which the mover's events do.
    unsafe { device.disable_event_tracking() }
}

/// A chunk's bytes, the first `len` of a pinned buffer, valid once `done` has passed; the
/// buffer goes back to `spare` when the chunk is released.
#[derive(Debug)]
struct Pinned {
    buf: Option<PinnedHostSlice<u8>>,
    len: usize,
    done: CudaEvent,
    spare: Spare,
}

impl HostBuffer for Pinned {
    fn bytes(&self) -> std::result::Result<&[u8], ChunkUnavailable> {
        let failed = |e: DriverError| ChunkUnavailable::Copy(Arc::new(e));
        self.done.synchronize().map_err(failed)?;
        // Taken only by `drop`, after which nothing reads the chunk.
        let Some(buf) = self.buf.as_ref() else {
            return Err(ChunkUnavailable::Copy(Arc::new(std::io::Error::other(
                "chunk buffer released",
            ))));
        };
        let all = buf.as_slice().map_err(failed)?;
        Ok(&all[..self.len])
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // Released while its copy is in flight: the memory is reused or freed after the copy.
        if self.done.synchronize().is_err() {
            return;
        }
        let mut spare = self.spare.lock();
        if let Some(buf) = self.buf.take().filter(|_| spare.len() < MAX_SPARE) {
            spare.push(buf);
        }
    }
}

/// Threads per block of `pensieve_step_write_codes_*` (its emulation launches as many).
const CODES_THREADS: u32 = 32;
/// The longest heads the GPU writes as codes (`CODES_MAX_DIM` in the kernel).
const CODES_MAX_DIM: usize = 256;

/// New tokens' `k` and `v` (`[tokens, n_kv_heads, head_dim]`) written to their slots of a
/// layer's pools of `codes` by the GPU (`kernels/step.cu`'s `write_codes`: the bytes
/// [`super::KvPool::write`] forms on the host, checked under the emulator), with `index` from
/// [`super::KvPool::write_index`] (row `r` starts with token `r`'s slot). `Ok(false)`, writing
/// nothing, where the GPU does not: heads longer than the kernel takes, or a device whose ops
/// are ordered by cudarc's events (the kernel records none).
pub(super) fn write_codes(
    (k, v): (&Tensor, &Tensor),
    index: &Tensor,
    (k_pool, v_pool): (&Tensor, &Tensor),
    codes: Codes,
    turned: bool,
) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;

    use crate::kernels::{function, own_stream, tensor_address, STEP};

    let (tokens, kv_heads, head_dim) = k.dims3()?;
    let candle_core::Device::Cuda(dev) = k.device() else {
        return Ok(false);
    };
    if head_dim > CODES_MAX_DIM || !own_stream(dev) || tokens == 0 {
        return Ok(false);
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (ka, t) = tensor_address(&k, "k")?;
    let (va, tv) = tensor_address(&v, "v")?;
    let (ia, ti) = tensor_address(index, "slots")?;
    let (kpa, _) = tensor_address(k_pool, "k pool")?;
    let (vpa, _) = tensor_address(v_pool, "v pool")?;
    if t != tv || ti != "u32" || t == "u8" || t == "u32" {
        return Err(Error::InvalidBatch(format!(
            "codes written from k {t}, v {tv} through slots of {ti}"
        )));
    }
    let layout = match codes {
        Codes::Q8 => "q8",
        Codes::Q4 => "q4",
    };
    let func = function(
        dev,
        STEP,
        &format!("pensieve_step_write_codes_{t}_{layout}"),
    )?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    let width = (kv_heads * head_dim) as i32;
    let slot_stride = index.dim(1)? as i32;
    let ints = [kv_heads, head_dim].map(|x| x as i32);
    let turned = i32::from(turned);
    b.arg(&ka).arg(&va).arg(&width).arg(&width);
    b.arg(&ia).arg(&slot_stride).arg(&kpa).arg(&vpa);
    b.arg(&ints[0]).arg(&ints[1]).arg(&turned);
    let config = LaunchConfig {
        grid_dim: (tokens as u32, kv_heads as u32, 2),
        block_dim: (CODES_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match the kernel's parameters in order and type; k and v are
    // contiguous `[tokens, kv_heads * head_dim]`, the index's rows start with slots the pool
    // checked, so block (r, h, z) reads row r's head h and writes head h of its slot's row.
    unsafe { b.launch(config) }.w()?;
    Ok(true)
}

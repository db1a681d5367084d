//! The kernels launched on a GPU ([`crate::kernels::ATTENTION`]): the step's plan uploaded once
//! (one copy) and reused by every layer.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaDevice, CudaStorage, CustomOp3, Layout, Shape};
use parking_lot::Mutex;

use super::plan::{mma_shared_bytes, Params, Plan, PlanShape, MAX_Q, NO_WINDOW};
use crate::attention::codes::Codes;
use crate::attention::{AttentionBatch, Dims};
use crate::kernels::{function, ATTENTION};

/// Threads per block of the attention kernel (`THREADS` in the kernel) and of the merge.
const ATTEND_THREADS: u32 = 128;
const MERGE_THREADS: u32 = 256;
/// Shared memory a block may take without its function opting in.
const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

// SAFETY: `Params` is `repr(C)` of 4-byte plain values, laid out as the kernel's struct.
unsafe impl DeviceRepr for Params {}

/// A step's plan on the device.
struct DevicePlan {
    /// The context and shapes it was cut for.
    key: (usize, PlanShape),
    params: Params,
    items: usize,
    mma_items: usize,
    merges: usize,
    words: CudaSlice<u32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

/// The device plan of the [`AttentionBatch`] that holds it, uploaded by the first layer that
/// needs it; a clone of the batch shares it (same sequences), a pushed sequence resets it.
#[derive(Clone, Default)]
pub(crate) struct PlanCache(Arc<Mutex<Option<Arc<DevicePlan>>>>);

impl std::fmt::Debug for PlanCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlanCache")
    }
}

/// Whether items of many queries go to the tensor-core kernel: `PENSIEVE_CUDA_MMA=0` sends
/// every item to the other one, for comparisons (`examples/bench_gpu.rs` switches it).
fn mma_on() -> bool {
    std::env::var("PENSIEVE_CUDA_MMA").map_or(true, |v| v != "0")
}

fn device_plan(
    batch: &AttentionBatch,
    dev: &CudaDevice,
    shape: PlanShape,
) -> candle_core::Result<Arc<DevicePlan>> {
    let ctx = dev.cuda_stream().context().clone();
    let key = (ctx.cu_ctx() as usize, shape);
    let mut cached = batch.device_plan.0.lock();
    if let Some(p) = cached.as_ref().filter(|p| p.key == key) {
        return Ok(p.clone());
    }
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    let plan = Plan::new(
        batch,
        PlanShape {
            sms: sms.max(1) as usize,
            ..shape
        },
    )
    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let parts = plan.parts.max(1);
    let p = Arc::new(DevicePlan {
        key,
        params: plan.params,
        items: plan.items,
        mma_items: plan.mma_items,
        merges: plan.merges,
        words: dev.clone_htod(&plan.words)?,
        // SAFETY (both): a merge reads only the partials its items wrote before it, earlier
        // on the same stream.
        part_acc: unsafe { dev.alloc::<f32>(parts * MAX_Q * shape.head_dim)? },
        part_ml: unsafe { dev.alloc::<f32>(parts * MAX_Q * 2)? },
    });
    *cached = Some(p.clone());
    Ok(p)
}

/// The op as candle sees it on a CUDA device.
pub(crate) struct CudaAttention<'a> {
    pub batch: &'a AttentionBatch,
    pub dims: Dims,
    pub scale: f32,
    pub window: Option<u32>,
}

impl CustomOp3 for CudaAttention<'_> {
    fn name(&self) -> &'static str {
        "pensieve-paged-attention-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the CUDA attention op runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        k: &CudaStorage,
        k_l: &Layout,
        v: &CudaStorage,
        v_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = &q.device;
        let d = self.dims;
        let CudaStorageSlice::F32(q_s) = &q.slice else {
            candle_core::bail!("q must be f32 for the CUDA attention kernel")
        };
        let q = view(q_s, q_l, "q", 4)?;
        let (dtype, bytes) = match (&k.slice, &v.slice, d.codes) {
            (CudaStorageSlice::F32(_), CudaStorageSlice::F32(_), _) => ("f32", 4),
            (CudaStorageSlice::F16(_), CudaStorageSlice::F16(_), _) => ("f16", 2),
            (CudaStorageSlice::BF16(_), CudaStorageSlice::BF16(_), _) => ("bf16", 2),
            (CudaStorageSlice::U8(_), CudaStorageSlice::U8(_), Some(Codes::Q8)) => ("q8", 1),
            (CudaStorageSlice::U8(_), CudaStorageSlice::U8(_), Some(Codes::Q4)) => ("q4", 1),
            _ => candle_core::bail!(
                "the CUDA attention kernel reads two f32, f16, bf16 or 8- and 4-bit pools"
            ),
        };
        if !matches!(d.head_dim, 64 | 128 | 256) {
            candle_core::bail!(
                "the CUDA attention kernel takes head dim 64, 128 or 256, not {}",
                d.head_dim
            )
        }
        let shape = PlanShape::of(d, bytes, 0, mma_on());
        let plan = device_plan(self.batch, dev, shape)?;
        let params = Params {
            scale: self.scale,
            window: self.window.unwrap_or(NO_WINDOW),
            ..plan.params
        };
        // SAFETY: every output is written by exactly one item or merge (the emulator's tests
        // check this on a NaN-filled output).
        let out = unsafe { dev.alloc::<f32>(d.tokens * d.n_heads * d.head_dim)? };
        let run = Launch {
            dev,
            q: &q,
            plan: &plan,
            out: &out,
            params: &params,
        };
        // The tensor-core kernel lays its arrays out in dynamic shared memory.
        let mma_shared = mma_shared_bytes(d.head_dim);
        for (blocks, kernel, shared) in [(plan.items, "", 0), (plan.mma_items, "mma_", mma_shared)]
        {
            if blocks > 0 {
                let name = format!("pensieve_attention_{kernel}{dtype}_d{}", d.head_dim);
                let func = function(dev, ATTENTION, &name)?;
                if shared > STATIC_SHARED_LIMIT {
                    // Past 48 KiB a kernel takes dynamic shared memory only when its function
                    // says so. Set at every launch (one driver call, a microsecond or two,
                    // beside a prefill's attention): the cached function keeps no flag.
                    func.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared as i32,
                    )
                    .w()?;
                }
                run.attend_pools(&func, blocks, shared, (k, k_l), (v, v_l))?;
            }
        }
        if plan.merges > 0 {
            run.merge(d.head_dim)?;
        }
        let storage = CudaStorage {
            slice: CudaStorageSlice::F32(out),
            device: dev.clone(),
        };
        Ok((storage, Shape::from((d.tokens, d.n_heads, d.head_dim))))
    }
}

/// The attention launches' arguments but the kernel and the pools.
struct Launch<'a> {
    dev: &'a CudaDevice,
    q: &'a CudaView<'a, f32>,
    plan: &'a DevicePlan,
    out: &'a CudaSlice<f32>,
    params: &'a Params,
}

impl Launch<'_> {
    /// [`Self::attend`] over pools of whichever storage type they hold (both the same).
    fn attend_pools(
        &self,
        func: &CudaFunction,
        blocks: usize,
        shared: u32,
        (k, k_l): (&CudaStorage, &Layout),
        (v, v_l): (&CudaStorage, &Layout),
    ) -> candle_core::Result<()> {
        let launch = (func, blocks, shared);
        match (&k.slice, &v.slice) {
            (CudaStorageSlice::F32(ks), CudaStorageSlice::F32(vs)) => {
                self.attend(launch, view(ks, k_l, "k", 4)?, view(vs, v_l, "v", 4)?)
            }
            (CudaStorageSlice::F16(ks), CudaStorageSlice::F16(vs)) => {
                self.attend(launch, view(ks, k_l, "k", 2)?, view(vs, v_l, "v", 2)?)
            }
            (CudaStorageSlice::BF16(ks), CudaStorageSlice::BF16(vs)) => {
                self.attend(launch, view(ks, k_l, "k", 2)?, view(vs, v_l, "v", 2)?)
            }
            // Codes: rows of bytes, whose copies are as wide as their alignment allows.
            (CudaStorageSlice::U8(ks), CudaStorageSlice::U8(vs)) => {
                self.attend(launch, view(ks, k_l, "k", 1)?, view(vs, v_l, "v", 1)?)
            }
            _ => candle_core::bail!("the CUDA attention kernel reads two pools of one type"),
        }
    }

    /// Folds the split items' partials into their outputs (`pensieve_attention_merge`).
    fn merge(&self, head_dim: usize) -> candle_core::Result<()> {
        let func = function(self.dev, ATTENTION, "pensieve_attention_merge")?;
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let head_dim = head_dim as i32;
        b.arg(&self.plan.words);
        b.arg(&self.plan.part_acc);
        b.arg(&self.plan.part_ml);
        b.arg(self.out);
        b.arg(self.params);
        b.arg(&head_dim);
        // SAFETY: the arguments match `pensieve_attention_merge`'s parameters in order and
        // type; the partials were written by the attention launches before it on the same
        // stream.
        unsafe { b.launch(grid(self.plan.merges, MERGE_THREADS, 0)) }.w()?;
        Ok(())
    }

    /// `blocks` items of `func` (one attention kernel), a block of `ATTEND_THREADS` with
    /// `shared` bytes of dynamic shared memory each.
    fn attend<T: DeviceRepr>(
        &self,
        (func, blocks, shared): (&CudaFunction, usize, u32),
        k: CudaView<'_, T>,
        v: CudaView<'_, T>,
    ) -> candle_core::Result<()> {
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(func);
        b.arg(self.q);
        b.arg(&k);
        b.arg(&v);
        b.arg(&self.plan.words);
        b.arg(self.out);
        b.arg(&self.plan.part_acc);
        b.arg(&self.plan.part_ml);
        b.arg(self.params);
        // SAFETY: the arguments match the attention kernels' parameters in order and type;
        // every index the kernel forms comes from the plan and the batch, whose slots
        // `Dims::check` checked against the pool.
        unsafe { b.launch(grid(blocks, ATTEND_THREADS, shared)) }.w()?;
        Ok(())
    }
}

/// The contiguous part of `s` that `l` covers, starting 16-byte aligned (the kernel loads K/V
/// rows 16 bytes at a time).
fn view<'a, T: DeviceRepr>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    what: &str,
    bytes: usize,
) -> candle_core::Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) if (a * bytes).is_multiple_of(16) => Ok(s.slice(a..b)),
        Some(_) => {
            candle_core::bail!("{what} must start 16-byte aligned for the CUDA attention kernel")
        }
        None => candle_core::bail!("{what} must be contiguous for the CUDA attention kernel"),
    }
}

/// A 1-D grid of `n` blocks of `threads` threads, each with `shared` bytes of dynamic shared
/// memory.
fn grid(n: usize, threads: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared,
    }
}

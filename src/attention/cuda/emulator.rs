//! The CUDA kernel of `kernels/attention.cu` run on the CPU by the emulator (feature
//! `cuda-emulator`, which the tests turn on; see `kernels/README.md`): the same planner, the
//! same launches in the same order with the same arguments as on a GPU, each block's threads as
//! fibers under a chosen schedule. Buffers the GPU would leave uninitialized (the output, the
//! partials) are filled with NaN first, so a query no block writes shows.

use std::ffi::{c_char, c_int, c_void};

use candle_core::{DType, Device, Tensor};

use super::plan::{mma_shared_bytes, Params, Plan, PlanShape, MAX_Q, NO_WINDOW};
use crate::attention::codes::{self, Codes};
use crate::attention::{Attend, Dims};

/// Threads per block of the attention kernel (`THREADS` in the kernel) and of the merge.
const ATTEND_THREADS: u32 = 128;
const MERGE_THREADS: u32 = 256;

type AttendFn = unsafe extern "C" fn(
    *const f32,
    *const c_void,
    *const c_void,
    *const u32,
    *mut f32,
    *mut f32,
    *mut f32,
    Params,
);
type MergeFn = unsafe extern "C" fn(*const u32, *const f32, *const f32, *mut f32, Params, i32);

/// One compiled copy of the kernels: the shipped one or a deliberately broken one.
pub(super) struct Variant {
    name: &'static str,
    why: &'static str,
    /// By pool type (f32, f16, bf16, `q8_0` and `q4_0` codes), then head dim (64, 128, 256).
    attend: [[AttendFn; 3]; 5],
    /// The tensor-core kernel, by pool type (f16, bf16), then head dim (64, 128, 256).
    mma: [[AttendFn; 3]; 2],
    merge: MergeFn,
}

type AddRmsNormFn =
    unsafe extern "C" fn(*const c_void, *const c_void, *const c_void, *mut c_void, i32, i32, f32);
type GatedFn =
    unsafe extern "C" fn(*const c_void, *const c_void, *mut c_void, i64, i32, i32, i32, i32);
type RopeWriteFn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    *const c_void,
    i32,
    i32,
    i32,
    *const c_void,
    *const c_void,
    *const u32,
    *mut f32,
    *mut c_void,
    *mut c_void,
    i32,
    i32,
    i32,
    i32,
);

type WriteCodesFn = unsafe extern "C" fn(
    *const c_void,
    *const c_void,
    i32,
    i32,
    *const u32,
    i32,
    *mut u8,
    *mut u8,
    i32,
    i32,
    i32,
);

/// One compiled copy of the step's fused kernels (`kernels/step.cu`), by activation type
/// (f32, f16, bf16), then for RoPE by pool type; the writes of codes by layout (`q8_0`,
/// `q4_0`), then activation type.
pub(super) struct StepVariant {
    name: &'static str,
    why: &'static str,
    write_codes: [[WriteCodesFn; 3]; 2],
    add_rms_norm: [AddRmsNormFn; 3],
    gated: [GatedFn; 3],
    rope_write: [[RopeWriteFn; 3]; 3],
}

include!(concat!(env!("OUT_DIR"), "/emu_kernels.rs"));

pub mod step;

unsafe extern "C" {
    fn pensieve_emu_launch(
        grid: *const u32,
        block: *const u32,
        dynamic_shared: usize,
        schedule: c_int,
        seed: u64,
        body: extern "C" fn(*mut c_void),
        ctx: *mut c_void,
        report: *mut c_char,
        report_len: usize,
    ) -> c_int;
}

/// The order in which the emulator resumes a block's threads between sync points. A kernel
/// without races gives bit-identical outputs under all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Thread order, every ready thread once per round: warps in lockstep.
    Lockstep,
    /// Reverse thread order.
    Reverse,
    /// The last warp runs as far as it can before the others start.
    WarpAhead,
    /// A fresh random order every round, from this seed.
    Shuffled(u64),
}

impl Schedule {
    /// One of each kind.
    pub const ALL: [Schedule; 4] = [
        Schedule::Lockstep,
        Schedule::Reverse,
        Schedule::WarpAhead,
        Schedule::Shuffled(0x5eed),
    ];

    fn code(self) -> (c_int, u64) {
        match self {
            Schedule::Lockstep => (0, 0),
            Schedule::Reverse => (1, 0),
            Schedule::WarpAhead => (2, 0),
            Schedule::Shuffled(seed) => (3, seed),
        }
    }
}

/// How to run one emulated call.
#[derive(Clone, Copy, Debug)]
pub struct Emulation {
    /// Which compiled copy of the kernels: 0 is the kernel as it ships, the others its
    /// deliberate breakages ([`variants`]).
    pub variant: usize,
    pub schedule: Schedule,
    /// The streaming multiprocessors the planner fills (few: decode rows are split).
    pub sms: usize,
    /// Whether items of many queries go to the tensor-core kernel where it exists.
    pub mma: bool,
}

impl Default for Emulation {
    fn default() -> Self {
        Self {
            variant: 0,
            schedule: Schedule::Lockstep,
            sms: 132,
            mma: true,
        }
    }
}

/// Whether the CPU device runs attention through the emulated CUDA kernel instead of the CPU
/// op: with `PENSIEVE_EMULATE_CUDA=1` in the environment, for the shapes the kernel takes
/// (pools of codes are `U8`). It lets the engine's own batches (swaps, drops, recompute) run
/// through the kernel in a test.
pub fn replaces_the_cpu_op(head_dim: usize, dtype: DType) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PENSIEVE_EMULATE_CUDA").is_ok_and(|v| v == "1"))
        && matches!(head_dim, 64 | 128 | 256)
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::U8)
}

/// Names and descriptions of the compiled kernel copies, in [`Emulation::variant`] order.
pub fn variants() -> Vec<(&'static str, &'static str)> {
    VARIANTS.iter().map(|v| (v.name, v.why)).collect()
}

/// Why an emulated call failed.
#[derive(Debug, thiserror::Error)]
pub enum EmulationError {
    /// The threads disagreed about a barrier or a warp collective (the report says where).
    #[error("the emulator stopped the kernel: {0}")]
    Divergence(String),
    /// The call itself was invalid.
    #[error(transparent)]
    Call(#[from] crate::Error),
}

fn candle(e: candle_core::Error) -> EmulationError {
    EmulationError::Call(e.into())
}

/// [`crate::attention::attention_in_window`] computed by the CUDA kernel under the emulator:
/// CPU tensors in (q `[tokens, n_heads, head_dim]`, pools `[n_slots, n_kv_heads, head_dim]` of
/// f32, f16 or bf16, or of 8- and 4-bit codes as [`crate::attention::KvPool`] writes them;
/// head dims 64, 128 or 256), f32 out.
///
/// # Errors
/// [`EmulationError::Divergence`] when the kernel's threads disagree about a sync point;
/// [`EmulationError::Call`] for shapes the kernel does not take.
pub fn attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    attend: Attend<'_>,
    how: Emulation,
) -> Result<Tensor, EmulationError> {
    let dims = Dims::check(q, k_pool, v_pool, attend.batch)?;
    // The kernel reads codes of turned heads as they are: the queries turned alike (and in
    // codes), the output turned back, as `attention_in_window` does around it.
    codes::rotated(q, dims, |q| {
        let (q, attend) = codes::scored_as_codes(q, dims, attend)?;
        kernel(&q, k_pool, v_pool, attend, how)
    })
}

/// [`attention`] over the pools as they are stored (codes of turned heads met by queries
/// the caller turned and quantized).
pub(crate) fn kernel(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    attend: Attend<'_>,
    how: Emulation,
) -> Result<Tensor, EmulationError> {
    let Attend {
        batch,
        scale,
        window,
        ..
    } = attend;
    let dims = Dims::check(q, k_pool, v_pool, batch)?;
    let dtype = k_pool.dtype();
    let (t, d) = kernel_index(dims, dtype)?;
    let variant = VARIANTS
        .get(how.variant)
        .ok_or_else(|| crate::Error::InvalidBatch(format!("no kernel variant {}", how.variant)))?;
    let shape = PlanShape::of(dims, dtype.size_in_bytes(), how.sms, how.mma);
    let plan = Plan::new(batch, shape)?;
    let params = Params {
        scale,
        window: window.unwrap_or(NO_WINDOW),
        ..plan.params
    };

    let q = q.to_dtype(DType::F32).map_err(candle)?;
    let q = q
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(candle)?;
    let (k, v) = (pool_bytes(k_pool)?, pool_bytes(v_pool)?);
    let n_out = dims.tokens * dims.n_heads * dims.head_dim;
    let mut out = vec![f32::NAN; n_out];
    let mut part_acc = vec![f32::NAN; plan.parts.max(1) * MAX_Q * dims.head_dim];
    let mut part_ml = vec![f32::NAN; plan.parts.max(1) * MAX_Q * 2];

    let attend = variant.attend[t][d];
    let (qp, kp, vp, wp) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), plan.words.as_ptr());
    let (op, ap, mp) = (
        out.as_mut_ptr(),
        part_acc.as_mut_ptr(),
        part_ml.as_mut_ptr(),
    );
    if plan.items > 0 {
        // SAFETY: the arguments are the kernel's, in order and type; every buffer outlives the
        // launch, which returns when the grid has run; the kernel indexes them through the
        // plan, which `Dims::check` checked against the pool.
        launch(plan.items, ATTEND_THREADS, 0, how.schedule, &|| unsafe {
            attend(qp, kp.cast(), vp.cast(), wp, op, ap, mp, params)
        })?;
    }
    if plan.mma_items > 0 {
        // The planner sends items here only for f16 and bf16 pools.
        let attend = variant.mma[t - 1][d];
        let shared = mma_shared_bytes(dims.head_dim) as usize;
        // SAFETY: as above, for the tensor-core kernel, with the dynamic shared memory it lays
        // its arrays out in.
        launch(
            plan.mma_items,
            ATTEND_THREADS,
            shared,
            how.schedule,
            &|| unsafe { attend(qp, kp.cast(), vp.cast(), wp, op, ap, mp, params) },
        )?;
    }
    if plan.merges > 0 {
        let merge = variant.merge;
        let head_dim = dims.head_dim as i32;
        // SAFETY: as above, for `pensieve_attention_merge`; the partials were written above.
        launch(plan.merges, MERGE_THREADS, 0, how.schedule, &|| unsafe {
            merge(wp, ap, mp, op, params, head_dim)
        })?;
    }
    let shape = (dims.tokens, dims.n_heads, dims.head_dim);
    Tensor::from_vec(out, shape, &Device::Cpu).map_err(candle)
}

/// Which build of the kernel takes the pools `dims` describes: the indices into a variant's
/// `attend` table.
fn kernel_index(dims: Dims, dtype: DType) -> Result<(usize, usize), EmulationError> {
    let t = match dims.codes {
        Some(Codes::Q8) => Some(3),
        Some(Codes::Q4) => Some(4),
        None => [DType::F32, DType::F16, DType::BF16]
            .iter()
            .position(|&x| x == dtype),
    };
    let d = [64, 128, 256].iter().position(|&x| x == dims.head_dim);
    match (t, d) {
        (Some(t), Some(d)) => Ok((t, d)),
        _ => Err(crate::Error::InvalidBatch(format!(
            "the CUDA kernel takes f32, f16, bf16 or 8- and 4-bit pools of head dim 64, 128 or 256, not {dtype:?} of {}",
            dims.head_dim
        ))
        .into()),
    }
}

/// The pool's values as stored, contiguous, in a 16-byte aligned buffer (the kernel loads
/// rows 16 bytes at a time, as from a GPU allocation).
fn pool_bytes(pool: &Tensor) -> Result<Vec<u128>, EmulationError> {
    let flat = pool.flatten_all().map_err(candle)?;
    Ok(match pool.dtype() {
        DType::F32 => aligned(&flat.to_vec1::<f32>().map_err(candle)?, f32::to_ne_bytes),
        DType::F16 => aligned(
            &flat.to_vec1::<half::f16>().map_err(candle)?,
            half::f16::to_ne_bytes,
        ),
        DType::BF16 => aligned(
            &flat.to_vec1::<half::bf16>().map_err(candle)?,
            half::bf16::to_ne_bytes,
        ),
        _ => aligned(&flat.to_vec1::<u8>().map_err(candle)?, |b: u8| [b]),
    })
}

fn aligned<T: Copy, const N: usize>(values: &[T], to: fn(T) -> [u8; N]) -> Vec<u128> {
    let mut words = vec![0u128; (values.len() * N).div_ceil(16)];
    let len = words.len() * 16;
    // SAFETY: the u128s are `len` initialized bytes, and u8 has no alignment requirement.
    let bytes: &mut [u8] =
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), len) };
    for (dst, &x) in bytes.chunks_exact_mut(N).zip(values) {
        dst.copy_from_slice(&to(x));
    }
    words
}

/// Runs `body` as every thread of a grid of `blocks` blocks of `threads` threads, each block
/// with `shared` bytes of dynamic shared memory.
fn launch(
    blocks: usize,
    threads: u32,
    shared: usize,
    schedule: Schedule,
    body: &dyn Fn(),
) -> Result<(), EmulationError> {
    let grid = [u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1];
    launch_grid(grid, threads, shared, schedule, body)
}

/// Runs `body` as every thread of a grid of `grid` blocks of `threads` threads, each block
/// with `shared` bytes of dynamic shared memory.
fn launch_grid(
    grid: [u32; 3],
    threads: u32,
    shared: usize,
    schedule: Schedule,
    body: &dyn Fn(),
) -> Result<(), EmulationError> {
    extern "C" fn trampoline(ctx: *mut c_void) {
        // SAFETY: `ctx` is the `&&dyn Fn()` below, alive for the whole launch.
        let body = unsafe { &*ctx.cast::<&dyn Fn()>() };
        body();
    }
    let block = [threads, 1, 1];
    let (code, seed) = schedule.code();
    let mut report = vec![0u8; 1024];
    let mut body = body;
    // SAFETY: the pointers are valid for the call; the runtime calls `trampoline` with `ctx`
    // only while it runs, and writes at most `report.len()` bytes NUL-terminated.
    let rc = unsafe {
        pensieve_emu_launch(
            grid.as_ptr(),
            block.as_ptr(),
            shared,
            code,
            seed,
            trampoline,
            (&mut body as *mut &dyn Fn()).cast(),
            report.as_mut_ptr().cast(),
            report.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let end = report.iter().position(|&b| b == 0).unwrap_or(report.len());
    Err(EmulationError::Divergence(
        String::from_utf8_lossy(&report[..end]).into_owned(),
    ))
}

//! The step's fused kernels (`kernels/step.cu`) run by the emulator: CPU tensors in, CPU
//! tensors out, each call the launch the GPU's fused pass makes (`crate::model::fused`: the
//! same grid, threads and arguments). Outputs start as NaN, so a value no thread writes shows.

use std::ffi::c_void;

use candle_core::{DType, Device, Tensor};

use super::{
    candle, launch_grid, pool_bytes, EmulationError, Schedule, StepVariant, STEP_VARIANTS,
};
use crate::attention::codes::{turned, Codes};
use crate::math::Activation;

/// Threads per block of the norm (`NORM_THREADS` in the kernel) and of the elementwise ops, as
/// the GPU's launches use them.
const NORM_THREADS: u32 = 256;
const ELEMENT_THREADS: u32 = 256;

/// Names and descriptions of the step kernels' compiled copies: 0 is the source as it ships,
/// the others its deliberate breakages (`kernels/emu/mutants`).
pub fn variants() -> Vec<(&'static str, &'static str)> {
    STEP_VARIANTS.iter().map(|v| (v.name, v.why)).collect()
}

fn variant(i: usize) -> Result<&'static StepVariant, EmulationError> {
    STEP_VARIANTS
        .get(i)
        .ok_or_else(|| crate::Error::InvalidBatch(format!("no step kernel variant {i}")).into())
}

/// The kernels' index of a value type (f32, f16, bf16).
fn type_index(dtype: DType) -> Result<usize, EmulationError> {
    [DType::F32, DType::F16, DType::BF16]
        .iter()
        .position(|&x| x == dtype)
        .ok_or_else(|| {
            crate::Error::InvalidBatch(format!("the step kernels do not take {dtype:?}")).into()
        })
}

/// Room for `n` values of `dtype`, every byte 0xff (a NaN in each float type).
fn unwritten(n: usize, dtype: DType) -> Vec<u128> {
    vec![u128::MAX; (n * dtype.size_in_bytes()).div_ceil(16)]
}

/// The first values of `words` as a `dtype` tensor of `shape` (f32, f16, bf16, or bytes).
fn tensor(words: &[u128], dtype: DType, shape: &[usize]) -> Result<Tensor, EmulationError> {
    let n: usize = shape.iter().product();
    // SAFETY: the u128s are initialized bytes, and u8 has no alignment requirement.
    let bytes: &[u8] =
        unsafe { std::slice::from_raw_parts(words.as_ptr().cast(), words.len() * 16) };
    let cpu = &Device::Cpu;
    let t = match dtype {
        DType::F32 => {
            let v = bytes.chunks_exact(4).take(n);
            let v = v.map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
            Tensor::from_vec(v.collect(), shape, cpu)
        }
        DType::F16 => {
            let v = bytes.chunks_exact(2).take(n);
            let v = v.map(|c| half::f16::from_ne_bytes([c[0], c[1]]));
            Tensor::from_vec(v.collect(), shape, cpu)
        }
        DType::BF16 => {
            let v = bytes.chunks_exact(2).take(n);
            let v = v.map(|c| half::bf16::from_ne_bytes([c[0], c[1]]));
            Tensor::from_vec(v.collect(), shape, cpu)
        }
        _ => Tensor::from_vec(bytes[..n].to_vec(), shape, cpu),
    };
    t.map_err(candle)
}

/// `x + y` and its RMSNorm with weights `w` (`[rows, dim]`, `[rows, dim]`, `[dim]`, one type),
/// as `pensieve_step_add_rms_norm_*` forms them: (the sums, the normed sums).
///
/// # Errors
/// [`EmulationError`] for shapes or types the kernel does not take, or a stopped run.
pub fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f32,
    variant_index: usize,
    schedule: Schedule,
) -> Result<(Tensor, Tensor), EmulationError> {
    let (rows, dim) = x.dims2().map_err(candle)?;
    let dtype = x.dtype();
    let f = variant(variant_index)?.add_rms_norm[type_index(dtype)?];
    let (xw, yw, ww) = (pool_bytes(x)?, pool_bytes(y)?, pool_bytes(w)?);
    let mut out = unwritten(2 * rows * dim, dtype);
    let (xp, yp, wp, op) = (xw.as_ptr(), yw.as_ptr(), ww.as_ptr(), out.as_mut_ptr());
    let (r, d) = (rows as i32, dim as i32);
    // SAFETY: the arguments are the kernel's, in order and type; each block reads its row of
    // x and y (`rows` x `dim` values each) and `dim` weights, and writes its row of both
    // halves of `out`, all of which outlive the launch.
    launch_grid([rows as u32, 1, 1], NORM_THREADS, 0, schedule, &|| unsafe {
        f(
            xp.cast(),
            yp.cast(),
            wp.cast(),
            op.cast::<c_void>(),
            r,
            d,
            eps,
        )
    })?;
    let out = tensor(&out, dtype, &[2, rows, dim])?;
    Ok((out.get(0).map_err(candle)?, out.get(1).map_err(candle)?))
}

/// `act(g) * u` over two tensors of one shape and type, as `pensieve_step_gated_*` forms it.
///
/// # Errors
/// As [`add_rms_norm`].
pub fn gated(
    g: &Tensor,
    u: &Tensor,
    act: Activation,
    variant_index: usize,
    schedule: Schedule,
) -> Result<Tensor, EmulationError> {
    let dtype = g.dtype();
    let f = variant(variant_index)?.gated[type_index(dtype)?];
    let total = g.elem_count();
    let n = g.dims().last().copied().unwrap_or(1) as i32;
    let (gw, uw) = (pool_bytes(g)?, pool_bytes(u)?);
    let mut out = unwritten(total, dtype);
    let (gp, up, op) = (gw.as_ptr(), uw.as_ptr(), out.as_mut_ptr());
    let code = match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::ClampedSwiglu => 2,
    };
    let blocks = total.div_ceil(ELEMENT_THREADS as usize) as u32;
    // SAFETY: as above; each thread reads and writes one value below `total`.
    launch_grid([blocks, 1, 1], ELEMENT_THREADS, 0, schedule, &|| unsafe {
        f(
            gp.cast(),
            up.cast(),
            op.cast::<c_void>(),
            total as i64,
            n,
            n,
            n,
            code,
        )
    })?;
    tensor(&out, dtype, g.dims())
}

/// The operands of [`rope_write`]: as the GPU's pass hands them to `RopeWrite`.
pub struct RopeWriteCall<'a> {
    /// The queries, `[tokens, n_heads * head_dim]`.
    pub q: &'a Tensor,
    /// The keys, `[tokens, n_kv_heads * head_dim]`, of q's type.
    pub k: &'a Tensor,
    /// The values, as the keys.
    pub v: &'a Tensor,
    /// The rotation's cosines, `[tokens, head_dim / 2]`, of q's type.
    pub cos: &'a Tensor,
    /// Its sines, as the cosines.
    pub sin: &'a Tensor,
    /// Each token's slot in the pools.
    pub slots: &'a [u32],
    /// The key pool, `[slots, n_kv_heads, head_dim]` of the pool's type.
    pub k_pool: &'a Tensor,
    /// The value pool, as the key pool.
    pub v_pool: &'a Tensor,
    /// Query heads (the pools give the kv heads and the head dim).
    pub n_heads: usize,
    /// Pairs `(2i, 2i + 1)` turn (`rope_i`) rather than `(i, i + head_dim / 2)`.
    pub interleaved: bool,
}

/// RoPE on Q and K with the KV write, as `pensieve_step_rope_write_*_*` does them: the rotated
/// queries (f32, `[tokens, n_heads, head_dim]`) and the two pools after the write.
///
/// # Errors
/// As [`add_rms_norm`]; a slot outside the pools.
pub fn rope_write(
    call: &RopeWriteCall<'_>,
    variant_index: usize,
    schedule: Schedule,
) -> Result<(Tensor, Tensor, Tensor), EmulationError> {
    let (tokens, q_width) = call.q.dims2().map_err(candle)?;
    let (n_slots, n_kv_heads, head_dim) = call.k_pool.dims3().map_err(candle)?;
    if call.slots.len() != tokens || call.slots.iter().any(|&s| s as usize >= n_slots) {
        return Err(crate::Error::InvalidBatch(format!(
            "slots {:?} for {tokens} tokens in a pool of {n_slots}",
            call.slots
        ))
        .into());
    }
    let (dtype, pool_dtype) = (call.q.dtype(), call.k_pool.dtype());
    let f = variant(variant_index)?.rope_write[type_index(dtype)?][type_index(pool_dtype)?];
    let kv_width = (n_kv_heads * head_dim) as i32;
    let ins = [call.q, call.k, call.v, call.cos, call.sin].map(pool_bytes);
    let [qw, kw, vw, cw, sw] = ins;
    let (qw, kw, vw, cw, sw) = (qw?, kw?, vw?, cw?, sw?);
    let (mut kp, mut vp) = (pool_bytes(call.k_pool)?, pool_bytes(call.v_pool)?);
    let mut q_out = unwritten(tokens * q_width, DType::F32);
    let ptrs = (
        qw.as_ptr(),
        kw.as_ptr(),
        vw.as_ptr(),
        cw.as_ptr(),
        sw.as_ptr(),
    );
    let outs = (q_out.as_mut_ptr(), kp.as_mut_ptr(), vp.as_mut_ptr());
    let slots = call.slots.as_ptr();
    let heads = [call.n_heads, n_kv_heads, head_dim].map(|x| x as i32);
    let interleaved = i32::from(call.interleaved);
    let grid = [tokens as u32, (call.n_heads + 2 * n_kv_heads) as u32, 1];
    let threads = (head_dim as u32 / 2).clamp(32, 128);
    // SAFETY: as above; block (r, head) reads row r's head of q, k or v and row r of cos and
    // sin, and writes row r's head of q_out or that head of slot `slots[r]` (checked above)
    // of a pool.
    launch_grid(grid, threads, 0, schedule, &|| unsafe {
        f(
            ptrs.0.cast(),
            ptrs.1.cast(),
            ptrs.2.cast(),
            q_width as i32,
            kv_width,
            kv_width,
            ptrs.3.cast(),
            ptrs.4.cast(),
            slots,
            outs.0.cast(),
            outs.1.cast(),
            outs.2.cast(),
            heads[0],
            heads[1],
            heads[2],
            interleaved,
        )
    })?;
    let pool_shape = [n_slots, n_kv_heads, head_dim];
    Ok((
        tensor(&q_out, DType::F32, &[tokens, call.n_heads, head_dim])?,
        tensor(&kp, pool_dtype, &pool_shape)?,
        tensor(&vp, pool_dtype, &pool_shape)?,
    ))
}

/// Threads per block of the writes of codes, as the GPU's launch uses them (`pool/cuda.rs`).
const CODES_THREADS: u32 = 32;

/// New tokens' `k` and `v` (`[tokens, n_kv_heads * head_dim]`, one activation type) written
/// to `slots` of two pools of codes (`U8`, `[n_slots, n_kv_heads, row bytes]`, as
/// [`crate::attention::KvPool`] keeps them), as `pensieve_step_write_codes_*` writes them on a
/// GPU: the two pools after the write.
///
/// # Errors
/// As [`add_rms_norm`]; a slot outside the pools, rows of no known codes.
pub fn write_codes(
    (k, v): (&Tensor, &Tensor),
    slots: &[u32],
    (k_pool, v_pool): (&Tensor, &Tensor),
    variant_index: usize,
    schedule: Schedule,
) -> Result<(Tensor, Tensor), EmulationError> {
    let (tokens, width) = k.dims2().map_err(candle)?;
    let (n_slots, n_kv_heads, row) = k_pool.dims3().map_err(candle)?;
    let head_dim = width / n_kv_heads.max(1);
    let codes = Codes::of_row(head_dim, row).filter(|_| head_dim <= 256);
    let (Some(codes), true) = (
        codes,
        slots.len() == tokens && slots.iter().all(|&s| (s as usize) < n_slots),
    ) else {
        return Err(crate::Error::InvalidBatch(format!(
            "slots {slots:?} for {tokens} tokens in a pool of {n_slots} rows of {row} bytes"
        ))
        .into());
    };
    let c = match codes {
        Codes::Q8 => 0,
        Codes::Q4 => 1,
    };
    let f = variant(variant_index)?.write_codes[c][type_index(k.dtype())?];
    let (kw, vw) = (pool_bytes(k)?, pool_bytes(v)?);
    let (mut kp, mut vp) = (pool_bytes(k_pool)?, pool_bytes(v_pool)?);
    let (kin, vin) = (kw.as_ptr(), vw.as_ptr());
    let (kout, vout) = (kp.as_mut_ptr(), vp.as_mut_ptr());
    let ints = [width, n_kv_heads, head_dim].map(|x| x as i32);
    let turned = i32::from(turned(head_dim));
    let grid = [tokens as u32, n_kv_heads as u32, 2];
    // SAFETY: as above; block (r, h, z) reads row r's head h of k or v and writes head h of
    // slot `slots[r]` (checked above) of a pool.
    launch_grid(grid, CODES_THREADS, 0, schedule, &|| unsafe {
        f(
            kin.cast(),
            vin.cast(),
            ints[0],
            ints[0],
            slots.as_ptr(),
            1,
            kout.cast(),
            vout.cast(),
            ints[1],
            ints[2],
            turned,
        )
    })?;
    let shape = [n_slots, n_kv_heads, row];
    Ok((
        tensor(&kp, DType::U8, &shape)?,
        tensor(&vp, DType::U8, &shape)?,
    ))
}

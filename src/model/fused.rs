//! A step's small ops fused on a GPU (`kernels/step.cu`), as candle custom ops. A decode step
//! on a GPU takes as long as the host takes to issue its launches, so each of these, which
//! replaces two to five of candle's, shortens it; what they compute is the ops they replace,
//! in f32, rounded once.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp3, DType, Layout, Shape, Tensor,
};

use super::arch::Activation;
use crate::kernels::{address, function, own_stream, tensor_address, STEP};

/// Whether the fused kernels run on `dev`: where it issues every op on one stream
/// ([`own_stream`]: they leave cudarc's events unrecorded), unless `PENSIEVE_CUDA_FUSED=0` in
/// the environment sends every pass through the candle ops they replace, for comparisons
/// (`examples/bench_gpu.rs`).
pub(super) fn runs_on(dev: &CudaDevice) -> bool {
    own_stream(dev) && std::env::var("PENSIEVE_CUDA_FUSED").map_or(true, |v| v != "0")
}

/// Threads per block of the norm (`NORM_THREADS` in the kernel) and of the elementwise ops.
const NORM_THREADS: u32 = 256;
const ELEMENT_THREADS: u32 = 256;

/// `n` values of `dtype` on `dev`, left for a kernel to write, and their address.
fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> candle_core::Result<(CudaStorage, u64)> {
    let stream = dev.cuda_stream();
    // SAFETY (each arm): every value is written by the kernel launched next, before any read.
    let (slice, at) = match dtype {
        DType::F32 => {
            let s = unsafe { dev.alloc::<f32>(n)? };
            let at = s.device_ptr(&stream).0;
            (CudaStorageSlice::F32(s), at)
        }
        DType::F16 => {
            let s = unsafe { dev.alloc::<half::f16>(n)? };
            let at = s.device_ptr(&stream).0;
            (CudaStorageSlice::F16(s), at)
        }
        DType::BF16 => {
            let s = unsafe { dev.alloc::<half::bf16>(n)? };
            let at = s.device_ptr(&stream).0;
            (CudaStorageSlice::BF16(s), at)
        }
        other => bail!("the fused kernels do not write {other:?}"),
    };
    let storage = CudaStorage {
        slice,
        device: dev.clone(),
    };
    Ok((storage, at))
}

fn grid(blocks: (u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.0, blocks.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `x + y` and its RMSNorm with weights `w` (`[rows, dim]`, `[rows, dim]`, `[dim]`, one type):
/// the sum, rounded to the type as candle's add rounds it, and the norm over that sum.
pub(super) fn add_rms_norm(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f32,
) -> crate::Result<(Tensor, Tensor)> {
    let out = x.apply_op3_no_bwd(y, w, &AddRmsNorm { eps })?;
    Ok((out.get(0)?, out.get(1)?))
}

struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "pensieve-add-rms-norm"
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
        bail!("the fused add and norm run on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        y: &CudaStorage,
        yl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (rows, dim) = xl.shape().dims2()?;
        if yl.shape() != xl.shape() || wl.shape().dims() != [dim] {
            bail!(
                "add and norm: x {:?}, y {:?}, w {:?}",
                xl.shape(),
                yl.shape(),
                wl.shape()
            )
        }
        let (xa, t) = address(x, xl, "x")?;
        let (ya, ty) = address(y, yl, "y")?;
        let (wa, tw) = address(w, wl, "w")?;
        if t != ty || t != tw {
            bail!("add and norm: x {t}, y {ty}, w {tw}")
        }
        let dev = &x.device;
        let (out, oa) = alloc(dev, x.dtype(), 2 * rows * dim)?;
        let func = function(dev, STEP, &format!("pensieve_step_add_rms_norm_{t}"))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let (rows_i, dim_i) = (rows as i32, dim as i32);
        b.arg(&xa)
            .arg(&ya)
            .arg(&wa)
            .arg(&oa)
            .arg(&rows_i)
            .arg(&dim_i)
            .arg(&self.eps);
        // SAFETY: the arguments match the kernel's parameters in order and type; each block
        // reads row `blockIdx.x` < rows of x and y and writes that row of both outputs.
        unsafe { b.launch(grid((rows as u32, 1), NORM_THREADS)) }.w()?;
        Ok((out, Shape::from((2, rows, dim))))
    }
}

/// The CUDA side of the fused FFN activation (`super::ops::gated`): `act(g) * u` over
/// contiguous operands of one shape and type.
pub(super) fn gated(
    act: Activation,
    g: &CudaStorage,
    gl: &Layout,
    u: &CudaStorage,
    ul: &Layout,
) -> candle_core::Result<(CudaStorage, Shape)> {
    if gl.shape() != ul.shape() {
        bail!("gated: gate {:?}, up {:?}", gl.shape(), ul.shape())
    }
    let (ga, t) = address(g, gl, "gate")?;
    let (ua, tu) = address(u, ul, "up")?;
    if t != tu {
        bail!("gated: gate {t}, up {tu}")
    }
    let total = gl.shape().elem_count();
    let n = *gl.shape().dims().last().unwrap_or(&1);
    let dev = &g.device;
    let (out, oa) = alloc(dev, g.dtype(), total)?;
    let func = function(dev, STEP, &format!("pensieve_step_gated_{t}"))?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    let (total_i, n_i) = (total as i64, n as i32);
    let code: i32 = match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::ClampedSwiglu => 2,
    };
    b.arg(&ga)
        .arg(&ua)
        .arg(&oa)
        .arg(&total_i)
        .arg(&n_i)
        .arg(&n_i)
        .arg(&n_i)
        .arg(&code);
    let blocks = total.div_ceil(ELEMENT_THREADS as usize) as u32;
    // SAFETY: the arguments match the kernel's parameters in order and type; each thread
    // reads and writes one value below `total`.
    unsafe { b.launch(grid((blocks, 1), ELEMENT_THREADS)) }.w()?;
    Ok((out, gl.shape().clone()))
}

/// RoPE on `q` and `k` (`[tokens, heads * head_dim]`, as the projections leave them) and the
/// KV write: returns the rotated queries in f32 (`[tokens, n_heads, head_dim]`, what the
/// attention kernel reads) and writes the rotated keys and the values, in the pools' type, to
/// each token's slot of `k_pool` and `v_pool` (`[slots, n_kv_heads, head_dim]`).
pub(super) struct RopeWrite<'a> {
    /// `[tokens, head_dim / 2]` each, in the projections' type.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    /// `[tokens]` u32, each checked against the pool.
    pub slots: &'a Tensor,
    pub k_pool: &'a Tensor,
    pub v_pool: &'a Tensor,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Pairs `(2i, 2i + 1)` turn (`rope_i`) rather than `(i, i + head_dim / 2)`.
    pub interleaved: bool,
}

impl CustomOp3 for RopeWrite<'_> {
    fn name(&self) -> &'static str {
        "pensieve-rope-write"
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
        bail!("the fused RoPE and KV write run on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (tokens, d) = (ql.shape().dims2()?.0, self.head_dim);
        let (q_width, kv_width) = (self.n_heads * d, self.n_kv_heads * d);
        let pool_shape = [self.k_pool.dim(0)?, self.n_kv_heads, d];
        if ql.shape().dims() != [tokens, q_width]
            || kl.shape().dims() != [tokens, kv_width]
            || vl.shape().dims() != [tokens, kv_width]
            || self.cos.dims() != [tokens, d / 2]
            || self.sin.dims() != [tokens, d / 2]
            || self.slots.dims() != [tokens]
            || self.k_pool.dims() != pool_shape
            || self.v_pool.dims() != pool_shape
            || d % 2 != 0
        {
            bail!(
                "rope and write: q {:?}, k {:?}, v {:?}, cos {:?}, slots {:?}, pools {:?}",
                ql.shape(),
                kl.shape(),
                vl.shape(),
                self.cos.dims(),
                self.slots.dims(),
                self.k_pool.dims()
            )
        }
        let (qa, t) = address(q, ql, "q")?;
        let (ka, tk) = address(k, kl, "k")?;
        let (va, tv) = address(v, vl, "v")?;
        let (ca, tc) = tensor_address(self.cos, "cos")?;
        let (sa, ts) = tensor_address(self.sin, "sin")?;
        let (slots, tslots) = tensor_address(self.slots, "slots")?;
        let (kpa, p) = tensor_address(self.k_pool, "k pool")?;
        let (vpa, pv) = tensor_address(self.v_pool, "v pool")?;
        if [tk, tv, tc, ts] != [t; 4] || tslots != "u32" || p != pv {
            bail!(
                "rope and write: q {t}, k {tk}, v {tv}, cos {tc}, sin {ts}, slots {tslots}, \
                 pools {p}, {pv}"
            )
        }
        let dev = &q.device;
        let (out, oa) = alloc(dev, DType::F32, tokens * q_width)?;
        let func = function(dev, STEP, &format!("pensieve_step_rope_write_{t}_{p}"))?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let ints = [q_width, kv_width, kv_width].map(|x| x as i32);
        let heads = [self.n_heads, self.n_kv_heads, d].map(|x| x as i32);
        let interleaved = i32::from(self.interleaved);
        b.arg(&qa).arg(&ka).arg(&va);
        b.arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
        b.arg(&ca).arg(&sa).arg(&slots).arg(&oa).arg(&kpa).arg(&vpa);
        b.arg(&heads[0])
            .arg(&heads[1])
            .arg(&heads[2])
            .arg(&interleaved);
        let threads = (d as u32 / 2).clamp(32, 128);
        let blocks = (tokens as u32, (self.n_heads + 2 * self.n_kv_heads) as u32);
        // SAFETY: the arguments match the kernel's parameters in order and type; shapes are
        // checked above and every slot against the pool by the caller, so each block reads
        // its row's heads and writes its row of the output and its slot's rows of the pools.
        unsafe { b.launch(grid(blocks, threads)) }.w()?;
        Ok((out, Shape::from((tokens, self.n_heads, d))))
    }
}

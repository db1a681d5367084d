// A step's small ops fused on the GPU (`src/model/transformer/fused.rs`): each replaces two to
// five of candle's, so that a decode step, whose time on a GPU is the host's time to issue its
// launches, issues about half as many.
//
// - `add_rms_norm`: the residual add and the next RMSNorm (two launches, one kernel): the sum
//   rounded to the activation type as candle's add rounds it, the norm over that sum.
// - `gated`: the FFN's activation times up (two launches).
// - `rope_write`: RoPE on Q and K, Q widened to f32 for the attention kernel, K and V
//   converted to the pool's type and written to each token's slot (five launches).
// - `write_codes`: K and V written to their slots of a pool of 8- or 4-bit codes, turned
//   and quantized as the CPU writes them (the host's quantization and a copy each way).
//
// Every kernel works row by row, so a row's result does not depend on the rest of the batch
// (the engine's batch invariance). Arithmetic is f32; values are rounded once, when stored.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

constexpr int NORM_THREADS = 256;

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Block r: sum = x + y of row r, normed = RMSNorm(sum) * w, the way candle's kernel forms it
// (the mean square in f32, then scale * value * weight). out: [2, rows, dim], the sums first.
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ y,
                             const T* __restrict__ w, T* __restrict__ out, int rows, int dim,
                             float eps) {
    __shared__ float partial[NORM_THREADS / 32];
    const int r = blockIdx.x;
    const T* xr = x + (size_t)r * dim;
    const T* yr = y + (size_t)r * dim;
    T* sum = out + (size_t)r * dim;
    T* normed = out + ((size_t)rows + r) * dim;
    float sq = 0.f;
    for (int i = threadIdx.x; i < dim; i += NORM_THREADS) {
        const T s = from_f32<T>(to_f32(xr[i]) + to_f32(yr[i]));
        sum[i] = s;
        const float f = to_f32(s);
        sq += f * f;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    sq = warp_sum(sq);
    if (lane == 0) partial[warp] = sq;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; ++i) total += partial[i];
    const float scale = rsqrtf(total / (float)dim + eps);
    // Each thread reads back only the sums it wrote.
    for (int i = threadIdx.x; i < dim; i += NORM_THREADS)
        normed[i] = from_f32<T>(scale * to_f32(sum[i]) * to_f32(w[i]));
}

// The activations of `src/model/arch.rs`: 0 SiLU, 1 GELU (tanh), 2 gpt-oss's clamped SwiGLU.
__device__ __forceinline__ float activate(float g, float u, int act) {
    switch (act) {
        case 0:
            return g / (1.f + expf(-g)) * u;
        case 1:
            return 0.5f * g * (1.f + tanhf(0.7978846f * g * (1.f + 0.044715f * g * g))) * u;
        default: {
            const float c = fminf(g, 7.f);
            return c / (1.f + expf(-1.702f * c)) * (fminf(fmaxf(u, -7.f), 7.f) + 1.f);
        }
    }
}

// out[r, i] = act(g[r, i]) * u[r, i] over rows of n, the operands `g_stride` and `u_stride`
// values apart row to row.
template <typename T>
__device__ void gated(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out,
                      long long total, int n, int g_stride, int u_stride, int act) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const long long r = e / n, i = e % n;
    out[e] = from_f32<T>(activate(to_f32(g[r * g_stride + i]), to_f32(u[r * u_stride + i]), act));
}

// Block (r, head) over the n_heads query heads, then the n_kv_heads key heads, then as many
// value heads of token row r: a query head is rotated into q_out (f32, [rows, n_heads, D]), a
// key head rotated and a value head copied into the pools ([slots, n_kv_heads, D] of P) at the
// row's slot. cos and sin: [rows, D / 2]. Pairs (i, i + D/2), or (2i, 2i + 1) if interleaved,
// turn by angle i, as candle's `rope` and `rope_i` turn them.
template <typename T, typename P>
__device__ void rope_write(const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, int q_stride, int k_stride, int v_stride,
                           const T* __restrict__ cos, const T* __restrict__ sin,
                           const uint32_t* __restrict__ slots, float* __restrict__ q_out,
                           P* __restrict__ k_pool, P* __restrict__ v_pool, int n_heads,
                           int n_kv_heads, int head_dim, int interleaved) {
    const int r = blockIdx.x, head = blockIdx.y, half = head_dim / 2;
    const size_t slot = slots[r];
    if (head >= n_heads + n_kv_heads) {
        const int h = head - n_heads - n_kv_heads;
        const T* src = v + (size_t)r * v_stride + (size_t)h * head_dim;
        P* dst = v_pool + (slot * n_kv_heads + h) * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = from_f32<P>(to_f32(src[i]));
        return;
    }
    const bool is_q = head < n_heads;
    const int h = is_q ? head : head - n_heads;
    const T* src = is_q ? q + (size_t)r * q_stride + (size_t)h * head_dim
                        : k + (size_t)r * k_stride + (size_t)h * head_dim;
    const T* c = cos + (size_t)r * half;
    const T* s = sin + (size_t)r * half;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
        const float x1 = to_f32(src[i1]), x2 = to_f32(src[i2]);
        const float ci = to_f32(c[i]), si = to_f32(s[i]);
        const float y1 = x1 * ci - x2 * si, y2 = x1 * si + x2 * ci;
        if (is_q) {
            float* dst = q_out + ((size_t)r * n_heads + h) * head_dim;
            dst[i1] = y1;
            dst[i2] = y2;
        } else {
            P* dst = k_pool + (slot * n_kv_heads + h) * head_dim;
            dst[i1] = from_f32<P>(y1);
            dst[i2] = from_f32<P>(y2);
        }
    }
}

// Writes `d` as f16, little-endian, at `out` (a block's bytes are not aligned).
__device__ __forceinline__ void store_scale(float d, unsigned char* out) {
    const uint16_t bits = __half_as_ushort(__float2half_rn(d));
    out[0] = (unsigned char)(bits & 0xff);
    out[1] = (unsigned char)(bits >> 8);
}

// llama.cpp's blocks of 32 codes (`src/attention/codes.rs`), quantized from 32 values as its
// reference quantizers (and `Codes::quantize`) do: the scale `d` kept as f16, the codes formed
// with the unrounded `d`. Every operation is rounded alone (`__f*_rn`: no fused multiply-add),
// so the bytes are the CPU's.
struct q8_0 {
    static constexpr int BLOCK = 34;
    __device__ static void quantize(const float* x, unsigned char* out) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
        const float d = __fdiv_rn(amax, 127.f);
        const float id = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
        store_scale(d, out);
        for (int i = 0; i < 32; ++i) out[2 + i] = (unsigned char)(int8_t)roundf(__fmul_rn(x[i], id));
    }
};
struct q4_0 {
    static constexpr int BLOCK = 18;
    __device__ static void quantize(const float* x, unsigned char* out) {
        float max = 0.f;  // the value of largest magnitude, the first of equals
        for (int i = 0; i < 32; ++i) max = fabsf(x[i]) > fabsf(max) ? x[i] : max;
        const float d = __fdiv_rn(max, -8.f);
        const float id = d != 0.f ? __fdiv_rn(1.f, d) : 0.f;
        store_scale(d, out);
        for (int j = 0; j < 16; ++j) out[2 + j] = (unsigned char)(code(x[j], id) | code(x[j + 16], id) << 4);
    }
    __device__ static int code(float x, float id) {
        const int c = (int)__fadd_rn(__fmul_rn(x, id), 8.5f);  // truncated, as Rust's `as`
        return c < 15 ? c : 15;
    }
};

// Heads of at most this many values are written as codes on the GPU (the attention kernel's
// largest).
constexpr int CODES_MAX_DIM = 256;

// Block (r, h, z): row r's kv head h of K (z = 0) or V (z = 1) written to slot `slots[r *
// slot_stride]` of its pool as blocks of C (`KvPool::write` on the CPU: the same bytes). In
// f32, turned first when `turned` (heads of a multiple of 64: the Walsh-Hadamard transform of
// each 64 values, its butterflies in `codes::hadamard`'s order, then its scale 1/8); one
// thread per 64 values for the turn and per block of 32 for the codes. k, v: [rows, n_kv_heads
// * head_dim] at k_stride and v_stride per row; pools: [n_slots, n_kv_heads, head_dim / 32 *
// C::BLOCK] bytes.
template <typename T, typename C>
__device__ void write_codes(const T* __restrict__ k, const T* __restrict__ v, int k_stride,
                            int v_stride, const uint32_t* __restrict__ slots, int slot_stride,
                            unsigned char* __restrict__ k_pool, unsigned char* __restrict__ v_pool,
                            int n_kv_heads, int head_dim, int turned) {
    __shared__ float x[CODES_MAX_DIM];
    const int r = blockIdx.x, h = blockIdx.y;
    const bool is_v = blockIdx.z == 1;
    const T* src = (is_v ? v + (size_t)r * v_stride : k + (size_t)r * k_stride) + (size_t)h * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) x[i] = to_f32(src[i]);
    __syncthreads();  // the row is in x
    if (turned && (int)threadIdx.x < head_dim / 64) {
        float* b = x + 64 * threadIdx.x;
        for (int w = 1; w < 64; w *= 2)
            for (int s = 0; s < 64; s += 2 * w)
                for (int i = s; i < s + w; ++i) {
                    const float lo = b[i], hi = b[i + w];
                    b[i] = __fadd_rn(lo, hi);
                    b[i + w] = __fsub_rn(lo, hi);
                }
        for (int i = 0; i < 64; ++i) b[i] = __fmul_rn(b[i], 0.125f);
    }
    __syncthreads();  // the row is turned
    const int block = threadIdx.x;
    if (block < head_dim / 32) {
        const size_t row = (size_t)head_dim / 32 * C::BLOCK;
        const size_t slot = slots[(size_t)r * slot_stride];
        unsigned char* dst = (is_v ? v_pool : k_pool) + (slot * n_kv_heads + h) * row;
        C::quantize(x + 32 * block, dst + block * C::BLOCK);
    }
}

}  // namespace

// Entry points named in full where they are instantiated (the emulator's build finds them
// there, and renames each for a mutant).
#define PENSIEVE_STEP_ACT(norm, gate, T)                                                        \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
        norm(const T* x, const T* y, const T* w, T* out, int rows, int dim, float eps) {        \
        add_rms_norm<T>(x, y, w, out, rows, dim, eps);                                          \
    }                                                                                           \
    extern "C" __global__ void gate(const T* g, const T* u, T* out, long long total, int n,     \
                                    int g_stride, int u_stride, int act) {                      \
        gated<T>(g, u, out, total, n, g_stride, u_stride, act);                                 \
    }

PENSIEVE_STEP_ACT(pensieve_step_add_rms_norm_f32, pensieve_step_gated_f32, float)
PENSIEVE_STEP_ACT(pensieve_step_add_rms_norm_f16, pensieve_step_gated_f16, __half)
PENSIEVE_STEP_ACT(pensieve_step_add_rms_norm_bf16, pensieve_step_gated_bf16, __nv_bfloat16)

#define PENSIEVE_STEP_ROPE(name, T, P)                                                           \
    extern "C" __global__ void name(                                                             \
        const T* q, const T* k, const T* v, int q_stride, int k_stride, int v_stride,           \
        const T* cos, const T* sin, const uint32_t* slots, float* q_out, P* k_pool, P* v_pool, \
        int n_heads, int n_kv_heads, int head_dim, int interleaved) {                           \
        rope_write<T, P>(q, k, v, q_stride, k_stride, v_stride, cos, sin, slots, q_out, k_pool, \
                         v_pool, n_heads, n_kv_heads, head_dim, interleaved);                   \
    }

PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f32_f32, float, float)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f32_f16, float, __half)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f32_bf16, float, __nv_bfloat16)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f16_f32, __half, float)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f16_f16, __half, __half)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_f16_bf16, __half, __nv_bfloat16)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_bf16_f32, __nv_bfloat16, float)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_bf16_f16, __nv_bfloat16, __half)
PENSIEVE_STEP_ROPE(pensieve_step_rope_write_bf16_bf16, __nv_bfloat16, __nv_bfloat16)

#define PENSIEVE_STEP_CODES(name, T, C)                                                         \
    extern "C" __global__ void name(const T* k, const T* v, int k_stride, int v_stride,        \
                                    const uint32_t* slots, int slot_stride,                    \
                                    unsigned char* k_pool, unsigned char* v_pool,              \
                                    int n_kv_heads, int head_dim, int turned) {                \
        write_codes<T, C>(k, v, k_stride, v_stride, slots, slot_stride, k_pool, v_pool,        \
                          n_kv_heads, head_dim, turned);                                       \
    }

PENSIEVE_STEP_CODES(pensieve_step_write_codes_f32_q8, float, q8_0)
PENSIEVE_STEP_CODES(pensieve_step_write_codes_f16_q8, __half, q8_0)
PENSIEVE_STEP_CODES(pensieve_step_write_codes_bf16_q8, __nv_bfloat16, q8_0)
PENSIEVE_STEP_CODES(pensieve_step_write_codes_f32_q4, float, q4_0)
PENSIEVE_STEP_CODES(pensieve_step_write_codes_f16_q4, __half, q4_0)
PENSIEVE_STEP_CODES(pensieve_step_write_codes_bf16_q4, __nv_bfloat16, q4_0)

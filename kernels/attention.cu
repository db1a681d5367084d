// Multi-query attention over non-contiguous KV slots: the contract of `src/attention/mod.rs`
// (and of the CPU kernel, `src/attention/cpu.rs`) on the GPU.
//
// One launch covers a mixed batch of prefill and decode rows. The host (`Plan` in
// `src/attention/cuda/plan.rs`) cuts the batch into items and lists them in one word buffer
// with the batch itself, once per step for every layer. An item is (sequence, kv head `g`, a
// run of at most MAX_Q of that head's queries, a range of context tiles): the queries of a kv
// head are numbered row by row (query `i` is row `i / group`, query head `g * group + i %
// group`), so any GQA group, 48 heads over one kv head included, cuts into items of MAX_Q.
//
// Each thread block runs one item with an online softmax per query (FlashAttention-2 style: a
// warp owns a query's state; lanes split the keys for the scores and the dimensions for P.V).
// K and V are staged a tile at a time in shared memory in their storage precision, by 16-byte
// loads through each entry's slot, and widened to f32 as they are read. A tile none of the
// item's queries can see (after the last query's position, or before the window of the first)
// is skipped whole: the host lists each tile's lowest and highest position.
//
// An item that covers its sequence's whole context writes its normalized output directly. Only
// decode rows are ever split over several items (the host does so only when the grid would not
// fill the GPU); their unnormalized partials (acc, m, l) are folded in order by
// `pensieve_attention_merge`, so the scratch is bounded by the grid, not by the context.
//
// Positions, not indices, decide visibility: entry j is visible to a query at position p iff
// ctx_positions[j] <= p and p - ctx_positions[j] < window.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
// Queries per item; the host cuts a kv head's queries into runs of at most this many.
constexpr int MAX_Q = 32;
constexpr int Q_PER_WARP = MAX_Q / WARPS;
// Words per item in the plan: seq, g, q0, q1, t0, t1, part (-1: written to out directly),
// lowest and highest query position.
constexpr int ITEM_WORDS = 9;
// Words per merge: first part, part count, seq, g, q0, q1.
constexpr int MERGE_WORDS = 6;
// Bytes of K (and as many of V) staged per tile: shared memory stays under the 48 KiB a kernel
// gets without opting in, for every head dim and storage type.
constexpr int TILE_BYTES = 16384;

// Where each array lies in the plan's words, and the scalars of the call (the host's
// `Params`, field for field).
struct Params {
    int32_t q_offsets;      // [sequences + 1]: first query row of each sequence
    int32_t ctx_offsets;    // [sequences + 1]: first context entry of each sequence
    int32_t q_positions;    // [tokens]
    int32_t ctx_slots;      // [context entries]
    int32_t ctx_positions;  // [context entries]
    int32_t tile_offsets;   // [sequences + 1]: first tile of each sequence
    int32_t tile_bounds;    // [tiles * 2]: lowest and highest position in each tile
    int32_t items;          // [items * ITEM_WORDS]
    int32_t merges;         // [merges * MERGE_WORDS]
    int32_t n_heads;
    int32_t n_kv_heads;
    float scale;
    uint32_t window;  // 0xffffffff: the whole causal context
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Loads of 4, 8 or 16 bytes.
template <int B> struct Chunk;
template <> struct Chunk<4> { using type = uint32_t; };
template <> struct Chunk<8> { using type = uint2; };
template <> struct Chunk<16> { using type = uint4; };

// N consecutive values at p (aligned to their size, at most 16 bytes at a time) as f32.
template <typename T, int N>
__device__ __forceinline__ void widen(const T* __restrict__ p, float* __restrict__ out) {
    constexpr int BYTES = N * (int)sizeof(T);
    constexpr int STEP = BYTES < 16 ? BYTES : 16;
    using C = typename Chunk<STEP>::type;
    static_assert(BYTES % STEP == 0, "whole chunks");
    __align__(16) T tmp[N];
#pragma unroll
    for (int o = 0; o < BYTES / STEP; ++o)
        reinterpret_cast<C*>(tmp)[o] = reinterpret_cast<const C*>(p)[o];
#pragma unroll
    for (int u = 0; u < N; ++u) out[u] = to_f32(tmp[u]);
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ bool visible(uint32_t key, uint32_t query, uint32_t window) {
    return key <= query && query - key < window;
}

// Context entries per tile for head dim D and storage type T (the host cuts tiles alike).
template <typename T, int D>
__host__ __device__ constexpr int k_tile() { return TILE_BYTES / (D * (int)sizeof(T)); }

// One item: see the file's comment. q: [tokens, n_heads, D] f32; k, v: [n_slots, n_kv_heads, D]
// of T; out: [tokens, n_heads, D]; part_acc: [parts, MAX_Q, D]; part_ml: [parts, MAX_Q, 2].
template <typename T, int D>
__device__ void attend(const float* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, const uint32_t* __restrict__ plan,
                       float* __restrict__ out, float* __restrict__ part_acc,
                       float* __restrict__ part_ml, const Params& p) {
    constexpr int K_TILE = k_tile<T, D>();
    constexpr int KPL = (K_TILE + 31) / 32;  // keys per lane in the scores
    constexpr int DL = D / 32;               // dimensions per lane in P.V
    constexpr int VEC = 16 / (int)sizeof(T);  // values per 16-byte load
    constexpr int VPR = D / VEC;              // 16-byte loads per row
    // A K row is padded by 16 bytes: the 8 lanes of a quarter warp, each reading 16 bytes of
    // its own key, then hit 8 different groups of 4 banks.
    constexpr int KSTRIDE = D + VEC;
    __shared__ __align__(16) T ks[K_TILE * KSTRIDE];
    __shared__ __align__(16) T vs[K_TILE * D];
    __shared__ uint32_t pos[K_TILE];
    __shared__ __align__(16) float qs[WARPS][D];  // the query a warp is scoring, scaled
    __shared__ float ps[WARPS][K_TILE];           // its probabilities over the tile

    const int32_t* it = reinterpret_cast<const int32_t*>(plan + p.items) + ITEM_WORDS * blockIdx.x;
    const int seq = it[0], g = it[1], q0 = it[2], q1 = it[3], t0 = it[4], t1 = it[5];
    const int part = it[6];
    const uint32_t q_lo = (uint32_t)it[7], q_hi = (uint32_t)it[8];
    const int32_t* q_offsets = reinterpret_cast<const int32_t*>(plan + p.q_offsets);
    const int32_t* ctx_offsets = reinterpret_cast<const int32_t*>(plan + p.ctx_offsets);
    const uint32_t* slots = plan + p.ctx_slots;
    const uint32_t* positions = plan + p.ctx_positions;
    const uint32_t* bounds = plan + p.tile_bounds + 2 * plan[p.tile_offsets + seq];
    const int group = p.n_heads / p.n_kv_heads;
    const int nq = q1 - q0;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first_row = q_offsets[seq];
    const int ctx0 = ctx_offsets[seq];
    const int ctx_len = ctx_offsets[seq + 1] - ctx0;
    const size_t kv_row = (size_t)p.n_kv_heads * D;

    // The warp's s-th query is the item's query `warp + s * WARPS`.
    float acc[Q_PER_WARP][DL];
    float m[Q_PER_WARP], l[Q_PER_WARP];
    uint32_t qpos[Q_PER_WARP];
    const float* qrow[Q_PER_WARP];
#pragma unroll
    for (int s = 0; s < Q_PER_WARP; ++s) {
        m[s] = -INFINITY;
        l[s] = 0.f;
#pragma unroll
        for (int c = 0; c < DL; ++c) acc[s][c] = 0.f;
        const int i = q0 + min(warp + s * WARPS, nq - 1);
        const int row = first_row + i / group, h = g * group + i % group;
        qrow[s] = q + ((size_t)row * p.n_heads + h) * D;
        qpos[s] = plan[p.q_positions + row];
    }

    for (int t = t0; t < t1; ++t) {
        // The same for the whole block: no query of the item sees any entry of this tile.
        const uint32_t lo = bounds[2 * t], hi = bounds[2 * t + 1];
        if (lo > q_hi || (q_lo >= hi && q_lo - hi >= p.window)) continue;
        const int base = t * K_TILE;
        const int n = min(K_TILE, ctx_len - base);
        __syncthreads();  // the previous tile is no longer read
        for (int e = threadIdx.x; e < n * VPR; e += THREADS) {
            const int j = e / VPR, c = (e % VPR) * VEC;
            const size_t at = (size_t)slots[ctx0 + base + j] * kv_row + (size_t)g * D + c;
            *reinterpret_cast<uint4*>(ks + j * KSTRIDE + c) = *reinterpret_cast<const uint4*>(k + at);
            *reinterpret_cast<uint4*>(vs + j * D + c) = *reinterpret_cast<const uint4*>(v + at);
        }
        for (int j = threadIdx.x; j < K_TILE; j += THREADS)
            pos[j] = j < n ? positions[ctx0 + base + j] : 0xffffffffu;
        __syncthreads();

#pragma unroll
        for (int s = 0; s < Q_PER_WARP; ++s) {
            if (warp + s * WARPS >= nq) break;  // the same for the whole warp
            for (int c = lane; c < D; c += 32) qs[warp][c] = qrow[s][c] * p.scale;
            __syncwarp();
            // Scores of keys lane, lane + 32, ...; a key past the tile's end is never read.
            float sc[KPL];
            float tile_max = -INFINITY;
#pragma unroll
            for (int h = 0; h < KPL; ++h) {
                const int j = lane + 32 * h;
                sc[h] = -INFINITY;
                if (j < n && visible(pos[j], qpos[s], p.window)) {
                    float dot = 0.f;
#pragma unroll 4
                    for (int c = 0; c < D; c += VEC) {
                        float kf[VEC];
                        widen<T, VEC>(ks + j * KSTRIDE + c, kf);
#pragma unroll
                        for (int u = 0; u < VEC; ++u) dot = fmaf(qs[warp][c + u], kf[u], dot);
                    }
                    sc[h] = dot;
                }
                tile_max = fmaxf(tile_max, sc[h]);
            }
            tile_max = warp_max(tile_max);
            if (tile_max == -INFINITY) {  // nothing visible to this query in this tile
                __syncwarp();             // qs is rewritten for the next query
                continue;
            }
            const float m_new = fmaxf(m[s], tile_max);
            const float alpha = __expf(m[s] - m_new);  // 0 while m is -inf
            float sum = 0.f;
#pragma unroll
            for (int h = 0; h < KPL; ++h) {
                const int j = lane + 32 * h;
                const float e = __expf(sc[h] - m_new);
                sum += e;
                if (j < K_TILE) ps[warp][j] = e;
            }
            l[s] = l[s] * alpha + warp_sum(sum);
            m[s] = m_new;
            __syncwarp();  // ps is written
#pragma unroll
            for (int c = 0; c < DL; ++c) acc[s][c] *= alpha;
            for (int j = 0; j < n; ++j) {
                const float pj = ps[warp][j];
                float vf[DL];
                widen<T, DL>(vs + j * D + lane * DL, vf);
#pragma unroll
                for (int c = 0; c < DL; ++c) acc[s][c] = fmaf(pj, vf[c], acc[s][c]);
            }
            __syncwarp();  // qs and ps are rewritten for the next query
        }
    }

#pragma unroll
    for (int s = 0; s < Q_PER_WARP; ++s) {
        const int local = warp + s * WARPS;
        if (local >= nq) break;
        if (part < 0) {
            const int i = q0 + local;
            const int row = first_row + i / group, h = g * group + i % group;
            float* o = out + ((size_t)row * p.n_heads + h) * D + lane * DL;
#pragma unroll
            for (int c = 0; c < DL; ++c) o[c] = l[s] > 0.f ? acc[s][c] / l[s] : 0.f;
        } else {
            const size_t at = (size_t)part * MAX_Q + local;
#pragma unroll
            for (int c = 0; c < DL; ++c) part_acc[at * D + lane * DL + c] = acc[s][c];
            if (lane == 0) {
                part_ml[2 * at] = m[s];
                part_ml[2 * at + 1] = l[s];
            }
        }
    }
}

}  // namespace

#define ATTEND(NAME, T, D)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS)                                     \
        NAME(const float* q, const T* k, const T* v, const uint32_t* plan, float* out,        \
             float* part_acc, float* part_ml, Params p) {                                     \
        attend<T, D>(q, k, v, plan, out, part_acc, part_ml, p);                               \
    }

ATTEND(pensieve_attention_f32_d64, float, 64)
ATTEND(pensieve_attention_f32_d128, float, 128)
ATTEND(pensieve_attention_f32_d256, float, 256)
ATTEND(pensieve_attention_f16_d64, __half, 64)
ATTEND(pensieve_attention_f16_d128, __half, 128)
ATTEND(pensieve_attention_f16_d256, __half, 256)
ATTEND(pensieve_attention_bf16_d64, __nv_bfloat16, 64)
ATTEND(pensieve_attention_bf16_d128, __nv_bfloat16, 128)
ATTEND(pensieve_attention_bf16_d256, __nv_bfloat16, 256)

// Folds the partials of each split decode row (`merges` holds its first part and part count,
// the parts being its segments in context order) and writes `acc / l` (zero for a query that
// saw no context) to out: [tokens, n_heads, d]. One block per merge; threads over (query,
// dimension).
extern "C" __global__ void pensieve_attention_merge(const uint32_t* plan, const float* part_acc,
                                                    const float* part_ml, float* out, Params p,
                                                    int d) {
    const int32_t* mg = reinterpret_cast<const int32_t*>(plan + p.merges) + MERGE_WORDS * blockIdx.x;
    const int first = mg[0], count = mg[1], seq = mg[2], g = mg[3], q0 = mg[4], q1 = mg[5];
    const int group = p.n_heads / p.n_kv_heads;
    const int nq = q1 - q0;
    const int first_row = (int)plan[p.q_offsets + seq];
    for (int e = threadIdx.x; e < nq * d; e += blockDim.x) {
        const int local = e / d, c = e % d;
        float m = -INFINITY;
        for (int s = 0; s < count; ++s)
            m = fmaxf(m, part_ml[2 * ((size_t)(first + s) * MAX_Q + local)]);
        float l = 0.f, acc = 0.f;
        if (m != -INFINITY) {
            for (int s = 0; s < count; ++s) {
                const size_t at = (size_t)(first + s) * MAX_Q + local;
                const float w = __expf(part_ml[2 * at] - m);  // 0 for a segment that saw nothing
                l = fmaf(part_ml[2 * at + 1], w, l);
                acc = fmaf(part_acc[at * d + c], w, acc);
            }
        }
        const int i = q0 + local;
        const int row = first_row + i / group, h = g * group + i % group;
        out[((size_t)row * p.n_heads + h) * d + c] = l > 0.f ? acc / l : 0.f;
    }
}

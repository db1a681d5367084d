// Multi-query attention over non-contiguous KV slots: the contract of `src/attention/mod.rs`
// (and of the CPU kernel, `src/attention/cpu.rs`) on the GPU.
//
// One launch covers a mixed batch of prefill and decode rows. Work is cut as on the CPU: an
// item is (sequence, block of query rows, kv head, segment of context tiles); the host builds
// the item list. Each thread block runs one item: the query heads sharing kv head `g` (GQA)
// for up to MAX_Q queries, against a tile of context entries at a time (64 for head dim 64,
// 32 for 128, so that shared memory stays under the 48 KiB a kernel gets without opting in),
// loaded once into shared
// memory as f32 through each entry's slot, with an online softmax per query
// (FlashAttention-2 style: one warp owns a query's state, lanes split the keys for the
// scores and the dimensions for P.V). Every item writes an unnormalized partial
// (acc, m, l); `pensieve_attention_merge` folds the segments of each (sequence, row block,
// kv head) in order and writes the normalized output. A long decode row thus spreads over
// many blocks (the split-context variant) and a short one is one item whose merge is a copy.
//
// Positions, not indices, decide visibility: entry j is visible to a query at position p iff
// ctx_positions[j] <= p.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
// Queries per item (rows x query heads of one kv head); the host sizes row blocks to fit.
constexpr int MAX_Q = 32;
constexpr int Q_PER_WARP = MAX_Q / WARPS;
// Ints per item in the host's list: seq, row0, row1, g, tile0, tile1.
constexpr int ITEM_INTS = 6;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

struct Batch {
    const int32_t* q_offsets;    // [sequences + 1]: first query row of each sequence
    const int32_t* ctx_offsets;  // [sequences + 1]: first context entry of each sequence
    const uint32_t* q_positions;    // [tokens]
    const uint32_t* ctx_slots;      // [context entries]
    const uint32_t* ctx_positions;  // [context entries]
};

// Context entries per tile for head dimension D (the host cuts segments in the same tiles).
template <int D>
__host__ __device__ constexpr int k_tile() { return D <= 64 ? 64 : 32; }

// One item: partial softmax state of its queries over its tiles.
// q: [tokens, n_heads, D] f32; k, v: [n_slots, n_kv_heads, D] of T;
// part_acc: [items, MAX_Q, D]; part_ml: [items, MAX_Q, 2].
template <typename T, int D>
__device__ void attend(const float* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, Batch b, const int32_t* __restrict__ items,
                       float* __restrict__ part_acc, float* __restrict__ part_ml, int n_heads,
                       int n_kv_heads, float scale) {
    constexpr int K_TILE = k_tile<D>();
    constexpr int KPL = K_TILE / 32;  // keys per lane in the scores
    constexpr int DL = D / 32;        // dimensions per lane in P.V
    __shared__ float ks[K_TILE][D + 1];  // +1: lanes reading different keys hit different banks
    __shared__ float vs[K_TILE][D];
    __shared__ uint32_t pos[K_TILE];
    __shared__ float qs[WARPS][D];  // the query a warp is scoring

    const int32_t* it = items + ITEM_INTS * blockIdx.x;
    const int seq = it[0], row0 = it[1], row1 = it[2], g = it[3], t0 = it[4], t1 = it[5];
    const int group = n_heads / n_kv_heads;
    const int nq = (row1 - row0) * group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first_row = b.q_offsets[seq] + row0;
    const int ctx0 = b.ctx_offsets[seq];
    const int ctx_len = b.ctx_offsets[seq + 1] - ctx0;
    const size_t kv_row = (size_t)n_kv_heads * D;

    // Query `warp + s * WARPS` of the item is row (i / group), query head g * group + i % group.
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
        const int i = min(warp + s * WARPS, nq - 1);
        const int r = i / group, h = g * group + i % group;
        qrow[s] = q + ((size_t)(first_row + r) * n_heads + h) * D;
        qpos[s] = b.q_positions[first_row + r];
    }

    for (int t = t0; t < t1; ++t) {
        const int base = t * K_TILE;
        const int n = min(K_TILE, ctx_len - base);
        __syncthreads();  // the previous tile is no longer read
        for (int e = threadIdx.x; e < K_TILE * D; e += THREADS) {
            const int j = e / D, c = e % D;
            float kx = 0.f, vx = 0.f;
            if (j < n) {
                const size_t at = (size_t)b.ctx_slots[ctx0 + base + j] * kv_row + (size_t)g * D + c;
                kx = to_f32(k[at]);
                vx = to_f32(v[at]);
            }
            ks[j][c] = kx;
            vs[j][c] = vx;
        }
        for (int j = threadIdx.x; j < K_TILE; j += THREADS)
            pos[j] = j < n ? b.ctx_positions[ctx0 + base + j] : 0xffffffffu;
        __syncthreads();

#pragma unroll
        for (int s = 0; s < Q_PER_WARP; ++s) {
            if (warp + s * WARPS >= nq) break;  // the same for the whole warp
            for (int c = lane; c < D; c += 32) qs[warp][c] = qrow[s][c] * scale;
            __syncwarp();
            // Scores of keys lane, lane + 32, ...
            float p[KPL];
            float tile_max = -INFINITY;
#pragma unroll
            for (int h = 0; h < KPL; ++h) {
                const int j = lane + 32 * h;
                float dot = 0.f;
#pragma unroll 16
                for (int c = 0; c < D; ++c) dot = fmaf(qs[warp][c], ks[j][c], dot);
                p[h] = pos[j] <= qpos[s] ? dot : -INFINITY;
                tile_max = fmaxf(tile_max, p[h]);
            }
            __syncwarp();  // qs is rewritten for the next query
            tile_max = warp_max(tile_max);
            if (tile_max == -INFINITY) continue;  // nothing visible in this tile
            const float m_new = fmaxf(m[s], tile_max);
            const float alpha = __expf(m[s] - m_new);  // 0 while m is -inf
            float sum = 0.f;
#pragma unroll
            for (int h = 0; h < KPL; ++h) {
                p[h] = __expf(p[h] - m_new);
                sum += p[h];
            }
            l[s] = l[s] * alpha + warp_sum(sum);
            m[s] = m_new;
#pragma unroll
            for (int c = 0; c < DL; ++c) acc[s][c] *= alpha;
#pragma unroll
            for (int h = 0; h < KPL; ++h) {
                for (int jj = 0; jj < 32 && 32 * h + jj < n; ++jj) {
                    const float pj = __shfl_sync(0xffffffffu, p[h], jj);
#pragma unroll
                    for (int c = 0; c < DL; ++c)
                        acc[s][c] = fmaf(pj, vs[32 * h + jj][lane + 32 * c], acc[s][c]);
                }
            }
        }
    }

#pragma unroll
    for (int s = 0; s < Q_PER_WARP; ++s) {
        const int i = warp + s * WARPS;
        if (i >= nq) break;
        const size_t at = (size_t)blockIdx.x * MAX_Q + i;
#pragma unroll
        for (int c = 0; c < DL; ++c) part_acc[at * D + lane + 32 * c] = acc[s][c];
        if (lane == 0) {
            part_ml[2 * at] = m[s];
            part_ml[2 * at + 1] = l[s];
        }
    }
}

}  // namespace

#define ATTEND(NAME, T, D)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const float* q, const T* k, const T* v, const int32_t* q_offsets,                 \
             const int32_t* ctx_offsets, const uint32_t* q_positions,                          \
             const uint32_t* ctx_slots, const uint32_t* ctx_positions, const int32_t* items,   \
             float* part_acc, float* part_ml, int n_heads, int n_kv_heads, float scale) {      \
        Batch b{q_offsets, ctx_offsets, q_positions, ctx_slots, ctx_positions};                 \
        attend<T, D>(q, k, v, b, items, part_acc, part_ml, n_heads, n_kv_heads, scale);        \
    }

ATTEND(pensieve_attention_f32_d64, float, 64)
ATTEND(pensieve_attention_f32_d128, float, 128)
ATTEND(pensieve_attention_f16_d64, __half, 64)
ATTEND(pensieve_attention_f16_d128, __half, 128)
ATTEND(pensieve_attention_bf16_d64, __nv_bfloat16, 64)
ATTEND(pensieve_attention_bf16_d128, __nv_bfloat16, 128)

// Folds the partials of each output group (one sequence's row block and kv head: `groups`
// holds its first item and item count, the items being its segments in context order) and
// writes `acc / l` (zero for a query that saw no context) to out: [tokens, n_heads, d] f32.
// One block per group; threads over (query, dimension).
extern "C" __global__ void pensieve_attention_merge(const float* part_acc, const float* part_ml,
                                                    const int32_t* items, const int32_t* groups,
                                                    const int32_t* q_offsets, float* out,
                                                    int n_heads, int n_kv_heads, int d) {
    const int first = groups[2 * blockIdx.x], count = groups[2 * blockIdx.x + 1];
    const int32_t* it = items + ITEM_INTS * first;
    const int seq = it[0], row0 = it[1], row1 = it[2], g = it[3];
    const int group = n_heads / n_kv_heads;
    const int nq = (row1 - row0) * group;
    const int first_row = q_offsets[seq] + row0;
    for (int e = threadIdx.x; e < nq * d; e += blockDim.x) {
        const int i = e / d, c = e % d;
        float m = -INFINITY;
        for (int s = 0; s < count; ++s) m = fmaxf(m, part_ml[2 * ((size_t)(first + s) * MAX_Q + i)]);
        float l = 0.f, acc = 0.f;
        if (m != -INFINITY) {
            for (int s = 0; s < count; ++s) {
                const size_t at = (size_t)(first + s) * MAX_Q + i;
                const float w = __expf(part_ml[2 * at] - m);  // 0 for a segment that saw nothing
                l = fmaf(part_ml[2 * at + 1], w, l);
                acc = fmaf(part_acc[at * d + c], w, acc);
            }
        }
        const int r = i / group, h = g * group + i % group;
        out[((size_t)(first_row + r) * n_heads + h) * d + c] = l > 0.f ? acc / l : 0.f;
    }
}

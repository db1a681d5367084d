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
// is skipped whole.
//
// An item that covers its sequence's whole context writes its normalized output directly. Only
// decode rows are ever split over several items (the host does so only when the grid would not
// fill the GPU); their unnormalized partials (acc, m, l) are folded in order by
// `pensieve_attention_merge`, so the scratch is bounded by the grid, not by the context.
//
// A sequence's context holds positions 0..ctx_len in a block table (paged KV): position j
// lies in slot blocks[j / block_size] * block_size + j % block_size. Entry j is visible to a
// query at position p iff j <= p and p - j < window.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <mma.h>
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
    int32_t q_positions;    // [tokens]
    int32_t block_offsets;  // [sequences + 1]: first block of each sequence's table
    int32_t blocks;         // [blocks]: the block tables
    int32_t ctx_lens;       // [sequences]: context entries of each sequence
    int32_t items;          // [items * ITEM_WORDS]
    int32_t merges;         // [merges * MERGE_WORDS]
    int32_t mma_items;      // [mma items * ITEM_WORDS]: the items for `attend_mma`
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t block_size;     // slots per block
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

// llama.cpp's blocks of 32 codes (`src/attention/codes.rs`): an f16 scale `d`, then the codes.
// q8_0: 32 signed bytes, value `d * q`. q4_0: 16 bytes of two 4-bit codes (values j and j + 16
// of the block in byte j's low and high nibble), value `d * (q - 8)`.
struct q8_0 {
    static constexpr int BLOCK = 34;
    __device__ static float code(const unsigned char* b, int i) { return (float)(int8_t)b[2 + i]; }
};
struct q4_0 {
    static constexpr int BLOCK = 18;
    __device__ static float code(const unsigned char* b, int i) {
        const int x = b[2 + i % 16];
        return (float)((i < 16 ? x & 15 : x >> 4) - 8);
    }
};

// How a pool of T keeps a head's row of D values: its bytes, the asynchronous copies that
// stage it (16 bytes, or as many as the row's alignment allows), how many values one read
// widens, and the bytes per value the tiles are cut by.
template <typename T, int D>
struct Row {
    static constexpr int BYTES = D * (int)sizeof(T);
    static constexpr int COPY = 16;
    static constexpr int VEC = 16 / (int)sizeof(T);
    static constexpr int VALUE_BYTES = (int)sizeof(T);
    // N values from value c of the row at `row`, as f32.
    template <int N>
    __device__ static void read(const unsigned char* __restrict__ row, int c, float* __restrict__ out) {
        widen<T, N>(reinterpret_cast<const T*>(row) + c, out);
    }
};

// Rows of codes: `d * q` is exact in f32 (an 11-bit scale times a code of at most 8 bits), as
// the CPU kernel and the reference widen it. A row's bytes (34 or 18 per block) align it to 4
// bytes at head dim 64, 8 at 128, 16 at 256: its copies are as wide as that.
template <typename C, int D>
struct CodeRow {
    static constexpr int BYTES = D / 32 * C::BLOCK;
    static constexpr int COPY = BYTES % 16 == 0 ? 16 : BYTES % 8 == 0 ? 8 : 4;
    static constexpr int VEC = 16;
    static constexpr int VALUE_BYTES = 1;
    template <int N>
    __device__ static void read(const unsigned char* __restrict__ row, int c, float* __restrict__ out) {
        static_assert(32 % N == 0, "a read stays within its block");
        const unsigned char* b = row + c / 32 * C::BLOCK;
        const float d = __half2float(*reinterpret_cast<const __half*>(b));
#pragma unroll
        for (int u = 0; u < N; ++u) out[u] = d * C::code(b, c % 32 + u);
    }
};
template <int D> struct Row<q8_0, D> : CodeRow<q8_0, D> {};
template <int D> struct Row<q4_0, D> : CodeRow<q4_0, D> {};

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

// Context entries per tile for head dim D and storage type T (the host cuts tiles alike, by
// the pool's bytes per value: 1 for codes).
template <typename T, int D>
__host__ __device__ constexpr int k_tile() { return TILE_BYTES / (D * Row<T, D>::VALUE_BYTES); }

// One block's item (see the file's comment) and where its sequence lies in the batch.
struct Item {
    int g, q0, t0, t1, part, nq, group, n_kv_heads, first_row, ctx_len, block_size;
    uint32_t q_lo, q_hi;     // the lowest and highest position of its queries
    const uint32_t* blocks;  // its sequence's block table

    // Item `index` of the list at word `list` of the plan.
    __device__ Item(const uint32_t* plan, const Params& p, int32_t list, int index) {
        const int32_t* it = reinterpret_cast<const int32_t*>(plan + list) + ITEM_WORDS * index;
        const int seq = it[0];
        g = it[1];
        q0 = it[2];
        nq = it[3] - it[2];
        t0 = it[4];
        t1 = it[5];
        part = it[6];
        q_lo = (uint32_t)it[7];
        q_hi = (uint32_t)it[8];
        group = p.n_heads / p.n_kv_heads;
        n_kv_heads = p.n_kv_heads;
        first_row = (int)plan[p.q_offsets + seq];
        ctx_len = (int)plan[p.ctx_lens + seq];
        block_size = p.block_size;
        blocks = plan + p.blocks + plan[p.block_offsets + seq];
    }

    // The pool slot of context position j.
    __device__ size_t slot(int j) const {
        return (size_t)blocks[j / block_size] * block_size + j % block_size;
    }

    // The row of q and out that holds the item's query i, and that query's head.
    __device__ int row(int i) const { return first_row + (q0 + i) / group; }
    __device__ int head(int i) const { return g * group + (q0 + i) % group; }

    // Whether no query of the item sees any entry of tile t, of `tile` entries (the same for
    // the whole block).
    __device__ bool skips(int t, int tile, uint32_t window) const {
        const uint32_t lo = (uint32_t)(t * tile), hi = (uint32_t)(min((t + 1) * tile, ctx_len) - 1);
        return lo > q_hi || (q_lo >= hi && q_lo - hi >= window);
    }
};

// One item: see the file's comment. q: [tokens, n_heads, D] f32; k, v: [n_slots, n_kv_heads]
// rows of T (`Row<T, D>::BYTES` each); out: [tokens, n_heads, D]; part_acc: [parts, MAX_Q, D];
// part_ml: [parts, MAX_Q, 2].
template <typename T, int D>
__device__ void attend(const float* __restrict__ q, const void* __restrict__ k_rows,
                       const void* __restrict__ v_rows, const uint32_t* __restrict__ plan,
                       float* __restrict__ out, float* __restrict__ part_acc,
                       float* __restrict__ part_ml, const Params& p) {
    using R = Row<T, D>;
    constexpr int K_TILE = k_tile<T, D>();
    constexpr int KPL = (K_TILE + 31) / 32;  // keys per lane in the scores
    constexpr int DL = D / 32;               // dimensions per lane in P.V
    constexpr int VEC = R::VEC;              // values per read in the scores
    constexpr int CPR = R::BYTES / R::COPY;  // copies per row
    // A K row is padded by 16 bytes: the 8 lanes of a quarter warp, each reading 16 bytes of
    // its own key, then hit 8 different groups of 4 banks.
    constexpr int KSTRIDE = R::BYTES + 16;
    __shared__ __align__(16) unsigned char ks[K_TILE * KSTRIDE];
    __shared__ __align__(16) unsigned char vs[K_TILE * R::BYTES];
    const unsigned char* const k = static_cast<const unsigned char*>(k_rows);
    const unsigned char* const v = static_cast<const unsigned char*>(v_rows);
    __shared__ uint32_t pos[K_TILE];
    __shared__ __align__(16) float qs[WARPS][D];  // the query a warp is scoring, scaled
    __shared__ float ps[WARPS][K_TILE];           // its probabilities over the tile

    const Item it(plan, p, p.items, blockIdx.x);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t kv_row = (size_t)p.n_kv_heads * R::BYTES;

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
        const int i = min(warp + s * WARPS, it.nq - 1);
        qrow[s] = q + ((size_t)it.row(i) * p.n_heads + it.head(i)) * D;
        qpos[s] = plan[p.q_positions + it.row(i)];
    }

    for (int t = it.t0; t < it.t1; ++t) {
        if (it.skips(t, K_TILE, p.window)) continue;
        const int base = t * K_TILE;
        const int n = min(K_TILE, it.ctx_len - base);
        __syncthreads();  // the previous tile is no longer read
        // Asynchronous copies (`cp.async`): a thread's 16-byte loads of the whole tile are all
        // in flight at once, straight into shared memory, where loads through registers kept
        // a few per thread in flight. A decode row's item does little work per byte, so the
        // bytes in flight per SM are what bounds it.
        for (int e = threadIdx.x; e < n * CPR; e += THREADS) {
            const int j = e / CPR, c = (e % CPR) * R::COPY;
            const size_t at = it.slot(base + j) * kv_row + (size_t)it.g * R::BYTES + c;
            __pipeline_memcpy_async(ks + j * KSTRIDE + c, k + at, R::COPY);
            __pipeline_memcpy_async(vs + j * R::BYTES + c, v + at, R::COPY);
        }
        __pipeline_commit();
        for (int j = threadIdx.x; j < K_TILE; j += THREADS)
            pos[j] = j < n ? (uint32_t)(base + j) : 0xffffffffu;
        __pipeline_wait_prior(0);
        __syncthreads();

#pragma unroll
        for (int s = 0; s < Q_PER_WARP; ++s) {
            if (warp + s * WARPS >= it.nq) break;  // the same for the whole warp
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
                        R::template read<VEC>(ks + j * KSTRIDE, c, kf);
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
                R::template read<DL>(vs + j * R::BYTES, lane * DL, vf);
#pragma unroll
                for (int c = 0; c < DL; ++c) acc[s][c] = fmaf(pj, vf[c], acc[s][c]);
            }
            __syncwarp();  // qs and ps are rewritten for the next query
        }
    }

#pragma unroll
    for (int s = 0; s < Q_PER_WARP; ++s) {
        const int local = warp + s * WARPS;
        if (local >= it.nq) break;
        if (it.part < 0) {
            float* o = out + ((size_t)it.row(local) * p.n_heads + it.head(local)) * D + lane * DL;
#pragma unroll
            for (int c = 0; c < DL; ++c) o[c] = l[s] > 0.f ? acc[s][c] / l[s] : 0.f;
        } else {
            const size_t at = (size_t)it.part * MAX_Q + local;
#pragma unroll
            for (int c = 0; c < DL; ++c) part_acc[at * D + lane * DL + c] = acc[s][c];
            if (lane == 0) {
                part_ml[2 * at] = m[s];
                part_ml[2 * at + 1] = l[s];
            }
        }
    }
}

// Items of many queries (prefill and recompute rows; the host sends those of at least MMA_MIN_Q
// queries of f16 or bf16 pools here) on the tensor cores, through CUDA's
// warp matrix functions: S = Q K^T and O += P V as 16x16x16 tile products with f32
// accumulators, the softmax between them a warp per query row as above.
//
// A tensor core multiplies half or bfloat16 values. K and V are exact in their storage type;
// Q and P are f32, so each is split into a sum of parts in that type, each part multiplied in
// turn: 2 parts of half or 3 of bfloat16, which keep ~22 bits of the scores and of the weights.
//
// Shared memory is the launch's dynamic memory, `mma_shared_bytes(D)`: the 48 KiB any kernel
// gets at head dims 64 and 128, 96 KiB at 256 (whose queries' parts alone take 48 KiB; the host
// opts in past 48 KiB). Each host tile is taken in sub-tiles of KT entries, the scores' f32 rows
// are overwritten in place by P's first two parts, and P V is formed 64 output columns at a time
// in the bytes of the sub-tile's K (read by then), then folded into each warp's registers
// (rescaled by the softmax).
constexpr int MMA_COLS = 64;

// Bytes of dynamic shared memory the tensor-core kernel of head dim d is launched with (the
// host's `mma_shared_bytes` in `src/attention/cuda/plan.rs` gives the same).
__host__ __device__ constexpr int mma_shared_bytes(int d) {
    return d > 128 ? 96 * 1024 : 48 * 1024;
}

// The launch's dynamic shared memory as `name` (the emulator's shim defines its own).
#ifndef PENSIEVE_DYNAMIC_SHARED
#define PENSIEVE_DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif

template <typename T> __device__ __forceinline__ T narrow(float x);
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// x as the sum of N values of T, `stride` apart from `out`: each the rounding of what the
// ones before it left.
template <typename T, int N>
__device__ __forceinline__ void split(float x, T* out, int stride) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const T h = narrow<T>(x);
        out[i * stride] = h;
        x -= to_f32(h);
    }
}

// Parts of Q and of P: enough for ~22 bits of mantissa (bfloat16 keeps 8 per part, half 11).
template <typename T> struct Parts { static constexpr int value = 2; };
template <> struct Parts<__nv_bfloat16> { static constexpr int value = 3; };

// `bytes` rounded up to whole 128-byte lines, so that every array starts aligned as the warp
// matrix functions' loads require (256 bits) and on a line of its own.
__host__ __device__ constexpr int lines(int bytes) { return (bytes + 127) / 128 * 128; }

// The tensor-core kernel's shared arrays: row strides (in elements), padded where room allows so
// that the 16 rows a warp matrix function reads fall on different banks, and byte offsets into
// the launch's dynamic shared memory.
template <typename T, int D>
struct MmaLayout {
    static constexpr int KT = 4096 / D < 32 ? 32 : 4096 / D;  // context entries per sub-tile
    static constexpr int QP = Parts<T>::value;
    static constexpr int KS = D + 8;           // K and V rows
    static constexpr int SS = KT + 4;          // score rows (f32); P's first two parts as T
    static constexpr int OS = MMA_COLS + 4;    // P V rows (f32)
    static constexpr int K_BYTES = lines(KT * KS * (int)sizeof(T));
    static constexpr int fixed = 2 * K_BYTES + lines(MAX_Q * SS * 4) +
                                 lines(QP > 2 ? MAX_Q * KT * (int)sizeof(T) : 32) + lines(KT * 4);
    // Query rows: padded if the whole still fits.
    static constexpr int QS =
        fixed + lines(QP * MAX_Q * (D + 8) * (int)sizeof(T)) <= mma_shared_bytes(D) ? D + 8 : D;
    // Where each array starts: the queries' parts, K, V, the scores (then P), P's third part,
    // the positions.
    static constexpr int Q_AT = 0;
    static constexpr int K_AT = Q_AT + lines(QP * MAX_Q * QS * (int)sizeof(T));
    static constexpr int V_AT = K_AT + K_BYTES;
    static constexpr int S_AT = V_AT + K_BYTES;
    static constexpr int P3_AT = S_AT + lines(MAX_Q * SS * 4);
    static constexpr int POS_AT = P3_AT + lines(QP > 2 ? MAX_Q * KT * (int)sizeof(T) : 32);
    static constexpr int END = POS_AT + lines(KT * 4);
    static_assert(END <= mma_shared_bytes(D), "shared memory");
    static_assert(KT * KS * sizeof(T) >= MAX_Q * OS * sizeof(float), "P V fits in K's bytes");
};

template <typename T, int D>
__device__ void attend_mma(const float* __restrict__ q, const void* __restrict__ k_values,
                           const void* __restrict__ v_values, const uint32_t* __restrict__ plan,
                           float* __restrict__ out, float* __restrict__ part_acc,
                           float* __restrict__ part_ml, const Params& p) {
    namespace wmma = nvcuda::wmma;
    const T* const k = static_cast<const T*>(k_values);
    const T* const v = static_cast<const T*>(v_values);
    using L = MmaLayout<T, D>;
    constexpr int HOST_TILE = k_tile<T, D>();
    constexpr int KT = L::KT, QP = L::QP, KS = L::KS, SS = L::SS, OS = L::OS, QS = L::QS;
    constexpr int KQ = KT / 4;                // keys per lane in the softmax (4 lanes a row)
    constexpr int DL = D / 32;                // output dimensions per lane: c * 32 + lane
    constexpr int ROWS = MAX_Q / WARPS;       // a warp's query rows: warp * ROWS + s
    constexpr int VEC = 16 / (int)sizeof(T);  // values per 16-byte load
    constexpr int VPR = D / VEC;              // 16-byte loads per row
    static_assert(HOST_TILE % KT == 0 && KT % 16 == 0 && D % MMA_COLS == 0, "tile shapes");
    static_assert(ROWS * 4 == 32, "4 lanes per row in the softmax");
    PENSIEVE_DYNAMIC_SHARED(shared);
    T* const qs = reinterpret_cast<T*>(shared + L::Q_AT);  // part i of query r at [i][r][0..D)
    T* const ks = reinterpret_cast<T*>(shared + L::K_AT);
    T* const vs = reinterpret_cast<T*>(shared + L::V_AT);
    // Row r: KT scores; then, in the same bytes, KT values of P's first part and KT of its
    // second.
    float* const sp = reinterpret_cast<float*>(shared + L::S_AT);
    // P's third part, for bfloat16.
    T* const p3 = reinterpret_cast<T*>(shared + L::P3_AT);
    uint32_t* const pos = reinterpret_cast<uint32_t*>(shared + L::POS_AT);
    T* const ps = reinterpret_cast<T*>(sp);
    float* const os = reinterpret_cast<float*>(ks);  // MAX_Q x MMA_COLS of P V, after S

    const Item it(plan, p, p.mma_items, blockIdx.x);
    const int nq = it.nq;
    const int row_tiles = (nq + 15) / 16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t kv_row = (size_t)p.n_kv_heads * D;

    // The item's queries, scaled, in parts; rows past the last query are zero.
    for (int e = threadIdx.x; e < MAX_Q * D; e += THREADS) {
        const int r = e / D, c = e % D;
        float x = 0.f;
        if (r < nq) x = q[((size_t)it.row(r) * p.n_heads + it.head(r)) * D + c] * p.scale;
        split<T, QP>(x, qs + r * QS + c, MAX_Q * QS);
    }
    // The softmax state of the lane's row (`sr`: the 4 lanes of a row hold it alike); the
    // output of the warp's rows, dimensions c * 32 + lane.
    const int sr = warp * ROWS + lane / 4, quarter = lane % 4;
    const uint32_t sr_pos = plan[p.q_positions + it.row(min(sr, nq - 1))];
    float m = -INFINITY, l = 0.f;
    float acc[ROWS][DL];
#pragma unroll
    for (int s = 0; s < ROWS; ++s)
#pragma unroll
        for (int c = 0; c < DL; ++c) acc[s][c] = 0.f;

    for (int t = it.t0; t < it.t1; ++t) {
        if (it.skips(t, HOST_TILE, p.window)) continue;
        for (int base = t * HOST_TILE; base < min((t + 1) * HOST_TILE, it.ctx_len); base += KT) {
            const int n = min(KT, it.ctx_len - base);
            __syncthreads();  // the previous sub-tile (and the queries) are written and read
            // Rows past the context are zero: P is zero there, and 0 * NaN would not be.
            for (int e = threadIdx.x; e < KT * VPR; e += THREADS) {
                const int j = e / VPR, c = (e % VPR) * VEC;
                uint4 kx = {0u, 0u, 0u, 0u}, vx = {0u, 0u, 0u, 0u};
                if (j < n) {
                    const size_t at = it.slot(base + j) * kv_row + (size_t)it.g * D + c;
                    kx = *reinterpret_cast<const uint4*>(k + at);
                    vx = *reinterpret_cast<const uint4*>(v + at);
                }
                *reinterpret_cast<uint4*>(ks + j * KS + c) = kx;
                *reinterpret_cast<uint4*>(vs + j * KS + c) = vx;
            }
            for (int j = threadIdx.x; j < KT; j += THREADS)
                pos[j] = j < n ? (uint32_t)(base + j) : 0xffffffffu;
            __syncthreads();

            // S = Q K^T, one 16x16 tile per warp at a time.
            for (int tile = warp; tile < row_tiles * (KT / 16); tile += WARPS) {
                const int rt = tile / (KT / 16), ct = tile % (KT / 16);
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> sc;
                wmma::fill_fragment(sc, 0.f);
#pragma unroll 2
                for (int kk = 0; kk < D; kk += 16) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                    wmma::load_matrix_sync(b, ks + ct * 16 * KS + kk, KS);
#pragma unroll
                    for (int i = 0; i < QP; ++i) {
                        wmma::load_matrix_sync(a, qs + (i * MAX_Q + rt * 16) * QS + kk, QS);
                        wmma::mma_sync(sc, a, b, sc);
                    }
                }
                wmma::store_matrix_sync(sp + rt * 16 * SS + ct * 16, sc, SS, wmma::mem_row_major);
            }
            __syncthreads();  // S is written; K is no longer read (its bytes take P V)

            // The online softmax, 4 lanes a row (keys quarter, quarter + 4, ...); P replaces
            // the row's scores.
            float e[KQ];
            float tile_max = -INFINITY;
#pragma unroll
            for (int i = 0; i < KQ; ++i) {
                const int j = quarter + 4 * i;
                const bool seen = sr < nq && j < n && visible(pos[j], sr_pos, p.window);
                e[i] = seen ? sp[sr * SS + j] : -INFINITY;
                tile_max = fmaxf(tile_max, e[i]);
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            float alpha = 1.f, sum = 0.f;
            if (tile_max != -INFINITY) {
                const float m_new = fmaxf(m, tile_max);
                alpha = __expf(m - m_new);  // 0 while m is -inf
                m = m_new;
            }
#pragma unroll
            for (int i = 0; i < KQ; ++i) {
                e[i] = tile_max == -INFINITY ? 0.f : __expf(e[i] - m);
                sum += e[i];
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l = l * alpha + sum;
            __syncwarp();  // the rows' scores are read before their P overwrites them
            if (sr < nq) {
#pragma unroll
                for (int i = 0; i < KQ; ++i) {
                    const int j = quarter + 4 * i;
                    T* two = ps + sr * 2 * SS + j;
                    split<T, 2>(e[i], two, KT);
                    if (QP > 2)  // what the first two parts left
                        p3[sr * KT + j] = narrow<T>(e[i] - to_f32(two[0]) - to_f32(two[KT]));
                }
            }
            float row_alpha[ROWS];
#pragma unroll
            for (int s = 0; s < ROWS; ++s) row_alpha[s] = __shfl_sync(0xffffffffu, alpha, 4 * s);
            __syncthreads();

            // O = O * alpha + P V, MMA_COLS output columns at a time.
#pragma unroll
            for (int oc = 0; oc < D; oc += MMA_COLS) {
                for (int tile = warp; tile < row_tiles * (MMA_COLS / 16); tile += WARPS) {
                    const int rt = tile / (MMA_COLS / 16), ct = tile % (MMA_COLS / 16);
                    wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
                    wmma::fill_fragment(o, 0.f);
#pragma unroll
                    for (int kk = 0; kk < KT; kk += 16) {
                        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                        wmma::load_matrix_sync(b, vs + kk * KS + oc + ct * 16, KS);
                        wmma::load_matrix_sync(a, ps + rt * 16 * 2 * SS + kk, 2 * SS);
                        wmma::mma_sync(o, a, b, o);
                        wmma::load_matrix_sync(a, ps + rt * 16 * 2 * SS + KT + kk, 2 * SS);
                        wmma::mma_sync(o, a, b, o);
                        if (QP > 2) {
                            wmma::load_matrix_sync(a, p3 + rt * 16 * KT + kk, KT);
                            wmma::mma_sync(o, a, b, o);
                        }
                    }
                    wmma::store_matrix_sync(os + rt * 16 * OS + ct * 16, o, OS,
                                            wmma::mem_row_major);
                }
                __syncthreads();
#pragma unroll
                for (int s = 0; s < ROWS; ++s) {
                    const int r = warp * ROWS + s;
                    if (r >= nq) break;
#pragma unroll
                    for (int c = oc / 32; c < (oc + MMA_COLS) / 32; ++c)
                        acc[s][c] = fmaf(acc[s][c], row_alpha[s], os[r * OS + c * 32 - oc + lane]);
                }
                if (oc + MMA_COLS < D) __syncthreads();  // os is rewritten by the next columns
            }
        }
    }

#pragma unroll
    for (int s = 0; s < ROWS; ++s) {
        const float row_m = __shfl_sync(0xffffffffu, m, 4 * s);
        const float row_l = __shfl_sync(0xffffffffu, l, 4 * s);
        const int r = warp * ROWS + s;
        if (r >= nq) continue;  // the same for the whole warp
        if (it.part < 0) {
            float* o = out + ((size_t)it.row(r) * p.n_heads + it.head(r)) * D;
#pragma unroll
            for (int c = 0; c < DL; ++c) o[c * 32 + lane] = row_l > 0.f ? acc[s][c] / row_l : 0.f;
        } else {
            const size_t at = (size_t)it.part * MAX_Q + r;
#pragma unroll
            for (int c = 0; c < DL; ++c) part_acc[at * D + c * 32 + lane] = acc[s][c];
            if (lane == 0) {
                part_ml[2 * at] = row_m;
                part_ml[2 * at + 1] = row_l;
            }
        }
    }
}

}  // namespace

// The entry points: `BODY` (attend or attend_mma) for storage type T and head dim D.
#define ATTEND(NAME, BODY, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS)                                     \
        NAME(const float* q, const void* k, const void* v, const uint32_t* plan, float* out,  \
             float* part_acc, float* part_ml, Params p) {                                     \
        BODY<T, D>(q, k, v, plan, out, part_acc, part_ml, p);                                 \
    }

ATTEND(pensieve_attention_f32_d64, attend, float, 64)
ATTEND(pensieve_attention_f32_d128, attend, float, 128)
ATTEND(pensieve_attention_f32_d256, attend, float, 256)
ATTEND(pensieve_attention_f16_d64, attend, __half, 64)
ATTEND(pensieve_attention_f16_d128, attend, __half, 128)
ATTEND(pensieve_attention_f16_d256, attend, __half, 256)
ATTEND(pensieve_attention_bf16_d64, attend, __nv_bfloat16, 64)
ATTEND(pensieve_attention_bf16_d128, attend, __nv_bfloat16, 128)
ATTEND(pensieve_attention_bf16_d256, attend, __nv_bfloat16, 256)
ATTEND(pensieve_attention_q8_d64, attend, q8_0, 64)
ATTEND(pensieve_attention_q8_d128, attend, q8_0, 128)
ATTEND(pensieve_attention_q8_d256, attend, q8_0, 256)
ATTEND(pensieve_attention_q4_d64, attend, q4_0, 64)
ATTEND(pensieve_attention_q4_d128, attend, q4_0, 128)
ATTEND(pensieve_attention_q4_d256, attend, q4_0, 256)
ATTEND(pensieve_attention_mma_f16_d64, attend_mma, __half, 64)
ATTEND(pensieve_attention_mma_f16_d128, attend_mma, __half, 128)
ATTEND(pensieve_attention_mma_f16_d256, attend_mma, __half, 256)
ATTEND(pensieve_attention_mma_bf16_d64, attend_mma, __nv_bfloat16, 64)
ATTEND(pensieve_attention_mma_bf16_d128, attend_mma, __nv_bfloat16, 128)
ATTEND(pensieve_attention_mma_bf16_d256, attend_mma, __nv_bfloat16, 256)

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

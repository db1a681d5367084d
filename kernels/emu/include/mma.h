// `mma.h` for the emulator (see `../cuda_emu.h`): CUDA's warp matrix functions
// (`nvcuda::wmma`) for m16n16k16 tiles of half or bfloat16 with f32 accumulators, modelled at
// fragment level.
//
// A fragment is what one lane holds: 8 of the tile's 256 elements. Which ones is CUDA's
// business and unspecified, so here each use (matrix_a, matrix_b, accumulator) deals them out
// by its own scrambled permutation: a kernel that reads or writes `x[i]` as a particular row or
// column, or carries elements from one use to another, computes garbage and is caught. Loads,
// stores and `mma_sync` are warp collectives (the runtime's `matrix_collective`): all 32 lanes
// must reach the same one, with the same pointer and leading dimension, the pointer 256-bit
// aligned and the leading dimension a multiple of 16 bytes, or the run stops with a report.
// `mma_sync` multiplies in f32 (products of half or bfloat16 values are exact there) and adds
// in k order; the tensor cores' own summation order and internal precision are not modelled.
#pragma once

#include <stddef.h>

#include "../cuda_emu.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator models m16n16k16 tiles");
    static constexpr int num_elements = 8;
    T x[num_elements];
};

}  // namespace wmma
}  // namespace nvcuda

namespace pensieve_emu {
namespace wmma_detail {

inline float widen(float x) { return x; }
inline float widen(__half x) { return __half2float(x); }
inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename Use> constexpr int use_id() { return 0; }
template <> constexpr int use_id<nvcuda::wmma::matrix_b>() { return 1; }
template <> constexpr int use_id<nvcuda::wmma::accumulator>() { return 2; }

// The (row, column) of element `j` of lane `lane`'s fragment, for a use: a bijection of the
// 256 elements, a different one per use.
inline void element(int use, int lane, int j, int& row, int& col) {
    static const unsigned MUL[3] = {97, 61, 29}, ADD[3] = {13, 7, 101};
    const unsigned e = ((unsigned)(lane * 8 + j) * MUL[use] + ADD[use]) & 255u;
    row = (int)(e / 16);
    col = (int)(e % 16);
}

// Where element (row, col) of a 16x16 tile lies from `base`, `ldm` elements per row (or per
// column when column-major).
inline size_t offset(int row, int col, unsigned ldm, bool column_major) {
    return column_major ? (size_t)col * ldm + row : (size_t)row * ldm + col;
}

template <typename T>
const char* check(const void* const* ptrs, const unsigned* ldms) {
    for (int l = 1; l < 32; ++l)
        if (ptrs[l] != ptrs[0] || ldms[l] != ldms[0])
            return "lanes of a warp passed different pointers or leading dimensions to a warp "
                   "matrix function";
    if ((uintptr_t)ptrs[0] % 32 != 0)
        return "a warp matrix function on a pointer not 256-bit aligned";
    if (ldms[0] * sizeof(T) % 16 != 0)
        return "a warp matrix function with a leading dimension not a multiple of 16 bytes";
    return nullptr;
}

// A load or store of one lane's fragment.
template <typename T>
struct Transfer : MatrixOp {
    T* frag;
    T* mem;
    unsigned ldm;
    bool column_major;
    int use;
    bool store;
};

template <typename T>
const char* transfer(MatrixOp* const* lanes) {
    const void* ptrs[32];
    unsigned ldms[32];
    for (int l = 0; l < 32; ++l) {
        const auto* op = static_cast<const Transfer<T>*>(lanes[l]);
        ptrs[l] = op->mem;
        ldms[l] = op->ldm;
    }
    if (const char* why = check<T>(ptrs, ldms)) return why;
    for (int l = 0; l < 32; ++l) {
        const auto* op = static_cast<const Transfer<T>*>(lanes[l]);
        for (int j = 0; j < 8; ++j) {
            int row, col;
            element(op->use, l, j, row, col);
            T* at = op->mem + offset(row, col, op->ldm, op->column_major);
            if (op->store)
                *at = op->frag[j];
            else
                op->frag[j] = *at;
        }
    }
    return nullptr;
}

template <typename T>
void run_transfer(T* frag, T* mem, unsigned ldm, bool column_major, int use, bool store,
                  const char* file, int line) {
    Transfer<T> op;
    op.run = &transfer<T>;
    op.frag = frag;
    op.mem = mem;
    op.ldm = ldm;
    op.column_major = column_major;
    op.use = use;
    op.store = store;
    matrix_collective(&op, file, line);
}

// D = A B + C for one lane's fragments.
template <typename TA, typename TB>
struct Mma : MatrixOp {
    float* d;
    const TA* a;
    const TB* b;
    const float* c;
};

template <typename TA, typename TB>
const char* mma(MatrixOp* const* lanes) {
    float a[16][16], b[16][16], c[16][16];
    for (int l = 0; l < 32; ++l) {
        const auto* op = static_cast<const Mma<TA, TB>*>(lanes[l]);
        for (int j = 0; j < 8; ++j) {
            int row, col;
            element(0, l, j, row, col);
            a[row][col] = widen(op->a[j]);
            element(1, l, j, row, col);
            b[row][col] = widen(op->b[j]);
            element(2, l, j, row, col);
            c[row][col] = op->c[j];
        }
    }
    float d[16][16];
    for (int i = 0; i < 16; ++i)
        for (int n = 0; n < 16; ++n) {
            float sum = 0.f;
            for (int k = 0; k < 16; ++k) sum += a[i][k] * b[k][n];
            d[i][n] = c[i][n] + sum;
        }
    for (int l = 0; l < 32; ++l) {
        const auto* op = static_cast<const Mma<TA, TB>*>(lanes[l]);
        for (int j = 0; j < 8; ++j) {
            int row, col;
            element(2, l, j, row, col);
            op->d[j] = d[row][col];
        }
    }
    return nullptr;
}

}  // namespace wmma_detail
}  // namespace pensieve_emu

namespace nvcuda {
namespace wmma {

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T value) {
    for (int j = 0; j < f.num_elements; ++j) f.x[j] = value;
}

template <typename Use, typename T, typename Layout>
inline void pensieve_load(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                          const char* file, int line) {
    static_assert(pensieve_emu::wmma_detail::use_id<Use>() != 2, "an accumulator takes a layout");
    pensieve_emu::wmma_detail::run_transfer<T>(f.x, const_cast<T*>(p), ldm,
                                               __is_same(Layout, col_major),
                                               pensieve_emu::wmma_detail::use_id<Use>(), false,
                                               file, line);
}

inline void pensieve_load(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                          unsigned ldm, layout_t layout, const char* file, int line) {
    pensieve_emu::wmma_detail::run_transfer<float>(f.x, const_cast<float*>(p), ldm,
                                                   layout == mem_col_major, 2, false, file, line);
}

inline void pensieve_store(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                           unsigned ldm, layout_t layout, const char* file, int line) {
    pensieve_emu::wmma_detail::run_transfer<float>(const_cast<float*>(f.x), p, ldm,
                                                   layout == mem_col_major, 2, true, file, line);
}

template <typename TA, typename LA, typename TB, typename LB>
inline void pensieve_mma(fragment<accumulator, 16, 16, 16, float>& d,
                         const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                         const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
                         const fragment<accumulator, 16, 16, 16, float>& c, const char* file,
                         int line) {
    static_assert(__is_same(TA, TB), "A and B of one type");
    pensieve_emu::wmma_detail::Mma<TA, TB> op;
    op.run = &pensieve_emu::wmma_detail::mma<TA, TB>;
    op.d = d.x;
    op.a = a.x;
    op.b = b.x;
    op.c = c.x;
    pensieve_emu::matrix_collective(&op, file, line);
}

}  // namespace wmma
}  // namespace nvcuda

// The call sites, for the runtime's reports and its check that a warp's lanes agree.
#define load_matrix_sync(...) pensieve_load(__VA_ARGS__, __FILE__, __LINE__)
#define store_matrix_sync(...) pensieve_store(__VA_ARGS__, __FILE__, __LINE__)
#define mma_sync(...) pensieve_mma(__VA_ARGS__, __FILE__, __LINE__)

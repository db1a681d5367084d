// The CUDA the kernels in `kernels/` use, for the host C++ compiler: the emulator's shim (see
// `kernels/README.md`). A kernel source compiles unchanged with this header forced in front of
// it (`-include`) and `kernels/emu/include` ahead on the include path; `runtime.cc` runs it.
//
// Each CUDA thread of a block is a fiber that runs until its next barrier or warp collective;
// the runtime resumes them in the order a schedule names and stops the run with a report when
// the threads of a block disagree about a barrier, or the lanes of a warp about a collective.
// Shared memory is one linker section, and dynamic shared memory a buffer of the launch's size,
// both poisoned (all bits set: NaN in every float type) before each block.
#pragma once

#include <stdint.h>
#include <string.h>

#include <math.h>

#include <cmath>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((section("pensieve_emu_shared")))

struct dim3 {
    unsigned x, y, z;
};
struct uint2 {
    unsigned x, y;
} __attribute__((aligned(8)));
struct uint4 {
    unsigned x, y, z, w;
} __attribute__((aligned(16)));
struct float2 {
    float x, y;
} __attribute__((aligned(8)));
struct float4 {
    float x, y, z, w;
} __attribute__((aligned(16)));

constexpr int warpSize = 32;

namespace pensieve_emu {

// Where a thread stands: its indices, and the call site and ordinal of its next sync point.
dim3 thread_idx();
dim3 block_idx();
dim3 block_dim();
dim3 grid_dim();

// The launch's dynamic shared memory: its bytes end at a page no access may touch, so a kernel
// that reads or writes past what the launch gave it stops the run (a fault).
unsigned char* dynamic_shared();

// A barrier of the whole block.
void syncthreads(const char* file, int line);

// The warp collectives; `kind` selects the exchange, `arg` its lane or lane mask.
enum class Collective : int {
    SyncWarp,
    ShflXor,
    ShflIdx,
    ShflDown,
    ShflUp,
    Ballot,
    Any,
    All,
    Matrix
};
uint32_t collective(Collective kind, unsigned mask, uint32_t value, int arg, const char* file,
                    int line);

// A warp matrix operation (`include/mma.h`): each lane parks with its own descriptor; once all
// 32 lanes of the warp are there, the runtime calls `run` once with every lane's descriptor, in
// lane order. `run` returns nullptr, or why the call breaks CUDA's rules (the run stops).
struct MatrixOp {
    const char* (*run)(MatrixOp* const* lanes);
};
void matrix_collective(MatrixOp* op, const char* file, int line);

// The asynchronous copies (`include/cuda_pipeline.h`): the calling thread's copy of `size`
// bytes (4, 8 or 16, both addresses aligned to it; the last `zfill` written as zeros) into its
// open group, the group closed, and the groups waited for until at most `prior` are pending
// (those land then, oldest first).
void async_copy(void* dst, const void* src, size_t size, size_t zfill);
void async_commit();
void async_wait(size_t prior);

template <typename T>
inline T exchange(Collective kind, unsigned mask, T value, int arg, const char* file, int line) {
    static_assert(sizeof(T) == 4, "shuffles of 32-bit values");
    uint32_t bits;
    memcpy(&bits, &value, 4);
    bits = collective(kind, mask, bits, arg, file, line);
    memcpy(&value, &bits, 4);
    return value;
}

}  // namespace pensieve_emu

#define threadIdx (::pensieve_emu::thread_idx())
#define blockIdx (::pensieve_emu::block_idx())
#define blockDim (::pensieve_emu::block_dim())
#define gridDim (::pensieve_emu::grid_dim())
#define PENSIEVE_DYNAMIC_SHARED(name) unsigned char* const name = ::pensieve_emu::dynamic_shared()
#define __syncthreads() ::pensieve_emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) __pensieve_syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_xor_sync(mask, v, o, ...) \
    ::pensieve_emu::exchange(::pensieve_emu::Collective::ShflXor, mask, v, o, __FILE__, __LINE__)
#define __shfl_sync(mask, v, src, ...) \
    ::pensieve_emu::exchange(::pensieve_emu::Collective::ShflIdx, mask, v, src, __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) \
    ::pensieve_emu::exchange(::pensieve_emu::Collective::ShflDown, mask, v, d, __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) \
    ::pensieve_emu::exchange(::pensieve_emu::Collective::ShflUp, mask, v, d, __FILE__, __LINE__)
#define __ballot_sync(mask, p)                                                                  \
    ::pensieve_emu::collective(::pensieve_emu::Collective::Ballot, mask, (p) ? 1u : 0u, 0,     \
                               __FILE__, __LINE__)
#define __any_sync(mask, p)                                                                     \
    (::pensieve_emu::collective(::pensieve_emu::Collective::Any, mask, (p) ? 1u : 0u, 0,       \
                                __FILE__, __LINE__) != 0)
#define __all_sync(mask, p)                                                                     \
    (::pensieve_emu::collective(::pensieve_emu::Collective::All, mask, (p) ? 1u : 0u, 0,       \
                                __FILE__, __LINE__) != 0)

inline void __pensieve_syncwarp(const char* file, int line, unsigned mask = 0xffffffffu) {
    ::pensieve_emu::collective(::pensieve_emu::Collective::SyncWarp, mask, 0, 0, file, line);
}

// CUDA's device math, as the host computes it. `__expf` is the GPU's fast approximation there
// (a few ulp off); here it is the correctly rounded expf, one of the differences the README
// lists.
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Single operations rounded alone (the GPU never fuses them into a multiply-add).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

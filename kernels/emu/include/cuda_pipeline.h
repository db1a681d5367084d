// `cuda_pipeline.h` for the emulator (see `../cuda_emu.h`): the asynchronous copies from global
// to shared memory (`cp.async`, sm_80 on). A copy is read when issued and **lands at the
// latest moment CUDA allows**: when a `__pipeline_wait_prior` leaves its group no longer
// pending, never earlier, so a kernel that reads a copy's destination before waiting for it
// reads the shared memory's poison.
#pragma once

#include <stddef.h>

#include "../cuda_emu.h"

inline void __pipeline_memcpy_async(void* dst_shared, const void* src_global,
                                    size_t size_and_align, size_t zfill = 0) {
    ::pensieve_emu::async_copy(dst_shared, src_global, size_and_align, zfill);
}
inline void __pipeline_commit() { ::pensieve_emu::async_commit(); }
inline void __pipeline_wait_prior(size_t prior) { ::pensieve_emu::async_wait(prior); }

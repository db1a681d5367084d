// `cuda_bf16.h` for the emulator (see `../cuda_emu.h`): bfloat16 as its bits, with the
// conversions the kernels use (round to nearest even, as the GPU's).
#pragma once

#include "../cuda_emu.h"

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
} __attribute__((aligned(4)));

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t bits = (uint32_t)h.bits << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((x >> 16) | 0x40u)};
    x += 0x7fffu + ((x >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(x >> 16)};
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return float2{__bfloat162float(h.x), __bfloat162float(h.y)};
}

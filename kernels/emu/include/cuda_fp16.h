// `cuda_fp16.h` for the emulator (see `../cuda_emu.h`): IEEE half precision as its bits, with
// the conversions the kernels use (round to nearest even, as the GPU's).
#pragma once

#include "../cuda_emu.h"

struct __half {
    uint16_t bits;
};
struct __half2 {
    __half x, y;
} __attribute__((aligned(4)));

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
    const uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  // inf, NaN
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: exact in f32
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

inline __half __float2half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return __half{(uint16_t)(sign | 0x7e00u)};  // NaN
    if (ax >= 0x477ff000u) return __half{(uint16_t)(sign | 0x7c00u)};  // rounds to inf
    if (ax < 0x38800000u) {  // subnormal half (or zero): round |f| / 2^-24 to an integer
        float a;
        memcpy(&a, &ax, 4);
        return __half{(uint16_t)(sign | (uint16_t)std::nearbyint(a * 16777216.f))};
    }
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // to nearest, ties to even
    return __half{(uint16_t)(sign | ((rounded - 0x38000000u) >> 13))};
}

inline __half __float2half_rn(float f) { return __float2half(f); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }

inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }

// SwiGLU's arithmetic on bf16 pairs, shared by the activation warps and the consumers' epilogues.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace primemoe::sm90 {

// e^-g as __expf(-g) computes it, with its result flushed below 2^-126 (ex2's .ftz): 1 + e^-g, the only use, has the
// same bits either way, and the flush drops __expf's rescale around ex2.
__device__ __forceinline__ float exp_neg(float g) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
  return e;
}
// Fast division: the result is rounded to bf16, so its 2-ulp error does not show.
__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + exp_neg(g)); }

// A bf16 pair as floats, the high half by a mask: one instruction less than __bfloat1622float2's extract and shift.
__device__ __forceinline__ float2 bf16_pair_to_float2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
__device__ __forceinline__ __nv_bfloat162 pack(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }

// bf16(silu(g) * u) of a pair of bf16 gate and a pair of bf16 up values.
__device__ __forceinline__ uint32_t silu_times(uint32_t gate_pair, uint32_t up_pair) {
  const float2 g = bf16_pair_to_float2(gate_pair);
  const float2 u = bf16_pair_to_float2(up_pair);
  const __nv_bfloat162 a = pack(silu(g.x) * u.x, silu(g.y) * u.y);
  return *reinterpret_cast<const uint32_t*>(&a);
}
// The same for a 16-byte chunk: four pairs of gate and of up values.
__device__ __forceinline__ uint4 silu_times(uint4 gate, uint4 up) {
  return make_uint4(silu_times(gate.x, up.x), silu_times(gate.y, up.y), silu_times(gate.z, up.z),
                    silu_times(gate.w, up.w));
}

}  // namespace primemoe::sm90

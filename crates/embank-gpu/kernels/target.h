// What the kernels of cache.cu need from where they run: CUDA (nvcc, to PTX) or the CPU
// emulator (g++, emu.cpp), which runs each warp's 32 lanes as 32 threads. Kernels use
// warp-level collectives only (no shared memory, no block barrier), always with all 32
// lanes converged: the emulator deadlocks otherwise, which is how its tests catch it.
#pragma once
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifdef __CUDACC__
#define KERNEL extern "C" __global__ void
#define DEV static __device__ __forceinline__
DEV u32 lane_id() { return threadIdx.x & 31u; }
DEV u64 thread_id() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
DEV u32 ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
DEV u32 shfl32(u32 v, u32 src) { return __shfl_sync(0xffffffffu, v, src); }
DEV u64 shfl_xor64(u64 v, u32 m) { return __shfl_xor_sync(0xffffffffu, v, m); }
DEV u64 atomic_add64(u64* p, u64 v) { return atomicAdd(p, v); }
DEV u32 atomic_add32(u32* p, u32 v) { return atomicAdd(p, v); }
DEV void atomic_max64(u64* p, u64 v) { atomicMax(p, v); }
DEV void atomic_add_f32(float* p, float v) { atomicAdd(p, v); }
DEV float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
DEV float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
DEV float fsub_rn(float a, float b) { return __fsub_rn(a, b); }
DEV float fdiv_rn(float a, float b) { return __fdiv_rn(a, b); }
DEV float fsqrt_rn(float a) { return __fsqrt_rn(a); }
DEV float pow_f32(float b, float t) { return (float)pow((double)b, (double)t); }
DEV u32 lowest_bit(u32 m) { return (u32)(__ffs((int)m) - 1); }
DEV u32 popcount32(u32 m) { return (u32)__popc(m); }
DEV void warp_sync() { __syncwarp(); }
DEV void thread_fence() { __threadfence(); }
DEV u64 load_cg(const u64* p) { return __ldcg((const unsigned long long*)p); }
DEV float bits_float(u32 x) { return __uint_as_float(x); }
DEV u32 float_bits(float f) { return __float_as_uint(f); }
#else
#include "emu.h"
#endif

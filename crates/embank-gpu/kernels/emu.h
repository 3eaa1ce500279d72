// The CPU emulator's side of target.h: one kernel launch runs its warps one after
// another, each warp as 32 threads that meet at a barrier in every collective.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>

#define KERNEL static void
#define DEV static inline
struct alignas(16) float4 { float x, y, z, w; };

struct EmuWarp {
    std::barrier<> bar{32};
    u64 vals[32];
};
extern thread_local u32 emu_lane;
extern thread_local u64 emu_thread;
extern thread_local EmuWarp* emu_warp;

DEV u32 lane_id() { return emu_lane; }
DEV u64 thread_id() { return emu_thread; }
DEV u32 ballot(bool p) {
    emu_warp->vals[emu_lane] = p ? 1 : 0;
    emu_warp->bar.arrive_and_wait();
    u32 m = 0;
    for (u32 i = 0; i < 32; i++) m |= (emu_warp->vals[i] ? 1u : 0u) << i;
    emu_warp->bar.arrive_and_wait();
    return m;
}
DEV u64 exchange(u64 v, u32 src) {
    emu_warp->vals[emu_lane] = v;
    emu_warp->bar.arrive_and_wait();
    u64 r = emu_warp->vals[src];
    emu_warp->bar.arrive_and_wait();
    return r;
}
DEV u32 shfl32(u32 v, u32 src) { return (u32)exchange(v, src); }
DEV u64 shfl_xor64(u64 v, u32 m) { return exchange(v, emu_lane ^ m); }
DEV u64 atomic_add64(u64* p, u64 v) { return std::atomic_ref<u64>(*p).fetch_add(v); }
DEV u32 atomic_add32(u32* p, u32 v) { return std::atomic_ref<u32>(*p).fetch_add(v); }
DEV void atomic_add_f32(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }
DEV void atomic_max64(u64* p, u64 v) {
    std::atomic_ref<u64> a(*p);
    u64 old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
}
DEV float fmul_rn(float a, float b) { volatile float r = a * b; return r; }
DEV float fadd_rn(float a, float b) { volatile float r = a + b; return r; }
DEV float fsub_rn(float a, float b) { volatile float r = a - b; return r; }
DEV float fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
DEV float fsqrt_rn(float a) { return std::sqrt(a); }
DEV float pow_f32(float b, float t) { return (float)std::pow((double)b, (double)t); }
DEV u32 lowest_bit(u32 m) { return (u32)__builtin_ctz(m); }
DEV u32 popcount32(u32 m) { return (u32)__builtin_popcount(m); }
DEV void warp_sync() { emu_warp->bar.arrive_and_wait(); }
DEV void thread_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
DEV u64 load_cg(const u64* p) { return std::atomic_ref<const u64>(*p).load(); }
DEV float bits_float(u32 x) { float f; std::memcpy(&f, &x, 4); return f; }
DEV u32 float_bits(float f) { u32 x; std::memcpy(&x, &f, 4); return x; }

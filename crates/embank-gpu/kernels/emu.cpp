// The CPU emulator of the GPU cache's kernels (built only with the crate's `emulator`
// feature, for tests): each launch runs its warps in turn on 32 lane threads. "Device"
// memory is host memory, so the kernels' pointers are plain pointers.
#include <thread>
#include <vector>
#include "target.h"

thread_local u32 emu_lane;
thread_local u64 emu_thread;
thread_local EmuWarp* emu_warp;

#include "cache.cu"

template <class A>
static void run(void (*k)(A), u64 threads, const void* args) {
    A a;
    std::memcpy(&a, args, sizeof(A));
    u64 warps = (threads + 31) / 32;
    // 32 lane threads for the whole launch, running the warps one after another in
    // step (a thread a lane and warp was most of a test's time), last warp first: a GPU
    // runs them in any order, and the host logic must not rely on the first-to-last one
    // (misses counted by atomics arrive in the order the warps got there).
    EmuWarp warp;
    std::vector<std::thread> lanes;
    lanes.reserve(32);
    for (u32 l = 0; l < 32; l++)
        lanes.emplace_back([&, l] {
            emu_lane = l;
            emu_warp = &warp;
            for (u64 i = 0; i < warps; i++) {
                u64 w = warps - 1 - i;
                emu_thread = w * 32 + l;
                k(a);
                warp.bar.arrive_and_wait();  // every lane done with this warp before the next
            }
        });
    for (auto& t : lanes) t.join();
}

extern "C" int embank_emu_launch(u32 kernel, u64 threads, const void* args, u64 args_len) {
    switch (kernel) {
        case 0: if (args_len != sizeof(FindArgs)) return -1; run(embank_find, threads, args); return 0;
        case 1: if (args_len != sizeof(FillArgs)) return -1; run(embank_fill, threads, args); return 0;
        case 2: if (args_len != sizeof(InvalidateArgs)) return -1; run(embank_invalidate, threads, args); return 0;
        case 3: if (args_len != sizeof(RefreshArgs)) return -1; run(embank_refresh, threads, args); return 0;
        case 4: if (args_len != sizeof(CountArgs)) return -1; run(embank_count, threads, args); return 0;
        case 5: if (args_len != sizeof(PoolArgs)) return -1; run(embank_pool, threads, args); return 0;
        case 6: if (args_len != sizeof(TrainFindArgs)) return -1; run(embank_train_find, threads, args); return 0;
        case 7: if (args_len != sizeof(TrainPlaceArgs)) return -1; run(embank_train_place, threads, args); return 0;
        case 8: if (args_len != sizeof(TrainUpdateArgs)) return -1; run(embank_train_update, threads, args); return 0;
    }
    return -2;
}

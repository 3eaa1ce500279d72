// Training through the GPU cache: the kernels of `embank.gpu.TrainCache(kernels="native")`
// (crates/embank-gpu/src/train.rs drives them). Included by cache.cu, so compiled with it
// by NVRTC (to cache.ptx) and by g++ into the emulator.
//
// The layout is the Python cache's own tensors (python/embank/_gpu_train.py), used in
// place: `n_buckets` buckets of `slots` entries in four arrays: keys (i64, -1 empty),
// used (i64, the clock of the last call that used the slot), records (f32, `width` =
// `dim` row values, then the optimizer's state) and dirty (one byte). A key's bucket is
// torch.remainder(key_hash(key), n_buckets). No digests: a warp compares a bucket's keys
// 32 at a time (buckets of 32 slots by default: one load a lane).
//
// Arithmetic is the store's (crates/embank-core/src/optim.rs), operation for operation,
// each rounded to nearest (no fused multiply-adds: NVRTC runs with --fmad=false, the
// emulator with -ffp-contract=off), so an update is bit for bit the host's.

struct Train {
    u64 keys, used, records, dirty;
    u64 n_buckets;
    u32 slots, width, dim, pad;
};

DEV u64 train_bucket(const Train& t, u64 key) {
    i64 b = (i64)mix(key) % (i64)t.n_buckets;
    return (u64)(b < 0 ? b + (i64)t.n_buckets : b);  // floored, as torch.remainder
}

// The flat slot of `key` in bucket `b`, or NO_SLOT. Collective (every lane, same key).
DEV i64 train_slot(const Train& t, u64 key, u64 b) {
    const u64* ks = (const u64*)t.keys + b * t.slots;
    for (u32 base = 0; base < t.slots; base += 32) {
        u32 s = base + lane_id();
        u32 m = ballot(s < t.slots && ks[s] == key);
        if (m) return (i64)(b * t.slots + base + lowest_bit(m));
    }
    return NO_SLOT;
}

// ---- find: each id's slot, the slots found touched, their rows gathered, misses listed ----

struct TrainFindArgs {
    Train t;
    u64 ids;      // const u64[n], distinct
    u64 slot;     // i64[n]: each id's slot, -1 where not cached
    u64 out;      // float[n * dim]: the rows found (a miss's row untouched), or 0
    u64 payload;  // u64[4 + 3n]: as FindArgs' ((key, index in the call, 0) a miss)
    u64 n;
    u64 clock;    // written to `used` of each slot found (0: none touched)
    Report r;
    u32 parity, pad;
};

KERNEL embank_train_find(TrainFindArgs a) {
    u64 i = warp_id();
    if (i == 0 && lane_id() == 0) ((u64*)a.payload)[1 - a.parity] = 0;
    if (i >= a.n) return;
    const Train& t = a.t;
    u32 l = lane_id();
    u64 key = ((const u64*)a.ids)[i];
    i64 slot = train_slot(t, key, train_bucket(t, key));
    if (l == 0) ((i64*)a.slot)[i] = slot;
    if (slot != NO_SLOT) {
        if (l == 0 && a.clock) ((u64*)t.used)[slot] = a.clock;
        if (a.out) {
            const float* src = (const float*)t.records + (u64)slot * t.width;
            float* dst = (float*)a.out + i * t.dim;
            for (u32 j = l; j < t.dim; j += 32) dst[j] = src[j];
        }
    } else if (l == 0) {
        u64* p = (u64*)a.payload;
        u64 at = atomic_add64(p + a.parity, 1);
        p[4 + 3 * at] = key;
        p[5 + 3 * at] = i;
        p[6 + 3 * at] = 0;
    }
    report(a.r, (const u64*)a.payload, a.parity);
}

// ---- place: a call's misses put in their buckets with their fetched records ----

// What happened to each miss (`TrainPlaceArgs::ev`'s flags).
#define PLACED_FREE 0ull     // took an empty slot
#define PLACED_EVICTED 1ull  // took the slot of a clean row
#define PLACED_DIRTY 2ull    // took the slot of a dirty row: its key and record copied out
#define PLACED_NONE 3ull     // no slot the call does not use itself: answered, not cached

struct TrainPlaceArgs {
    Train t;
    u64 keys;    // const u64[m]: the misses, grouped by bucket (the call's order within one)
    u64 at;      // const u32[m]: each miss's index in the call
    u64 recs;    // const float[m * width]: each miss's record, in `keys`' order
    u64 groups;  // const u32[g + 1]: where each bucket's misses start
    u64 slot;    // i64[n]: a placed miss's slot written
    u64 out;     // float[n * dim]: every miss's row written, or 0
    u64 ev;      // u64[m] flags, u64[m] evicted keys, float[m * width] evicted records
                 // (mapped host memory: the host reads them once the launch is done)
    u64 m, n_groups, clock;
};

KERNEL embank_train_place(TrainPlaceArgs a) {
    u64 g = warp_id();
    if (g >= a.n_groups) return;
    const Train& t = a.t;
    u32 l = lane_id(), S = t.slots, W = t.width;
    const u32* groups = (const u32*)a.groups;
    const u64* nk = (const u64*)a.keys;
    u64* ks = (u64*)t.keys;
    u64* used = (u64*)t.used;
    u8* dirty = (u8*)t.dirty;
    float* records = (float*)t.records;
    u64* flags = (u64*)a.ev;
    u64* ev_keys = flags + a.m;
    float* ev_recs = (float*)(ev_keys + a.m);
    u64 b = train_bucket(t, nk[groups[g]]);
    for (u32 k = groups[g]; k < groups[g + 1]; k++) {
        // The slot given next: empty ones first, then the least recently used, never one
        // this call uses (its `used` is the call's clock); ties to the lowest index. The
        // order of embank/_gpu_train.py's torch path, so both place the same keys alike.
        u64 best = ~0ull, best_s = ~0ull;
        for (u32 s = l; s < S; s += 32) {
            u64 f = b * S + s;
            u64 pri = ks[f] == EMPTY_KEY ? 0ull : used[f] == a.clock ? ~0ull : used[f] + 1ull;
            if (pri < best) {
                best = pri;
                best_s = s;
            }
        }
        for (u32 x = 16; x >= 1; x >>= 1) {
            u64 ob = shfl_xor64(best, x), os = shfl_xor64(best_s, x);
            if (ob < best || (ob == best && os < best_s)) {
                best = ob;
                best_s = os;
            }
        }
        u32 at = ((const u32*)a.at)[k];
        const float* rec = (const float*)a.recs + (u64)k * W;
        if (a.out)
            for (u32 j = l; j < t.dim; j += 32) ((float*)a.out)[(u64)at * t.dim + j] = rec[j];
        if (best == ~0ull) {
            if (l == 0) flags[k] = PLACED_NONE;
            continue;
        }
        u64 v = b * S + best_s;
        u64 old = ks[v];
        u64 flag = old == EMPTY_KEY ? PLACED_FREE : dirty[v] ? PLACED_DIRTY : PLACED_EVICTED;
        if (flag == PLACED_DIRTY)
            for (u32 j = l; j < W; j += 32) ev_recs[(u64)k * W + j] = records[v * W + j];
        warp_sync();  // the old record copied out before the new one lands
        for (u32 j = l; j < W; j += 32) records[v * W + j] = rec[j];
        if (l == 0) {
            flags[k] = flag;
            ev_keys[k] = old;
            ks[v] = nk[k];
            used[v] = a.clock;
            dirty[v] = 0;
            ((i64*)a.slot)[at] = (i64)v;
        }
        warp_sync();  // the bucket's lanes see this miss's slot taken before the next
    }
}

// ---- update: the table's optimizer applied to cached rows (one warp a row) ----

#define OPT_SGD 0
#define OPT_ADAGRAD 1
#define OPT_ROWWISE_ADAGRAD 2
#define OPT_ADAM 3
#define OPT_ADAMW 4
#define OPT_FTRL 5

struct TrainUpdateArgs {
    Train t;
    u64 slots;  // const i64[n]: the rows' slots (< 0: skipped)
    u64 grads;  // const float[n * dim]
    u64 n;
    u32 kind, mark_dirty;
    float lr, eps, beta1, beta2, weight_decay, l1, l2, beta;
};

KERNEL embank_train_update(TrainUpdateArgs a) {
    u64 i = warp_id();
    if (i >= a.n) return;
    i64 slot = ((const i64*)a.slots)[i];
    if (slot < 0) return;
    const Train& t = a.t;
    u32 l = lane_id(), d = t.dim;
    float* rec = (float*)t.records + (u64)slot * t.width;
    const float* g = (const float*)a.grads + i * d;
    float lr = a.lr, eps = a.eps;
    if (a.kind == OPT_SGD) {
        for (u32 j = l; j < d; j += 32) rec[j] = fsub_rn(rec[j], fmul_rn(lr, g[j]));
    } else if (a.kind == OPT_ADAGRAD) {
        for (u32 j = l; j < d; j += 32) {
            float s = fadd_rn(rec[d + j], fmul_rn(g[j], g[j]));
            rec[d + j] = s;
            rec[j] = fsub_rn(rec[j], fdiv_rn(fmul_rn(lr, g[j]), fadd_rn(fsqrt_rn(s), eps)));
        }
    } else if (a.kind == OPT_ROWWISE_ADAGRAD) {
        u32 mult = 0;
        if (l == 0) {  // the mean of the squared gradient, summed in order (the host's)
            float sum = 0.0f;
            for (u32 j = 0; j < d; j++) sum = fadd_rn(sum, fmul_rn(g[j], g[j]));
            float s = fadd_rn(rec[d], fdiv_rn(sum, (float)d));
            rec[d] = s;
            mult = float_bits(fdiv_rn(lr, fadd_rn(fsqrt_rn(s), eps)));
        }
        float m = bits_float(shfl32(mult, 0));
        for (u32 j = l; j < d; j += 32) rec[j] = fsub_rn(rec[j], fmul_rn(m, g[j]));
    } else if (a.kind == OPT_FTRL) {
        float l1 = a.l1, l2 = a.l2, beta = a.beta;
        for (u32 j = l; j < d; j += 32) {
            float w = rec[j], z = rec[d + j], n = rec[2 * d + j], gj = g[j];
            float n_new = fadd_rn(n, fmul_rn(gj, gj));
            float sigma = fdiv_rn(fsub_rn(fsqrt_rn(n_new), fsqrt_rn(n)), lr);
            z = fadd_rn(z, fsub_rn(gj, fmul_rn(sigma, w)));
            float sign = z > 0.0f ? 1.0f : z < 0.0f ? -1.0f : (float_bits(z) >> 31 ? -1.0f : 1.0f);
            float den = fadd_rn(fdiv_rn(fadd_rn(beta, fsqrt_rn(n_new)), lr), l2);
            float az = z < 0.0f ? -z : z;
            rec[j] = az <= l1 ? 0.0f : fdiv_rn(-fsub_rn(z, fmul_rn(sign, l1)), den);
            rec[d + j] = z;
            rec[2 * d + j] = n_new;
        }
    } else {  // Adam, AdamW: a step count a row, bias-corrected with it
        float b1 = a.beta1, b2 = a.beta2;
        float step = fadd_rn(rec[3 * d], 1.0f);
        warp_sync();  // every lane read the count before lane 0 writes it
        if (l == 0) rec[3 * d] = step;
        float bc1 = fsub_rn(1.0f, pow_f32(b1, step)), bc2 = fsub_rn(1.0f, pow_f32(b2, step));
        float decay = fsub_rn(1.0f, fmul_rn(lr, a.weight_decay));
        for (u32 j = l; j < d; j += 32) {
            float w = rec[j], gj = g[j];
            if (a.kind == OPT_ADAMW) w = fmul_rn(w, decay);
            float m = fadd_rn(fmul_rn(b1, rec[d + j]), fmul_rn(fsub_rn(1.0f, b1), gj));
            float v = fadd_rn(fmul_rn(b2, rec[2 * d + j]), fmul_rn(fmul_rn(fsub_rn(1.0f, b2), gj), gj));
            float mhat = fdiv_rn(m, bc1), vhat = fdiv_rn(v, bc2);
            rec[j] = fsub_rn(w, fdiv_rn(fmul_rn(lr, mhat), fadd_rn(fsqrt_rn(vhat), eps)));
            rec[d + j] = m;
            rec[2 * d + j] = v;
        }
    }
    if (a.mark_dirty && l == 0) ((u8*)t.dirty)[slot] = 1;
}

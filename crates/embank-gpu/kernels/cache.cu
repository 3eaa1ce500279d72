// The GPU cache's kernels (crates/embank-gpu/src/cache.rs drives them). Compiled twice:
// by nvcc to PTX (cache.ptx, committed, loaded through the CUDA driver at run time; see
// tools/gpu_ptx.sh) and by g++ into the CPU emulator the tests run (emu.cpp).
//
// Layout (after HierarchicalKV): `n_buckets` buckets of `slots` entries; per entry a
// key (u64, EMPTY when free), a one-byte digest (the hash's top byte), a score (u64)
// and a row of `dim` values (f32, f16 or bf16); per bucket a version (u32) that every
// invalidation bumps. One warp serves one key (lookup, invalidate, refresh) or one
// bucket's new keys (insert). The host orders every launch of a cache after the one
// before (one event), so launches never overlap: within one launch, score touches use
// atomics and an insert's warp owns its bucket.
#include "target.h"

#define EMPTY_KEY 0xFFFFFFFFFFFFFFFFull
#define LOCKED_KEY 0xFFFFFFFFFFFFFFFEull
#define NO_SLOT (-1ll)

// Counters (u64, on the device): what stats() reads.
#define C_INVALIDATED 0
#define C_SYNC_INSERTS 1
#define C_ASYNC_INSERTS 2
#define C_REFUSED 3
#define C_EVICTIONS 4
#define C_REFRESH_CHANGED 5
#define C_ROWS 6

// The cache's arrays and shape, passed by value in every kernel's arguments. Pointers
// travel as u64 so that the Rust side's #[repr(C)] twin has the same layout.
struct Cache {
    u64 keys, digests, scores, rows, versions, counters, clock;
    u32 n_buckets, slots, dim, dtype /* 0 f32, 1 f16, 2 bf16 */, policy /* 0 lru, 1 lfu, 2 custom */, pad;
};

// splitmix64's finalizer (embank.gpu.key_hash computes the same bits).
DEV u64 mix(u64 k) {
    u64 h = k ^ (k >> 30);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}
// The bucket: the hash's low 32 bits scaled to n_buckets (a multiply, not a division);
// the digest comes from the top byte, independent of it.
DEV u64 bucket_of(const Cache& c, u64 h) { return ((h & 0xffffffffull) * (u64)c.n_buckets) >> 32; }
DEV u32 digest_of(u64 h) { return (u32)(h >> 56); }

// ---- element types (bit-exact on both targets; round to nearest even) ----

DEV u16 f32_to_f16(float f) {
    u32 x = float_bits(f);
    u32 sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xffu) return (u16)(sign | 0x7c00u | (m ? 0x200u : 0u));
    int ee = (int)e - 127 + 15;
    if (ee >= 31) return (u16)(sign | 0x7c00u);
    if (ee <= 0) {
        if (ee < -10) return (u16)sign;
        m |= 0x800000u;
        u32 shift = (u32)(14 - ee);
        u32 hm = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (hm & 1u))) hm++;
        return (u16)(sign | hm);
    }
    u32 hm = m >> 13, rem = m & 0x1fffu;
    u32 h = sign | ((u32)ee << 10) | hm;
    if (rem > 0x1000u || (rem == 0x1000u && (hm & 1u))) h++;
    return (u16)h;
}
DEV float f16_to_f32(u16 h) {
    u32 sign = ((u32)h & 0x8000u) << 16, e = ((u32)h >> 10) & 0x1fu, m = (u32)h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}
DEV u16 f32_to_bf16(float f) {
    u32 x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
DEV float bf16_to_f32(u16 h) { return bits_float((u32)h << 16); }

DEV float row_get(const Cache& c, u64 slot, u32 j) {
    u64 at = slot * c.dim + j;
    if (c.dtype == 0) return ((const float*)c.rows)[at];
    u16 h = ((const u16*)c.rows)[at];
    return c.dtype == 1 ? f16_to_f32(h) : bf16_to_f32(h);
}
DEV void row_set(const Cache& c, u64 slot, u32 j, float v) {
    u64 at = slot * c.dim + j;
    if (c.dtype == 0) ((float*)c.rows)[at] = v;
    else ((u16*)c.rows)[at] = c.dtype == 1 ? f32_to_f16(v) : f32_to_bf16(v);
}

// Value `j` of a row as the table stores it (0 f32, 1 f16, 2 int8: `dim` bytes q, then
// f32 scale and bias; q * scale + bias, never fused, as the store decodes).
DEV float stored_get(const u8* row, u32 stored, u32 dim, u32 j) {
    if (stored == 0) return ((const float*)row)[j];
    if (stored == 1) return f16_to_f32(((const u16*)row)[j]);
    const u8* t = row + dim;
    u32 s = (u32)t[0] | ((u32)t[1] << 8) | ((u32)t[2] << 16) | ((u32)t[3] << 24);
    u32 b = (u32)t[4] | ((u32)t[5] << 8) | ((u32)t[6] << 16) | ((u32)t[7] << 24);
    return fadd_rn(fmul_rn((float)row[j], bits_float(s)), bits_float(b));
}

// The flat slot of `key` in bucket `b`, or NO_SLOT. Collective: every lane calls it with
// the same key. Lane l compares the digests of slots 4l..4l+3, then each lane with a
// candidate reads its key; at most a few rounds (a false digest match is 1 in 256).
DEV i64 find_slot(const Cache& c, u64 key, u64 b, u32 d) {
    if (key >= LOCKED_KEY) return NO_SLOT;
    u32 l = lane_id(), S = c.slots;
    const u8* dg = (const u8*)c.digests + b * S;
    const u64* ks = (const u64*)c.keys + b * S;
    u32 cand = 0;
    if (S >= 4) {
        if (4 * l < S) {
            u32 w = *(const u32*)(dg + 4 * l);
            for (u32 q = 0; q < 4; q++)
                if (((w >> (8 * q)) & 0xffu) == d) cand |= 1u << q;
        }
    } else if (l < S && dg[l] == d) {
        cand = 1;
    }
    u32 stride = S >= 4 ? 4 : 1;
    for (;;) {
        bool has = cand != 0;
        if (!ballot(has)) return NO_SLOT;
        bool hit = false;
        u32 q = 0;
        if (has) {
            q = lowest_bit(cand);
            cand &= cand - 1;
            hit = ks[stride * l + q] == key;
        }
        u32 m = ballot(hit);
        if (m) {
            u32 src = lowest_bit(m);
            u32 qq = shfl32(q, src);
            return (i64)(b * S + stride * src + qq);
        }
    }
}

DEV u64 warp_id() { return thread_id() >> 5; }

// ---- lookup: find, touch, gather, and the misses compacted (one launch) ----

// Where a lookup's last warp copies the miss count and the first `hint` misses: pinned
// host memory mapped into the device's address space, so no copy is launched and the host
// reads them once the launch's event is done. `done` counts the warps finished (the last
// one copies, then zeroes it for the next launch).
struct Report {
    u64 host;   // u64[4 + 3 * hint], device address of mapped host memory
    u64 done;   // u32, device memory, zero between launches
    u64 hint;   // misses copied at most
    u64 warps;  // warps that check in
};

// Called by every warp that checks in, after its work: the last one copies. Only for
// small launches (`host` 0 otherwise: the host copies): every warp's fence and atomic on
// one counter would cost a large launch more than the copy it saves.
DEV void report(const Report& r, const u64* payload, u32 parity) {
    if (r.host == 0) return;
    u32 l = lane_id();
    u32 last = 0;
    if (l == 0) {
        thread_fence();
        last = atomic_add32((u32*)r.done, 1u) == (u32)(r.warps - 1) ? 1u : 0u;
    }
    warp_sync();  // lane 0's fence and atomic ordered before the other lanes' reads below
    last = shfl32(last, 0);
    if (!last) return;
    thread_fence();
    u64 count = load_cg(payload + parity);
    u64 copy = count < r.hint ? count : r.hint;
    u64* host = (u64*)r.host;
    for (u64 k = l; k < 3 * copy; k += 32) host[4 + k] = load_cg(payload + 4 + k);
    if (l == 0) {
        host[parity] = count;
        *(u32*)r.done = 0;
    }
}

struct FindArgs {
    Cache c;
    u64 ids;       // const u64[n]
    u64 out;       // float[n * dim]
    u64 dflt;      // const float[dim]: a miss's row until it is filled
    u64 payload;   // u64[4 + 3n]: two miss counts (this launch's, `parity`, zero at its
                   // start; the other zeroed here for the next), the warps done (Report's
                   // `done`), a pad, then (key, version, score) a miss
    u64 miss_at;   // u32[n]: each miss's place in the batch
    u64 given;     // const u64[n] scores (policy custom), or 0
    u64 n;
    u64 cap;       // misses recorded at most (counted all the same)
    Report r;
    u32 parity, vec4;  // vec4: rows and `out` 16-byte aligned f32, dim % 4 == 0
};

// Row `slot` of the cache into `out` (f32), the warp's lanes side by side.
DEV void gather(const Cache& c, u64 slot, float* out, bool vec4) {
    u32 l = lane_id();
    if (vec4) {
        const float4* src = (const float4*)((const float*)c.rows + slot * c.dim);
        float4* dst = (float4*)out;
        for (u32 j = l; j < c.dim / 4; j += 32) dst[j] = src[j];
    } else if (c.dtype == 0) {
        const float* src = (const float*)c.rows + slot * c.dim;
        for (u32 j = l; j < c.dim; j += 32) out[j] = src[j];
    } else {
        for (u32 j = l; j < c.dim; j += 32) out[j] = row_get(c, slot, j);
    }
}

KERNEL embank_find(FindArgs a) {
    u64 i = warp_id();
    if (i == 0 && lane_id() == 0) ((u64*)a.payload)[1 - a.parity] = 0;
    if (i >= a.n) return;
    const Cache& c = a.c;
    u32 l = lane_id();
    u64 key = ((const u64*)a.ids)[i];
    u64 h = mix(key), b = bucket_of(c, h);
    i64 slot = find_slot(c, key, b, digest_of(h));
    float* out = (float*)a.out + i * c.dim;
    u64 score = c.policy == 2 ? ((const u64*)a.given)[i] : c.clock;
    if (slot != NO_SLOT) {
        if (l == 0) {
            u64* sc = (u64*)c.scores + slot;
            if (c.policy == 1) atomic_add64(sc, 1);
            else atomic_max64(sc, score);
        }
        gather(c, (u64)slot, out, a.vec4 != 0);
    } else {
        if (l == 0) {
            u64* p = (u64*)a.payload;
            u64 at = atomic_add64(p + a.parity, 1);
            if (at < a.cap) {
                p[4 + 3 * at] = key;
                p[5 + 3 * at] = ((const u32*)c.versions)[b];
                p[6 + 3 * at] = score;
                ((u32*)a.miss_at)[at] = (u32)i;
            }
        }
        const float* dflt = (const float*)a.dflt;
        for (u32 j = l; j < c.dim; j += 32) out[j] = dflt[j];
    }
    report(a.r, (const u64*)a.payload, a.parity);
}

// ---- pooled lookup: find, touch and pool a bag's rows (one warp a bag) ----

struct PoolArgs {
    Cache c;
    u64 ids;       // const u64[n]
    u64 offsets;   // const i64[bags]: where each bag starts (the last ends at n)
    u64 weights;   // const float[n] per-sample weights, or 0
    u64 out;       // float[bags * dim]
    u64 dflt;      // const float[dim]
    u64 payload;   // as FindArgs'
    u64 miss_at;   // u32[n]: each miss's bag
    u64 miss_w;    // float[n]: each miss's weight in its bag
    u64 given;     // const u64[n] scores (policy custom), or 0
    u64 n, bags;
    u64 cap;       // misses recorded at most (counted all the same)
    Report r;
    u32 parity, mean, add_default /* async: a miss pools the default row */, pad;
};

KERNEL embank_pool(PoolArgs a) {
    u64 b = warp_id();
    if (b == 0 && lane_id() == 0) ((u64*)a.payload)[1 - a.parity] = 0;
    if (b >= a.bags) return;
    const Cache& c = a.c;
    u32 l = lane_id();
    const i64* offsets = (const i64*)a.offsets;
    i64 start = offsets[b], end = b + 1 < a.bags ? offsets[b + 1] : (i64)a.n;
    float* out = (float*)a.out + b * c.dim;
    for (u32 j = l; j < c.dim; j += 32) out[j] = 0.0f;
    float scale = a.mean && end > start ? 1.0f / (float)(end - start) : 1.0f;
    for (i64 i = start; i < end; i++) {
        u64 key = ((const u64*)a.ids)[i];
        u64 h = mix(key), bk = bucket_of(c, h);
        i64 slot = find_slot(c, key, bk, digest_of(h));
        float w = a.weights ? ((const float*)a.weights)[i] : 1.0f;
        w = a.mean ? scale : w;
        u64 score = c.policy == 2 ? ((const u64*)a.given)[i] : c.clock;
        if (slot != NO_SLOT) {
            if (l == 0) {
                u64* sc = (u64*)c.scores + slot;
                if (c.policy == 1) atomic_add64(sc, 1);
                else atomic_max64(sc, score);
            }
            for (u32 j = l; j < c.dim; j += 32) out[j] += w * row_get(c, (u64)slot, j);
        } else {
            if (l == 0) {
                u64* p = (u64*)a.payload;
                u64 at = atomic_add64(p + a.parity, 1);
                if (at < a.cap) {
                    p[4 + 3 * at] = key;
                    p[5 + 3 * at] = ((const u32*)c.versions)[bk];
                    p[6 + 3 * at] = score;
                    ((u32*)a.miss_at)[at] = (u32)b;
                    ((float*)a.miss_w)[at] = w;
                }
            }
            if (a.add_default) {
                const float* dflt = (const float*)a.dflt;
                for (u32 j = l; j < c.dim; j += 32) out[j] += w * dflt[j];
            }
        }
    }
    report(a.r, (const u64*)a.payload, a.parity);
}

// ---- fill: a lookup's misses answered from the fetched rows, and new keys inserted ----

struct FillArgs {
    Cache c;
    u64 out;        // float[* x dim] (0: nothing to answer)
    u64 miss_at;    // const u32[n_answer]: each miss's place in `out`
    u64 row_of;     // const u32[n_answer]: each miss's row among `rows`
    u64 rows;       // const u8[*]: fetched rows, `row_bytes` each, as the table stores them
    u64 keys;       // const u64[n_insert]: new keys, grouped by bucket
    u64 key_row;    // const u32[n_insert]: each new key's row among `rows`
    u64 key_ver;    // const u32[n_insert]: its bucket's version when it was found missing
    u64 key_score;  // const u64[n_insert]: its score (policy custom)
    u64 groups;     // const u32[n_groups + 1]: where each bucket's keys start
    u64 miss_w;     // const float[n_answer]: pooled (not 0): each miss's weight, and
                    // `miss_at` its bag: the row is added to its bag's (atomically)
    u64 n_answer, n_groups;
    u32 stored, row_bytes, which /* C_SYNC_INSERTS or C_ASYNC_INSERTS */, pad;
};

KERNEL embank_fill(FillArgs a) {
    u64 w = warp_id();
    const Cache& c = a.c;
    u32 l = lane_id();
    if (w < a.n_answer) {
        u64 at = ((const u32*)a.miss_at)[w];
        const u8* row = (const u8*)a.rows + (u64)((const u32*)a.row_of)[w] * a.row_bytes;
        float* out = (float*)a.out + at * c.dim;
        if (a.miss_w) {
            float wt = ((const float*)a.miss_w)[w];
            for (u32 j = l; j < c.dim; j += 32) atomic_add_f32(out + j, wt * stored_get(row, a.stored, c.dim, j));
        } else {
            for (u32 j = l; j < c.dim; j += 32) out[j] = stored_get(row, a.stored, c.dim, j);
        }
        return;
    }
    u64 g = w - a.n_answer;
    if (g >= a.n_groups) return;
    const u32* groups = (const u32*)a.groups;
    u32 start = groups[g], end = groups[g + 1];
    const u64* nk = (const u64*)a.keys;
    u64* counters = (u64*)c.counters;
    u32 S = c.slots;
    u64 b = bucket_of(c, mix(nk[start]));
    u64* ks = (u64*)c.keys + b * S;
    u64* sc = (u64*)c.scores + b * S;
    u8* dg = (u8*)c.digests + b * S;
    u32 ver = ((const u32*)c.versions)[b];
    for (u32 k = start; k < end; k++) {
        u64 key = nk[k];
        if (((const u32*)a.key_ver)[k] != ver) {  // a write since the miss was found
            if (l == 0) atomic_add64(counters + C_REFUSED, 1);
            continue;
        }
        u64 score = c.policy == 0 ? c.clock : c.policy == 1 ? 1ull : ((const u64*)a.key_score)[k];
        // The key already there (inserted since its miss): its slot. Else the slot of
        // least score (free slots first, then the lowest index): packed (rank << 7) | idx.
        u64 best = ~0ull;
        u32 here = 0xffffffffu;
        for (u32 s = l; s < S; s += 32) {
            u64 kk = ks[s];
            if (kk == key) here = s;
            u64 rank = kk == EMPTY_KEY ? 0ull : sc[s] + 1ull;
            u64 packed = (rank << 7) | s;
            if (packed < best) best = packed;
        }
        u32 found = ballot(here != 0xffffffffu);
        u64 slot;
        bool evict = false;
        if (found) {
            slot = shfl32(here, lowest_bit(found));
        } else {
            for (u32 m = 16; m >= 1; m >>= 1) {
                u64 o = shfl_xor64(best, m);
                if (o < best) best = o;
            }
            u64 rank = best >> 7;
            if (rank > score + 1ull) {  // a full bucket of keys scoring higher: refused
                if (l == 0) atomic_add64(counters + C_REFUSED, 1);
                continue;
            }
            slot = best & 127u;
            evict = rank != 0;
        }
        if (l == 0) {
            if (!found) {
                ks[slot] = key;
                dg[slot] = (u8)digest_of(mix(key));
                sc[slot] = score;
                if (evict) atomic_add64(counters + C_EVICTIONS, 1);
            } else if (score > sc[slot]) {
                sc[slot] = score;
            }
            atomic_add64(counters + a.which, 1);
        }
        const u8* row = (const u8*)a.rows + (u64)((const u32*)a.key_row)[k] * a.row_bytes;
        for (u32 j = l; j < c.dim; j += 32) row_set(c, b * S + slot, j, stored_get(row, a.stored, c.dim, j));
        warp_sync();  // the bucket's lanes see this key's writes before the next key
    }
}

// ---- invalidate: bump each key's bucket version, empty its slot ----

struct InvalidateArgs {
    Cache c;
    u64 keys;  // const u64[n], distinct
    u64 n;
};

KERNEL embank_invalidate(InvalidateArgs a) {
    u64 i = warp_id();
    if (i >= a.n) return;
    const Cache& c = a.c;
    u64 key = ((const u64*)a.keys)[i];
    u64 h = mix(key), b = bucket_of(c, h);
    if (lane_id() == 0) atomic_add32((u32*)c.versions + b, 1u);
    i64 slot = find_slot(c, key, b, digest_of(h));
    if (slot != NO_SLOT && lane_id() == 0) {
        ((u64*)c.keys)[slot] = EMPTY_KEY;
        ((u8*)c.digests)[slot] = 0;
        ((u64*)c.scores)[slot] = 0;
        atomic_add64((u64*)c.counters + C_INVALIDATED, 1);
    }
}

// ---- refresh: rewrite cached rows from the table where their bucket did not move ----

struct RefreshArgs {
    Cache c;
    u64 slots;  // const u64[n]: flat slots
    u64 keys;   // const u64[n]: the key each held when read
    u64 vers;   // const u32[n]: its bucket's version then
    u64 found;  // const u8[n]: the table still holds the key
    u64 rows;   // const u8[n * row_bytes]
    u64 n;
    u32 stored, row_bytes;
};

KERNEL embank_refresh(RefreshArgs a) {
    u64 i = warp_id();
    if (i >= a.n) return;
    const Cache& c = a.c;
    u32 l = lane_id();
    u64 slot = ((const u64*)a.slots)[i];
    u64 key = ((const u64*)a.keys)[i];
    u64 b = slot / c.slots;
    if (((const u32*)c.versions)[b] != ((const u32*)a.vers)[i] || ((const u64*)c.keys)[slot] != key) return;
    if (!((const u8*)a.found)[i]) {
        if (l == 0) {
            ((u64*)c.keys)[slot] = EMPTY_KEY;
            ((u8*)c.digests)[slot] = 0;
            ((u64*)c.scores)[slot] = 0;
            atomic_add64((u64*)c.counters + C_REFRESH_CHANGED, 1);
        }
        return;
    }
    const u8* row = (const u8*)a.rows + i * a.row_bytes;
    bool diff = false;
    for (u32 j = l; j < c.dim; j += 32) {
        float v = stored_get(row, a.stored, c.dim, j);
        float before = row_get(c, slot, j);
        row_set(c, slot, j, v);
        if (float_bits(row_get(c, slot, j)) != float_bits(before)) diff = true;
    }
    if (ballot(diff) && l == 0) atomic_add64((u64*)c.counters + C_REFRESH_CHANGED, 1);
}

// ---- rows cached: one thread a slot ----

struct CountArgs {
    Cache c;
    u64 n;  // n_buckets * slots
};

KERNEL embank_count(CountArgs a) {
    u64 i = thread_id();
    bool live = false;
    if (i < a.n) {
        u64 k = ((const u64*)a.c.keys)[i];
        live = k < LOCKED_KEY;
    }
    u32 m = ballot(live);
    if (lane_id() == 0 && m) atomic_add64((u64*)a.c.counters + C_ROWS, (u64)popcount32(m));
}

#include "train.cuh"

//! The GPU cache's host logic and kernels, run on the CPU emulator (the kernels of
//! kernels/cache.cu compiled by g++), against an embedded table as the reference.
//! `cargo test -p embank-gpu --features emulator`.
#![cfg(feature = "emulator")]

use std::sync::Arc;

use embank_core::{DType, Store, StoreOptions, TableApi, TableOptions};
use embank_gpu::device::Emulator;
use embank_gpu::{Device, GpuTable, Insert, Options, Policy, RowType};

struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    table: Arc<dyn TableApi>,
}

fn table(dtype: DType, dim: u32, keys: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let mut o = TableOptions::new(dim);
    o.dtype = dtype;
    o.capacity = 4096;
    let t = store.create_table("t", o).unwrap();
    let ks: Vec<u64> = (0..keys).collect();
    let rows: Vec<f32> = (0..keys as usize * dim as usize).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    t.push(&ks, &rows).unwrap();
    Fixture { _dir: dir, store, table: Arc::new(t) }
}

fn options(n_buckets: usize, slots: usize, dim: usize) -> Options {
    Options {
        n_buckets,
        slots,
        row_type: RowType::F32,
        policy: Policy::Lru,
        insert: Insert::Sync,
        hit_rate_threshold: 0.8,
        window: 8,
        default_row: vec![-7.0; dim],
        stored_rows: true,
        async_miss_cap: embank_gpu::ASYNC_MISS_CAP,
        report_warps_max: embank_gpu::REPORT_WARPS_MAX,
        refresh_chunk: embank_gpu::REFRESH_CHUNK,
    }
}

fn dev() -> Arc<dyn Device> {
    Arc::new(Emulator)
}

/// A lookup through the cache: ids and rows in (emulated) device memory, i.e. host memory.
fn lookup(cache: &GpuTable, ids: &[u64]) -> (Vec<f32>, Option<usize>) {
    let mut out = vec![0f32; ids.len() * cache.dim()];
    let hits = cache.lookup(ids.as_ptr() as u64, ids.len(), out.as_mut_ptr() as u64, 0, 0).unwrap();
    (out, hits)
}

fn reference(t: &Arc<dyn TableApi>, ids: &[u64]) -> Vec<f32> {
    let mut out = vec![0f32; ids.len() * t.dim()];
    let mut found = vec![false; ids.len()];
    t.lookup(ids, &mut out, &mut found).unwrap();
    out
}

#[test]
fn sync_lookups_answer_the_tables_rows_then_hit() {
    let f = table(DType::F32, 5, 300);
    let cache = GpuTable::new(dev(), f.table.clone(), options(4, 32, 5)).unwrap();
    // Duplicates, a key the table lacks (answered with its missing default, not cached).
    let ids: Vec<u64> = vec![3, 7, 3, 250, 9_999, 7, 42];
    let (out, hits) = lookup(&cache, &ids);
    assert_eq!(out, reference(&f.table, &ids));
    assert_eq!(hits, Some(0));
    let (out, hits) = lookup(&cache, &ids);
    assert_eq!(out, reference(&f.table, &ids));
    assert_eq!(hits, Some(6), "all but the absent key hit");
    let s = cache.stats().unwrap();
    assert_eq!(s.rows_cached, 4, "four distinct keys the table holds");
    assert_eq!(s.sync_inserts, 4);
    assert_eq!(s.host.host_syncs, 2);
}

#[test]
fn a_full_cache_evicts_and_stays_exact() {
    // Misses reported by the kernel's last warp, and copied by the host (no report).
    for report_warps_max in [embank_gpu::REPORT_WARPS_MAX, 0] {
        full_cache_evicts_and_stays_exact(report_warps_max);
    }
}

fn full_cache_evicts_and_stays_exact(report_warps_max: usize) {
    let f = table(DType::F32, 3, 500);
    // 2 buckets of 8: 16 rows for 500 keys.
    let mut o = options(2, 8, 3);
    o.report_warps_max = report_warps_max;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    let mut seed = 1u64;
    for _ in 0..6 {
        let ids: Vec<u64> = (0..40)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (seed >> 33) % 500
            })
            .collect();
        let (out, _) = lookup(&cache, &ids);
        assert_eq!(out, reference(&f.table, &ids));
    }
    let s = cache.stats().unwrap();
    assert!(s.rows_cached <= 16 && s.rows_cached >= 8, "{s:?}");
    assert!(s.evictions > 0, "{s:?}");
}

#[test]
fn compact_tables_and_row_types_decode_on_the_device() {
    for (dtype, row_type) in [
        (DType::Int8, RowType::F32),
        (DType::F16, RowType::F32),
        (DType::F32, RowType::F16),
        (DType::F32, RowType::Bf16),
    ] {
        let f = table(dtype, 6, 100);
        let mut o = options(4, 16, 6);
        o.row_type = row_type;
        let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
        let ids: Vec<u64> = (0..20).collect();
        let (miss, _) = lookup(&cache, &ids);
        let want = reference(&f.table, &ids);
        assert_eq!(miss, want, "{dtype:?}: a miss answers the table's row exactly");
        let (hit, hits) = lookup(&cache, &ids);
        assert_eq!(hits, Some(20));
        for (a, b) in hit.iter().zip(&want) {
            let tol = match row_type {
                RowType::F32 => 0.0,
                RowType::F16 => 2e-3 * b.abs().max(1e-3),
                RowType::Bf16 => 8e-3 * b.abs().max(1e-3),
            };
            assert!((a - b).abs() <= tol, "{dtype:?}/{row_type:?}: {a} vs {b}");
        }
    }
}

#[test]
fn f16_rounding_is_to_nearest_even_as_torch_does() {
    let f = table(DType::F32, 4, 1);
    // Values on and around half-way points, subnormals, overflow.
    let vals = [1.0f32 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, 6.0e-8, 65520.0];
    f.table.push(&[0], &vals).unwrap();
    let mut o = options(1, 8, 4);
    o.row_type = RowType::F16;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    lookup(&cache, &[0]);
    let (hit, _) = lookup(&cache, &[0]);
    let want = [1.0f32, 1.0 + 4.0 / 2048.0, 5.960_464_5e-8, f32::INFINITY];
    assert_eq!(hit, want);
}

#[test]
fn change_notices_reach_the_cache_within_one_lookup() {
    let f = table(DType::F32, 4, 100);
    let cache = GpuTable::new(dev(), f.table.clone(), options(8, 16, 4)).unwrap();
    f.store.add_change_listener(cache.listener("t")).unwrap();
    let ids: Vec<u64> = (0..50).collect();
    lookup(&cache, &ids);
    f.table.push(&[5, 6], &[9.0; 8]).unwrap();
    let (out, hits) = lookup(&cache, &ids);
    assert_eq!(out, reference(&f.table, &ids));
    assert_eq!(&out[20..28], &[9.0; 8]);
    assert_eq!(hits, Some(48), "the two written rows were dropped, then fetched");
    assert_eq!(cache.stats().unwrap().invalidated, 2);
}

#[test]
fn refresh_rewrites_rows_written_behind_the_caches_back() {
    let f = table(DType::F32, 4, 100);
    let cache = GpuTable::new(dev(), f.table.clone(), options(8, 16, 4)).unwrap();
    let ids: Vec<u64> = (0..40).collect();
    lookup(&cache, &ids);
    // No listener: these writes bypass the cache.
    f.table.push(&[1, 2, 3], &[4.5; 12]).unwrap();
    f.table.delete(&[4]).unwrap();
    let (stale, _) = lookup(&cache, &ids);
    assert_ne!(stale, reference(&f.table, &ids));
    let r = cache.refresh().unwrap();
    assert_eq!(r.rows, 40);
    assert_eq!(r.changed, 4, "three rewritten, one dropped");
    let (fresh, hits) = lookup(&cache, &ids);
    assert_eq!(fresh, reference(&f.table, &ids));
    assert_eq!(hits, Some(39));
}

#[test]
fn refresh_in_small_chunks_by_several_readers_twice_and_two_at_once_with_lookups_between() {
    // 900 cached rows in chunks of 128 (readers of 2 rows at least): every chunk's
    // keys, slots, versions and rows come from the readers, the buffers from the first
    // refresh are kept for the next, and lookups run while two threads refresh.
    let f = table(DType::F32, 4, 2000);
    let mut o = options(64, 32, 4);
    o.refresh_chunk = 128;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    let ids: Vec<u64> = (0..900).collect();
    assert_eq!(lookup(&cache, &ids).1, Some(0));
    let held = cache.stats().unwrap().rows_cached;
    assert_eq!(held, 900);
    for round in 0..2u64 {
        // Behind the cache's back: every seventh row rewritten, every 50th dropped.
        let rewritten: Vec<u64> = ids.iter().copied().filter(|k| k % 7 == round).collect();
        let rows: Vec<f32> = rewritten.iter().flat_map(|&k| [k as f32 + 0.5 + round as f32; 4]).collect();
        f.table.push(&rewritten, &rows).unwrap();
        let dropped: Vec<u64> = ids.iter().copied().filter(|k| k % 50 == 49 - round).collect();
        f.table.delete(&dropped).unwrap();
        let r = cache.refresh().unwrap();
        let gone = dropped.iter().filter(|k| **k % 7 != round).count() as u64;
        assert_eq!(r.rows, held, "round {round}");
        assert_eq!(r.changed, rewritten.len() as u64 + gone, "round {round}");
        assert!(r.threads >= 1 && r.read_seconds <= r.seconds);
        let (fresh, _) = lookup(&cache, &ids);
        assert_eq!(fresh, reference(&f.table, &ids), "round {round}");
        // The dropped rows come back on that lookup (the table holds the default).
        for k in &dropped {
            f.table.push(&[*k], &[*k as f32; 4]).unwrap();
        }
        cache.refresh().unwrap();
        assert_eq!(lookup(&cache, &ids).0, reference(&f.table, &ids), "round {round}");
    }
    let cache = Arc::new(cache);
    f.table.push(&[3, 4, 5], &[2.0; 12]).unwrap();
    cache.refresh().unwrap();
    f.table.push(&[3, 4, 5], &[1.25; 12]).unwrap();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let c = cache.clone();
            s.spawn(move || {
                for _ in 0..3 {
                    c.refresh().unwrap();
                }
            });
        }
        for _ in 0..5 {
            let (out, _) = lookup(&cache, &[3, 4, 5, 800]);
            // Before or after the refresh of rows 3-5, never a mix within a row.
            for row in out[..12].chunks(4) {
                assert!(row == [2.0; 4] || row == [1.25; 4], "{row:?}");
            }
        }
    });
    assert_eq!(lookup(&cache, &ids).0, reference(&f.table, &ids));
    assert_eq!(cache.stats().unwrap().host.refreshes, 4 + 1 + 6);
}

#[test]
fn a_refresh_whose_table_read_fails_says_so_and_the_cache_still_answers() {
    let f = table(DType::F32, 4, 300);
    let mut o = options(16, 32, 4);
    o.refresh_chunk = 64;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    let ids: Vec<u64> = (0..300).collect();
    let (want, _) = lookup(&cache, &ids);
    cache.refresh().unwrap(); // the buffers kept
    f.store.close().unwrap();
    let e = cache.refresh().unwrap_err();
    assert!(!e.to_string().is_empty());
    // Its buffers freed, not kept half-used; the cached rows answer as before.
    let (out, hits) = lookup(&cache, &ids);
    assert_eq!((out, hits), (want, Some(300)));
    assert_eq!(cache.stats().unwrap().host.refreshes, 1);
    cache.close().unwrap();
}

#[test]
fn async_lookups_answer_the_default_then_the_rows() {
    let f = table(DType::F32, 4, 100);
    let mut o = options(8, 16, 4);
    o.insert = Insert::Async;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    let ids: Vec<u64> = vec![1, 2, 3, 2];
    let (out, hits) = lookup(&cache, &ids);
    assert_eq!(hits, None);
    assert_eq!(out, vec![-7.0; 16]);
    cache.wait().unwrap();
    let (out, _) = lookup(&cache, &ids);
    assert_eq!(out, reference(&f.table, &ids));
    let s = cache.stats().unwrap();
    assert_eq!((s.async_inserts, s.host.default_answers, s.host.host_syncs), (3, 4, 0));
}

/// The emulator refuses a driver call made without the cache's context current, so every
/// test here checks the host logic enters before its calls; this one checks each call
/// leaves the caller's context as it found it (a process with caches on several GPUs:
/// PyTorch's current device must not change under it), on the caller's thread and on
/// the background inserter's.
#[test]
fn every_call_leaves_the_callers_context_as_it_was() {
    use embank_gpu::device::{current_context, set_current_context, EMULATOR_CONTEXT};
    let f = table(DType::F32, 4, 100);
    for caller in [0x77, 0, EMULATOR_CONTEXT] {
        set_current_context(caller);
        for insert in [Insert::Sync, Insert::Async] {
            let mut o = options(8, 16, 4);
            o.insert = insert;
            let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
            assert_eq!(current_context(), caller, "after new");
            lookup(&cache, &[1, 2, 3, 2]);
            assert_eq!(current_context(), caller, "after lookup");
            cache.wait().unwrap();
            assert_eq!(current_context(), caller, "after wait");
            cache.invalidate(&[2]).unwrap();
            assert_eq!(current_context(), caller, "after invalidate");
            cache.refresh().unwrap();
            assert_eq!(current_context(), caller, "after refresh");
            assert_eq!(cache.stats().unwrap().rows_cached, 2);
            assert_eq!(current_context(), caller, "after stats");
            cache.close().unwrap();
            drop(cache);
            assert_eq!(current_context(), caller, "after close and drop");
        }
    }
    set_current_context(0);
}

/// Which of a bucket's new keys get its slots does not depend on the order the misses
/// reach the host (on a GPU, the order its warps counted them in: any).
#[test]
fn the_keys_a_full_bucket_takes_do_not_depend_on_the_misses_order() {
    let f = table(DType::F32, 4, 100);
    let cached = |ids: &[u64]| -> Vec<u64> {
        let cache = GpuTable::new(dev(), f.table.clone(), options(1, 4, 4)).unwrap();
        let (out, _) = lookup(&cache, ids);
        assert_eq!(out, reference(&f.table, ids));
        (0..100u64).filter(|&k| cache.invalidate(&[k]).unwrap() == 1).collect()
    };
    let ids: Vec<u64> = vec![11, 5, 73, 2, 40, 18, 99, 7];
    let first = cached(&ids);
    assert_eq!(first.len(), 4, "one bucket of 4 slots: {first:?}");
    let mut rev = ids.clone();
    rev.reverse();
    assert_eq!(cached(&rev), first);
    let mut rot = ids.clone();
    rot.rotate_left(3);
    assert_eq!(cached(&rot), first);
}

#[test]
fn invalidate_drops_the_rows_and_counts_them() {
    let f = table(DType::F32, 4, 100);
    let cache = GpuTable::new(dev(), f.table.clone(), options(8, 16, 4)).unwrap();
    lookup(&cache, &[1, 2, 3]);
    assert_eq!(cache.invalidate(&[2, 3, 3, 77]).unwrap(), 2);
    assert_eq!(lookup(&cache, &[1, 2, 3]).1, Some(1));
}

#[test]
fn lfu_refuses_a_new_key_where_every_slot_is_used_more() {
    let f = table(DType::F32, 2, 100);
    let mut o = options(1, 2, 2);
    o.policy = Policy::Lfu;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    lookup(&cache, &[1, 2]);
    lookup(&cache, &[1, 2]); // both used twice
    lookup(&cache, &[3]); // a new key scores 1: refused
    assert_eq!(lookup(&cache, &[1, 2]).1, Some(2));
    assert_eq!(cache.stats().unwrap().insert_refused, 1);
}

#[test]
fn two_threads_on_one_cache() {
    let f = table(DType::F32, 3, 200);
    let cache = Arc::new(GpuTable::new(dev(), f.table.clone(), options(4, 16, 3)).unwrap());
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let cache = cache.clone();
            let table = f.table.clone();
            s.spawn(move || {
                for r in 0..4u64 {
                    let ids: Vec<u64> = (0..30).map(|i| (i * 7 + r * 13 + t * 101) % 200).collect();
                    let (out, _) = lookup(&cache, &ids);
                    assert_eq!(out, reference(&table, &ids));
                }
            });
        }
    });
    let s = cache.stats().unwrap();
    assert_eq!(s.host.lookups, 8);
}

/// No bags over some ids (empty offsets): nothing to answer, nothing launched, and no
/// count read that no kernel wrote (the emulator's memory starts poisoned, as a GPU's
/// is not zeroed); the next lookups stay exact.
#[test]
fn a_pooled_lookup_of_no_bags_answers_nothing_and_reads_nothing() {
    use embank_gpu::Bags;
    let f = table(DType::F32, 3, 100);
    for insert in [Insert::Sync, Insert::Async] {
        let mut o = options(4, 16, 3);
        o.insert = insert;
        let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
        let ids: Vec<u64> = vec![1, 2, 3];
        let offsets: Vec<i64> = vec![];
        let bags = Bags { offsets: offsets.as_ptr() as u64, bags: 0, weights: 0, mean: false };
        let mut out = [f32::NAN; 3];
        let r = cache.lookup_pooled(ids.as_ptr() as u64, ids.len(), bags, out.as_mut_ptr() as u64, 0, 0).unwrap();
        assert_eq!(r, Some(0));
        assert!(out.iter().all(|v| v.is_nan()), "nothing written");
        cache.wait().unwrap();
        let s = cache.stats().unwrap();
        assert_eq!((s.rows_cached, s.host.misses), (0, 0), "{insert:?}");
        lookup(&cache, &ids);
        cache.wait().unwrap(); // async: the first lookup answers the default
        let (out, _) = lookup(&cache, &ids);
        assert_eq!(out, reference(&f.table, &ids));
    }
}

/// Bags pooled by the cache against the table's rows pooled here: sum, weighted sum and
/// mean, misses (sync: fetched and added; async: the default row), an empty bag.
#[test]
fn pooled_lookups_pool_bags_as_an_embedding_bag_does() {
    use embank_gpu::Bags;
    let f = table(DType::F32, 3, 100);
    let ids: Vec<u64> = vec![1, 2, 3, 2, 9_999, 5, 6];
    let offsets: Vec<i64> = vec![0, 3, 3, 5]; // bags [1,2,3] [] [2,9999] [5,6]
    let weights: Vec<f32> = vec![0.5, 2.0, 1.0, -1.0, 3.0, 1.0, 0.25];
    let rows = reference(&f.table, &ids);
    let pool = |w: Option<&[f32]>, mean: bool, dflt: Option<f32>| -> Vec<f32> {
        let mut out = vec![0f32; 4 * 3];
        for b in 0..4 {
            let (s, e) = (offsets[b] as usize, if b + 1 < 4 { offsets[b + 1] as usize } else { ids.len() });
            for i in s..e {
                let wt = if mean { 1.0 / (e - s) as f32 } else { w.map_or(1.0, |w| w[i]) };
                for j in 0..3 {
                    let v = if ids[i] == 9_999 { dflt.unwrap_or(rows[i * 3 + j]) } else { rows[i * 3 + j] };
                    out[b * 3 + j] += wt * v;
                }
            }
        }
        out
    };
    for insert in [Insert::Sync, Insert::Async] {
        let mut o = options(4, 16, 3);
        o.insert = insert;
        let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
        for (w, mean) in [(None, false), (Some(&weights[..]), false), (None, true)] {
            for round in 0..2 {
                let mut out = vec![f32::NAN; 4 * 3];
                let bags = Bags {
                    offsets: offsets.as_ptr() as u64,
                    bags: 4,
                    weights: w.map_or(0, |w| w.as_ptr() as u64),
                    mean,
                };
                cache.lookup_pooled(ids.as_ptr() as u64, ids.len(), bags, out.as_mut_ptr() as u64, 0, 0).unwrap();
                cache.wait().unwrap();
                // Async: the first round's misses pool the default (-7); 9999 never gets cached.
                let first_async = insert == Insert::Async && round == 0 && w.is_none() && !mean;
                let want = if insert == Insert::Async && (first_async || ids.contains(&9_999)) {
                    if first_async {
                        // Every key missed the first time: all default rows.
                        let mut o = vec![0f32; 12];
                        for b in 0..4 {
                            let (s, e) = (offsets[b] as usize, if b + 1 < 4 { offsets[b + 1] as usize } else { 7 });
                            for _ in s..e {
                                for j in 0..3 {
                                    o[b * 3 + j] += -7.0;
                                }
                            }
                        }
                        o
                    } else {
                        pool(w, mean, Some(-7.0))
                    }
                } else {
                    pool(w, mean, None)
                };
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                        "{insert:?} w={} mean={mean}: {out:?} vs {want:?}",
                        w.is_some()
                    );
                }
            }
        }
    }
}

#[test]
fn an_async_lookup_records_its_misses_up_to_the_cap() {
    let f = table(DType::F32, 2, 100);
    let mut o = options(8, 16, 2);
    o.insert = Insert::Async;
    o.async_miss_cap = 3;
    let cache = GpuTable::new(dev(), f.table.clone(), o).unwrap();
    let ids: Vec<u64> = (0..10).collect();
    let (out, _) = lookup(&cache, &ids);
    assert_eq!(out, vec![-7.0; 20], "every miss answered with the default");
    cache.wait().unwrap();
    let s = cache.stats().unwrap();
    assert_eq!((s.async_inserts, s.host.async_dropped, s.host.default_answers), (3, 7, 10));
    let (_, _) = lookup(&cache, &ids);
    cache.wait().unwrap();
    assert_eq!(cache.stats().unwrap().rows_cached, 6, "three more the second time");
}

//! Store-level behaviour: growth, errors, locking, drop, reopen speed path.

use std::collections::HashSet;

use embank_core::{ErrorKind, Initializer, Store, StoreOptions, TableOptions};

fn opts(dim: u32) -> TableOptions {
    TableOptions::new(dim)
}

#[test]
fn growth_keeps_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let mut o = opts(4);
    o.capacity = 100;
    let t = store.create_table("g", o).unwrap();
    let n = 60_000u64;
    for chunk in (0..n).collect::<Vec<_>>().chunks(997) {
        let rows: Vec<f32> = chunk.iter().flat_map(|&k| [k as f32; 4]).collect();
        t.push(chunk, &rows).unwrap();
    }
    let stats = t.stats().unwrap();
    assert!(stats.grow_count >= 5, "expected several rebuilds, saw {}", stats.grow_count);
    assert_eq!(stats.rows, n);
    let check = |t: &embank_core::Table| {
        let keys: Vec<u64> = (0..n).collect();
        let mut out = vec![0.0; keys.len() * 4];
        let mut found = vec![false; keys.len()];
        t.lookup(&keys, &mut out, &mut found).unwrap();
        for k in 0..n as usize {
            assert!(found[k], "key {k} lost");
            assert_eq!(out[k * 4..k * 4 + 4], [k as f32; 4], "key {k}");
        }
    };
    check(&t);
    drop(t);
    store.close().unwrap();
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let t = store.table("g").unwrap();
    assert!(t.stats().unwrap().recovered.is_none(), "a clean close must not need repair");
    check(&t);
    // Only the current index generation is left on disk.
    let table_dir = path.join("tables/0");
    let indexes: Vec<_> = std::fs::read_dir(table_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("index."))
        .collect();
    assert_eq!(indexes.len(), 1);
}

#[test]
fn growth_off_reports_table_full_and_keeps_data() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let mut o = opts(2);
    o.capacity = 10;
    o.growth = false;
    let t = store.create_table("f", o).unwrap();
    let cap = t.stats().unwrap().capacity;
    let keys: Vec<u64> = (0..cap).collect();
    t.push(&keys, &vec![1.0; keys.len() * 2]).unwrap();
    let err = t.push(&[cap, cap + 1], &[2.0; 4]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TableFull, "{err}");
    assert!(err.to_string().contains("growth is off"), "{err}");
    let err = t.pull(&[cap + 5], &mut [0.0; 2]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TableFull);
    assert_eq!(t.len().unwrap(), cap);
    // Replacing existing rows still works when full.
    t.push(&[0], &[3.0, 3.0]).unwrap();
    let mut out = [0.0; 2];
    t.pull(&[0], &mut out).unwrap();
    assert_eq!(out, [3.0, 3.0]);
}

#[test]
fn growth_off_holds_its_capacity_at_any_load_factor_max() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    // Maxima under the index's load target (0.76) as well as above it.
    for (i, max) in [0.71, 0.72, 0.76, 0.9, 0.98].into_iter().enumerate() {
        let mut o = opts(2);
        (o.capacity, o.growth, o.load_factor_max) = (10_000, false, max);
        let t = store.create_table(&format!("t{i}"), o).unwrap();
        let keys: Vec<u64> = (0..10_000).collect();
        t.push(&keys, &vec![1.0; keys.len() * 2]).unwrap_or_else(|e| panic!("load_factor_max {max}: {e}"));
        assert!(t.stats().unwrap().capacity >= 10_000, "load_factor_max {max}");
    }
}

#[test]
fn bad_input_is_refused_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let t = store.create_table("t", opts(3)).unwrap();
    t.push(&[1, 2], &[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]).unwrap();
    let err = t.push(&[3], &[1.0, 2.0]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("dim 3"), "{err}");
    let err = t.push(&[1, 4], &[9.0, 9.0, 9.0, f32::NAN, 0.0, 0.0]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("key 4"), "{err}");
    let err = t.pull(&[1], &mut [0.0; 4]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let mut out = [0.0; 6];
    t.pull(&[1, 2], &mut out).unwrap();
    assert_eq!(out, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0], "a refused push changed rows");
    assert_eq!(t.len().unwrap(), 2);

    for (dim, what) in [(0, "dim"), (4097, "dim")] {
        let err = store.create_table("x", opts(dim)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains(what));
    }
    for name in ["", ".hidden", "a/b", "spaces here"] {
        assert_eq!(store.create_table(name, opts(2)).unwrap_err().kind(), ErrorKind::InvalidInput, "{name:?}");
    }
    assert_eq!(store.create_table("t", opts(3)).unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(store.table("nope").unwrap_err().kind(), ErrorKind::NotFound);
    let mut o = opts(2);
    o.init = Initializer::Uniform { low: 1.0, high: 0.0 };
    assert_eq!(store.create_table("u", o).unwrap_err().kind(), ErrorKind::Config);
}

#[test]
fn lock_format_version_and_drop() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let err = Store::open(&path, StoreOptions::default()).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Locked, "{err}");
    let t = store.create_table("a", opts(2)).unwrap();
    store.create_table("b", opts(5)).unwrap();
    assert_eq!(store.tables().unwrap(), vec!["a", "b"]);
    store.drop_table("a").unwrap();
    assert_eq!(t.len().unwrap_err().kind(), ErrorKind::Closed);
    assert_eq!(store.tables().unwrap(), vec!["b"]);
    // A new table may take the dropped name; it starts empty.
    let a2 = store.create_table("a", opts(2)).unwrap();
    assert_eq!(a2.len().unwrap(), 0);
    store.close().unwrap();
    store.close().unwrap();
    assert_eq!(store.tables().unwrap_err().kind(), ErrorKind::Closed);

    let names: HashSet<String> = std::fs::read_dir(path.join("tables"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into())
        .collect();
    assert_eq!(names.len(), 2, "dropped table's files are gone: {names:?}");

    // A store of a future format version is refused clearly.
    let catalog = std::fs::read_to_string(path.join("STORE")).unwrap();
    std::fs::write(path.join("STORE"), catalog.replacen("embank-store 1 ", "embank-store 7 ", 1)).unwrap();
    let err = Store::open(&path, StoreOptions::default()).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::FormatVersion, "{err}");
    assert!(err.to_string().contains("version 7"), "{err}");

    let err =
        Store::open(dir.path().join("missing"), StoreOptions { create: false, ..Default::default() }).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    std::fs::write(dir.path().join("junk.txt"), "x").unwrap();
    let err = Store::open(dir.path(), StoreOptions::default()).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[test]
fn never_written_rows_agree_across_stores() {
    let dir = tempfile::tempdir().unwrap();
    let mut rows = Vec::new();
    for (s, order) in [("a", vec![5u64, 9, 1]), ("b", vec![1u64, 5, 9])] {
        let store = Store::open(dir.path().join(s), StoreOptions::default()).unwrap();
        let mut o = opts(8);
        o.init = Initializer::Normal { mean: 0.0, std: 0.1 };
        o.seed = 3;
        let t = store.create_table("t", o).unwrap();
        let mut out = vec![0.0; 24];
        t.pull(&order, &mut out).unwrap();
        let mut by_key: Vec<(u64, Vec<f32>)> =
            order.iter().enumerate().map(|(i, &k)| (k, out[i * 8..i * 8 + 8].to_vec())).collect();
        by_key.sort_by_key(|(k, _)| *k);
        rows.push(by_key);
    }
    assert_eq!(rows[0], rows[1]);
}

#[test]
fn truncated_files_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    {
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let t = store.create_table("t", opts(4)).unwrap();
        t.push(&[1, 2, 3], &[1.0; 12]).unwrap();
    }
    let rows = path.join("tables/0/rows.ebr");
    std::fs::OpenOptions::new().write(true).open(&rows).unwrap().set_len(100).unwrap();
    let err = Store::open(&path, StoreOptions::default()).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Recover, "{err}");
    assert!(err.to_string().contains("table \"t\""), "{err}");
}

/// f16 and int8 tables on both media: checkpoints, restore and export at a
/// checkpoint give the rows as stored; f16 trains through `push_grad` (state f32);
/// int8 refuses an optimizer and `push_grad` with errors that say why, nothing written.
#[test]
fn compact_tables_checkpoint_restore_export_and_train_as_their_type_allows() {
    use embank_core::RecordLayout;
    use embank_core::{DType, MediumKind, Optimizer};
    const D: usize = 8;
    let rows_of = |v: f32, n: u64| -> Vec<f32> {
        (0..n).flat_map(|k| (0..D).map(move |i| v + k as f32 * 0.01 + i as f32 * 0.37)).collect()
    };
    let stored = |mut r: Vec<f32>, dtype: DType| {
        for row in r.chunks_exact_mut(D) {
            RecordLayout::new(D, 0, dtype).round_trip(row);
        }
        r
    };
    for dtype in [DType::F16, DType::Int8] {
        for medium in [MediumKind::Mmap, MediumKind::Block] {
            let ctx = format!("{dtype} on {}", medium.name());
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(dir.path().join("s"), StoreOptions { cache_bytes: 64 << 10, ..Default::default() })
                .unwrap();
            let mut o = opts(D as u32);
            o.dtype = dtype;
            o.medium = medium;
            let t = store.create_table("t", o.clone()).unwrap();
            let keys: Vec<u64> = (0..500).collect();
            t.push(&keys, &rows_of(0.25, 500)).unwrap();
            store.checkpoint(1).unwrap();
            t.push(&keys, &rows_of(-3.0, 500)).unwrap();
            let mut out = vec![0f32; 500 * D];
            t.pull(&keys, &mut out).unwrap();
            assert_eq!(out, stored(rows_of(-3.0, 500), dtype), "{ctx}: rows read back as stored");
            let mut exported = vec![f32::NAN; 500 * D];
            store
                .export_checkpoint("t", 1, 128, |ks, rs| {
                    for (i, &k) in ks.iter().enumerate() {
                        exported[k as usize * D..][..D].copy_from_slice(&rs[i * D..(i + 1) * D]);
                    }
                    Ok(())
                })
                .unwrap();
            assert_eq!(exported, stored(rows_of(0.25, 500), dtype), "{ctx}: export at a checkpoint");
            store.restore(1).unwrap();
            let t = store.table("t").unwrap();
            t.pull(&keys, &mut out).unwrap();
            assert_eq!(out, stored(rows_of(0.25, 500), dtype), "{ctx}: restored");
            assert_eq!(t.stats().unwrap().dtype, dtype.name());
            if dtype == DType::Int8 {
                let e = t.push_grad(&keys[..1], &[0.1; D]).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Unsupported, "{ctx}");
                assert!(e.to_string().contains("int8") && e.to_string().contains("serv"), "{ctx}: {e}");
                let mut again = vec![0f32; 500 * D];
                t.pull(&keys, &mut again).unwrap();
                assert_eq!(again, out, "{ctx}: nothing written");
                o.optimizer = Optimizer::Sgd { lr: 0.1 };
                let e = store.create_table("u", o).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Config, "{ctx}");
                assert!(e.to_string().contains("int8 table is for serving"), "{ctx}: {e}");
            } else {
                o.optimizer = Optimizer::Sgd { lr: 0.5 };
                let u = store.create_table("u", o).unwrap();
                u.push(&keys[..2], &rows_of(1.0, 2)).unwrap();
                u.push_grad(&keys[..2], &[0.25; 2 * D]).unwrap();
                let mut got = vec![0f32; 2 * D];
                u.pull(&keys[..2], &mut got).unwrap();
                let want: Vec<f32> = stored(rows_of(1.0, 2), dtype).iter().map(|v| v - 0.5 * 0.25).collect();
                assert_eq!(got, stored(want, dtype), "{ctx}: one SGD step, rounded to f16");
            }
            store.close().unwrap();
        }
    }
}

/// `embank plan`'s byte model against what a loaded table reports: the index exactly,
/// the medium's records within 5 %, for both media and every type.
#[test]
fn planned_tier_bytes_match_a_loaded_table() {
    use embank_core::{tier_bytes, TableShape};
    use embank_core::{DType, MediumKind, Optimizer};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), StoreOptions::default()).unwrap();
    let n = 30_000u64;
    for (i, (medium, dtype, optimizer)) in [
        (MediumKind::Mmap, DType::F32, Optimizer::None),
        (MediumKind::Mmap, DType::F16, Optimizer::Adagrad { lr: 0.1, eps: 1e-8, initial_accumulator_value: 0.0 }),
        (MediumKind::Block, DType::Int8, Optimizer::None),
    ]
    .into_iter()
    .enumerate()
    {
        let mut o = TableOptions::new(24);
        o.capacity = n;
        o.medium = medium;
        o.dtype = dtype;
        o.optimizer = optimizer;
        let t = store.create_table(&format!("t{i}"), o).unwrap();
        let keys: Vec<u64> = (0..n).collect();
        t.push(&keys, &vec![0.5; keys.len() * 24]).unwrap();
        let s = t.stats().unwrap();
        let plan = tier_bytes(&TableShape { name: "t".into(), dim: 24, dtype, optimizer, medium }, n);
        assert_eq!(plan.index, s.index_bytes, "{medium:?} {dtype}");
        assert_eq!(plan.record_bytes, s.record_bytes, "{medium:?} {dtype}");
        let used = s.records_used * s.record_bytes;
        assert!(
            (plan.medium as f64 - used as f64).abs() <= 0.05 * used as f64,
            "{medium:?} {dtype}: {} vs {used}",
            plan.medium
        );
    }
}

/// Rows read ahead (`lookahead`) start referenced in the row cache, so the reader's own
/// traffic between the hint and the pull does not evict them first.
#[test]
fn rows_read_ahead_survive_the_traffic_before_their_pull() {
    use embank_core::MediumKind;
    let dir = tempfile::tempdir().unwrap();
    // About 2,000 rows of dim 32 (128 B + 96 B each) fit.
    let store = Store::open(dir.path().join("s"), StoreOptions { cache_bytes: 448_000, ..Default::default() }).unwrap();
    let mut o = opts(32);
    o.medium = MediumKind::Block;
    o.capacity = 20_000;
    let t = store.create_table("t", o).unwrap();
    let all: Vec<u64> = (0..20_000).collect();
    t.push(&all, &vec![1.0; all.len() * 32]).unwrap();
    store.flush().unwrap();
    // A full cache first (pushes write around it).
    let mut out = vec![0f32; 2500 * 32];
    t.pull(&(5_000..7_500).collect::<Vec<u64>>(), &mut out).unwrap();
    let ahead: Vec<u64> = (0..800).collect();
    assert!(t.lookahead(&ahead).unwrap());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while t.stats().unwrap().lookahead_rows < 800 {
        assert!(std::time::Instant::now() < deadline, "lookahead never loaded");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Other traffic: a pull of 1,000 other rows (half the cache) before the hinted pull.
    let mut out = vec![0f32; 1000 * 32];
    t.pull(&(10_000..11_000).collect::<Vec<u64>>(), &mut out).unwrap();
    let before = t.stats().unwrap();
    let mut out = vec![0f32; ahead.len() * 32];
    t.pull(&ahead, &mut out).unwrap();
    let after = t.stats().unwrap();
    let hits = after.cache_hits - before.cache_hits;
    assert!(hits >= 790, "only {hits} of 800 rows read ahead were still cached");
}

/// Swaps the row pointers of two keys in a closed table's index file (format 3: each
/// slot's key and 32-bit row number at `slot_offsets`).
fn swap_row_pointers(index: &std::path::Path, a: u64, b: u64) {
    use embank_core::testing::{slot_offsets, BUCKET_BYTES, INDEX_HEADER_BYTES, SLOTS_PER_BUCKET};
    let mut bytes = std::fs::read(index).unwrap();
    let word = |bytes: &[u8], at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    // Where the row number of the occupied slot holding `key` lies.
    let row_of = |bytes: &[u8], key: u64| {
        (INDEX_HEADER_BYTES..bytes.len())
            .step_by(BUCKET_BYTES)
            .flat_map(|bucket| (0..SLOTS_PER_BUCKET).map(move |s| (bucket, slot_offsets(s))))
            .find(|&(bucket, (key_at, _, fp_at))| bytes[bucket + fp_at] != 0 && word(bytes, bucket + key_at) == key)
            .map(|(bucket, (_, row_at, _))| bucket + row_at)
            .unwrap_or_else(|| panic!("key {key} not in the index"))
    };
    let (ra, rb) = (row_of(&bytes, a), row_of(&bytes, b));
    let (pa, pb) = (bytes[ra..ra + 4].to_vec(), bytes[rb..rb + 4].to_vec());
    bytes[ra..ra + 4].copy_from_slice(&pb);
    bytes[rb..rb + 4].copy_from_slice(&pa);
    std::fs::write(index, bytes).unwrap();
}

#[test]
fn an_index_pointing_a_key_at_another_keys_record_is_refused_by_every_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let keys: Vec<u64> = (1000..1200).collect();
    let rows: Vec<f32> = keys.iter().flat_map(|&k| [k as f32; 4]).collect();
    {
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let t = store.create_table("t", opts(4)).unwrap();
        t.push(&keys, &rows).unwrap();
        drop(t);
        store.close().unwrap();
    }
    let index = std::fs::read_dir(path.join("tables/0"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("index."))
        .unwrap();
    swap_row_pointers(&index, 1005, 1107);
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let t = store.table("t").unwrap();
    // The bad key in the middle of a batch of good ones, for each read path.
    let batch = [1001, 1002, 1005, 1003, 1004, 1006, 1007, 1008, 1009, 1010, 1011];
    let mut out = vec![0f32; batch.len() * 4];
    let mut found = vec![false; batch.len()];
    let e = t.lookup(&batch, &mut out, &mut found).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "lookup: {e}");
    assert!(e.to_string().contains("key 1005"), "lookup names the key: {e}");
    let e = t.pull(&batch, &mut out).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "pull: {e}");
    for create in [false, true] {
        let e = t.with_rows(&batch, create, |_, _| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "with_rows (create {create}): {e}");
        assert!(e.to_string().contains("key 1005"), "with_rows names the key: {e}");
    }
    // Nothing was written by the refused reads: the good keys read as before.
    let good: Vec<u64> = keys.iter().copied().filter(|&k| k != 1005 && k != 1107).collect();
    let mut out = vec![0f32; good.len() * 4];
    let mut found = vec![false; good.len()];
    t.lookup(&good, &mut out, &mut found).unwrap();
    assert!(found.iter().all(|&f| f));
    for (i, &k) in good.iter().enumerate() {
        assert_eq!(out[i * 4..i * 4 + 4], [k as f32; 4], "key {k}");
    }
    assert_eq!(t.stats().unwrap().rows, keys.len() as u64);
}

/// `lookup_stored` hands out rows as stored: decoded with `RecordLayout::decode_row` they
/// are exactly what `lookup` returns, for every element type, on the fast path (small
/// and staged indexes), behind a row cache (block medium), with optimizer state after
/// the row, and for missing keys (the missing default, encoded). Wrong sizes are refused
/// with an error that names them, and nothing is written.
#[test]
fn lookup_stored_decodes_to_exactly_what_lookup_returns() {
    use embank_core::RecordLayout;
    use embank_core::{DType, MediumKind, MissingDefault, Optimizer};
    const D: usize = 24;
    for dtype in [DType::F32, DType::F16, DType::Int8] {
        for (medium, capacity, optimizer) in [
            (MediumKind::Mmap, 1_000, false),
            (MediumKind::Mmap, 400_000, false), // an index of >= 8 MiB: the staged lookup
            (MediumKind::Block, 1_000, false),
            (MediumKind::Mmap, 1_000, true),
        ] {
            if optimizer && dtype == DType::Int8 {
                continue; // int8 tables are for serving: no optimizer
            }
            let ctx = format!("{dtype} on {} (capacity {capacity}, optimizer {optimizer})", medium.name());
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(dir.path().join("s"), StoreOptions { cache_bytes: 16 << 10, ..Default::default() })
                .unwrap();
            let mut o = opts(D as u32);
            o.dtype = dtype;
            o.medium = medium;
            o.capacity = capacity;
            o.missing = MissingDefault::Value { value: -7.5 };
            if optimizer {
                o.optimizer = Optimizer::Adagrad { lr: 0.1, eps: 1e-8, initial_accumulator_value: 0.1 };
            }
            let t = store.create_table("t", o).unwrap();
            let keys: Vec<u64> = (0..3_000u64).map(|k| k * 7919).collect();
            let rows: Vec<f32> = keys
                .iter()
                .flat_map(|&k| (0..D).map(move |i| ((k % 101) as f32 - 50.0) * 0.013 + i as f32 * 0.21))
                .collect();
            t.push(&keys, &rows).unwrap();
            if optimizer {
                t.push_grad(&keys[..100], &vec![0.5; 100 * D]).unwrap();
            }
            // Every other key asked for is missing, in runs and alone, and one key twice.
            let mut ask: Vec<u64> = keys.iter().step_by(3).copied().collect();
            ask.extend([1, 2, 3, keys[5], 4, keys[5]]);
            let rb = t.row_bytes();
            assert_eq!(rb, RecordLayout::new(D, 0, dtype).row_bytes(), "{ctx}");
            let (mut want, mut want_found) = (vec![0f32; ask.len() * D], vec![false; ask.len()]);
            t.lookup(&ask, &mut want, &mut want_found).unwrap();
            let (mut bytes, mut found) = (vec![0u8; ask.len() * rb], vec![true; ask.len()]);
            t.lookup_stored(&ask, &mut bytes, &mut found).unwrap();
            assert_eq!(found, want_found, "{ctx}: found-mask");
            let plain = RecordLayout::new(D, 0, dtype);
            let mut got = vec![0f32; ask.len() * D];
            for (b, r) in bytes.chunks_exact(rb).zip(got.chunks_exact_mut(D)) {
                plain.decode_row(b, r);
            }
            assert_eq!(got, want, "{ctx}: decoded stored rows");
            assert!(got[got.len() - 7 * D..got.len() - 2 * D].iter().any(|&v| v == -7.5), "{ctx}: the missing default");
            // Through the one table interface too.
            let api: &dyn embank_core::TableApi = &t;
            let mut again = vec![0u8; ask.len() * rb];
            api.lookup_stored(&ask, &mut again, &mut found).unwrap();
            assert_eq!(again, bytes, "{ctx}: TableApi");
            let e = t.lookup_stored(&ask, &mut vec![0u8; ask.len() * rb - 1], &mut found).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{ctx}: {e}");
            assert!(e.to_string().contains(&format!("{} bytes", ask.len() * rb)), "{ctx}: {e}");
            assert_eq!(t.len().unwrap(), keys.len() as u64, "{ctx}: lookup_stored creates nothing");
        }
    }
}

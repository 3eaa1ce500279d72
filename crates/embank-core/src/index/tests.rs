use super::bucket::{empty_slots_portable, match_fp, match_fp_portable};
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn new_index(dir: &tempfile::TempDir, buckets: u64) -> Index {
    Index::create(&dir.path().join("i"), buckets, 99, RowUnits::IDENTITY).unwrap()
}

/// [`Index::get_staged`] over `keys` in batches of [`STAGED_KEYS_MAX`], as `get` answers.
fn staged(index: &Index, keys: &[u64]) -> Vec<Option<u64>> {
    let mut out = Vec::new();
    for chunk in keys.chunks(STAGED_KEYS_MAX) {
        let hashes: Vec<u64> = chunk.iter().map(|&k| index.hash(k)).collect();
        // Garbage in, to see every entry written.
        let mut ptrs = vec![u64::MAX; chunk.len()];
        index.get_staged(chunk, &hashes, &mut ptrs);
        out.extend(ptrs.into_iter().map(|p| (p != 0).then_some(p)));
    }
    out
}

/// A bucket that changes between a staged lookup's stages is read again: here the key
/// moves to another slot after its fingerprints were matched, so the slots matched are
/// stale, and only the version check finds it.
#[test]
fn a_bucket_changed_between_stages_is_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let index = new_index(&dir, 1);
    let (a, k, filler) = (1u64, 2u64, 3u64);
    for key in [a, k] {
        assert!(index.insert_new(key, index.hash(key), 100 + key).unwrap());
    }
    let hk = index.hash(k);
    index.probe_start(hk);
    let probe = index.probe_home(hk);
    // k leaves slot 1, a filler takes it, k comes back in slot 2 with a new pointer.
    assert_eq!(index.remove(k, hk), Some(102));
    assert!(index.insert_new(filler, index.hash(filler), 103).unwrap());
    assert!(index.insert_new(k, hk, 202).unwrap());
    assert_eq!(index.find(k, hk).unwrap().slot, 2);
    assert_eq!(index.probe_slots(k, hk, probe), Some(202));
    // Unchanged: the probe answers by itself.
    let probe = index.probe_home(hk);
    assert_eq!(index.probe_slots(k, hk, probe), Some(202));
    assert_eq!(index.probe_slots(99, index.hash(99), index.probe_home(index.hash(99))), None);
}

/// Staged lookups read while writers replace, remove and re-insert keys in the same
/// buckets (a small index, so buckets are locked and changed under the readers all the
/// time, and keys live past their home bucket): every answer is a pointer some writer
/// stored for that key, and keys no writer touches are always found.
#[test]
fn staged_lookups_during_writes_see_only_stored_pointers() {
    use std::sync::atomic::AtomicBool;
    let dir = tempfile::tempdir().unwrap();
    let index = new_index(&dir, 16);
    // 16 * 17 = 272 slots: 130 keys that stay, 100 that writers churn. A pointer names its
    // key in its high bits (row numbers are 32 bits).
    let (stable, churned) = (0..130u64, 130..230u64);
    let ptr_of = |key: u64, generation: u64| key << 20 | (generation % (1 << 20) + 1);
    for key in stable.clone().chain(churned.clone()) {
        assert!(index.insert_new(key, index.hash(key), ptr_of(key, 0)).unwrap());
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for w in 0..2u64 {
            let (index, stop, churned) = (&index, &stop, churned.clone());
            s.spawn(move || {
                let mut generation = 1;
                while !stop.load(Ordering::Relaxed) {
                    // The two writers own alternate keys: one writer per key, as the table's
                    // striped locks guarantee.
                    for key in churned.clone().filter(|k| k % 2 == w) {
                        let h = index.hash(key);
                        if generation % 3 == 0 {
                            index.remove(key, h);
                            assert!(index.insert_new(key, h, ptr_of(key, generation)).unwrap());
                        } else {
                            index.replace(key, h, ptr_of(key, generation));
                        }
                    }
                    generation += 1;
                }
            });
        }
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (index, stable, churned) = (&index, stable.clone(), churned.clone());
                s.spawn(move || {
                    let keys: Vec<u64> = stable.clone().chain(churned).chain(1000..1020).collect();
                    for _ in 0..2000 {
                        for (&key, got) in keys.iter().zip(staged(index, &keys)) {
                            match got {
                                Some(p) => assert_eq!(p >> 20, key, "key {key} read another key's pointer {p:#x}"),
                                None => assert!(!stable.contains(&key), "stable key {key} not found"),
                            }
                            assert!(key < 1000 || got.is_none(), "absent key {key} found");
                        }
                    }
                })
            })
            .collect();
        for r in readers {
            r.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
}

#[test]
fn slot_offsets_name_the_words_the_bucket_uses() {
    let bucket: Bucket = unsafe { std::mem::zeroed() };
    let base = &bucket as *const Bucket as usize;
    for slot in 0..SLOTS_PER_BUCKET {
        let (key_at, row_at, fp_at) = super::bucket::slot_offsets(slot);
        assert_eq!(bucket.key(slot) as *const AtomicU64 as usize - base, key_at, "slot {slot}");
        assert_eq!(bucket.row(slot) as *const AtomicU32 as usize - base, row_at, "slot {slot}");
        assert_eq!(key_at / 64, row_at / 64, "slot {slot}: key and row number on one line");
        bucket.set_fp(slot, 0xa5);
        let fps = bucket.fp_words();
        assert_eq!((fps[(fp_at - 16) / 8] >> ((fp_at - 16) % 8 * 8)) as u8, 0xa5, "slot {slot}");
        bucket.set_fp(slot, 0);
    }
}

#[test]
fn fp_matching() {
    let words = [0x0000_0300_0503_0001u64, 0x0000_0000_0000_0300, 0x0303_0300_0000_0103];
    // Slot 16 (byte 0 of the third word) matches 3; bytes 17.. of the third word are no
    // slots.
    assert_eq!(match_fp(words, 3), (1 << 2) | (1 << 5) | (1 << 9) | (1 << 16));
    assert_eq!(match_fp(words, 1), 1);
    let empty = empty_slots(words);
    assert_eq!(empty & 0b1, 0);
    assert_ne!(empty & 0b10, 0);
}

proptest! {
    /// The vector match and the byte loops agree on every slot, the seven unused bytes
    /// (17..24) never reported, whatever they hold.
    #[test]
    fn fp_matching_equals_the_byte_loops(w0 in any::<u64>(), w1 in any::<u64>(), w2 in any::<u64>(), pick in 0usize..25, fp in any::<u8>()) {
        let words = [w0, w1, w2];
        // Often a fingerprint the words hold (byte `pick`), else a random one.
        let fp = if pick < 24 { (words[pick / 8] >> (pick % 8 * 8)) as u8 } else { fp };
        prop_assert_eq!(match_fp(words, fp), match_fp_portable(words, fp));
        prop_assert_eq!(empty_slots(words), empty_slots_portable(words));
        prop_assert_eq!(match_fp(words, fp) >> SLOTS_PER_BUCKET, 0);
    }
}

#[test]
fn fills_a_tiny_index_completely() {
    let dir = tempfile::tempdir().unwrap();
    let index = new_index(&dir, 4);
    let slots = index.slot_count();
    for key in 0..slots {
        let h = index.hash(key);
        assert!(index.insert_new(key, h, key + 1).unwrap(), "key {key} of {slots}");
    }
    assert!(!index.insert_new(slots, index.hash(slots), 7).unwrap(), "a full index took one more key");
    for key in 0..slots {
        assert_eq!(index.get(key, index.hash(key)), Some(key + 1));
    }
    // Full buckets: most keys live past their home bucket, where a staged lookup hands
    // over to the probe sequence.
    let keys: Vec<u64> = (0..slots + 20).collect();
    for (&key, got) in keys.iter().zip(staged(&index, &keys)) {
        assert_eq!(got, (key < slots).then_some(key + 1), "staged, key {key}");
    }
    assert_eq!(index.len(), slots);
    // Remove everything; every overflow counter must return to zero.
    for key in 0..slots {
        assert_eq!(index.remove(key, index.hash(key)), Some(key + 1));
    }
    for b in 0..index.bucket_count() {
        assert_eq!(index.bucket(b).overflow.load(Ordering::Relaxed), 0, "bucket {b}");
    }
    assert!(index.is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Put(u64, u64),
    Remove(u64),
    Recover,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..300u64, 1..u32::MAX as u64).prop_map(|(k, p)| Op::Put(k, p)),
        3 => (0..300u64).prop_map(Op::Remove),
        1 => Just(Op::Recover),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    /// The index behaves as a HashMap, including after a recovery pass.
    #[test]
    fn behaves_like_a_hashmap(ops in proptest::collection::vec(op(), 1..400)) {
        let dir = tempfile::tempdir().unwrap();
        let index = new_index(&dir, 32);
        let mut model: HashMap<u64, u64> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Put(k, p) => {
                    let h = index.hash(k);
                    if index.replace(k, h, p).is_none() {
                        prop_assert!(index.insert_new(k, h, p).unwrap(), "step {}: insert failed", i);
                    }
                    model.insert(k, p);
                }
                Op::Remove(k) => {
                    prop_assert_eq!(index.remove(k, index.hash(k)), model.remove(&k), "step {}", i);
                }
                Op::Recover => {
                    let report = index.recover(|_, _, _| true);
                    prop_assert_eq!(report.keys, model.len() as u64);
                    prop_assert_eq!(report.slots_dropped, 0);
                }
            }
            prop_assert_eq!(index.len(), model.len() as u64, "step {}", i);
        }
        for k in 0..300u64 {
            prop_assert_eq!(index.get(k, index.hash(k)), model.get(&k).copied(), "key {}", k);
        }
        let keys: Vec<u64> = (0..300u64).collect();
        for (k, got) in keys.iter().zip(staged(&index, &keys)) {
            prop_assert_eq!(got, model.get(k).copied(), "staged, key {}", k);
        }
        let mut seen = HashMap::new();
        index.for_each(0, index.bucket_count(), |k, p| { seen.insert(k, p); });
        prop_assert_eq!(seen, model);
    }
}

#[test]
fn reopen_keeps_keys_and_recover_unlocks_interrupted_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("i");
    {
        let index = Index::create(&path, 16, 3, RowUnits::IDENTITY).unwrap();
        for key in 0..100 {
            assert!(index.insert_new(key, index.hash(key), 1000 + key).unwrap());
        }
        // Simulate a writer killed inside bucket 5.
        index.bucket(5).version.fetch_add(1, Ordering::Relaxed);
    }
    let index = Index::open(&path).unwrap();
    assert_eq!(index.seed(), 3);
    let report = index.recover(|key, ptr, _| ptr == 1000 + key && key != 7);
    assert_eq!(report.buckets_interrupted, 1);
    assert_eq!(report.slots_dropped, 1);
    assert_eq!(report.keys, 99);
    for key in 0..100 {
        let want = if key == 7 { None } else { Some(1000 + key) };
        assert_eq!(index.get(key, index.hash(key)), want, "key {key}");
    }
}

#[test]
fn open_rejects_truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("i");
    drop(Index::create(&path, 16, 3, RowUnits::IDENTITY).unwrap());
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(INDEX_HEADER_BYTES as u64 + 100).unwrap();
    let err = Index::open(&path).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Recover, "{err}");
}

/// An index of many buckets holding a few keys takes disk only where they are (a page
/// each, and the header's), also after a reopen, the background repair's pass (which
/// passes over pages without blocks, or without keys, untouched) and the full repair.
/// A page holding data but only zeros (a backing cut short) is passed over too.
#[test]
fn an_index_takes_disk_only_where_its_keys_are() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    if !crate::fsutil::sparse_files_ok(&std::fs::File::open(dir.path()).unwrap()) {
        eprintln!("{} is on a file system where the index is allocated whole; test not run", dir.path().display());
        return;
    }
    let path = dir.path().join("i");
    let buckets = 1 << 16; // 16 MiB of buckets
    let allocated = |p: &std::path::Path| std::fs::metadata(p).unwrap().blocks() * 512;
    // The pages, and a few blocks of the file system's own (an extent tree's).
    let most = 5 * BACKING_PAGE_BYTES + (16 << 10);
    {
        let index = Index::create(&path, buckets, 7, RowUnits::IDENTITY).unwrap();
        for key in 1..=4u64 {
            assert!(index.insert_new(key, index.hash(key), 4096 * key).unwrap());
        }
        index.flush().unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        assert_eq!(len, INDEX_HEADER_BYTES as u64 + buckets * BUCKET_BYTES as u64, "the file's length");
        assert!(index.backing.backed_pages() <= 5, "{} pages backed for 4 keys", index.backing.backed_pages());
        let bytes = allocated(&path);
        assert!(bytes <= most, "{bytes} bytes allocated for 4 keys, expected at most {most}");
    }
    // Zeros written into a page no key uses, as a backing cut short by a full disk leaves.
    let homes: Vec<u64> = {
        let i = Index::open(&path).unwrap();
        (1..=4u64).map(|k| i.home_of(i.hash(k)) / 16).collect()
    };
    let zeros_page = (1..buckets / 16).find(|p| !homes.contains(p)).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0u8; 4096], INDEX_HEADER_BYTES as u64 + zeros_page * 16 * BUCKET_BYTES as u64).unwrap();
    }
    let mut index = Index::open(&path).unwrap();
    assert_eq!(index.backing.backed_pages(), 0, "pages seen backed at open");
    index.begin_lazy_repair();
    let mut seen = Vec::new();
    index.repair_scan(0, buckets / 2, |key, _| seen.push(key));
    // A key inserted during the pass, into a page it has already passed.
    let late = (100..).find(|&k| index.home_of(index.hash(k)) < buckets / 2).unwrap();
    assert!(index.insert_new(late, index.hash(late), 4096 * 99).unwrap());
    index.repair_scan(buckets / 2, buckets, |key, _| seen.push(key));
    seen.sort_unstable();
    assert_eq!(seen, [1, 2, 3, 4], "keys the background pass counted");
    let written = index.backing.backed_pages();
    assert!(
        (4..=6).contains(&written),
        "{written} pages the pass and the insert saw backed, expected the keys' 4 and the late key's"
    );
    assert_eq!(index.finish_lazy_repair().keys, 5, "keys after the pass and the late insert");
    assert_eq!(index.recover(|_, _, _| true).keys, 5, "keys after the full repair");
    index.flush().unwrap();
    let bytes = allocated(&path);
    assert!(bytes <= most + BACKING_PAGE_BYTES, "{bytes} bytes allocated after the repairs");
}

/// An index built in DRAM and persisted reads as one built in its mapped file, key for
/// key (across a reopen), and its file stays sparse: pages without keys are not written.
#[test]
fn an_index_built_in_dram_persists_equal_and_sparse() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let buckets = 1 << 12; // 1 MiB of buckets, 256 pages
    let mapped = Index::create(&dir.path().join("mapped"), buckets, 7, RowUnits::IDENTITY).unwrap();
    let path = dir.path().join("dram");
    let dram = Index::create_in_memory(&path, buckets, 7, RowUnits::IDENTITY).unwrap();
    assert!(dram.is_in_memory() && !path.exists(), "a DRAM build writes no file before persist");
    let keys: Vec<u64> = (0..400u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    for (i, &k) in keys.iter().enumerate() {
        let ptr = 4096 + i as u64 * 16;
        assert!(mapped.insert_new(k, mapped.hash(k), ptr).unwrap());
        assert!(dram.insert_new(k, dram.hash(k), ptr).unwrap());
    }
    assert_eq!(dram.remove(keys[0], dram.hash(keys[0])), mapped.remove(keys[0], mapped.hash(keys[0])));
    let dram = dram.persist().unwrap();
    assert!(!dram.is_in_memory());
    let reopened = Index::open(&path).unwrap();
    for index in [&dram, &reopened] {
        assert_eq!(index.len(), mapped.len());
        assert_eq!(index.bucket_count(), buckets);
        for &k in &keys {
            assert_eq!(index.get(k, index.hash(k)), mapped.get(k, mapped.hash(k)), "key {k}");
        }
    }
    let sparse_path = dir.path().join("sparse");
    let sparse = Index::create_in_memory(&sparse_path, 1 << 14, 7, RowUnits::IDENTITY).unwrap();
    assert!(sparse.insert_new(5, sparse.hash(5), 4096).unwrap());
    let sparse = sparse.persist().unwrap();
    let meta = std::fs::metadata(&sparse_path).unwrap();
    if crate::fsutil::sparse_files_ok(&std::fs::File::open(&sparse_path).unwrap()) {
        assert!(
            meta.blocks() * 512 <= 64 << 10,
            "a 4 MiB index holding one key took {} bytes of disk",
            meta.blocks() * 512
        );
    }
    assert_eq!(sparse.get(5, sparse.hash(5)), Some(4096));
    // Persisting over an existing file is refused (a left-over must be removed first).
    let again = Index::create_in_memory(&sparse_path, 1 << 4, 7, RowUnits::IDENTITY).unwrap();
    assert!(again.persist().is_err());
}

/// A rollback on first touch (`undo.rs`): while two readers look keys up (one key at a
/// time and staged) and a writer inserts and removes keys of its own, every key the
/// journal names reads as it was at the checkpoint (present with its pointer, or absent),
/// before and after the background applies the rest; the index then holds exactly the
/// checkpoint's keys and the writer's. A small index, so keys live past their home
/// buckets and undos insert along probe paths.
#[test]
fn a_rollback_on_first_touch_answers_every_key_as_at_the_checkpoint() {
    use std::sync::atomic::AtomicBool;
    let dir = tempfile::tempdir().unwrap();
    let mut index = new_index(&dir, 50); // 850 slots
    let ptr = |key: u64, generation: u64| key << 20 | (generation + 1);
    let mut at_ckpt: HashMap<u64, u64> = HashMap::new();
    for k in 0..500u64 {
        assert!(index.insert_new(k, index.hash(k), ptr(k, 0)).unwrap());
        at_ckpt.insert(k, ptr(k, 0));
    }
    // After the checkpoint: replaced (some twice), removed, created; each key's first
    // change journaled with its record at the checkpoint, a second change journaled too.
    let mut journal = Vec::new();
    for k in (0..500u64).step_by(3) {
        journal.push((k, ptr(k, 0)));
        index.replace(k, index.hash(k), ptr(k, 1));
        if k % 2 == 0 {
            journal.push((k, ptr(k, 1)));
            index.replace(k, index.hash(k), ptr(k, 2));
        }
    }
    for k in (1..500u64).step_by(7) {
        // (A key replaced above is journaled again: its first entry wins.)
        journal.push((k, index.get(k, index.hash(k)).unwrap()));
        index.remove(k, index.hash(k)).unwrap();
    }
    for k in 500..650u64 {
        journal.push((k, 0));
        assert!(index.insert_new(k, index.hash(k), ptr(k, 1)).unwrap());
    }
    // Keep each key's first entry as the reference does.
    let mut first: HashMap<u64, u64> = HashMap::new();
    for &(k, old) in &journal {
        first.entry(k).or_insert(old);
    }
    assert_eq!(first.iter().filter(|(k, &old)| old != 0 && at_ckpt[k] != old).count(), 0);
    index.begin_lazy_repair();
    let keys = index.begin_lazy_undo(7, journal.iter().copied());
    assert_eq!(keys, first.len() as u64);
    assert!(index.undo_pending());
    let index = &index;
    let done = AtomicBool::new(false);
    let first_rounds = AtomicU64::new(0);
    let writer_keys = 1000..1060u64;
    std::thread::scope(|s| {
        for reader in 0..2u64 {
            let (at_ckpt, done, first_rounds) = (&at_ckpt, &done, &first_rounds);
            s.spawn(move || {
                let mut rng = crate::hash::splitmix64(reader + 1);
                let mut rounds = 0;
                while rounds < 3 || !done.load(Ordering::Acquire) {
                    let batch: Vec<u64> = (0..STAGED_KEYS_MAX)
                        .map(|_| {
                            rng = crate::hash::splitmix64(rng);
                            rng % 650
                        })
                        .collect();
                    let got = if reader == 0 {
                        batch.iter().map(|&k| index.get(k, index.hash(k))).collect()
                    } else {
                        staged(index, &batch)
                    };
                    for (&k, g) in batch.iter().zip(got) {
                        assert_eq!(g, at_ckpt.get(&k).copied(), "key {k} read during the rollback");
                    }
                    rounds += 1;
                    if rounds == 1 {
                        first_rounds.fetch_add(1, Ordering::AcqRel);
                    }
                }
            });
        }
        s.spawn(|| {
            for round in 0..20u64 {
                for k in writer_keys.clone() {
                    let h = index.hash(k);
                    if round % 2 == 0 {
                        assert!(index.insert_new(k, h, ptr(k, round)).unwrap());
                    } else {
                        assert_eq!(index.remove(k, h), Some(ptr(k, round - 1)));
                    }
                }
            }
            assert!(index.insert_new(writer_keys.start, index.hash(writer_keys.start), 77).unwrap());
        });
        // The background's part, a few buckets at a time, once both readers have read a
        // batch with every undo pending.
        let t0 = std::time::Instant::now();
        while first_rounds.load(Ordering::Acquire) < 2 && t0.elapsed().as_secs() < 20 {
            std::thread::yield_now();
        }
        let mut at = 0;
        loop {
            let next = index.undo_some(at, 3);
            if next == at {
                break;
            }
            at = next;
            std::thread::yield_now();
        }
        index.undo_all().unwrap();
        done.store(true, Ordering::Release);
    });
    assert!(!index.undo_pending());
    let mut all = HashMap::new();
    index.for_each(0, index.bucket_count(), |k, p| {
        assert!(all.insert(k, p).is_none(), "key {k} twice");
    });
    let mut want = at_ckpt.clone();
    want.insert(writer_keys.start, 77);
    assert_eq!(all, want, "the index after the rollback");
}

/// An undo with no slot to return its key to (every slot taken) is an error of
/// `undo_all`, which stays; the other keys are returned. (The table rolls back on first
/// touch only while the index keeps room for every key the journal may return:
/// `checkpoint::begin_lazy_rollback`.)
#[test]
fn an_undo_without_a_slot_is_an_error_and_the_other_keys_are_returned() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = new_index(&dir, 4);
    let slots = index.slot_count();
    for key in 0..slots {
        assert!(index.insert_new(key, index.hash(key), key + 1).unwrap());
    }
    // Key 0 deleted and its slot taken by key 1000 (not journaled: it stays); key 1
    // replaced.
    index.remove(0, index.hash(0)).unwrap();
    assert!(index.insert_new(1000, index.hash(1000), 5000).unwrap());
    index.replace(1, index.hash(1), 77).unwrap();
    index.begin_lazy_repair();
    index.begin_lazy_undo(3, [(0, 1), (1, 2)]);
    let e = index.undo_all().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Recover, "{e}");
    assert!(e.to_string().contains("no index slot to return key 0 to checkpoint 3"), "{e}");
    assert_eq!(index.undo_all().unwrap_err().kind(), ErrorKind::Recover, "the error stays");
    assert!(!index.undo_pending());
    assert_eq!(index.get(1, index.hash(1)), Some(2));
    assert_eq!(index.get(0, index.hash(0)), None);
}

/// A key an undo returns to a slot that held another key this interval (journaled,
/// marked, then removed) is not marked journaled: its next change must be journaled.
#[test]
fn a_key_an_undo_returns_does_not_inherit_the_slots_mark() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = new_index(&dir, 8);
    let tag = 0x1234;
    let home = |i: &Index, k: u64| i.geo.home(i.hash(k));
    // K, deleted after the checkpoint; its home bucket full of other keys.
    let k = 1u64;
    let h = home(&index, k);
    for other in (2..).filter(|&o| home(&index, o) == h).take(SLOTS_PER_BUCKET) {
        assert!(index.insert_new(other, index.hash(other), other + 1).unwrap());
    }
    // K2, homed where K's probe goes next, changed this interval: journaled, marked, removed.
    let y = index.geo.next(h, index.geo.step(index.hash(k)));
    let k2 = (1000..).find(|&o| home(&index, o) == y).unwrap();
    assert!(index.insert_new(k2, index.hash(k2), 5).unwrap());
    let f = index.find(k2, index.hash(k2)).unwrap();
    index.mark_journaled(f.bucket, f.slot, tag);
    assert!(index.journaled(f.bucket, f.slot, tag));
    index.remove(k2, index.hash(k2)).unwrap();
    index.begin_lazy_repair();
    index.begin_lazy_undo(3, [(k, 777)]);
    let back = index.find(k, index.hash(k)).unwrap();
    assert_eq!((back.bucket, back.slot, back.ptr), (f.bucket, f.slot, 777), "K took K2's slot");
    assert!(!index.journaled(back.bucket, back.slot, tag), "K inherited K2's mark");
}

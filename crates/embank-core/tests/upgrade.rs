//! A store whose index an older embank wrote (format 1 or 2: 14 slots of `(key, row byte
//! offset)` a bucket) opens in this build: converted once to format 3, every row kept.

use embank_core::testing::{slot_offsets, BUCKET_BYTES, INDEX_HEADER_BYTES, SLOTS_PER_BUCKET};
use embank_core::{ErrorKind, MediumKind, Placement, Store, StoreOptions, TableOptions};

fn index_file(store: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(store.join("tables/0"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("index.") && name.ends_with(".ebi")
        })
        .unwrap()
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Rewrites a closed table's format 3 index as an older build wrote it: a header of
/// version 1 (`buckets` a power of two) or 2, its CRC over bytes 0..32 only, the live
/// count, state, free-list generation and boot id kept; 14 `(key, row byte offset)`
/// slots a bucket, placed in order (where a key sits does not matter to a conversion).
fn write_legacy(index: &std::path::Path, buckets: u64) {
    let new = std::fs::read(index).unwrap();
    let (base, unit) = (u64_at(&new, 72), u64_at(&new, 80));
    let mut pairs = Vec::new();
    for bucket in (INDEX_HEADER_BYTES..new.len()).step_by(BUCKET_BYTES) {
        for s in 0..SLOTS_PER_BUCKET {
            let (key_at, row_at, fp_at) = slot_offsets(s);
            if new[bucket + fp_at] != 0 {
                let row = u32::from_le_bytes(new[bucket + row_at..][..4].try_into().unwrap()) as u64;
                pairs.push((u64_at(&new, bucket + key_at), base + row * unit));
            }
        }
    }
    assert_eq!(pairs.len() as u64, u64_at(&new, 32));
    assert!(pairs.len() as u64 <= buckets * 14);
    let mut old = vec![0u8; INDEX_HEADER_BYTES + buckets as usize * 256];
    old[..72].copy_from_slice(&new[..72]);
    old[8..12].copy_from_slice(&(if buckets.is_power_of_two() { 1u32 } else { 2 }).to_le_bytes());
    old[16..24].copy_from_slice(&buckets.to_le_bytes());
    let crc = crc32c::crc32c(&old[0..32]);
    old[44..48].copy_from_slice(&crc.to_le_bytes());
    for (i, &(key, ptr)) in pairs.iter().enumerate() {
        let (b, s) = (INDEX_HEADER_BYTES + i / 14 * 256, i % 14);
        old[b + 8 + s] = 0x5a;
        old[b + 24 + 16 * s..][..8].copy_from_slice(&key.to_le_bytes());
        old[b + 32 + 16 * s..][..8].copy_from_slice(&ptr.to_le_bytes());
    }
    std::fs::write(index, old).unwrap();
}

fn rows_of(keys: &[u64], dim: usize) -> Vec<f32> {
    keys.iter().flat_map(|&k| (0..dim).map(move |j| k as f32 + j as f32 / 8.0)).collect()
}

#[test]
fn an_index_of_format_1_or_2_is_converted_on_open_and_every_row_kept() {
    for (medium, buckets) in [(MediumKind::Mmap, 512u64), (MediumKind::Block, 300)] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let keys: Vec<u64> = (0..3000u64).map(|i| i * 7919 + 3).collect();
        let dim = 8;
        {
            let store = Store::open(&path, StoreOptions::default()).unwrap();
            let mut o = TableOptions::new(dim as u32);
            o.medium = medium;
            if medium == MediumKind::Block {
                o.placement = Placement::Cache;
            }
            let t = store.create_table("t", o).unwrap();
            t.push(&keys, &rows_of(&keys, dim)).unwrap();
            // Some records freed: the free list saved at the close must load again.
            assert_eq!(t.delete(&keys[..100]).unwrap(), 100);
            drop(t);
            store.close().unwrap();
        }
        let index = index_file(&path);
        write_legacy(&index, buckets);
        {
            let store = Store::open(&path, StoreOptions::default()).unwrap();
            let t = store.table("t").unwrap();
            assert!(t.recover_stats().is_none(), "{medium:?}: a clean legacy index needs no repair");
            let mut out = vec![0f32; keys.len() * dim];
            let mut found = vec![false; keys.len()];
            t.lookup(&keys, &mut out, &mut found).unwrap();
            assert_eq!(found.iter().filter(|&&f| f).count(), keys.len() - 100, "{medium:?}");
            for (i, &k) in keys.iter().enumerate().skip(100) {
                assert_eq!(&out[i * dim..(i + 1) * dim], &rows_of(&[k], dim)[..], "{medium:?}: key {k}");
            }
            // Writes reuse the freed records and read back.
            let more: Vec<u64> = (1..=200u64).map(|k| k << 40).collect();
            t.push(&more, &rows_of(&more, dim)).unwrap();
            let mut out = vec![0f32; more.len() * dim];
            let mut found = vec![false; more.len()];
            t.lookup(&more, &mut out, &mut found).unwrap();
            assert!(found.iter().all(|&f| f));
            assert_eq!(out, rows_of(&more, dim));
            assert_eq!(t.len().unwrap(), keys.len() as u64 - 100 + 200);
            drop(t);
            store.close().unwrap();
        }
        let bytes = std::fs::read(index_file(&path)).unwrap();
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3, "{medium:?}: written as format 3");
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        assert_eq!(store.table("t").unwrap().len().unwrap(), keys.len() as u64 - 100 + 200);
    }
}

#[test]
fn a_legacy_index_left_dirty_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let keys: Vec<u64> = (0..500).collect();
    {
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let t = store.create_table("t", TableOptions::new(4)).unwrap();
        t.push(&keys, &rows_of(&keys, 4)).unwrap();
        drop(t);
        store.close().unwrap();
    }
    let index = index_file(&path);
    write_legacy(&index, 64);
    let mut bytes = std::fs::read(&index).unwrap();
    bytes[40..44].copy_from_slice(&1u32.to_le_bytes()); // state: open (its user died)
    std::fs::write(&index, &bytes).unwrap();
    let Err(err) = Store::open(&path, StoreOptions::default()).and_then(|s| s.table("t")) else {
        panic!("a dirty legacy index opened");
    };
    assert_eq!(err.kind(), ErrorKind::FormatVersion, "{err}");
    assert!(err.to_string().contains("not closed cleanly"), "{err}");
    assert_eq!(std::fs::read(&index).unwrap(), bytes, "the old index is untouched");
}

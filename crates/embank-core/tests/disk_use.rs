//! Disk use grows with rows, not with capacity (issue 55).
//!
//! What counts is what `du` counts: the blocks the file system allocated, summed over
//! the store directory. The index file is as long as its capacity asks (its buckets sit
//! where keys hash), but only the parts that keys were written to have blocks; the rows
//! file and the undo journals grow in steps with what they hold.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use embank_core::{Initializer, MediumKind, Store, StoreOptions, TableOptions};

const MB: u64 = 1_000_000;

/// True when `dir`'s file system keeps the index sparse (as `fsutil::sparse_files_ok`
/// says: on tmpfs, for one, mapped files are allocated whole); the tests of the index's
/// size say so and pass without running elsewhere.
fn sparse_here(dir: &Path) -> bool {
    // SAFETY: statfs is plain data, filled by the call for a path we own.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    if unsafe { libc::statfs(path.as_ptr(), &mut s) } != 0 {
        return false;
    }
    // ext4, XFS, btrfs, f2fs, ZFS, bcachefs
    let sparse = [0xEF53, 0x5846_5342, 0x9123_683E, 0xF2F5_2010, 0x2FC1_2FC1, 0xCA45_1A4E].contains(&(s.f_type as u64));
    if !sparse {
        eprintln!("disk_use: {} is on a file system where the index is allocated whole; test not run", dir.display());
    }
    sparse
}

/// Bytes of allocated blocks under `dir` (files only), as `du` counts them.
fn allocated_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        total += if meta.is_dir() { allocated_bytes(&entry.path()) } else { meta.blocks() * 512 };
    }
    total
}

/// Allocated bytes of each file under `dir`, for failure messages.
fn listing(dir: &Path) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            out += &listing(&entry.path());
        } else {
            out += &format!(
                "\n  {}: {} bytes allocated, {} long",
                entry.path().display(),
                meta.blocks() * 512,
                meta.len()
            );
        }
    }
    out
}

/// README's first example: a table of capacity 10 M, four rows pulled, pushed, one deleted.
fn readme_example(medium: MediumKind) {
    let dir = tempfile::tempdir().unwrap();
    if !sparse_here(dir.path()) {
        return;
    }
    let path = dir.path().join("model");
    {
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let mut options = TableOptions::new(64);
        options.init = Initializer::Normal { mean: 0.0, std: 0.01 };
        options.capacity = 10_000_000;
        options.medium = medium;
        let users = store.create_table("user", options).unwrap();
        let keys = [3u64, 14, 15, 92];
        let mut rows = vec![0f32; keys.len() * 64];
        users.pull(&keys, &mut rows).unwrap();
        let half: Vec<f32> = rows.iter().map(|x| x * 0.5).collect();
        users.push(&keys, &half).unwrap();
        users.delete(&keys[..1]).unwrap();
        store.flush().unwrap();
        store.close().unwrap();
    }
    let bytes = allocated_bytes(&path);
    assert!(
        bytes < MB,
        "{medium:?}: a table of capacity 10 M holding 3 rows takes {bytes} bytes of disk, expected under {MB}:{}",
        listing(&path)
    );
    // It reads back after a reopen, and the sizes still hold.
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let users = store.table("user").unwrap();
    assert_eq!(users.len().unwrap(), 3, "{medium:?}: rows after reopening");
    store.close().unwrap();
    let bytes = allocated_bytes(&path);
    assert!(bytes < MB, "{medium:?}: after a reopen the store takes {bytes} bytes:{}", listing(&path));
}

#[test]
fn a_table_of_four_rows_takes_under_a_megabyte_whatever_its_capacity_mmap() {
    readme_example(MediumKind::Mmap);
}

#[test]
fn a_table_of_four_rows_takes_under_a_megabyte_whatever_its_capacity_block() {
    readme_example(MediumKind::Block);
}

/// A table with the default options and checkpoints (undo journals, their spare).
#[test]
fn a_default_table_with_checkpoints_takes_under_a_megabyte() {
    for medium in [MediumKind::Mmap, MediumKind::Block] {
        let dir = tempfile::tempdir().unwrap();
        if !sparse_here(dir.path()) {
            return;
        }
        let path = dir.path().join("store");
        let store = Store::open(&path, StoreOptions::default()).unwrap();
        let mut options = TableOptions::new(64);
        options.medium = medium;
        let t = store.create_table("t", options).unwrap();
        let keys = [1u64, 2, 3, 4];
        let mut rows = vec![0f32; keys.len() * 64];
        t.pull(&keys, &mut rows).unwrap();
        store.checkpoint(1).unwrap();
        t.push(&keys, &vec![1.0; keys.len() * 64]).unwrap();
        store.checkpoint(2).unwrap();
        t.push(&keys, &vec![2.0; keys.len() * 64]).unwrap();
        store.flush().unwrap();
        let bytes = allocated_bytes(&path);
        assert!(bytes < MB, "{medium:?}: a default table of 4 rows takes {bytes} bytes:{}", listing(&path));
        store.close().unwrap();
    }
}

/// 1,000 rows in a default table (capacity 1 Mi: a 32 MiB index of 8,192 pages) take a
/// page of the index each, about: under 5 MB in all (the index's pages where keys landed,
/// the rows, the journals of two checkpoints).
#[test]
fn a_thousand_rows_take_a_page_of_index_each() {
    let dir = tempfile::tempdir().unwrap();
    if !sparse_here(dir.path()) {
        return;
    }
    let path = dir.path().join("store");
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let t = store.create_table("t", TableOptions::new(64)).unwrap();
    let keys: Vec<u64> = (0..1000).map(|k| k * 7919).collect();
    t.push(&keys, &vec![0.5; keys.len() * 64]).unwrap();
    store.checkpoint(1).unwrap();
    t.push(&keys, &vec![1.5; keys.len() * 64]).unwrap();
    store.checkpoint(2).unwrap();
    store.close().unwrap();
    let bytes = allocated_bytes(&path);
    assert!(
        bytes < 5 * MB,
        "a default table of 1,000 rows takes {bytes} bytes, expected under 5 MB:{}",
        listing(&path)
    );
}

/// 1 M rows of dim 64 `f32` take at most 1.3 times their bytes besides the index.
#[test]
fn a_million_rows_take_little_more_than_their_bytes() {
    const ROWS: u64 = 1_000_000;
    const DIM: usize = 64;
    const BATCH: u64 = 50_000;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = Store::open(&path, StoreOptions::default()).unwrap();
    let t = store.create_table("t", TableOptions::new(DIM as u32)).unwrap();
    let rows = vec![0.25f32; BATCH as usize * DIM];
    for start in (0..ROWS).step_by(BATCH as usize) {
        let keys: Vec<u64> = (start..start + BATCH).collect();
        t.push(&keys, &rows).unwrap();
    }
    store.flush().unwrap();
    let table_dir = path.join("tables").join("0");
    let index: u64 = std::fs::read_dir(&table_dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".ebi"))
        .map(|e| e.metadata().unwrap().blocks() * 512)
        .sum();
    let besides_index = allocated_bytes(&path) - index;
    let row_bytes = ROWS * DIM as u64 * 4;
    assert!(
        besides_index * 10 <= row_bytes * 13,
        "1 M rows of dim 64 ({row_bytes} bytes) take {besides_index} bytes besides the index ({:.3}x), expected \
         at most 1.3x:{}",
        besides_index as f64 / row_bytes as f64,
        listing(&path)
    );
    store.close().unwrap();
}

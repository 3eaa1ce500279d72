//! A full disk is an error, never a signal.
//!
//! Each test mounts a small tmpfs (root only: elsewhere the test says so and passes
//! without running), puts a ballast file and a store on it, and writes new rows until
//! the file system is full: under the mmap medium, the block medium behind the row
//! cache, the undo journals of checkpoints, and the pages of a sparse index. Each must
//! end in an `Io` error that
//! says "no space left", with the process alive (SIGBUS would kill the test binary),
//! every row flushed before intact, reads working, and `close` + reopen working while
//! the disk is still full; once the ballast is deleted, writes succeed again.

use std::path::PathBuf;
use std::process::Command;

use embank_core::{ErrorKind, MediumKind, Optimizer, Placement, Store, StoreOptions, TableOptions};

const DIM: usize = 256;
const BATCH: u64 = 256;

/// A tmpfs of `mib` MiB mounted on a fresh directory; unmounted on drop.
struct Mount {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Mount {
    /// A tmpfs of `mib` MiB.
    fn new(mib: u64) -> Option<Mount> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("disk_full: cannot mount a tmpfs here (needs root); test not run");
            return None;
        }
        Some(Mount { _dir: dir, path })
    }
}

impl Mount {
    /// An ext4 file system of `mib` MiB in a file, mounted through a loop device: a file
    /// system where holes stay holes when read (on tmpfs a read of a hole allocates, so
    /// the store allocates its mapped files whole there).
    fn ext4(mib: u64) -> Option<Mount> {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("image");
        std::fs::File::create(&image).unwrap().set_len(mib << 20).unwrap();
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        // No blocks reserved for root (the tests run as root): full means full.
        let made =
            Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&image).status().is_ok_and(|s| s.success());
        let ok = made
            && Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&path).status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("disk_full: cannot make and mount an ext4 image here (needs mkfs.ext4, root, a loop device); test not run");
            return None;
        }
        Some(Mount { _dir: dir, path })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

fn row(key: u64, version: u64) -> Vec<f32> {
    (0..DIM).map(|j| (key * 7 + j as u64 + version * 1000) as f32).collect()
}

fn rows(keys: &[u64], version: u64) -> Vec<f32> {
    keys.iter().flat_map(|&k| row(k, version)).collect()
}

fn options() -> StoreOptions {
    StoreOptions { cache_bytes: 2 << 20, ..Default::default() }
}

fn check_rows(store: &Store, keys: &[u64], version: u64, ctx: &str) {
    let t = store.table("t").unwrap();
    for chunk in keys.chunks(1024) {
        let mut out = vec![0f32; chunk.len() * DIM];
        let mut found = vec![false; chunk.len()];
        t.lookup(chunk, &mut out, &mut found).unwrap();
        for (i, &k) in chunk.iter().enumerate() {
            assert!(found[i], "{ctx}: flushed key {k} is gone");
            assert_eq!(&out[i * DIM..(i + 1) * DIM], &row(k, version)[..], "{ctx}: flushed row of key {k} differs");
        }
    }
}

fn is_disk_full(e: &embank_core::Error) -> bool {
    e.kind() == ErrorKind::Io && e.to_string().contains("no space left")
}

/// Fills the disk with new rows of table `t` (created with `table`); `checkpoints`
/// takes a checkpoint every few batches and rewrites old rows (journal entries). A
/// ballast file of `ballast_mib` MiB is deleted at the end, to make room again.
fn fill_and_recover(mount: &Mount, table: TableOptions, checkpoints: bool, ballast_mib: usize) {
    let ballast = mount.path.join("ballast");
    std::fs::write(&ballast, vec![1u8; ballast_mib << 20]).unwrap();
    let path = mount.path.join("store");
    let store = Store::open(&path, options()).unwrap();
    let t = store.create_table("t", table).unwrap();
    let mut flushed: Vec<u64> = Vec::new();
    let mut next = 0u64;
    let mut error = None;
    for b in 0..10_000u64 {
        let keys: Vec<u64> = (next..next + BATCH).collect();
        let r = t.push(&keys, &rows(&keys, 0)).and_then(|()| {
            if checkpoints && b % 4 == 3 {
                // Rewrite every flushed row with the same bytes: each is journaled once per interval.
                for chunk in flushed.chunks(4096) {
                    t.push(chunk, &rows(chunk, 0))?;
                }
                store.checkpoint(b)?;
            }
            store.flush()
        });
        match r {
            Ok(()) => {
                flushed.extend(&keys);
                next += BATCH;
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let e = error.expect("the file system never filled up");
    assert!(is_disk_full(&e), "expected a disk-full Io error, got {:?}: {e}", e.kind());
    assert!(!flushed.is_empty(), "the disk filled before the first batch");
    // Reads work on the full disk, and a write of new rows fails again the same way.
    check_rows(&store, &flushed, 0, "after the error");
    let keys: Vec<u64> = (next..next + 4 * BATCH).collect();
    let e = t.push(&keys, &rows(&keys, 0)).err();
    if let Some(e) = e {
        assert!(is_disk_full(&e), "second write: {e}");
    }
    // Close keeps what it can (an error is allowed); reopening on the full disk works.
    drop(t);
    let _ = store.close();
    drop(store);
    let store = Store::open(&path, options()).expect("reopen on a full disk");
    check_rows(&store, &flushed, 0, "after reopening on the full disk");
    drop(store);
    // With space again, writes succeed.
    std::fs::remove_file(&ballast).unwrap();
    let store = Store::open(&path, options()).unwrap();
    let t = store.table("t").unwrap();
    let keys: Vec<u64> = (1 << 40..(1 << 40) + BATCH).collect();
    t.push(&keys, &rows(&keys, 3)).expect("a write after space was freed");
    store.flush().unwrap();
    check_rows(&store, &keys, 3, "after space was freed");
    check_rows(&store, &flushed, 0, "old rows after space was freed");
    store.close().unwrap();
}

fn table(medium: MediumKind, placement: Placement) -> TableOptions {
    let mut o = TableOptions::new(DIM as u32);
    o.medium = medium;
    o.placement = placement;
    o.capacity = 1000; // the index grows on the way, too
    o
}

#[test]
fn mmap_medium_full_disk_is_an_error() {
    let Some(m) = Mount::new(40) else { return };
    fill_and_recover(&m, table(MediumKind::Mmap, Placement::Auto), false, 8);
}

#[test]
fn block_medium_full_disk_is_an_error() {
    let Some(m) = Mount::new(40) else { return };
    fill_and_recover(&m, table(MediumKind::Block, Placement::Cache), false, 8);
}

#[test]
fn journals_on_a_full_disk_are_an_error() {
    let Some(m) = Mount::new(40) else { return };
    let mut o = table(MediumKind::Mmap, Placement::Auto);
    o.optimizer = Optimizer::Sgd { lr: 0.1 };
    fill_and_recover(&m, o, true, 8);
}

/// An index of a large capacity is sparse: a page gets blocks before the first key is
/// written into it. Here the disk is full while the rows file still has room for new
/// records: the insert that needs a new page of the index is the call that fails, and
/// the repair's pass after a reopen on the full disk writes no page without blocks. On
/// ext4 (on tmpfs the index is allocated whole).
#[test]
fn index_pages_on_a_full_disk_are_an_error() {
    let Some(m) = Mount::ext4(48) else { return };
    let path = m.path.join("store");
    let store = Store::open(&path, options()).unwrap();
    let mut o = table(MediumKind::Mmap, Placement::Auto);
    o.capacity = 2_000_000; // a 64 MiB index file on a 48 MiB file system
    let t = store.create_table("t", o).unwrap();
    // The rows file's first step holds 62 records of 1,040 bytes: 48 keys fit.
    let first: Vec<u64> = (0..16).collect();
    t.push(&first, &rows(&first, 0)).unwrap();
    store.flush().unwrap();
    let ballast = m.path.join("ballast");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&ballast).unwrap();
        for block in [1 << 20, 4096, 1024] {
            while f.write_all(&vec![1u8; block]).is_ok() {}
        }
        let _ = f.sync_all();
    }
    let keys: Vec<u64> = (1000..1032).collect();
    let e = t.push(&keys, &rows(&keys, 0)).expect_err("new keys on a full disk");
    assert!(is_disk_full(&e), "expected a disk-full Io error, got {:?}: {e}", e.kind());
    assert!(e.to_string().contains("index.0.ebi"), "expected the index's page to be what lacked room: {e}");
    check_rows(&store, &first, 0, "after the error");
    drop(t);
    let _ = store.close();
    drop(store);
    let store = Store::open(&path, options()).expect("reopen on a full disk");
    check_rows(&store, &first, 0, "after reopening on the full disk");
    store.wait_repaired().unwrap();
    drop(store);
    std::fs::remove_file(&ballast).unwrap();
    let store = Store::open(&path, options()).unwrap();
    let t = store.table("t").unwrap();
    t.push(&keys, &rows(&keys, 3)).expect("new keys after space was freed");
    store.flush().unwrap();
    check_rows(&store, &keys, 3, "after space was freed");
    check_rows(&store, &first, 0, "old rows after space was freed");
    store.close().unwrap();
}

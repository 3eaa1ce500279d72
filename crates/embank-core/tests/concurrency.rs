//! Readers and writers on overlapping keys: every row is written as a constant
//! vector, so a read that mixed two writes would show two different values. Readers
//! take turns at `lookup`, `pull` and `lookup_stored`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{MediumKind, RowWrites, Store, StoreOptions, TableOptions};

const DIM: usize = 32;
const KEYS: u64 = 256;

#[test]
fn no_read_returns_a_mixed_row() {
    run(MediumKind::Mmap, StoreOptions::default());
}

/// Rows written through the file (`pwrite`) while readers copy them from the mapping:
/// three writers' records share pages, and readers see each whole or not at all.
#[test]
fn no_read_returns_a_mixed_row_with_rows_written_through_the_file() {
    run(MediumKind::Mmap, StoreOptions { row_writes: RowWrites::File, ..StoreOptions::default() });
}

/// The block medium under a row cache of about 60 rows: reads race evictions,
/// admissions, pushes into dirty entries, and write-backs by the maintenance
/// thread and by writers.
#[test]
fn no_read_returns_a_mixed_row_on_the_block_medium() {
    run(MediumKind::Block, StoreOptions { cache_bytes: 16 << 10, ..StoreOptions::default() });
}

fn run(medium: MediumKind, options: StoreOptions) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("s"), options.clone()).unwrap();
    let mut o = TableOptions::new(DIM as u32);
    o.medium = medium;
    o.capacity = 16; // growth happens while readers run
    let table = store.create_table("t", o).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // A deadlock must fail the run, not hang it: give up loudly after 120 s.
    let done = Arc::new(AtomicBool::new(false));
    {
        let done = done.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(120));
            if !done.load(Ordering::Relaxed) {
                eprintln!("concurrency test still running after 120 s: deadlock");
                std::process::exit(101);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut handles = Vec::new();
    for w in 0..3u64 {
        let (t, stop) = (table.clone(), stop.clone());
        handles.push(std::thread::spawn(move || {
            let mut x = w * 1_000_003 + 1;
            let mut writes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let keys: Vec<u64> = (0..16).map(|i| (x >> 20).wrapping_add(i * 7) % KEYS).collect();
                let v = ((x >> 33) % 1_000_000) as f32;
                let rows: Vec<f32> = keys.iter().flat_map(|_| [v; DIM]).collect();
                if x.is_multiple_of(5) {
                    t.delete(&keys[..4]).unwrap();
                } else {
                    t.push(&keys, &rows).unwrap();
                }
                writes += 1;
            }
            writes
        }));
    }
    for r in 0..3u64 {
        let (t, stop) = (table.clone(), stop.clone());
        handles.push(std::thread::spawn(move || {
            let keys: Vec<u64> = (0..KEYS).map(|k| (k * 31 + r) % KEYS).collect();
            let mut out = vec![0.0; keys.len() * DIM];
            let mut found = vec![false; keys.len()];
            let mut stored = vec![0u8; keys.len() * DIM * 4];
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match reads % 3 {
                    0 => t.lookup(&keys, &mut out, &mut found).unwrap(),
                    1 => t.pull(&keys, &mut out).unwrap(),
                    _ => {
                        // Rows as stored (f32 here: the little-endian floats).
                        t.lookup_stored(&keys, &mut stored, &mut found).unwrap();
                        for (o, b) in out.iter_mut().zip(stored.chunks_exact(4)) {
                            *o = f32::from_le_bytes(b.try_into().unwrap());
                        }
                    }
                }
                for (i, row) in out.chunks(DIM).enumerate() {
                    assert!(
                        row.iter().all(|&x| x == row[0]),
                        "reader {r} read {reads}: mixed row for key {}: {row:?}",
                        keys[i]
                    );
                }
                reads += 1;
            }
            reads
        }));
    }
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let counts: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(counts.iter().all(|&c| c > 10), "every thread made progress: {counts:?}");
    let stats = table.stats().unwrap();
    done.store(true, Ordering::Relaxed);
    assert!(stats.grow_count >= 1, "the table grew during the run");
    assert!(stats.rows <= KEYS);
    // What reaches the medium is whole rows too.
    drop(table);
    store.close().unwrap();
    let store = Store::open(dir.path().join("s"), options).unwrap();
    let mut n = 0;
    store
        .table("t")
        .unwrap()
        .export(64, |keys, rows| {
            for (i, row) in rows.chunks(DIM).enumerate() {
                assert!(row.iter().all(|&x| x == row[0]), "mixed row for key {} after reopen: {row:?}", keys[i]);
            }
            n += keys.len() as u64;
            Ok(())
        })
        .unwrap();
    assert_eq!(n, stats.rows);
}

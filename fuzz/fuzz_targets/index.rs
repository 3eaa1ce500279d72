//! An index file: any bytes open (or fail), an index of format 1 or 2 converted first;
//! recovery never panics, and afterwards every key the index lists is found where it
//! says, with a pointer recovery accepted.
#![no_main]
use libfuzzer_sys::fuzz_target;

use embank_core::fuzzing::{Index, RowUnits};

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let path = common::scratch().join("index.0.ebi");
    std::fs::write(&path, data).unwrap();
    // Format 3 names its rows (bytes 72..88 of the header); older ones convert as a
    // table of 16-byte records would.
    let word = |at: usize| data.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    let units = match (data.get(8..12), word(72), word(80)) {
        (Some([3, 0, 0, 0]), Some(base), Some(unit)) => RowUnits { base, unit },
        _ => RowUnits { base: 4096, unit: 16 },
    };
    let Ok(index) = Index::open_for_rows(&path, units) else { return };
    let row = |ptr: u64| ptr >= units.base && (ptr - units.base) % units.unit == 0;
    index.recover(|_, ptr, _| row(ptr));
    let mut pairs = Vec::new();
    index.for_each(0, index.bucket_count(), |k, p| pairs.push((k, p)));
    for (k, p) in pairs.into_iter().take(256) {
        assert!(row(p), "recovery kept a pointer it refused");
        assert!(index.get(k, index.hash(k)).is_some(), "a listed key {k} is not found");
    }
});

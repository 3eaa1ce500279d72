//! An index file: any bytes open (or fail); recovery never panics, and afterwards every
//! key the index lists is found where it says, with a pointer recovery accepted.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let path = common::scratch().join("index.0.ebi");
    std::fs::write(&path, data).unwrap();
    let Ok(index) = embank_core::fuzzing::Index::open(&path) else { return };
    // Accept pointers that are 16-aligned, as if records had that stride.
    index.recover(|_, ptr, _| ptr % 16 == 0 && ptr >= 4096);
    let mut pairs = Vec::new();
    index.for_each(0, index.bucket_count(), |k, p| pairs.push((k, p)));
    for (k, p) in pairs.into_iter().take(256) {
        assert!(p % 16 == 0 && p >= 4096, "recovery kept a pointer it refused");
        assert!(index.get(k, index.hash(k)).is_some(), "a listed key {k} is not found");
    }
});

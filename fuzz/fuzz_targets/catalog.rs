//! The `STORE` catalog file: any bytes open as a catalog or fail with an error.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    std::fs::write(dir.join(embank_core::fuzzing::CATALOG_FILE), data).unwrap();
    if let Ok(c) = embank_core::fuzzing::Catalog::open(dir) {
        let _ = c.snapshot();
    }
});

//! The `CHECKPOINTS` file (JSON, with hex metadata blobs): any bytes load or fail.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    std::fs::write(dir.join("CHECKPOINTS"), data).unwrap();
    if let Ok(list) = embank_core::checkpoint::load_checkpoints(dir) {
        for c in list {
            assert!(c.meta.len() <= data.len(), "a blob comes from the file");
        }
    }
});

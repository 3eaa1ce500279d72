//! The checkpoint list: any bytes in a slot (`CHECKPOINTS.0`/`.1`: header, CRC, JSON with
//! hex metadata blobs) or in the single `CHECKPOINTS` of stores before the slots load or fail.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    for name in ["CHECKPOINTS", "CHECKPOINTS.0", "CHECKPOINTS.1"] {
        let _ = std::fs::remove_file(dir.join(name));
    }
    // The first byte picks the file: a slot (the other absent), or the one of before.
    let Some((&which, rest)) = data.split_first() else { return };
    let name = ["CHECKPOINTS.0", "CHECKPOINTS.1", "CHECKPOINTS"][which as usize % 3];
    std::fs::write(dir.join(name), rest).unwrap();
    if let Ok(list) = embank_core::fuzzing::load_checkpoints(dir) {
        for c in list {
            assert!(c.meta.len() <= rest.len(), "a blob comes from the file");
        }
    }
});

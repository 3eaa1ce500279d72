//! An undo journal: any bytes open (or fail) and list only completed entries of its seq.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let dir = common::scratch();
    std::fs::write(embank_core::fuzzing::journal_path_of(dir, 1), data).unwrap();
    if let Ok(j) = embank_core::fuzzing::Journal::open(dir, 1) {
        for e in j.entries() {
            assert_eq!(e.seq, 1, "entries of another journal are never read as this one's");
        }
    }
});

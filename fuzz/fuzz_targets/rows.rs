//! A rows file of the mmap medium: any bytes open (or fail); reading any handed-out
//! record checks its key and checksum without panicking.
#![no_main]
use embank_core::fuzzing::MmapMedium;
use embank_core::{DType, RecordLayout};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let path = common::scratch().join("rows.ebr");
    let _ = std::fs::remove_file(&path);
    std::fs::write(&path, data).unwrap();
    let Ok(m) = MmapMedium::open(&path, RecordLayout::new(4, 0, DType::F32)) else { return };
    let alloc = m.alloc();
    let mut out = [0f32; 4];
    for r in 0..alloc.next_record().min(64) {
        let ptr = 4096 + r * m.stride();
        assert!(alloc.is_valid_ptr(ptr));
        if m.verify(ptr, m.key_at(ptr), true).is_ok() {
            m.read_into(ptr, &mut out);
        }
    }
});

//! Helpers shared by the crash-style integration tests.

/// xorshift64: a seedable stream for kill timings and key choices (seed must be non-zero).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Opens a store, retrying while it reads as locked. Tests in one binary run side by side
/// and fork children: a child holds copies of every descriptor, another test's store lock
/// too, from fork to exec, so a lock just released can look held for a moment.
#[allow(dead_code)] // not every test binary opens stores this way
pub fn open_store(path: &std::path::Path, options: embank_core::StoreOptions) -> embank_core::Store {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match embank_core::Store::open(path, options.clone()) {
            Err(e) if e.kind() == embank_core::ErrorKind::Locked && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.unwrap(),
        }
    }
}

//! `strict_assert!`: checked in tests and debug builds, free in release builds. The
//! macros are this crate's own (`#[macro_use]` on the module, declared first).
//!
//! Use it for invariants on hot paths (a row read back has the key we asked
//! for). Invariants that guard persistent data use plain `assert!` or return
//! [`crate::ErrorKind::Corrupt`].

macro_rules! strict_assert {
    ($($arg:tt)*) => {
        if cfg!(any(test, debug_assertions, feature = "test-utils")) {
            assert!($($arg)*);
        }
    };
}

macro_rules! strict_assert_eq {
    ($($arg:tt)*) => {
        if cfg!(any(test, debug_assertions, feature = "test-utils")) {
            assert_eq!($($arg)*);
        }
    };
}

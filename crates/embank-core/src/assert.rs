//! `strict_assert!`: checked in tests and debug builds, free in release builds.
//!
//! Use it for invariants on hot paths (a row read back has the key we asked
//! for). Invariants that guard persistent data use plain `assert!` or return
//! [`crate::ErrorKind::Corrupt`].

#[macro_export]
macro_rules! strict_assert {
    ($($arg:tt)*) => {
        if cfg!(any(test, debug_assertions, feature = "test-utils")) {
            assert!($($arg)*);
        }
    };
}

#[macro_export]
macro_rules! strict_assert_eq {
    ($($arg:tt)*) => {
        if cfg!(any(test, debug_assertions, feature = "test-utils")) {
            assert_eq!($($arg)*);
        }
    };
}

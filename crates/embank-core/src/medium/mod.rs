//! Persistent media (tier T2): where row records live.
//!
//! `mmap`: a byte-addressable file mapped into memory (persistent memory, CXL
//! memory, DAX, or the page cache). Rows are copy-on-write records; a record
//! replaced or deleted is reclaimed once no reader can still see it.

pub mod mmap;

pub use mmap::MmapMedium;

//! Persistent media (tier T2): where row records live.
//!
//! `mmap`: a byte-addressable file mapped into memory (persistent memory, CXL
//! memory, DAX, or the page cache). `block`: a data file on an SSD read and
//! written with `O_DIRECT` through io_uring (or a pread pool). On both, rows
//! are copy-on-write records; a record replaced or deleted is reclaimed once
//! no reader can still see it (`alloc.rs`).

pub mod alloc;
pub mod block;
pub mod mmap;

pub use alloc::RecordAlloc;
pub use block::{BlockMedium, ReadItem};
pub use mmap::MmapMedium;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Which medium a table's rows live on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediumKind {
    /// A memory-mapped file (the default).
    #[default]
    Mmap,
    /// A data file read with O_DIRECT through io_uring, under the DRAM row cache.
    Block,
}

impl MediumKind {
    pub fn parse(s: &str) -> Result<MediumKind> {
        match s {
            "mmap" => Ok(MediumKind::Mmap),
            "block" => Ok(MediumKind::Block),
            other => Err(Error::config(format!("unknown medium {other:?}: use mmap or block"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MediumKind::Mmap => "mmap",
            MediumKind::Block => "block",
        }
    }
}

/// A table's medium.
pub enum Medium {
    Mmap(MmapMedium),
    Block(BlockMedium),
}

impl Medium {
    pub fn alloc(&self) -> &RecordAlloc {
        match self {
            Medium::Mmap(m) => m.alloc(),
            Medium::Block(m) => m.alloc(),
        }
    }

    pub fn dim(&self) -> usize {
        match self {
            Medium::Mmap(m) => m.dim(),
            Medium::Block(m) => m.dim(),
        }
    }

    /// Reads rows into `out` (see [`BlockMedium::read`]); on the mmap medium a copy.
    pub fn read(&self, items: &[ReadItem], out: &mut [f32]) -> Result<()> {
        match self {
            Medium::Block(m) => m.read(items, out),
            Medium::Mmap(m) => {
                let dim = m.dim();
                for it in items {
                    if m.key_at(it.ptr) != it.key {
                        return Err(Error::corrupt(format!(
                            "record at offset {} holds key {}, the index says {}",
                            it.ptr,
                            m.key_at(it.ptr),
                            it.key
                        )));
                    }
                    out[it.pos * dim..(it.pos + 1) * dim].copy_from_slice(m.row_at(it.ptr));
                }
                Ok(())
            }
        }
    }

    /// Writes unpublished records `(key, ptr, row)`.
    pub fn write(&self, items: &[(u64, u64, &[f32])]) -> Result<()> {
        match self {
            Medium::Block(m) => m.write(items),
            Medium::Mmap(m) => {
                for &(key, ptr, row) in items {
                    m.write_row(ptr, key, row);
                }
                Ok(())
            }
        }
    }

    /// True when the record at `ptr` holds `key` (and, with `checksum`, matches its checksum).
    pub fn check(&self, ptr: u64, key: u64, checksum: bool) -> Result<bool> {
        match self {
            Medium::Mmap(m) => Ok(m.key_at(ptr) == key && (!checksum || m.checksum_ok(ptr))),
            Medium::Block(m) => m.check(ptr, key),
        }
    }

    pub fn flush(&self) -> Result<()> {
        match self {
            Medium::Mmap(m) => m.flush(),
            Medium::Block(m) => m.flush(),
        }
    }

    pub fn kind(&self) -> MediumKind {
        match self {
            Medium::Mmap(_) => MediumKind::Mmap,
            Medium::Block(_) => MediumKind::Block,
        }
    }
}

//! Indexes of format 1 and 2 (14 slots of `(key, row byte offset)` a bucket, 18.3 bytes
//! a slot), converted to format 3 on their first open by this build: read once in file
//! order, every key inserted into a new index of as many slots, which replaces the old
//! file by a rename. Only a cleanly closed index converts: one a killed process left
//! needs the repair and rollback of the build that wrote it.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::bucket::{BUCKET_BYTES, SLOTS_PER_BUCKET};
use super::build::fits_in_memory;
use super::Index;
use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{self, IndexHeader, RowUnits, INDEX_HEADER_BYTES};

/// Slots of a format 1 or 2 bucket, from byte 24 (after the version, the overflow
/// counter and 16 bytes of fingerprints), 16 bytes each.
const LEGACY_SLOTS: usize = 14;
const LEGACY_SLOTS_AT: usize = 24;
/// Buckets read at a time.
const READ_BUCKETS: usize = 16 * 1024;

/// Converts the index at `path` to format 3 if it is of format 1 or 2; its rows lie at
/// `units`. A no-op for a format 3 index.
pub(super) fn convert_if_legacy(path: &Path, units: RowUnits) -> Result<()> {
    let mut file = File::open(path).map_err(|e| io_at("cannot open index file", path, e))?;
    let mut head = vec![0u8; INDEX_HEADER_BYTES];
    if file.read_exact(&mut head).is_err() {
        // Too short: `Index::open` says so.
        return Ok(());
    }
    let header = IndexHeader::read(&head).map_err(|e| e.context(path.display().to_string()))?;
    if header.units.is_some() {
        return Ok(());
    }
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let state = u32::from_le_bytes(head[format::INDEX_STATE_OFFSET..][..4].try_into().expect("4 bytes"));
    if state != format::STATE_CLEAN {
        return Err(Error::new(
            ErrorKind::FormatVersion,
            "this index (format 1 or 2, from an embank before 17-slot buckets) was not closed cleanly: \
             open the store once with the embank that wrote it, so it repairs it, then with this one, which converts it",
        )
        .context(path.display().to_string()));
    }
    let (keys, free_generation) = (word(format::INDEX_LEN_OFFSET), word(format::INDEX_FREE_GENERATION_OFFSET));
    let t0 = Instant::now();
    let tmp = converting_path(path);
    let _ = std::fs::remove_file(&tmp);
    // As many slots as before: the table's own growth decides when it needs more.
    let mut buckets = (header.bucket_count * LEGACY_SLOTS as u64).div_ceil(SLOTS_PER_BUCKET as u64);
    let index = loop {
        let index = if fits_in_memory(buckets) {
            Index::create_in_memory(&tmp, buckets, header.seed, units)?
        } else {
            Index::create(&tmp, buckets, header.seed, units)?
        };
        match fill(&index, &mut file, path, header.bucket_count, units) {
            Ok(true) => break index,
            // A key found no slot within its probe limit: more buckets.
            Ok(false) => buckets *= 2,
            Err(e) => {
                drop(index);
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        }
        drop(index);
        let _ = std::fs::remove_file(&tmp);
    };
    if index.len() != keys {
        drop(index);
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::corrupt(format!(
            "index of format 1 or 2 says it holds {keys} keys, its slots hold another count"
        ))
        .context(path.display().to_string()));
    }
    let index = index.persist().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    index.mark_closed(free_generation)?;
    drop(index);
    std::fs::rename(&tmp, path).map_err(|e| io_at("cannot replace index file", path, e))?;
    if let Some(dir) = path.parent() {
        crate::fsutil::sync_dir(dir)?;
    }
    tracing::info!(
        index = %path.display(),
        keys,
        buckets_from = header.bucket_count,
        buckets_to = buckets,
        seconds = t0.elapsed().as_secs_f64(),
        "index converted from format 1/2 to format 3 (17 slots a bucket)"
    );
    Ok(())
}

/// Where a conversion builds the new index before it replaces the old.
fn converting_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".converting");
    path.with_file_name(name)
}

/// Inserts every key of the legacy file into `index`; false when one found no slot.
fn fill(index: &Index, file: &mut File, path: &Path, bucket_count: u64, units: RowUnits) -> Result<bool> {
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(INDEX_HEADER_BYTES as u64)).map_err(|e| io_at("cannot read index file", path, e))?;
    let mut buf = vec![0u8; READ_BUCKETS * BUCKET_BYTES];
    let mut left = bucket_count;
    while left > 0 {
        let n = left.min(READ_BUCKETS as u64) as usize;
        let chunk = &mut buf[..n * BUCKET_BYTES];
        file.read_exact(chunk).map_err(|e| io_at("cannot read index file", path, e))?;
        for bucket in chunk.chunks_exact(BUCKET_BYTES) {
            for slot in 0..LEGACY_SLOTS {
                if bucket[8 + slot] == 0 {
                    continue;
                }
                let at = LEGACY_SLOTS_AT + 16 * slot;
                let key = u64::from_le_bytes(bucket[at..at + 8].try_into().expect("8 bytes"));
                let ptr = u64::from_le_bytes(bucket[at + 8..at + 16].try_into().expect("8 bytes"));
                let off = ptr.wrapping_sub(units.base);
                if ptr < units.base || off % units.unit != 0 || off / units.unit >= RowUnits::ROWS_MAX {
                    return Err(Error::corrupt(format!("key {key} points at byte {ptr}, not a row of {units:?}"))
                        .context(path.display().to_string()));
                }
                let hash = index.hash(key);
                if index.get(key, hash).is_some() {
                    return Err(
                        Error::corrupt(format!("key {key} is in two slots")).context(path.display().to_string())
                    );
                }
                if !index.insert_new(key, hash, ptr)? {
                    return Ok(false);
                }
            }
        }
        left -= n as u64;
    }
    Ok(true)
}

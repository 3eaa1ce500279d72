//! One update-stream message, byte by byte (docs/FORMAT.md, "Update stream messages").
//! Little-endian throughout:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `EBUP` |
//! | 4 | 2 | version (1) |
//! | 6 | 1 | kind: 1 rows, 2 deletes, 3 commit, 4 reset |
//! | 7 | 1 | dtype of the rows: the record format's code (`DType::code`), 1 = f32; 0, an older f32, is read too |
//! | 8 | 8 | checkpoint seq on the publishing store |
//! | 16 | 8 | checkpoint batch id |
//! | 24 | 8 | checkpoint time, microseconds since the Unix epoch |
//! | 32 | 4 | dim (0 for deletes and commits) |
//! | 36 | 4 | count: keys (rows, deletes); messages before it in this checkpoint and partition (commit) |
//! | 40 | 2 | table name length n (0 for commits) |
//! | 42 | n | table name, UTF-8 |
//! | 42+n | 8·count | keys (rows, deletes) |
//! | … | 4·count·dim | rows, row-major (rows only) |
//! | end−4 | 4 | CRC-32C of every byte before it |

use embank_core::{DType, Error, ErrorKind, Result, DIM_MAX};

pub const MAGIC: [u8; 4] = *b"EBUP";
pub const VERSION: u16 = 1;
/// Bytes before the table name.
pub const HEADER_BYTES: usize = 42;
/// Smallest message bound a publisher accepts: one row of the widest table fits.
pub const MESSAGE_BYTES_MIN: usize = 4 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Rows of a table at the checkpoint (insert or replace).
    Rows = 1,
    /// Keys of a table absent at the checkpoint.
    Deletes = 2,
    /// The checkpoint is complete in this partition: apply it.
    Commit = 3,
    /// What follows for the table in this checkpoint is all of it (a full snapshot, sent
    /// first and after the publisher lost its place): at the commit, keys it did not bring
    /// are deleted (the replica keeps serving the others meanwhile).
    Reset = 4,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Rows,
            2 => Kind::Deletes,
            3 => Kind::Commit,
            4 => Kind::Reset,
            _ => return None,
        })
    }
}

/// Which checkpoint a message belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CheckpointId {
    pub seq: u64,
    pub batch_id: u64,
    pub unix_micros: u64,
}

/// A decoded message (borrowing nothing: keys and rows are copied out once).
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub kind: Kind,
    pub checkpoint: CheckpointId,
    pub table: String,
    pub dim: u32,
    /// Commit: how many messages of this checkpoint came before it in the partition.
    pub count: u32,
    pub keys: Vec<u64>,
    pub rows: Vec<f32>,
}

fn header(out: &mut Vec<u8>, kind: Kind, ck: CheckpointId, dim: u32, count: u32, table: &str) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind as u8);
    out.push(DType::F32.code());
    out.extend_from_slice(&ck.seq.to_le_bytes());
    out.extend_from_slice(&ck.batch_id.to_le_bytes());
    out.extend_from_slice(&ck.unix_micros.to_le_bytes());
    out.extend_from_slice(&dim.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&(table.len() as u16).to_le_bytes());
    out.extend_from_slice(table.as_bytes());
}

/// The CRC-32C a message ends with, of the bytes before it.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let crc = checksum(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Keys of one rows message of a table of `dim` under a bound of `message_bytes`.
pub fn rows_per_message(message_bytes: usize, table: &str, dim: usize) -> usize {
    let room = message_bytes.saturating_sub(HEADER_BYTES + table.len() + 4);
    (room / (8 + 4 * dim)).max(1)
}

/// Keys of one deletes message under a bound of `message_bytes`.
pub fn deletes_per_message(message_bytes: usize, table: &str) -> usize {
    rows_per_message(message_bytes, table, 0)
}

pub fn encode_rows(ck: CheckpointId, table: &str, dim: usize, keys: &[u64], rows: &[f32]) -> Vec<u8> {
    debug_assert_eq!(rows.len(), keys.len() * dim);
    let mut out = Vec::with_capacity(HEADER_BYTES + table.len() + keys.len() * (8 + 4 * dim) + 4);
    header(&mut out, Kind::Rows, ck, dim as u32, keys.len() as u32, table);
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    for x in rows {
        out.extend_from_slice(&x.to_le_bytes());
    }
    seal(out)
}

pub fn encode_deletes(ck: CheckpointId, table: &str, keys: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + table.len() + keys.len() * 8 + 4);
    header(&mut out, Kind::Deletes, ck, 0, keys.len() as u32, table);
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    seal(out)
}

pub fn encode_reset(ck: CheckpointId, table: &str, dim: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + table.len() + 4);
    header(&mut out, Kind::Reset, ck, dim as u32, 0, table);
    seal(out)
}

/// The commit marker of a checkpoint in one partition, after `before` messages of it.
pub fn encode_commit(ck: CheckpointId, before: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + 4);
    header(&mut out, Kind::Commit, ck, 0, before, "");
    seal(out)
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::InvalidInput, format!("update message: {what}"))
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Decodes and checks one message: magic, version, kind, lengths, checksum, name.
pub fn decode(b: &[u8]) -> Result<Message> {
    if b.len() < HEADER_BYTES + 4 {
        return Err(bad(format!("{} bytes is shorter than a header", b.len())));
    }
    if b[..4] != MAGIC {
        return Err(bad("bad magic (not an embank update stream?)"));
    }
    let version = u16_at(b, 4);
    if version != VERSION {
        return Err(bad(format!("version {version}; this embank reads version {VERSION}")));
    }
    let (body, tail) = b.split_at(b.len() - 4);
    let crc = u32::from_le_bytes(tail.try_into().unwrap());
    if crc32c::crc32c(body) != crc {
        return Err(Error::new(ErrorKind::ChecksumMismatch, "update message: checksum mismatch"));
    }
    let kind = Kind::from_u8(b[6]).ok_or_else(|| bad(format!("unknown kind {}", b[6])))?;
    // Rows travel as f32 (a compact table publishes them de-quantized); 0 is how
    // messages written before the codes were the record's spelled it.
    if b[7] != 0 && b[7] != DType::F32.code() {
        return Err(bad(format!("unknown dtype {}", b[7])));
    }
    let checkpoint = CheckpointId { seq: u64_at(b, 8), batch_id: u64_at(b, 16), unix_micros: u64_at(b, 24) };
    let dim = u32_at(b, 32);
    let count = u32_at(b, 36);
    let name_len = u16_at(b, 40) as usize;
    if dim > DIM_MAX {
        return Err(bad(format!("dim {dim} is over {DIM_MAX}")));
    }
    let name_end = HEADER_BYTES + name_len;
    if name_end > body.len() {
        return Err(bad("table name runs past the message"));
    }
    let table =
        std::str::from_utf8(&b[HEADER_BYTES..name_end]).map_err(|_| bad("table name is not UTF-8"))?.to_string();
    let (nkeys, row_elems) = match kind {
        Kind::Rows => (count as usize, count as usize * dim as usize),
        Kind::Deletes => (count as usize, 0),
        Kind::Commit | Kind::Reset => (0, 0),
    };
    if kind != Kind::Commit && table.is_empty() {
        return Err(bad(format!("{kind:?} message names no table")));
    }
    // Fields a kind does not use must be zero: one message has one encoding.
    if kind == Kind::Commit && !table.is_empty() {
        return Err(bad("a commit names a table"));
    }
    if matches!(kind, Kind::Deletes | Kind::Commit) && dim != 0 {
        return Err(bad(format!("{kind:?} message has dim {dim}")));
    }
    if kind == Kind::Reset && count != 0 {
        return Err(bad(format!("reset message has count {count}")));
    }
    if matches!(kind, Kind::Rows | Kind::Reset) && dim == 0 {
        return Err(bad(format!("{kind:?} message of table {table:?} has dim 0")));
    }
    let want = name_end as u64 + 8 * nkeys as u64 + 4 * row_elems as u64;
    if want != body.len() as u64 {
        return Err(bad(format!("{kind:?} message of {} bytes should have {want} before its checksum", body.len())));
    }
    let keys = body[name_end..name_end + 8 * nkeys]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let rows =
        body[name_end + 8 * nkeys..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    Ok(Message { kind, checkpoint, table, dim, count, keys, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CK: CheckpointId = CheckpointId { seq: 7, batch_id: 700, unix_micros: 1_700_000_000_000_000 };

    #[test]
    fn every_kind_roundtrips() {
        let m = decode(&encode_rows(CK, "user", 2, &[1, 2], &[0.5, 1.5, -2.0, 3.0])).unwrap();
        assert_eq!((m.kind, m.checkpoint, m.table.as_str(), m.dim, m.count), (Kind::Rows, CK, "user", 2, 2));
        assert_eq!((m.keys, m.rows), (vec![1, 2], vec![0.5, 1.5, -2.0, 3.0]));
        let m = decode(&encode_deletes(CK, "user", &[9])).unwrap();
        assert_eq!((m.kind, m.keys.as_slice()), (Kind::Deletes, &[9u64][..]));
        let m = decode(&encode_commit(CK, 12)).unwrap();
        assert_eq!((m.kind, m.count, m.table.as_str()), (Kind::Commit, 12, ""));
        let m = decode(&encode_reset(CK, "item", 16)).unwrap();
        assert_eq!((m.kind, m.dim), (Kind::Reset, 16));
    }

    #[test]
    fn layout_matches_the_documented_offsets() {
        let b = encode_rows(CK, "ab", 1, &[0x0102], &[1.0]);
        assert_eq!(&b[..4], b"EBUP");
        assert_eq!((b[6], b[7]), (1, DType::F32.code()));
        assert_eq!(u64_at(&b, 8), 7);
        assert_eq!(u64_at(&b, 16), 700);
        assert_eq!((u32_at(&b, 32), u32_at(&b, 36), u16_at(&b, 40)), (1, 1, 2));
        assert_eq!(&b[42..44], b"ab");
        assert_eq!(u64_at(&b, 44), 0x0102);
        assert_eq!(b.len(), 44 + 8 + 4 + 4);
    }

    #[test]
    fn damage_is_refused_with_a_reason() {
        let good = encode_rows(CK, "user", 2, &[1, 2], &[0.5, 1.5, -2.0, 3.0]);
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x40;
            assert!(decode(&b).is_err(), "a flipped bit at byte {i} was accepted");
        }
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err(), "a message cut to {n} bytes was accepted");
        }
        assert!(decode(&good[..10]).unwrap_err().to_string().contains("shorter"));
        // Unused fields must be zero (a fuzz finding: a commit naming a table decoded).
        let mut commit = encode_commit(CK, 1)[..HEADER_BYTES].to_vec();
        commit[40] = 1;
        commit.push(b'x');
        assert!(decode(&seal(commit)).unwrap_err().to_string().contains("names a table"));
    }

    #[test]
    fn bounds_hold_a_row_at_least() {
        assert_eq!(rows_per_message(1 << 20, "t", 128), ((1 << 20) - 42 - 1 - 4) / (8 + 512));
        assert_eq!(rows_per_message(10, "t", 128), 1);
        let n = rows_per_message(MESSAGE_BYTES_MIN, "table", 4);
        let b = encode_rows(CK, "table", 4, &vec![1; n], &vec![0.0; n * 4]);
        assert!(b.len() <= MESSAGE_BYTES_MIN, "{} > {MESSAGE_BYTES_MIN}", b.len());
    }
}

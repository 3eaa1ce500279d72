//! On-disk formats: magics, versions, headers. `docs/FORMAT.md` describes
//! every byte; keep the two in step.
//!
//! All integers are little-endian. Every header carries a magic, a format
//! version and a CRC-32C over its fixed fields.

use crate::error::{Error, ErrorKind, Result};

/// Format version of every file this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Format version of an index file whose bucket count is not a power of two (sized to
/// its keys; its keys probe linearly: `hash::Geometry`). Versions 1 and 2 hold 14 slots
/// of `(key, row byte offset)` a bucket; this build converts them on open.
pub const INDEX_FORMAT_VERSION_ANY_COUNT: u32 = 2;
/// Format version of the index files this build writes: 17 slots a bucket, keys beside
/// their 32-bit row numbers (`index::bucket`), the rows' base and stride in the header.
pub const INDEX_FORMAT_VERSION: u32 = 3;

pub const INDEX_MAGIC: [u8; 8] = *b"EMBKIDX\0";
pub const ROWS_MAGIC: [u8; 8] = *b"EMBKROWS";
pub const BLOCK_ROWS_MAGIC: [u8; 8] = *b"EMBKBLKR";
pub const FREE_MAGIC: [u8; 8] = *b"EMBKFREE";
pub const CATALOG_MAGIC: &str = "embank-store";

/// Bytes of the index and rows file headers (one page, keeps buckets and rows aligned).
pub const INDEX_HEADER_BYTES: usize = 4096;
pub const ROWS_HEADER_BYTES: usize = 4096;

// Index header fields.
pub const INDEX_LEN_OFFSET: usize = 32;
pub const INDEX_STATE_OFFSET: usize = 40;
pub const INDEX_FREE_GENERATION_OFFSET: usize = 48;
/// 16 bytes: the kernel's boot id when the index was last opened (zero: unknown). A dirty
/// index opened again in the same boot was left by a killed process, whose writes all
/// reached the page cache; after a reboot the pages may be torn.
pub const INDEX_BOOT_ID_OFFSET: usize = 56;
/// Format 3: the row pointer of row number 0 (u64), then the stride (u64).
pub const INDEX_ROW_UNITS_OFFSET: usize = 72;

/// `state` word: closed cleanly.
pub const STATE_CLEAN: u32 = 0;
/// `state` word: in use, or its user died.
pub const STATE_OPEN: u32 = 1;

// Rows header fields.
pub const ROWS_NEXT_RECORD_OFFSET: usize = 32;

/// Bytes before a row's elements: key u64, crc32c u32, flags u32.
pub const ROW_HEADER_BYTES: usize = 16;

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn check_magic_version(b: &[u8], magic: &[u8; 8], what: &str) -> Result<()> {
    if &b[0..8] != magic {
        return Err(Error::new(ErrorKind::Recover, format!("not an embank {what} file (bad magic)")));
    }
    let version = le_u32(b, 8);
    if version != FORMAT_VERSION {
        return Err(Error::new(
            ErrorKind::FormatVersion,
            format!("{what} file has format version {version}; this build reads version {FORMAT_VERSION}"),
        ));
    }
    Ok(())
}

/// How an index's 32-bit row numbers map to the row pointers (byte offsets in the rows
/// file) its callers see: `pointer = base + number * unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowUnits {
    pub base: u64,
    pub unit: u64,
}

impl RowUnits {
    /// Pointers that are the numbers themselves (the index's unit tests).
    #[cfg(test)]
    pub const IDENTITY: RowUnits = RowUnits { base: 0, unit: 1 };

    /// Rows of `stride` bytes after a rows-file header.
    #[cfg(test)]
    pub fn rows(stride: u64) -> RowUnits {
        RowUnits { base: ROWS_HEADER_BYTES as u64, unit: stride }
    }

    /// Rows a 32-bit row number can name: a table's rows file holds at most this many.
    pub const ROWS_MAX: u64 = 1 << 32;
}

/// Fixed fields of an index file header.
///
/// ```text
///  0  magic "EMBKIDX\0"      8  format version u32   12 header bytes u32 (4096)
/// 16  bucket count u64      24  hash seed u64
/// 32  live keys u64 (*)     40  state u32 (*)        44 crc32c u32 (**)
/// 48  free-list generation u64 (*)                   56 boot id, 16 bytes (*)
/// 72  row units: base u64   80  unit u64             (format 3)
/// (*) updated in place while the index is open
/// (**) of bytes 0..32, and in format 3 of bytes 72..88 after them
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexHeader {
    pub bucket_count: u64,
    pub seed: u64,
    /// `None` in a version 1 or 2 header (its slots hold row pointers).
    pub units: Option<RowUnits>,
}

impl IndexHeader {
    pub fn new(bucket_count: u64, seed: u64, units: RowUnits) -> Self {
        IndexHeader { bucket_count, seed, units: Some(units) }
    }

    fn crc(b: &[u8], version: u32) -> u32 {
        let crc = crc32c::crc32c(&b[0..32]);
        match version {
            INDEX_FORMAT_VERSION => crc32c::crc32c_append(crc, &b[INDEX_ROW_UNITS_OFFSET..INDEX_ROW_UNITS_OFFSET + 16]),
            _ => crc,
        }
    }

    pub fn write(&self, b: &mut [u8]) {
        let units = self.units.expect("this build writes format 3 index headers");
        b[0..8].copy_from_slice(&INDEX_MAGIC);
        b[8..12].copy_from_slice(&INDEX_FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(INDEX_HEADER_BYTES as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.bucket_count.to_le_bytes());
        b[24..32].copy_from_slice(&self.seed.to_le_bytes());
        b[32..40].copy_from_slice(&0u64.to_le_bytes());
        b[40..44].copy_from_slice(&STATE_OPEN.to_le_bytes());
        b[48..56].copy_from_slice(&0u64.to_le_bytes());
        let at = INDEX_ROW_UNITS_OFFSET;
        b[at..at + 8].copy_from_slice(&units.base.to_le_bytes());
        b[at + 8..at + 16].copy_from_slice(&units.unit.to_le_bytes());
        let crc = Self::crc(b, INDEX_FORMAT_VERSION);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
    }

    pub fn read(b: &[u8]) -> Result<Self> {
        if b[0..8] != INDEX_MAGIC {
            return Err(Error::new(ErrorKind::Recover, "not an embank index file (bad magic)"));
        }
        let version = le_u32(b, 8);
        if !matches!(version, FORMAT_VERSION | INDEX_FORMAT_VERSION_ANY_COUNT | INDEX_FORMAT_VERSION) {
            return Err(Error::new(
                ErrorKind::FormatVersion,
                format!(
                    "index file has format version {version}; this build reads versions 1 to {INDEX_FORMAT_VERSION}"
                ),
            ));
        }
        if Self::crc(b, version) != le_u32(b, 44) {
            return Err(Error::new(ErrorKind::ChecksumMismatch, "index header checksum mismatch"));
        }
        let bucket_count = le_u64(b, 16);
        // Versions 1 and 2 told power-of-two bucket counts from others.
        let legacy_version =
            if bucket_count.is_power_of_two() { FORMAT_VERSION } else { INDEX_FORMAT_VERSION_ANY_COUNT };
        if bucket_count == 0 || (version != INDEX_FORMAT_VERSION && version != legacy_version) {
            return Err(Error::new(
                ErrorKind::Recover,
                format!("index header of format version {version} names {bucket_count} buckets"),
            ));
        }
        let units = (version == INDEX_FORMAT_VERSION)
            .then(|| RowUnits { base: le_u64(b, INDEX_ROW_UNITS_OFFSET), unit: le_u64(b, INDEX_ROW_UNITS_OFFSET + 8) });
        // A stride is at most a few tens of KiB (DIM_MAX f32 values and their state), the
        // base a header: bounds that keep `base + number * stride` far inside a u64.
        if units.is_some_and(|u| u.unit == 0 || u.unit > 1 << 24 || u.base > 1 << 32) {
            return Err(Error::new(ErrorKind::Recover, format!("index header names rows at {units:?}")));
        }
        Ok(IndexHeader { bucket_count, seed: le_u64(b, 24), units })
    }
}

/// Element type of a table's stored rows. The API takes and returns `f32` for
/// every type; optimizer state is always stored as `f32`.
///
/// - `f32`: IEEE single, stored as given.
/// - `f16`: IEEE half; `f32 -> f16` rounds to nearest, ties to even (values past
///   65504 become infinities, tiny ones subnormals or zero).
/// - `int8`: row-wise asymmetric 8-bit quantization (the "fused 8-bit rowwise"
///   layout of inference tables): `dim` unsigned bytes `q`, then an `f32` scale
///   and an `f32` bias. See [`RecordLayout`](crate::RecordLayout) for the exact formula.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    Int8,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Int8];

    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::Int8 => 3,
        }
    }

    pub fn from_code(code: u8) -> Result<Self> {
        match code {
            1 => Ok(DType::F32),
            2 => Ok(DType::F16),
            3 => Ok(DType::Int8),
            other => Err(Error::new(ErrorKind::Unsupported, format!("unknown element type code {other}"))),
        }
    }

    /// Bytes one row of `dim` elements takes as stored (an `int8` row adds its scale and bias).
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            DType::F32 => dim * 4,
            DType::F16 => dim * 2,
            DType::Int8 => dim + 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Int8 => "int8",
        }
    }

    /// Parses `f32`, `f16` or `int8` (also `float32`, `float16` and `half`, which name the
    /// same types everywhere). Anything else is refused, naming the choices: numpy's
    /// `float` is 64-bit and its `i8`/`u8` are 8-byte integers, and `uint8` would suggest
    /// raw bytes where `int8` means rows quantized with a scale and bias.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "int8" => Ok(DType::Int8),
            _ => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "unknown dtype {s:?}: expected f32, f16 or int8 (int8: 8-bit codes with an f32 scale and bias per row)"
                ),
            )),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes from one row record to the next for a record payload of `payload` bytes (what
/// a new table's rows file is created with; a file's header keeps its own, so tables
/// made under another rule read as they are): header plus payload, rounded up to 16
/// bytes. An `f32` record of a cache line or more that would then touch one line more
/// than it needs wherever it starts (records start at every multiple of
/// `gcd(stride, 64)` within a line) is rounded up to whole 64-byte lines instead: dim
/// 16 takes 80 bytes, dim 64 272, dim 128 528 (2, 5 and 9 lines, as when line-aligned),
/// dim 24 128 (packed to 112, a quarter of them would touch 3 lines). Compact element
/// types (`f16`, `int8`) stay packed to 16 bytes: density is what they are for.
pub fn record_stride(payload: usize, dtype: DType) -> u32 {
    let raw = (ROW_HEADER_BYTES + payload) as u32;
    let packed = raw.div_ceil(16) * 16;
    if raw < 64 || dtype != DType::F32 {
        return packed;
    }
    let lines = raw.div_ceil(64);
    // The latest a record starts within a line: 64 - gcd(packed, 64) (0 when packed
    // records start on lines).
    let start_latest = 64 - (1u32 << packed.trailing_zeros().min(6));
    if start_latest + raw <= lines * 64 {
        packed
    } else {
        lines * 64
    }
}

/// Bytes from one record to the next on the block medium: header plus payload,
/// rounded up to the direct-I/O alignment `align`, so each row is one read.
pub fn block_stride(payload: usize, align: u32) -> u32 {
    ((ROW_HEADER_BYTES + payload) as u32).div_ceil(align) * align
}

/// Fixed fields of a rows file header (the block medium's `rows.ebb` has the
/// same layout with magic "EMBKBLKR" and a stride from [`block_stride`]).
///
/// ```text
///  0  magic "EMBKROWS"      8  format version u32    12 header bytes u32 (4096)
/// 16  elements u32 (*)     20  dtype u8, 3 zero bytes
/// 24  record stride u32    28  crc32c of bytes 0..28 u32
/// 32  next record u64 (**): records [0, next) have been handed out
/// ```
///
/// (*) The `f32`s of a decoded record: the row's dim plus its optimizer state.
/// The payload size follows from the catalog's layout, which the opener checks
/// the stride against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsHeader {
    pub dim: u32,
    pub dtype: DType,
    pub stride: u32,
}

impl RowsHeader {
    pub fn write(&self, b: &mut [u8]) {
        self.write_as(b, &ROWS_MAGIC)
    }

    pub fn write_as(&self, b: &mut [u8], magic: &[u8; 8]) {
        b[0..8].copy_from_slice(magic);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(ROWS_HEADER_BYTES as u32).to_le_bytes());
        b[16..20].copy_from_slice(&self.dim.to_le_bytes());
        b[20..24].copy_from_slice(&[self.dtype.code(), 0, 0, 0]);
        b[24..28].copy_from_slice(&self.stride.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b[32..40].copy_from_slice(&0u64.to_le_bytes());
    }

    pub fn read(b: &[u8]) -> Result<Self> {
        let header = Self::read_as(b, &ROWS_MAGIC, "rows")?;
        if !header.stride.is_multiple_of(16) || (header.stride as usize) <= ROW_HEADER_BYTES {
            return Err(Error::new(ErrorKind::Recover, format!("rows header stride {} is malformed", header.stride)));
        }
        Ok(header)
    }

    /// Reads a block-medium header; its stride must be a multiple of 512 holding a record.
    pub fn read_block(b: &[u8]) -> Result<Self> {
        let header = Self::read_as(b, &BLOCK_ROWS_MAGIC, "block rows")?;
        if !header.stride.is_multiple_of(512) || header.stride == 0 {
            return Err(Error::new(ErrorKind::Recover, "block rows header stride does not fit its dim"));
        }
        Ok(header)
    }

    fn read_as(b: &[u8], magic: &[u8; 8], what: &str) -> Result<Self> {
        check_magic_version(b, magic, what)?;
        if crc32c::crc32c(&b[0..28]) != le_u32(b, 28) {
            return Err(Error::new(ErrorKind::ChecksumMismatch, format!("{what} header checksum mismatch")));
        }
        Ok(RowsHeader { dim: le_u32(b, 16), dtype: DType::from_code(b[20])?, stride: le_u32(b, 24) })
    }
}

/// A saved free list: which row records are free, written at a clean close.
///
/// ```text
///  0 magic "EMBKFREE"   8 format version u32   12 crc32c of everything after byte 16 u32
/// 16 generation u64    24 count u64           32 count record numbers, u64 each
/// ```
pub fn encode_free_list(generation: u64, records: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(32 + records.len() * 8);
    b.extend_from_slice(&FREE_MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&generation.to_le_bytes());
    b.extend_from_slice(&(records.len() as u64).to_le_bytes());
    for r in records {
        b.extend_from_slice(&r.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b[16..]);
    b[12..16].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Reads a saved free list; returns its generation and records.
pub fn decode_free_list(b: &[u8]) -> Result<(u64, Vec<u64>)> {
    if b.len() < 32 {
        return Err(Error::new(ErrorKind::Recover, "free list file is truncated"));
    }
    check_magic_version(b, &FREE_MAGIC, "free list")?;
    if crc32c::crc32c(&b[16..]) != le_u32(b, 12) {
        return Err(Error::new(ErrorKind::ChecksumMismatch, "free list checksum mismatch"));
    }
    let generation = le_u64(b, 16);
    let count = le_u64(b, 24) as usize;
    if b.len() != 32 + count * 8 {
        return Err(Error::new(ErrorKind::Recover, "free list length does not match its count"));
    }
    Ok((generation, (0..count).map(|i| le_u64(b, 32 + i * 8)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_damage() {
        let mut b = vec![0u8; 4096];
        let h = IndexHeader::new(64, 5, RowUnits::rows(80));
        h.write(&mut b);
        assert_eq!(IndexHeader::read(&b).unwrap(), h);
        b[17] ^= 1;
        assert_eq!(IndexHeader::read(&b).unwrap_err().kind(), ErrorKind::ChecksumMismatch);
        h.write(&mut b);
        b[INDEX_ROW_UNITS_OFFSET + 8] ^= 1;
        assert_eq!(IndexHeader::read(&b).unwrap_err().kind(), ErrorKind::ChecksumMismatch, "the stride is covered");
        // A version 2 header (CRC of bytes 0..32 only) reads without units.
        h.write(&mut b);
        b[8..12].copy_from_slice(&INDEX_FORMAT_VERSION_ANY_COUNT.to_le_bytes());
        b[16..24].copy_from_slice(&63u64.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..32]);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(IndexHeader::read(&b).unwrap(), IndexHeader { bucket_count: 63, seed: 5, units: None });
        h.write(&mut b);
        b[8] = 9;
        assert_eq!(IndexHeader::read(&b).unwrap_err().kind(), ErrorKind::FormatVersion);

        let r = RowsHeader { dim: 7, dtype: DType::F32, stride: record_stride(28, DType::F32) };
        r.write(&mut b);
        assert_eq!(RowsHeader::read(&b).unwrap(), r);
        b[0] = b'X';
        assert_eq!(RowsHeader::read(&b).unwrap_err().kind(), ErrorKind::Recover);
    }

    #[test]
    fn strides() {
        assert_eq!(record_stride(4, DType::F32), 32);
        assert_eq!(record_stride(32, DType::F32), 48, "under a line: packed");
        assert_eq!(record_stride(48, DType::F32), 64);
        assert_eq!(record_stride(64, DType::F32), 80, "dim 16: 2 lines either way");
        assert_eq!(record_stride(80, DType::F32), 96, "dim 20: starts at 0 or 32, 2 lines");
        assert_eq!(record_stride(96, DType::F32), 128, "dim 24: packed, one in four would touch 3 lines");
        assert_eq!(record_stride(256, DType::F32), 272);
        assert_eq!(record_stride(260, DType::F32), 288, "dim 64 with row-wise Adagrad's word");
        assert_eq!(record_stride(512, DType::F32), 528);
        assert_eq!(record_stride(16384, DType::F32), 16400);
        assert_eq!(record_stride(256, DType::F16), 272);
        assert_eq!(record_stride(136, DType::Int8), 160);
        // No f32 record touches more lines than its bytes need, wherever it starts.
        for payload in (4..4096).step_by(4) {
            let stride = record_stride(payload, DType::F32) as usize;
            let raw = ROW_HEADER_BYTES + payload;
            assert!(stride >= raw && stride.is_multiple_of(16), "payload {payload}: stride {stride}");
            if raw >= 64 {
                let lines = (0..64).map(|k| (k * stride % 64 + raw).div_ceil(64)).max().unwrap();
                assert_eq!(lines, raw.div_ceil(64), "payload {payload}: stride {stride} touches {lines} lines");
            }
        }
    }

    #[test]
    fn free_list_round_trip() {
        let b = encode_free_list(3, &[1, 5, 9]);
        assert_eq!(decode_free_list(&b).unwrap(), (3, vec![1, 5, 9]));
        let mut bad = b.clone();
        bad[40] ^= 1;
        assert_eq!(decode_free_list(&bad).unwrap_err().kind(), ErrorKind::ChecksumMismatch);
        assert!(decode_free_list(&b[..35]).is_err());
    }
}

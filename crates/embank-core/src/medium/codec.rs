//! The one record codec of both media: `key u64 | crc32c u32 | flags u32 |
//! payload`, the payload encoded by the table's [`RecordLayout`]. The checksum
//! covers the key's 8 bytes and the payload (not the flags, not the padding up
//! to the stride). Records are checked where they are read back: key first
//! (the index's word against the record's), then the checksum where asked.

use crate::error::{Error, ErrorKind, Result};
use crate::format::ROW_HEADER_BYTES;
use crate::layout::RecordLayout;

#[derive(Clone, Copy, Debug)]
pub struct RecordCodec {
    layout: RecordLayout,
    payload: usize,
}

impl RecordCodec {
    pub fn new(layout: RecordLayout) -> RecordCodec {
        RecordCodec { layout, payload: layout.payload_bytes() }
    }

    #[inline(always)]
    pub fn layout(&self) -> &RecordLayout {
        &self.layout
    }

    /// Bytes of header and payload (a record's stride may add padding).
    #[inline(always)]
    pub fn record_bytes(&self) -> usize {
        ROW_HEADER_BYTES + self.payload
    }

    /// Writes a whole record into `out` (at least `record_bytes()` long; the rest is
    /// left as it is).
    #[inline]
    pub fn encode(&self, out: &mut [u8], key: u64, record: &[f32]) {
        let (head, payload) = out[..self.record_bytes()].split_at_mut(ROW_HEADER_BYTES);
        self.layout.encode(record, payload);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&key.to_le_bytes()), payload);
        head[0..8].copy_from_slice(&key.to_le_bytes());
        head[8..12].copy_from_slice(&crc.to_le_bytes());
        head[12..16].fill(0);
    }

    /// The key a record holds.
    #[inline(always)]
    pub fn key(rec: &[u8]) -> u64 {
        u64::from_le_bytes(rec[0..8].try_into().expect("record header"))
    }

    /// True when the record's checksum matches its key and payload.
    #[inline]
    pub fn checksum_ok(&self, rec: &[u8]) -> bool {
        let stored = u32::from_le_bytes(rec[8..12].try_into().expect("record header"));
        crc32c::crc32c_append(crc32c::crc32c(&rec[0..8]), &rec[ROW_HEADER_BYTES..self.record_bytes()]) == stored
    }

    /// The stored payload of a record.
    #[inline(always)]
    pub fn payload<'a>(&self, rec: &'a [u8]) -> &'a [u8] {
        &rec[ROW_HEADER_BYTES..self.record_bytes()]
    }

    /// Decodes a record's payload into `out` (`elems()` `f32`s).
    #[inline(always)]
    pub fn decode(&self, rec: &[u8], out: &mut [f32]) {
        self.layout.decode(self.payload(rec), out)
    }

    /// Checks that `rec` (read from `ptr`) holds `key` and, with `checksum`, matches
    /// its checksum; the error says which and where (`place` names the file).
    pub fn verify(&self, rec: &[u8], key: u64, ptr: u64, checksum: bool, place: &dyn Fn() -> String) -> Result<()> {
        let held = Self::key(rec);
        if held != key {
            return Err(Error::corrupt(format!(
                "{}: record at offset {ptr} holds key {held}, the index says {key}",
                place()
            )));
        }
        if checksum && !self.checksum_ok(rec) {
            return Err(Error::new(
                ErrorKind::ChecksumMismatch,
                format!("{}: row of key {key} at offset {ptr} fails its checksum", place()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::DType;

    #[test]
    fn encode_check_decode_and_a_flipped_bit() {
        let c = RecordCodec::new(RecordLayout::new(4, 0, DType::F32));
        let mut rec = vec![0xAAu8; c.record_bytes() + 8];
        c.encode(&mut rec, 42, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(&rec[c.record_bytes()..], &[0xAA; 8], "padding is not touched");
        assert_eq!(RecordCodec::key(&rec), 42);
        assert!(c.checksum_ok(&rec));
        c.verify(&rec, 42, 4096, true, &|| "f".into()).unwrap();
        assert_eq!(c.verify(&rec, 43, 4096, true, &|| "f".into()).unwrap_err().kind(), ErrorKind::Corrupt);
        let mut out = [0f32; 4];
        c.decode(&rec, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
        rec[ROW_HEADER_BYTES + 3] ^= 0x10;
        assert!(!c.checksum_ok(&rec));
        assert_eq!(c.verify(&rec, 42, 4096, true, &|| "f".into()).unwrap_err().kind(), ErrorKind::ChecksumMismatch);
    }
}

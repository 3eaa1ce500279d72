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
        let crc = record_crc(key, self.encode_unsummed(out, key, record));
        out[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    /// [`encode`](Self::encode) of four records at once: their checksums run in
    /// lockstep (see [`record_crcs4`]). The four `outs` are distinct records.
    #[inline]
    pub fn encode4(&self, outs: [&mut [u8]; 4], keys: [u64; 4], records: [&[f32]; 4]) {
        let [o0, o1, o2, o3] = outs;
        let payloads = [
            self.encode_unsummed(o0, keys[0], records[0]),
            self.encode_unsummed(o1, keys[1], records[1]),
            self.encode_unsummed(o2, keys[2], records[2]),
            self.encode_unsummed(o3, keys[3], records[3]),
        ];
        let crcs = record_crcs4(keys, payloads);
        for (o, crc) in [o0, o1, o2, o3].into_iter().zip(crcs) {
            o[8..12].copy_from_slice(&crc.to_le_bytes());
        }
    }

    /// [`encode`](Self::encode) of every `(out, key, record)`, four at a time
    /// ([`encode4`](Self::encode4)); the outs are distinct records.
    pub fn encode_each<'o, 'r>(&self, mut items: impl Iterator<Item = (&'o mut [u8], u64, &'r [f32])>) {
        loop {
            match [items.next(), items.next(), items.next(), items.next()] {
                [Some(a), Some(b), Some(c), Some(d)] => {
                    self.encode4([a.0, b.0, c.0, d.0], [a.1, b.1, c.1, d.1], [a.2, b.2, c.2, d.2])
                }
                // Fewer than four left: one at a time.
                rest => {
                    for (out, key, record) in rest.into_iter().flatten() {
                        self.encode(out, key, record);
                    }
                    return;
                }
            }
        }
    }

    /// Writes a record's key, flags and payload, not its checksum; returns the payload.
    #[inline(always)]
    fn encode_unsummed<'o>(&self, out: &'o mut [u8], key: u64, record: &[f32]) -> &'o [u8] {
        let (head, payload) = out[..self.record_bytes()].split_at_mut(ROW_HEADER_BYTES);
        self.layout.encode(record, payload);
        head[0..8].copy_from_slice(&key.to_le_bytes());
        head[12..16].fill(0);
        payload
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
        record_crc(Self::key(rec), &rec[ROW_HEADER_BYTES..self.record_bytes()]) == stored
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

/// A record's checksum: CRC-32C of the key's 8 little-endian bytes, then the payload.
#[inline]
pub fn record_crc(key: u64, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&key.to_le_bytes()), payload)
}

/// [`record_crc`] of four records (payloads of one length). The CRC instruction takes
/// three cycles to give its result and can start one every cycle, so one record's
/// chain of them runs at a third of the speed four independent chains do; a push
/// checksums every record it writes (16 % of a fused step's push went to it).
pub fn record_crcs4(keys: [u64; 4], payloads: [&[u8]; 4]) -> [u32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        let len = payloads[0].len();
        if payloads.iter().all(|p| p.len() == len) && std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE 4.2 (checked just above).
            return unsafe { crcs4_sse42(keys, payloads) };
        }
    }
    [0, 1, 2, 3].map(|j| record_crc(keys[j], payloads[j]))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crcs4_sse42(keys: [u64; 4], payloads: [&[u8]; 4]) -> [u32; 4] {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    // CRC-32C as the crc32c crate computes it: state !0, the bytes, then inverted.
    let mut c = keys.map(|k| _mm_crc32_u64(u64::from(u32::MAX), k));
    let [w0, w1, w2, w3] = payloads.map(|p| p.chunks_exact(8));
    let tails = [w0.remainder(), w1.remainder(), w2.remainder(), w3.remainder()];
    let le = |x: &[u8]| u64::from_le_bytes(x.try_into().expect("8 bytes"));
    for (((a, b), d), e) in w0.zip(w1).zip(w2).zip(w3) {
        c[0] = _mm_crc32_u64(c[0], le(a));
        c[1] = _mm_crc32_u64(c[1], le(b));
        c[2] = _mm_crc32_u64(c[2], le(d));
        c[3] = _mm_crc32_u64(c[3], le(e));
    }
    for (c, tail) in c.iter_mut().zip(tails) {
        for &byte in tail {
            *c = u64::from(_mm_crc32_u8(*c as u32, byte));
        }
    }
    c.map(|x| !(x as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::DType;

    #[test]
    fn four_checksums_at_once_equal_one_at_a_time() {
        // Payload lengths with and without a tail of fewer than 8 bytes.
        for len in [0usize, 1, 7, 8, 13, 64, 130, 144] {
            let payloads: Vec<Vec<u8>> =
                (0..4u8).map(|j| (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(j * 7)).collect()).collect();
            let keys = [0, 1, u64::MAX, 0x0123_4567_89ab_cdef];
            let got = record_crcs4(keys, [&payloads[0], &payloads[1], &payloads[2], &payloads[3]]);
            for j in 0..4 {
                assert_eq!(got[j], record_crc(keys[j], &payloads[j]), "len {len} record {j}");
            }
        }
        // And encode4 writes what encode writes.
        for dtype in [DType::F32, DType::F16] {
            let c = RecordCodec::new(RecordLayout::new(5, 5, dtype));
            let rows: Vec<Vec<f32>> = (0..4).map(|j| (0..10).map(|i| (i * 4 + j) as f32 * 0.37).collect()).collect();
            let mut one = vec![vec![0x55u8; c.record_bytes()]; 4];
            for j in 0..4 {
                c.encode(&mut one[j], 100 + j as u64, &rows[j]);
            }
            let mut four = vec![vec![0x55u8; c.record_bytes()]; 4];
            let [a, b, d, e] = &mut four[..] else { unreachable!() };
            c.encode4([a, b, d, e], [100, 101, 102, 103], [&rows[0], &rows[1], &rows[2], &rows[3]]);
            assert_eq!(one, four, "{dtype:?}");
        }
    }

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

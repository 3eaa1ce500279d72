//! What a table's records hold, decided in one place: the row's `dim` and element
//! type, and the optimizer state after it.
//!
//! The API always takes and returns `f32`; a record is *decoded* into `elems()`
//! `f32`s (the row, then the optimizer state) and *encoded* into
//! `payload_bytes()` bytes on the medium by [`RecordLayout::encode`] /
//! [`RecordLayout::decode`]. Optimizer state is always stored as `f32`. Adding an
//! element type means a [`DType`] variant (code, name, bytes) and its arm in the
//! two functions below; media, cache, server and bindings size everything from
//! the layout.

use crate::catalog::TableMeta;
use crate::format::DType;

/// Layout of one table's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordLayout {
    /// Elements of a row as users see it.
    pub dim: usize,
    /// `f32`s of optimizer state stored after the row (0 without an optimizer).
    pub state_len: usize,
    /// Stored type of the row's elements.
    pub dtype: DType,
}

impl RecordLayout {
    pub fn new(dim: usize, state_len: usize, dtype: DType) -> RecordLayout {
        RecordLayout { dim, state_len, dtype }
    }

    /// The layout of a table's records from its catalog entry.
    pub fn of(meta: &TableMeta) -> RecordLayout {
        let dim = meta.dim as usize;
        RecordLayout::new(dim, meta.optimizer.state_len(dim), meta.dtype)
    }

    /// `f32`s of a decoded record: the row, then its optimizer state.
    #[inline(always)]
    pub fn elems(&self) -> usize {
        self.dim + self.state_len
    }

    /// Whether records carry optimizer state after the row.
    #[inline(always)]
    pub fn has_state(&self) -> bool {
        self.state_len > 0
    }

    /// Bytes of an encoded record's payload (after the record header).
    pub fn payload_bytes(&self) -> usize {
        self.dim * self.dtype.bytes() + self.state_len * 4
    }

    /// Bytes of one row's elements as stored (what zero-copy serving sends for `f32`).
    pub fn row_bytes(&self) -> usize {
        self.dim * self.dtype.bytes()
    }

    /// True when stored rows are the API's `f32`s byte for byte (zero-copy reads possible).
    pub fn rows_are_f32(&self) -> bool {
        self.dtype == DType::F32
    }

    /// Encodes a decoded record (`elems()` `f32`s) into `out` (`payload_bytes()` bytes).
    #[inline]
    pub fn encode(&self, record: &[f32], out: &mut [u8]) {
        debug_assert_eq!(record.len(), self.elems());
        debug_assert_eq!(out.len(), self.payload_bytes());
        match self.dtype {
            // Row and state are both f32: one copy of the little-endian bytes.
            DType::F32 => out.copy_from_slice(f32_bytes(record)),
        }
    }

    /// Decodes `payload` (`payload_bytes()` bytes) into `out` (`elems()` `f32`s).
    #[inline]
    pub fn decode(&self, payload: &[u8], out: &mut [f32]) {
        debug_assert_eq!(payload.len(), self.payload_bytes());
        debug_assert_eq!(out.len(), self.elems());
        match self.dtype {
            DType::F32 => f32_bytes_mut(out).copy_from_slice(payload),
        }
    }
}

/// The bytes of `f32`s as stored and sent: little-endian (embank builds only for
/// little-endian targets, see `lib.rs`).
#[inline(always)]
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialized bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Mutable bytes of `f32`s (every bit pattern is a valid `f32`).
#[inline(always)]
pub fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; any 4 bytes written form a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_records_roundtrip_byte_for_byte() {
        let l = RecordLayout::new(3, 3, DType::F32);
        assert_eq!((l.elems(), l.payload_bytes(), l.row_bytes()), (6, 24, 12));
        let rec = [1.0, -2.5, 3.25, 0.0, 1e-3, 7.0];
        let mut bytes = vec![0u8; l.payload_bytes()];
        l.encode(&rec, &mut bytes);
        assert_eq!(&bytes[4..8], &(-2.5f32).to_le_bytes());
        let mut back = [0f32; 6];
        l.decode(&bytes, &mut back);
        assert_eq!(back, rec);
    }
}

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
//!
//! Element types (stored row, then `f32` optimizer state):
//!
//! - `f32`: the little-endian bytes.
//! - `f16`: IEEE half per element; `f32 -> f16` rounds to nearest, ties to even
//!   (`half`'s conversion), so a stored value is within 2^-11 relative of the
//!   pushed one (for normal values up to 65504).
//! - `int8`: row-wise asymmetric quantization, `dim` bytes `q`, then `scale`
//!   and `bias` (`f32`):
//!
//!   ```text
//!   bias  = min(x)                      scale = (max(x) - min(x)) / 255
//!   q[i]  = clamp(round((x[i] - bias) / scale), 0, 255)   (0 when scale == 0)
//!   x'[i] = q[i] * scale + bias         (f32 multiply, then f32 add)
//!   ```
//!
//!   `round` is half away from zero. So `|x[i] - x'[i]| <= scale / 2` plus
//!   `f32` rounding (a few ulps of `max|x|`): the round-trip error is bounded by
//!   half a step, `(max - min) / 510`. Re-quantizing a de-quantized row gives the
//!   same values (in rare rows within 1e-4 of a step, from `f32` rounding of
//!   the recomputed scale). A row holding a NaN or an infinity stores NaN for
//!   every element (there is no finite scale for it).

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
        self.row_bytes() + self.state_len * 4
    }

    /// Bytes of one row as stored (what zero-copy serving sends for `f32`).
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.dim)
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
            DType::F16 => {
                let (row, state) = out.split_at_mut(self.dim * 2);
                encode_f16(&record[..self.dim], row);
                state.copy_from_slice(f32_bytes(&record[self.dim..]));
            }
            DType::Int8 => {
                let (row, state) = out.split_at_mut(self.dim + 8);
                encode_int8(&record[..self.dim], row);
                state.copy_from_slice(f32_bytes(&record[self.dim..]));
            }
        }
    }

    /// Decodes `payload` (`payload_bytes()` bytes) into `out` (`elems()` `f32`s).
    #[inline]
    pub fn decode(&self, payload: &[u8], out: &mut [f32]) {
        debug_assert_eq!(payload.len(), self.payload_bytes());
        debug_assert_eq!(out.len(), self.elems());
        match self.dtype {
            DType::F32 => f32_bytes_mut(out).copy_from_slice(payload),
            DType::F16 => {
                let (row, state) = payload.split_at(self.dim * 2);
                decode_f16(row, &mut out[..self.dim]);
                f32_bytes_mut(&mut out[self.dim..]).copy_from_slice(state);
            }
            DType::Int8 => {
                let (row, state) = payload.split_at(self.dim + 8);
                decode_int8(row, &mut out[..self.dim]);
                f32_bytes_mut(&mut out[self.dim..]).copy_from_slice(state);
            }
        }
    }

    /// Encodes a row alone (`dim` `f32`s, no optimizer state) into `out` (`row_bytes()`
    /// bytes): a row as stored, what [`Table::lookup_stored`](crate::Table::lookup_stored)
    /// returns; [`decode_row`](Self::decode_row) reads it back.
    #[inline]
    pub fn encode_row(&self, row: &[f32], out: &mut [u8]) {
        debug_assert_eq!(row.len(), self.dim);
        debug_assert_eq!(out.len(), self.row_bytes());
        match self.dtype {
            DType::F32 => out.copy_from_slice(f32_bytes(row)),
            DType::F16 => encode_f16(row, out),
            DType::Int8 => encode_int8(row, out),
        }
    }

    /// Decodes only the row of `payload` (no optimizer state) into `out` (`dim` `f32`s);
    /// `payload` may also be a stored row alone (`row_bytes()` bytes).
    #[inline]
    pub fn decode_row(&self, payload: &[u8], out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.dim);
        let row = &payload[..self.row_bytes()];
        match self.dtype {
            DType::F32 => f32_bytes_mut(out).copy_from_slice(row),
            DType::F16 => decode_f16(row, out),
            DType::Int8 => decode_int8(row, out),
        }
    }

    /// The row as it reads back once stored: `x` passed through this type's rounding
    /// (a model of what the table holds, for tests and for error bounds).
    pub fn round_trip(&self, row: &mut [f32]) {
        if self.dtype == DType::F32 {
            return;
        }
        let plain = RecordLayout::new(row.len(), 0, self.dtype);
        let mut bytes = vec![0u8; plain.payload_bytes()];
        plain.encode(row, &mut bytes);
        plain.decode(&bytes, row);
    }
}

/// Encodes rows (`dim` `f32`s each, back to back) as stored rows of `dtype` (`row_bytes`
/// bytes each, back to back) into `out`: what `lookup_stored` hands out for rows it read
/// decoded (a tier's, a missing key's default).
pub fn encode_rows(dtype: DType, dim: usize, rows: &[f32], out: &mut [u8]) {
    let plain = RecordLayout::new(dim, 0, dtype);
    for (row, o) in rows.chunks_exact(dim).zip(out.chunks_exact_mut(plain.row_bytes())) {
        plain.encode_row(row, o);
    }
}

/// Checks the buffers of a `lookup_stored` of `keys` keys on table `name` (rows of `dim`
/// elements stored as `dtype`): `out` must hold `keys * row_bytes` bytes, `found` `keys`.
pub fn check_stored_lens(
    name: &str,
    dtype: DType,
    dim: usize,
    keys: usize,
    out: usize,
    found: usize,
) -> crate::error::Result<()> {
    let rb = dtype.row_bytes(dim);
    if out == keys * rb && found == keys {
        return Ok(());
    }
    Err(crate::error::Error::invalid(format!(
        "lookup_stored: table {name:?} stores rows of {rb} bytes ({dtype} x {dim}), so {keys} keys need {} bytes \
         and a found-mask of {keys}; got {out} bytes and {found}",
        keys * rb
    )))
}

/// `f32 -> f16` (round to nearest even), vectorized (F16C when the CPU has it) where
/// the bytes are 2-aligned, which records always are.
#[inline]
fn encode_f16(row: &[f32], out: &mut [u8]) {
    use half::slice::HalfFloatSliceExt;
    // SAFETY: every bit pattern is a valid f16; align_to only splits at alignment.
    let (pre, mid, post) = unsafe { out.align_to_mut::<half::f16>() };
    if pre.is_empty() && post.is_empty() {
        mid.convert_from_f32_slice(row);
        return;
    }
    for (v, o) in row.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
    }
}

/// `f16 -> f32` straight into the caller's output: eight elements per F16C instruction
/// where the CPU has it (one call for the whole row; `half`'s slice conversion calls
/// through a function pointer per eight elements, which cost a pulled f16 row more than
/// its conversion), else `half`'s.
#[inline]
fn decode_f16(row: &[u8], out: &mut [f32]) {
    debug_assert_eq!(row.len(), out.len() * 2);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above); the lengths match.
        unsafe { decode_f16_avx512(row, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has F16C and AVX (checked just above); the lengths match.
        unsafe { decode_f16_f16c(row, out) };
        return;
    }
    decode_f16_portable(row, out)
}

fn decode_f16_portable(row: &[u8], out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    // SAFETY: every bit pattern is a valid f16; align_to only splits at alignment.
    let (pre, mid, post) = unsafe { row.align_to::<half::f16>() };
    if pre.is_empty() && post.is_empty() {
        mid.convert_to_f32_slice(out);
        return;
    }
    for (b, o) in row.chunks_exact(2).zip(out.iter_mut()) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn decode_f16_f16c(row: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = out.len();
    let (src, dst) = (row.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 halves (16 bytes) at 2*i and 8 floats at i lie in the slices.
        let h = _mm_loadu_si128(src.add(2 * i) as *const __m128i);
        _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(h));
        i += 8;
    }
    for (b, o) in row[2 * i..].chunks_exact(2).zip(out[i..].iter_mut()) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Sixteen halves per instruction (AVX-512F's `vcvtph2ps`), as [`decode_f16_f16c`] does eight.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_f16_avx512(row: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    let n = out.len();
    let (src, dst) = (row.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 halves (32 bytes) at 2*i and 16 floats at i lie in the slices.
        let h = _mm256_loadu_si256(src.add(2 * i) as *const __m256i);
        _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
        i += 16;
    }
    for (b, o) in row[2 * i..].chunks_exact(2).zip(out[i..].iter_mut()) {
        *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Row-wise asymmetric 8-bit quantization (formula in the module docs): `row.len()`
/// bytes, then scale and bias.
#[inline]
fn encode_int8(row: &[f32], out: &mut [u8]) {
    let (q, tail) = out.split_at_mut(row.len());
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut finite = true;
    for &v in row {
        finite &= v.is_finite();
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if row.is_empty() {
        (lo, hi) = (0.0, 0.0);
    }
    let (scale, bias) = if finite && (hi - lo).is_finite() { ((hi - lo) / 255.0, lo) } else { (f32::NAN, f32::NAN) };
    if scale > 0.0 {
        for (v, o) in row.iter().zip(q.iter_mut()) {
            *o = ((v - bias) / scale).round().clamp(0.0, 255.0) as u8;
        }
    } else {
        q.fill(0);
    }
    tail[0..4].copy_from_slice(&scale.to_le_bytes());
    tail[4..8].copy_from_slice(&bias.to_le_bytes());
}

#[inline]
fn decode_int8(row: &[u8], out: &mut [f32]) {
    let (q, tail) = row.split_at(out.len());
    let scale = f32::from_le_bytes(tail[0..4].try_into().expect("int8 scale"));
    let bias = f32::from_le_bytes(tail[4..8].try_into().expect("int8 bias"));
    if scale.is_nan() {
        out.fill(f32::NAN);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above); `q` and `out` have one length.
        unsafe { decode_int8_avx512(q, scale, bias, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above); `q` and `out` have one length.
        unsafe { decode_int8_avx2(q, scale, bias, out) };
        return;
    }
    decode_int8_portable(q, scale, bias, out)
}

#[inline]
fn decode_int8_portable(q: &[u8], scale: f32, bias: f32, out: &mut [f32]) {
    for (&b, o) in q.iter().zip(out.iter_mut()) {
        *o = b as f32 * scale + bias;
    }
}

/// Eight elements per step: widen, convert, multiply, then add (not fused: the result
/// is the portable loop's, bit for bit, on every CPU).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_int8_avx2(q: &[u8], scale: f32, bias: f32, out: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm256_add_ps, _mm256_cvtepi32_ps, _mm256_cvtepu8_epi32, _mm256_mul_ps, _mm256_set1_ps,
        _mm256_storeu_ps, _mm_loadl_epi64,
    };
    debug_assert_eq!(q.len(), out.len());
    let n = out.len();
    let (vs, vb) = (_mm256_set1_ps(scale), _mm256_set1_ps(bias));
    let (src, dst) = (q.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 bytes at i and 8 floats at i lie in the slices.
        let b = _mm_loadl_epi64(src.add(i) as *const __m128i);
        let f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        _mm256_storeu_ps(dst.add(i), _mm256_add_ps(_mm256_mul_ps(f, vs), vb));
        i += 8;
    }
    decode_int8_portable(&q[i..], scale, bias, &mut out[i..]);
}

/// Sixteen elements per step, as [`decode_int8_avx2`] does eight: half the instructions
/// and stores a row. (The two loops differ only in vector width; a macro over the
/// intrinsics' names would hide more than the dozen lines it saves.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_int8_avx512(q: &[u8], scale: f32, bias: f32, out: &mut [f32]) {
    use std::arch::x86_64::{
        __m128i, _mm512_add_ps, _mm512_cvtepi32_ps, _mm512_cvtepu8_epi32, _mm512_mul_ps, _mm512_set1_ps,
        _mm512_storeu_ps, _mm_loadu_si128,
    };
    debug_assert_eq!(q.len(), out.len());
    let n = out.len();
    let (vs, vb) = (_mm512_set1_ps(scale), _mm512_set1_ps(bias));
    let (src, dst) = (q.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 bytes at i and 16 floats at i lie in the slices.
        let b = _mm_loadu_si128(src.add(i) as *const __m128i);
        let f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
        _mm512_storeu_ps(dst.add(i), _mm512_add_ps(_mm512_mul_ps(f, vs), vb));
        i += 16;
    }
    decode_int8_portable(&q[i..], scale, bias, &mut out[i..]);
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

    #[test]
    fn f16_rounds_to_nearest_even_and_keeps_state_f32() {
        let l = RecordLayout::new(3, 2, DType::F16);
        assert_eq!((l.elems(), l.payload_bytes(), l.row_bytes()), (5, 14, 6));
        // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): ties go to even (1).
        let tie = 1.0 + f32::powi(2.0, -11);
        let rec = [tie, -2.5, 70000.0, 0.123_456_79, 1e-3];
        let mut bytes = vec![0u8; l.payload_bytes()];
        l.encode(&rec, &mut bytes);
        let mut back = [0f32; 5];
        l.decode(&bytes, &mut back);
        assert_eq!(back[0], 1.0);
        assert_eq!(back[1], -2.5);
        assert_eq!(back[2], f32::INFINITY, "past the f16 range");
        assert_eq!(&back[3..], &rec[3..], "state stays f32");
    }

    #[test]
    fn int8_matches_the_documented_formula_and_its_error_bound() {
        let l = RecordLayout::new(4, 1, DType::Int8);
        assert_eq!((l.payload_bytes(), l.row_bytes()), (16, 12));
        let rec = [-1.0, 0.5, 2.0, 0.25, 9.0];
        let mut bytes = vec![0u8; l.payload_bytes()];
        l.encode(&rec, &mut bytes);
        let scale = 3.0f32 / 255.0;
        assert_eq!(&bytes[..4], &[0, (1.5 / scale).round() as u8, 255, (1.25f32 / scale).round() as u8]);
        assert_eq!(f32::from_le_bytes(bytes[4..8].try_into().unwrap()), scale);
        assert_eq!(f32::from_le_bytes(bytes[8..12].try_into().unwrap()), -1.0);
        let mut back = [0f32; 5];
        l.decode(&bytes, &mut back);
        for i in 0..4 {
            assert!((back[i] - rec[i]).abs() <= scale / 2.0 + 1e-6, "{i}: {} vs {}", back[i], rec[i]);
        }
        assert_eq!(back[4], 9.0, "state stays f32");
        // A constant row, an empty range, and a non-finite element.
        let mut flat = [3.5f32; 4];
        l.round_trip(&mut flat);
        assert_eq!(flat, [3.5; 4]);
        let mut bad = [1.0, f32::INFINITY, 0.0, 2.0];
        l.round_trip(&mut bad);
        assert!(bad.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn f16_conversion_is_the_same_on_unaligned_bytes() {
        let row: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.731).collect();
        let mut aligned = vec![0u16; 37];
        // SAFETY: u16 storage viewed as bytes.
        let aligned = unsafe { std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, 74) };
        encode_f16(&row, aligned);
        let mut buf = [0u8; 75];
        let odd = if (buf.as_ptr() as usize).is_multiple_of(2) { &mut buf[1..] } else { &mut buf[..74] };
        encode_f16(&row, odd);
        assert_eq!(&odd[..], &aligned[..]);
        let (mut a, mut b) = (vec![0f32; 37], vec![0f32; 37]);
        decode_f16(aligned, &mut a);
        decode_f16(odd, &mut b);
        assert_eq!(a, b);
    }

    proptest::proptest! {
        #[test]
        fn compact_types_round_trip_within_their_bounds_and_requantize_stably(
            row in proptest::collection::vec(-1000.0f32..1000.0, 1..80),
            offset in -100.0f32..100.0,
        ) {
            let row: Vec<f32> = row.iter().map(|v| v / 100.0 + offset).collect();
            for dtype in [DType::F16, DType::Int8] {
                let l = RecordLayout::new(row.len(), 0, dtype);
                let mut once = row.clone();
                l.round_trip(&mut once);
                let lo = row.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for (a, b) in row.iter().zip(&once) {
                    let bound = match dtype {
                        DType::F16 => a.abs() * f32::powi(2.0, -11) + 1e-7,
                        _ => (hi - lo) / 510.0 + 4.0 * f32::EPSILON * a.abs().max(hi.abs()),
                    };
                    proptest::prop_assert!((a - b).abs() <= bound, "{dtype}: {a} -> {b}, bound {bound}");
                }
                let mut twice = once.clone();
                l.round_trip(&mut twice);
                let step = (hi - lo) / 255.0;
                for (a, b) in once.iter().zip(&twice) {
                    proptest::prop_assert!((a - b).abs() <= step * 1e-3 + 2.0 * f32::EPSILON * a.abs(), "{dtype}: {a} -> {b}");
                }
            }
        }
    }

    #[test]
    fn vectorized_decoders_equal_the_portable_ones_bit_for_bit() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // Lengths with and without a tail of fewer than 8 (or 16) elements.
        for n in [0usize, 1, 7, 8, 9, 15, 16, 17, 24, 100, 128, 131] {
            // Every f16 bit pattern class: random bits cover normals, subnormals, inf, NaN.
            let halves: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            decode_f16(&halves, &mut a);
            decode_f16_portable(&halves, &mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "f16, {n} elements");
            let q: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            for (scale, bias) in [(0.0037f32, -0.41f32), (1.0 / 255.0, 0.0), (3.3e-7, 12345.678)] {
                let mut row = q.clone();
                row.extend_from_slice(&scale.to_le_bytes());
                row.extend_from_slice(&bias.to_le_bytes());
                decode_int8(&row, &mut a);
                decode_int8_portable(&q, scale, bias, &mut b);
                assert_eq!(bits(&a), bits(&b), "int8, {n} elements, scale {scale}");
                // Each vector width the CPU has, not only the one the dispatcher picks.
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU has AVX2; the lengths match.
                        unsafe { decode_int8_avx2(&q, scale, bias, &mut a) };
                        assert_eq!(bits(&a), bits(&b), "int8 AVX2, {n} elements, scale {scale}");
                    }
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        // SAFETY: the CPU has AVX-512F; the lengths match.
                        unsafe { decode_int8_avx512(&q, scale, bias, &mut a) };
                        assert_eq!(bits(&a), bits(&b), "int8 AVX-512, {n} elements, scale {scale}");
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            {
                decode_f16_portable(&halves, &mut b);
                if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
                    // SAFETY: the CPU has F16C and AVX; the lengths match.
                    unsafe { decode_f16_f16c(&halves, &mut a) };
                    assert_eq!(bits(&a), bits(&b), "f16 F16C, {n} elements");
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F; the lengths match.
                    unsafe { decode_f16_avx512(&halves, &mut a) };
                    assert_eq!(bits(&a), bits(&b), "f16 AVX-512, {n} elements");
                }
            }
        }
    }
}

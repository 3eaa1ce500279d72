//! Reading and writing `.npy` files (format versions 1-3, little-endian,
//! C order): enough for key (`<u8`, `<i8`) and row (`<f4`) arrays, streamed.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8] = b"\x93NUMPY";
/// Bytes of the header we write: fixed, so the final shape can be patched in place.
const HEADER_BYTES: usize = 128;

pub struct NpyWriter {
    out: BufWriter<File>,
    path: PathBuf,
    descr: &'static str,
    row_elems: Option<usize>,
    count: u64,
}

fn header(descr: &str, shape: &str) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let mut h = Vec::with_capacity(HEADER_BYTES);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&[1, 0]);
    let len = HEADER_BYTES - 10;
    h.extend_from_slice(&(len as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h.resize(HEADER_BYTES - 1, b' ');
    h.push(b'\n');
    h
}

impl NpyWriter {
    /// A writer of a 1-D array (`row_elems` None) or a 2-D array of rows of `row_elems`.
    pub fn create(path: &Path, descr: &'static str, row_elems: Option<usize>) -> std::io::Result<NpyWriter> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        out.write_all(&header(descr, "(0,)"))?;
        Ok(NpyWriter { out, path: path.to_owned(), descr, row_elems, count: 0 })
    }

    pub fn write_u64(&mut self, values: &[u64]) -> std::io::Result<()> {
        for v in values {
            self.out.write_all(&v.to_le_bytes())?;
        }
        self.count += values.len() as u64;
        Ok(())
    }

    pub fn write_f32_rows(&mut self, values: &[f32]) -> std::io::Result<()> {
        let dim = self.row_elems.expect("a 2-D writer");
        // SAFETY: f32 has no padding; this target is little-endian (checked below).
        const _: () = assert!(cfg!(target_endian = "little"));
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        self.out.write_all(bytes)?;
        self.count += (values.len() / dim) as u64;
        Ok(())
    }

    pub fn finish(mut self) -> std::io::Result<PathBuf> {
        let shape = match self.row_elems {
            None => format!("({},)", self.count),
            Some(d) => format!("({}, {})", self.count, d),
        };
        self.out.flush()?;
        let mut f = self.out.into_inner().map_err(|e| e.into_error())?;
        f.seek(SeekFrom::Start(0))?;
        f.write_all(&header(self.descr, &shape))?;
        f.sync_all()?;
        Ok(self.path)
    }
}

/// An opened `.npy` file positioned at its data.
pub struct NpyReader {
    input: BufReader<File>,
    pub descr: String,
    pub shape: Vec<usize>,
}

fn field<'a>(dict: &'a str, name: &str) -> Option<&'a str> {
    let at = dict.find(&format!("'{name}'"))? + name.len() + 2;
    let rest = dict[at..].trim_start().strip_prefix(':')?.trim_start();
    Some(rest)
}

impl NpyReader {
    pub fn open(path: &Path) -> Result<NpyReader, String> {
        let bad = |why: &str| format!("{}: not a readable .npy file: {why}", path.display());
        let mut input =
            BufReader::with_capacity(1 << 20, File::open(path).map_err(|e| format!("{}: {e}", path.display()))?);
        let mut pre = [0u8; 8];
        input.read_exact(&mut pre).map_err(|_| bad("too short"))?;
        if &pre[..6] != MAGIC {
            return Err(bad("bad magic"));
        }
        let len = match pre[6] {
            1 => {
                let mut b = [0u8; 2];
                input.read_exact(&mut b).map_err(|_| bad("too short"))?;
                u16::from_le_bytes(b) as usize
            }
            2 | 3 => {
                let mut b = [0u8; 4];
                input.read_exact(&mut b).map_err(|_| bad("too short"))?;
                u32::from_le_bytes(b) as usize
            }
            v => return Err(bad(&format!("unknown version {v}"))),
        };
        if len > 1 << 20 {
            return Err(bad("header too long"));
        }
        let mut dict = vec![0u8; len];
        input.read_exact(&mut dict).map_err(|_| bad("truncated header"))?;
        let dict = String::from_utf8_lossy(&dict).into_owned();
        let descr = field(&dict, "descr")
            .and_then(|r| r.strip_prefix('\''))
            .and_then(|r| r.split('\'').next())
            .ok_or_else(|| bad("no descr"))?
            .to_owned();
        if field(&dict, "fortran_order").is_some_and(|r| r.starts_with("True")) {
            return Err(bad("Fortran-order arrays are not supported; save with np.ascontiguousarray"));
        }
        let shape_text = field(&dict, "shape")
            .and_then(|r| r.strip_prefix('('))
            .and_then(|r| r.split(')').next())
            .ok_or_else(|| bad("no shape"))?;
        let shape = shape_text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad("bad shape"))?;
        Ok(NpyReader { input, descr, shape })
    }

    /// Reads up to `n` 8-byte little-endian integers (keys); `<i8` values must be >= 0.
    pub fn read_keys(&mut self, n: usize, out: &mut Vec<u64>) -> Result<(), String> {
        out.clear();
        let mut b = vec![0u8; n * 8];
        self.input.read_exact(&mut b).map_err(|e| format!("reading keys: {e}"))?;
        for c in b.chunks_exact(8) {
            let v = u64::from_le_bytes(c.try_into().unwrap());
            if self.descr == "<i8" && (v as i64) < 0 {
                return Err(format!("key {} is negative", v as i64));
            }
            out.push(v);
        }
        Ok(())
    }

    /// Reads `n` integers of an integer array (`<i8`, `<i4`, `<u8`, `<u4`) as `i64`.
    pub fn read_ints(&mut self, n: usize, out: &mut Vec<i64>) -> Result<(), String> {
        out.clear();
        let width = match self.descr.as_str() {
            "<i8" | "<u8" => 8,
            "<i4" | "<u4" => 4,
            other => return Err(format!("expected an int64 or int32 array, found dtype {other}")),
        };
        let mut b = vec![0u8; n * width];
        self.input.read_exact(&mut b).map_err(|e| format!("reading integers: {e}"))?;
        match self.descr.as_str() {
            "<i8" => out.extend(b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()))),
            "<u8" => out.extend(b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap()) as i64)),
            "<i4" => out.extend(b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)),
            _ => out.extend(b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as i64)),
        }
        Ok(())
    }

    /// Reads `n` rows of `dim` elements as `f32`, whatever the rows' stored type:
    /// `<f4`; `<f2` (IEEE half); or `|u1` rows of `dim + 8` bytes, the fused 8-bit
    /// row-wise layout (`dim` quantized bytes, an `f32` scale, an `f32` bias: the layout
    /// of embank's `int8` rows and of common quantized embedding exports), de-quantized as `q * scale + bias`.
    pub fn read_rows(&mut self, n: usize, dim: usize, out: &mut Vec<f32>) -> Result<(), String> {
        use crate::format::DType;
        use crate::layout::RecordLayout;
        let dtype = match self.descr.as_str() {
            "<f4" => return self.read_f32(n * dim, out),
            "<f2" => DType::F16,
            "|u1" | "<u1" | "|i1" => DType::Int8,
            other => return Err(format!("rows must be float32, float16 or fused 8-bit (uint8), found dtype {other}")),
        };
        let layout = RecordLayout::new(dim, 0, dtype);
        let width = layout.payload_bytes();
        let mut b = vec![0u8; n * width];
        self.input.read_exact(&mut b).map_err(|e| format!("reading rows: {e}"))?;
        out.clear();
        out.resize(n * dim, 0.0);
        for (src, dst) in b.chunks_exact(width).zip(out.chunks_exact_mut(dim)) {
            layout.decode(src, dst);
        }
        Ok(())
    }

    /// Elements per row of a 2-D rows array as the table sees them (a fused 8-bit row's
    /// last 8 bytes are its scale and bias).
    pub fn row_dim(&self) -> Result<usize, String> {
        let width = *self.shape.get(1).ok_or("rows must be a 2-D array")?;
        match self.descr.as_str() {
            "|u1" | "<u1" | "|i1" if width <= 8 => {
                Err(format!("fused 8-bit rows need more than 8 bytes each (q, then scale and bias), found {width}"))
            }
            "|u1" | "<u1" | "|i1" => Ok(width - 8),
            _ => Ok(width),
        }
    }

    /// Reads `n` elements of `<f4`.
    pub fn read_f32(&mut self, n: usize, out: &mut Vec<f32>) -> Result<(), String> {
        out.clear();
        let mut b = vec![0u8; n * 4];
        self.input.read_exact(&mut b).map_err(|e| format!("reading rows: {e}"))?;
        out.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let kp = dir.path().join("k.npy");
        let rp = dir.path().join("r.npy");
        let mut k = NpyWriter::create(&kp, "<u8", None).unwrap();
        k.write_u64(&[1, 2, 3]).unwrap();
        k.finish().unwrap();
        let mut r = NpyWriter::create(&rp, "<f4", Some(2)).unwrap();
        r.write_f32_rows(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        r.finish().unwrap();
        let mut k = NpyReader::open(&kp).unwrap();
        assert_eq!((k.descr.as_str(), k.shape.as_slice()), ("<u8", &[3usize][..]));
        let mut keys = Vec::new();
        k.read_keys(3, &mut keys).unwrap();
        assert_eq!(keys, [1, 2, 3]);
        let mut r = NpyReader::open(&rp).unwrap();
        assert_eq!(r.shape, [3, 2]);
        let mut rows = Vec::new();
        r.read_f32(6, &mut rows).unwrap();
        assert_eq!(rows, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        std::fs::write(dir.path().join("bad.npy"), b"hello").unwrap();
        let err = NpyReader::open(&dir.path().join("bad.npy")).err().unwrap();
        assert!(err.contains("not a readable .npy"), "{err}");
    }
}

//! Physical limits of the access pattern, measured in the same run as the engines (the
//! machine's copy bandwidth and device limits are the core's `copy_bandwidth` and
//! `device_limits`).

use std::time::{Duration, Instant};

/// Keys/s of an index-free gather of the same key stream from a flat array of
/// rows (key k at offset k * dim), software-prefetched 8 keys ahead, copying
/// into a reply buffer, from one thread per key stream: the best any store can
/// do on this access pattern.
/// The index-free gather: keys/s, and the p50 and p99 of one batch's time (µs): the
/// latency the access pattern itself has on this machine, beside the engines'.
pub fn gather(keys: u64, dim: usize, batches: &[Vec<u64>], batch: usize, seconds: f64) -> (f64, f64, f64) {
    gather_rows(keys, dim * 4, 8, batches, batch, seconds)
}

/// Keys/s of the same index-free gather over rows of `row_bytes` bytes (the stored size
/// of a compact element type: f16 `dim * 2`, int8 `dim + 8`), copied as they are (no
/// decode), prefetched 16 keys ahead: what fewer bytes per row can buy on this access
/// pattern, whoever stores them. Set against [`gather`] of the f32 rows, it bounds the
/// speed-up a compact type can give.
pub fn gather_stored(keys: u64, row_bytes: usize, batches: &[Vec<u64>], batch: usize, seconds: f64) -> f64 {
    gather_rows(keys, row_bytes, 16, batches, batch, seconds).0
}

/// Keys/s of the best a store with a one-line index can do on this access pattern, for
/// rows of `dtype`: each key's record pointer is read from a table of 8-byte pointers
/// (one random line a key, where embank's index reads a bucket line and, for most keys,
/// a slot line), its record (a 16-byte header and the payload, at embank's record
/// stride) prefetched, and the row decoded into `f32`s as a pull returns them; in stages
/// of 256 keys as the core's `Index::get_staged` runs them. Measured for f32
/// and a compact type in the same run, the ratio of the two bounds what the compact
/// type can give against f32 through any index that reads one line a key.
pub fn gather_indexed(
    keys: u64,
    dim: usize,
    dtype: embank_core::DType,
    batches: &[Vec<u64>],
    batch: usize,
    seconds: f64,
) -> f64 {
    use embank_core::RecordLayout;
    let layout = RecordLayout::new(dim, 0, dtype);
    let payload = layout.payload_bytes();
    let stride = embank_core::record_stride(payload, dtype) as usize;
    let mut records = huge_zeroed::<u8>(keys as usize * stride);
    let mut row = vec![0f32; dim];
    for (k, rec) in records.chunks_exact_mut(stride).enumerate() {
        for (j, x) in row.iter_mut().enumerate() {
            *x = ((k * 31 + j) % 97) as f32 / 97.0;
        }
        rec[..8].copy_from_slice(&(k as u64).to_le_bytes());
        layout.encode(&row, &mut rec[16..16 + payload]);
    }
    let mut ptrs = huge_zeroed::<u64>(keys as usize);
    for (k, p) in ptrs.iter_mut().enumerate() {
        *p = (k * stride) as u64;
    }
    let (records, ptrs) = (&records, &ptrs);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds.max(0.1));
    let t0 = Instant::now();
    let done: usize = std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .iter()
            .map(|stream| {
                s.spawn(move || {
                    let mut out = vec![0f32; batch * dim];
                    let mut at = [0u64; 256];
                    let n = stream.len() / batch;
                    let (mut done, mut i) = (0usize, 0usize);
                    while Instant::now() < deadline {
                        let ks = &stream[(i % n) * batch..(i % n + 1) * batch];
                        for (c, chunk) in ks.chunks(256).enumerate() {
                            for &k in chunk {
                                prefetch_lines((&ptrs[k as usize]) as *const u64 as *const u8, 8, false);
                            }
                            for (j, &k) in chunk.iter().enumerate() {
                                at[j] = ptrs[k as usize];
                                prefetch_lines(records[at[j] as usize..].as_ptr(), 16 + payload, false);
                            }
                            for (j, &k) in chunk.iter().enumerate() {
                                let rec = &records[at[j] as usize..at[j] as usize + 16 + payload];
                                if u64::from_le_bytes(rec[..8].try_into().unwrap_or_default()) != k {
                                    continue;
                                }
                                let o = (c * 256 + j) * dim;
                                layout.decode(&rec[16..], &mut out[o..o + dim]);
                            }
                        }
                        std::hint::black_box(&out);
                        done += batch;
                        i += 1;
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_default()).sum()
    });
    done as f64 / t0.elapsed().as_secs_f64()
}

/// `n` zeroed values on transparent huge pages where the kernel allows (`MADV_HUGEPAGE`
/// before the first touch), as `--huge-pages` maps an engine's index and rows.
fn huge_zeroed<T: Copy + Default>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n];
    let (start, len) = (v.as_ptr() as usize, std::mem::size_of_val(v.as_slice()));
    let huge = 2 << 20;
    let (from, to) = (start.next_multiple_of(huge), (start + len) / huge * huge);
    if to > from {
        // SAFETY: advice on whole pages inside the vector's allocation; contents unchanged.
        unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE) };
    }
    v
}

/// The gather of rows of `row_bytes`, prefetched `ahead` keys ahead: keys/s and a batch's
/// p50 and p99 (µs).
fn gather_rows(
    keys: u64,
    row_bytes: usize,
    ahead: usize,
    batches: &[Vec<u64>],
    batch: usize,
    seconds: f64,
) -> (f64, f64, f64) {
    let flat: Vec<u8> = (0..keys as usize * row_bytes).map(|i| i as u8).collect();
    let flat = &flat;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds.max(0.1));
    let t0 = Instant::now();
    let per_thread: Vec<(usize, Vec<u64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .iter()
            .map(|stream| {
                s.spawn(move || {
                    let mut out = vec![0u8; batch * row_bytes];
                    let n = stream.len() / batch;
                    let mut done = 0usize;
                    let mut i = 0;
                    let mut lat = Vec::with_capacity(1 << 16);
                    while Instant::now() < deadline {
                        let start = Instant::now();
                        let ks = &stream[(i % n) * batch..(i % n + 1) * batch];
                        for (j, &k) in ks.iter().enumerate() {
                            if let Some(&next) = ks.get(j + ahead) {
                                prefetch_lines(flat[next as usize * row_bytes..].as_ptr(), row_bytes, false);
                            }
                            out[j * row_bytes..(j + 1) * row_bytes]
                                .copy_from_slice(&flat[k as usize * row_bytes..(k as usize + 1) * row_bytes]);
                        }
                        std::hint::black_box(&out);
                        lat.push(start.elapsed().as_nanos() as u64);
                        done += batch;
                        i += 1;
                    }
                    (done, lat)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    let total: usize = per_thread.iter().map(|(d, _)| d).sum();
    let mut lat: Vec<u64> = per_thread.into_iter().flat_map(|(_, l)| l).collect();
    lat.sort_unstable();
    let us = |p: f64| super::percentile(&lat, p) as f64 / 1e3;
    (total as f64 / secs, us(50.0), us(99.0))
}

/// Hints the CPU to load the `len` bytes at `p`, line by line (for writing: `write`).
#[inline(always)]
pub(super) fn prefetch_lines(p: *const u8, len: usize, write: bool) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        let a = p.wrapping_add(line) as *const i8;
        // SAFETY: prefetch never faults.
        unsafe {
            if write {
                _mm_prefetch(a, _MM_HINT_ET0);
            } else {
                _mm_prefetch(a, _MM_HINT_T0);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len, write);
}

/// Payload bandwidth of one loopback TCP stream in GB/s: a thread writes 256 KiB
/// buffers to a socket on 127.0.0.1 for `seconds`, another reads them (the kernel copies
/// every byte in and out, as it does for a networked engine's replies); best of 3. The
/// most a networked engine's replies can carry between two processes of this machine.
pub fn loopback_tcp(seconds: f64) -> std::io::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut best = 0f64;
    for _ in 0..3 {
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            let mut s = std::net::TcpStream::connect(addr)?;
            let buf = vec![7u8; 256 << 10];
            let end = Instant::now() + Duration::from_secs_f64(seconds / 3.0);
            while Instant::now() < end {
                s.write_all(&buf)?;
            }
            Ok(())
        });
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 256 << 10];
        let (t, mut bytes) = (Instant::now(), 0u64);
        loop {
            match s.read(&mut buf)? {
                0 => break,
                n => bytes += n as u64,
            }
        }
        let secs = t.elapsed().as_secs_f64();
        writer.join().expect("loopback writer thread")?;
        best = best.max(bytes as f64 / secs / 1e9);
    }
    Ok(best)
}

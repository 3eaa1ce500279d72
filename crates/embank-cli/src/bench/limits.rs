//! Physical limits of the access pattern, measured in the same run as the engines.

use std::time::{Duration, Instant};

/// Memory copy bandwidth in GB/s, counting bytes read plus bytes written
/// (a STREAM-like copy of 256 MiB after first touch; best of 5).
pub fn copy_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src); // first touch
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * n as f64 / best / 1e9
}

/// Keys/s of an index-free gather of the same key stream from a flat array of
/// rows (key k at offset k * dim), software-prefetched 8 keys ahead, copying
/// into a reply buffer, from one thread per key stream: the best any store can
/// do on this access pattern.
pub fn gather(keys: u64, dim: usize, batches: &[Vec<u64>], batch: usize, seconds: f64) -> f64 {
    let mut flat = vec![0f32; keys as usize * dim];
    for (i, x) in flat.iter_mut().enumerate() {
        *x = i as f32;
    }
    let flat = &flat;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds.max(0.1));
    let t0 = Instant::now();
    let total: usize = std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .iter()
            .map(|stream| {
                s.spawn(move || {
                    let mut out = vec![0f32; batch * dim];
                    let n = stream.len() / batch;
                    let mut done = 0usize;
                    let mut i = 0;
                    while Instant::now() < deadline {
                        let ks = &stream[(i % n) * batch..(i % n + 1) * batch];
                        for (j, &k) in ks.iter().enumerate() {
                            if let Some(&ahead) = ks.get(j + 8) {
                                let p = flat[ahead as usize * dim..].as_ptr() as *const u8;
                                for line in (0..dim * 4).step_by(64) {
                                    // SAFETY: within the flat array.
                                    prefetch(unsafe { p.add(line) });
                                }
                            }
                            out[j * dim..(j + 1) * dim]
                                .copy_from_slice(&flat[k as usize * dim..(k as usize + 1) * dim]);
                        }
                        std::hint::black_box(&out);
                        done += batch;
                        i += 1;
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    total as f64 / t0.elapsed().as_secs_f64()
}

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

//! This machine's physical limits, beside what embank gets from it: memory copy
//! bandwidth, and the random reads a device sustains through the core's own I/O
//! engine (`embank bench` measures them in the same run as the engines; `embank plan
//! --limits` turns hit rates into keys/s with them).

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

use crate::hash::splitmix64;
use crate::io::{direct_io_alignment, engine, AlignedBuf, Dir, IoChoice, IoReq};

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

/// What the device under the bench directory sustains for one block-medium record size.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct DeviceLimits {
    /// Bytes per I/O: the block medium's record stride for the bench's dim.
    pub record_bytes: u32,
    /// Random aligned `O_DIRECT` reads per second at queue depth `depth`.
    pub random_reads_per_second: f64,
    /// Random reads + writes per second, half each, at the same depth.
    pub mixed_ops_per_second: f64,
    pub depth: u32,
    pub file_bytes: u64,
}

/// Measures random `O_DIRECT` reads, then a 50/50 read/write mix, of `record` bytes at
/// random aligned offsets of a scratch file of `file_bytes` (written first, so reads hit
/// the device, not unwritten extents) in `dir`, through embank's own I/O engine at
/// `depth` in flight — what the block medium can at best get from this device. Each
/// phase runs `seconds`.
pub fn device_limits(
    dir: &std::path::Path,
    record: u32,
    file_bytes: u64,
    depth: u32,
    seconds: f64,
) -> Result<DeviceLimits, String> {
    let path = dir.join("device-limit.scratch");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| format!("cannot open {} with O_DIRECT: {e}", path.display()))?;
    let _ = std::fs::remove_file(&path); // unlinked: gone however the bench ends
    let fd = file.as_raw_fd();
    let engine = engine(IoChoice::Auto, depth).map_err(|e| e.to_string())?;
    let align = direct_io_alignment(fd).unwrap_or(4096).max(512) as u64;
    let record = (record as u64).div_ceil(align) * align;
    let slots = (file_bytes / record).max(1024);
    // Fill the file with large sequential writes.
    let chunk = 8u64 << 20;
    let mut buf = AlignedBuf::new(chunk as usize);
    buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let total = slots * record;
    let mut at = 0;
    while at < total {
        let len = chunk.min(total - at) as usize;
        let req = IoReq { offset: at, buf: buf.as_mut_slice().as_mut_ptr(), len };
        engine.submit(fd, Dir::Write, &[req]).map_err(|e| format!("filling the scratch file: {e}"))?;
        at += len as u64;
    }
    // SAFETY: fsync on a file we own.
    unsafe { libc::fsync(fd) };
    let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(record as usize)).collect();
    let mut n = 0u64;
    let mut next = || {
        n += 1;
        splitmix64(n)
    };
    let mut run = |mixed: bool| -> Result<f64, String> {
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let started = Instant::now();
        let mut ops = 0u64;
        while Instant::now() < deadline {
            let mut reqs: Vec<IoReq> = bufs
                .iter_mut()
                .map(|b| IoReq {
                    offset: (next() % slots) * record,
                    buf: b.as_mut_slice().as_mut_ptr(),
                    len: record as usize,
                })
                .collect();
            if mixed {
                let writes = reqs.split_off(reqs.len() / 2);
                engine.submit(fd, Dir::Write, &writes).map_err(|e| e.to_string())?;
            }
            engine.submit(fd, Dir::Read, &reqs).map_err(|e| e.to_string())?;
            ops += depth as u64;
        }
        Ok(ops as f64 / started.elapsed().as_secs_f64())
    };
    let reads = run(false)?;
    let mixed = run(true)?;
    Ok(DeviceLimits {
        record_bytes: record as u32,
        random_reads_per_second: reads,
        mixed_ops_per_second: mixed,
        depth,
        file_bytes: total,
    })
}

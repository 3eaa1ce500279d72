//! Block I/O engines for the block medium: io_uring, and `pread`/`pwrite` from a
//! small thread pool where io_uring is unavailable or refused.
//!
//! An engine takes a batch of requests (offset, aligned buffer, length) on one
//! file descriptor, keeps up to `depth` of them in flight, and returns once all
//! have completed. A failed or short transfer fails the whole batch with an
//! `Io` error naming the offset; every request of the batch has finished (or
//! was never started) when the call returns, so buffers can be reused.

use std::alloc::Layout;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar};

use parking_lot::Mutex;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};

/// Alignment of I/O buffers (covers any logical block size up to a page).
pub const BUF_ALIGN: usize = 4096;

/// One read or write of `len` bytes at `offset` from or into `buf`.
#[derive(Clone, Copy, Debug)]
pub struct IoReq {
    pub offset: u64,
    pub buf: *mut u8,
    pub len: usize,
}

// SAFETY: a request is a description of memory the caller keeps alive and
// unaliased until the engine call that carries it returns.
unsafe impl Send for IoReq {}
unsafe impl Sync for IoReq {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// Which engine a store uses for block media.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoChoice {
    /// io_uring when the kernel allows it, else pread.
    #[default]
    Auto,
    Uring,
    Pread,
}

impl IoChoice {
    pub fn parse(s: &str) -> Result<IoChoice> {
        match s {
            "auto" => Ok(IoChoice::Auto),
            "uring" | "io_uring" => Ok(IoChoice::Uring),
            "pread" => Ok(IoChoice::Pread),
            other => Err(Error::config(format!("unknown I/O engine {other:?}: use auto, uring or pread"))),
        }
    }
}

/// Counters of one engine.
#[derive(Default)]
pub struct IoCounters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub inflight_max: AtomicU64,
}

/// Numbers about an engine, for `stats()`.
#[derive(Clone, Debug, Serialize)]
pub struct IoStats {
    pub engine: &'static str,
    pub depth: u32,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Most requests in flight at once so far.
    pub inflight_max: u64,
}

impl IoCounters {
    fn count(&self, dir: Dir, reqs: &[IoReq]) {
        let bytes: u64 = reqs.iter().map(|r| r.len as u64).sum();
        match dir {
            Dir::Read => {
                self.reads.fetch_add(reqs.len() as u64, Ordering::Relaxed);
                self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
            }
            Dir::Write => {
                self.writes.fetch_add(reqs.len() as u64, Ordering::Relaxed);
                self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
            }
        }
    }

    fn inflight(&self, n: usize) {
        self.inflight_max.fetch_max(n as u64, Ordering::Relaxed);
    }

    fn snapshot(&self, engine: &'static str, depth: u32) -> IoStats {
        IoStats {
            engine,
            depth,
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            inflight_max: self.inflight_max.load(Ordering::Relaxed),
        }
    }
}

/// A batch I/O engine.
pub trait IoEngine: Send + Sync {
    /// `uring` or `pread` (wrappers report the engine they wrap): the tests' messages.
    #[cfg(test)]
    fn name(&self) -> &'static str;
    /// Performs every request; fails if any fails or transfers fewer bytes than asked.
    fn submit(&self, fd: RawFd, dir: Dir, reqs: &[IoReq]) -> Result<()>;
    fn stats(&self) -> IoStats;
}

fn transfer_error(dir: Dir, req: &IoReq, got: i64) -> Error {
    let what = if dir == Dir::Read { "read" } else { "write" };
    if got < 0 {
        Error::new(ErrorKind::Io, format!("{what} of {} bytes at offset {} failed", req.len, req.offset))
            .with_source(std::io::Error::from_raw_os_error(-got as i32))
    } else {
        Error::new(ErrorKind::Io, format!("short {what} at offset {}: {got} of {} bytes", req.offset, req.len))
    }
}

/// Picks the engine: io_uring if asked or possible, else the thread pool.
pub fn engine(choice: IoChoice, depth: u32) -> Result<Arc<dyn IoEngine>> {
    let depth = depth.clamp(1, 4096);
    match choice {
        IoChoice::Pread => Ok(Arc::new(PreadEngine::new(2, depth))),
        IoChoice::Uring => Ok(Arc::new(UringEngine::new(depth)?)),
        IoChoice::Auto => match UringEngine::new(depth) {
            Ok(e) => Ok(Arc::new(e)),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring is unavailable; block media use pread from a thread pool");
                Ok(Arc::new(PreadEngine::new(2, depth)))
            }
        },
    }
}

/// io_uring: one ring per concurrent caller (rings are pooled), up to `depth`
/// requests in flight per call.
pub struct UringEngine {
    rings: Mutex<Vec<io_uring::IoUring>>,
    depth: u32,
    counters: IoCounters,
}

impl UringEngine {
    pub fn new(depth: u32) -> Result<UringEngine> {
        let ring = io_uring::IoUring::new(depth.next_power_of_two()).map_err(|e| {
            Error::new(ErrorKind::Unsupported, "cannot set up an io_uring (kernel too old, or refused)").with_source(e)
        })?;
        Ok(UringEngine { rings: Mutex::new(vec![ring]), depth, counters: IoCounters::default() })
    }

    fn ring(&self) -> Result<io_uring::IoUring> {
        if let Some(r) = self.rings.lock().pop() {
            return Ok(r);
        }
        io_uring::IoUring::new(self.depth.next_power_of_two())
            .map_err(|e| Error::new(ErrorKind::Io, "cannot set up another io_uring").with_source(e))
    }

    /// Runs the batch; the flag says whether the ring is still fit for reuse.
    fn run(&self, ring: &mut io_uring::IoUring, fd: RawFd, dir: Dir, reqs: &[IoReq]) -> (Result<()>, bool) {
        use io_uring::{opcode, types};
        let depth = self.depth as usize;
        let mut next = 0;
        let mut inflight = 0usize;
        let mut first_error: Option<Error> = None;
        while next < reqs.len() || inflight > 0 {
            // Queue more while there is room and nothing has failed.
            let mut queued = 0;
            while first_error.is_none() && next < reqs.len() && inflight < depth {
                let r = &reqs[next];
                let entry = match dir {
                    Dir::Read => opcode::Read::new(types::Fd(fd), r.buf, r.len as u32).offset(r.offset).build(),
                    Dir::Write => opcode::Write::new(types::Fd(fd), r.buf, r.len as u32).offset(r.offset).build(),
                }
                .user_data(next as u64);
                // SAFETY: the buffer stays valid until its completion is reaped below;
                // this function never returns with requests in flight.
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    break;
                }
                next += 1;
                inflight += 1;
                queued += 1;
            }
            if queued > 0 {
                self.counters.inflight(inflight);
            }
            if inflight == 0 {
                break;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // Requests queued but not accepted are dropped with the ring's state;
                // reap what the kernel has, then give up on this ring.
                return (Err(Error::new(ErrorKind::Io, "io_uring submit failed").with_source(e)), false);
            }
            for cqe in ring.completion() {
                inflight -= 1;
                let r = &reqs[cqe.user_data() as usize];
                let res = cqe.result() as i64;
                if res != r.len as i64 && first_error.is_none() {
                    first_error = Some(transfer_error(dir, r, res));
                }
            }
        }
        match first_error {
            Some(e) => (Err(e), true),
            None => {
                self.counters.count(dir, reqs);
                (Ok(()), true)
            }
        }
    }
}

impl IoEngine for UringEngine {
    #[cfg(test)]
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, fd: RawFd, dir: Dir, reqs: &[IoReq]) -> Result<()> {
        if reqs.is_empty() {
            return Ok(());
        }
        let mut ring = self.ring()?;
        let (result, reusable) = self.run(&mut ring, fd, dir, reqs);
        if reusable {
            self.rings.lock().push(ring);
        }
        result
    }

    fn stats(&self) -> IoStats {
        self.counters.snapshot("uring", self.depth)
    }
}

fn pio(fd: RawFd, dir: Dir, r: &IoReq) -> Result<()> {
    loop {
        // SAFETY: the caller keeps `buf` valid for `len` bytes.
        let n = unsafe {
            match dir {
                Dir::Read => libc::pread(fd, r.buf as *mut libc::c_void, r.len, r.offset as libc::off_t),
                Dir::Write => libc::pwrite(fd, r.buf as *const libc::c_void, r.len, r.offset as libc::off_t),
            }
        };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            return Err(transfer_error(dir, r, -(errno as i64)));
        }
        if n as usize != r.len {
            return Err(transfer_error(dir, r, n as i64));
        }
        return Ok(());
    }
}

struct Job {
    fd: RawFd,
    dir: Dir,
    reqs: Vec<IoReq>,
    done: Arc<Done>,
}

#[derive(Default)]
struct Done {
    state: std::sync::Mutex<(usize, Option<Error>)>,
    cv: Condvar,
}

impl Done {
    fn finish(&self, result: Result<()>) {
        let mut st = self.state.lock().unwrap();
        st.0 -= 1;
        if let Err(e) = result {
            st.1.get_or_insert(e);
        }
        self.cv.notify_all();
    }
}

/// `pread`/`pwrite` spread over a few worker threads (plus the caller).
pub struct PreadEngine {
    jobs: Mutex<mpsc::Sender<Job>>,
    threads: usize,
    depth: u32,
    counters: IoCounters,
}

/// Requests a caller handles inline instead of waking workers.
const PREAD_INLINE_MAX: usize = 4;

impl PreadEngine {
    pub fn new(threads: usize, depth: u32) -> PreadEngine {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        for i in 0..threads {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("embank-pread-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock().unwrap().recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    let result = job.reqs.iter().try_for_each(|r| pio(job.fd, job.dir, r));
                    job.done.finish(result);
                })
                .expect("spawn pread worker");
        }
        PreadEngine { jobs: Mutex::new(tx), threads, depth, counters: IoCounters::default() }
    }
}

impl IoEngine for PreadEngine {
    #[cfg(test)]
    fn name(&self) -> &'static str {
        "pread"
    }

    fn submit(&self, fd: RawFd, dir: Dir, reqs: &[IoReq]) -> Result<()> {
        if reqs.len() <= PREAD_INLINE_MAX {
            self.counters.inflight(reqs.len().min(1));
            reqs.iter().try_for_each(|r| pio(fd, dir, r))?;
            self.counters.count(dir, reqs);
            return Ok(());
        }
        // One share per worker and one for the caller.
        let shares = self.threads + 1;
        let per = reqs.len().div_ceil(shares);
        let done = Arc::new(Done::default());
        let mut chunks = reqs.chunks(per);
        let own = chunks.next().unwrap_or(&[]);
        {
            let tx = self.jobs.lock();
            for chunk in chunks {
                done.state.lock().unwrap().0 += 1;
                let job = Job { fd, dir, reqs: chunk.to_vec(), done: Arc::clone(&done) };
                if let Err(mpsc::SendError(job)) = tx.send(job) {
                    // Workers are gone (only at process exit): do it here.
                    let result = job.reqs.iter().try_for_each(|r| pio(fd, dir, r));
                    done.finish(result);
                }
            }
        }
        self.counters.inflight(shares.min(reqs.len()));
        let own_result = own.iter().try_for_each(|r| pio(fd, dir, r));
        let mut st = done.state.lock().unwrap();
        while st.0 > 0 {
            st = done.cv.wait(st).unwrap();
        }
        own_result?;
        if let Some(e) = st.1.take() {
            return Err(e);
        }
        self.counters.count(dir, reqs);
        Ok(())
    }

    fn stats(&self) -> IoStats {
        self.counters.snapshot("pread", self.depth)
    }
}

/// Test hook: makes an engine fail. Counters count requests; when one reaches
/// zero the request it counts fails (after transferring half of its bytes when
/// `short` is set, so a write really leaves a torn record behind).
#[derive(Debug, Default)]
pub struct FaultPlan {
    /// Requests to let through before a read fails; negative = never.
    pub fail_read_after: AtomicI64,
    pub fail_write_after: AtomicI64,
    pub short: std::sync::atomic::AtomicBool,
    pub injected: AtomicU64,
}

impl FaultPlan {
    pub fn new() -> Arc<FaultPlan> {
        let p = FaultPlan::default();
        p.fail_read_after.store(-1, Ordering::Relaxed);
        p.fail_write_after.store(-1, Ordering::Relaxed);
        Arc::new(p)
    }

    pub fn fail_reads_after(&self, n: i64) {
        self.fail_read_after.store(n, Ordering::SeqCst);
    }

    pub fn fail_writes_after(&self, n: i64) {
        self.fail_write_after.store(n, Ordering::SeqCst);
    }

    pub fn clear(&self) {
        self.fail_read_after.store(-1, Ordering::SeqCst);
        self.fail_write_after.store(-1, Ordering::SeqCst);
    }

    /// Position in `n` requests that must fail, if any (and consumes the countdown).
    fn take(&self, dir: Dir, n: usize) -> Option<usize> {
        let counter = if dir == Dir::Read { &self.fail_read_after } else { &self.fail_write_after };
        let left = counter.load(Ordering::SeqCst);
        if left < 0 {
            return None;
        }
        if (left as usize) < n {
            counter.store(-1, Ordering::SeqCst);
            self.injected.fetch_add(1, Ordering::SeqCst);
            Some(left as usize)
        } else {
            counter.store(left - n as i64, Ordering::SeqCst);
            None
        }
    }
}

/// An engine that obeys a [`FaultPlan`] and otherwise passes requests through.
pub struct FaultyEngine {
    pub inner: Arc<dyn IoEngine>,
    pub plan: Arc<FaultPlan>,
}

impl IoEngine for FaultyEngine {
    #[cfg(test)]
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn submit(&self, fd: RawFd, dir: Dir, reqs: &[IoReq]) -> Result<()> {
        let Some(bad) = self.plan.take(dir, reqs.len()) else { return self.inner.submit(fd, dir, reqs) };
        // Everything before the failing request goes through, as a real partial batch would.
        self.inner.submit(fd, dir, &reqs[..bad])?;
        let r = reqs[bad];
        if self.plan.short.load(Ordering::SeqCst) {
            // Whole 512-byte blocks only (direct I/O); a one-block request transfers nothing.
            let half = IoReq { len: r.len / 2 / 512 * 512, ..r };
            if half.len > 0 {
                self.inner.submit(fd, dir, std::slice::from_ref(&half))?;
            }
            return Err(transfer_error(dir, &r, half.len as i64));
        }
        Err(transfer_error(dir, &r, -(libc::EIO as i64)))
    }

    fn stats(&self) -> IoStats {
        self.inner.stats()
    }
}

/// A zeroed heap buffer aligned for `O_DIRECT`.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN);
        let layout = Layout::from_size_align(len, BUF_ALIGN).expect("buffer layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, len }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: owned, initialized (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: owned, initialized.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Grows to at least `len` bytes (contents are not kept).
    pub fn reserve(&mut self, len: usize) {
        if self.len < len {
            *self = AlignedBuf::new(len.next_power_of_two());
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Layout::from_size_align(self.len, BUF_ALIGN).unwrap()) }
    }
}

/// The alignment `O_DIRECT` needs for offsets and lengths on the file system of `fd`
/// (statx `STATX_DIOALIGN`); `None` when the kernel or file system does not say.
pub fn direct_io_alignment(fd: RawFd) -> Option<u32> {
    // SAFETY: statx writes into the zeroed struct we own.
    unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let empty = c"";
        let rc = libc::statx(fd, empty.as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut st);
        if rc != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 || st.stx_dio_offset_align == 0 {
            return None;
        }
        Some(st.stx_dio_offset_align.max(st.stx_dio_mem_align))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn roundtrip(engine: &dyn IoEngine) {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        file.set_len(64 * 4096).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..64).map(|_| AlignedBuf::new(4096)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            b.as_mut_slice().fill(i as u8 + 1);
        }
        let reqs: Vec<IoReq> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| IoReq { offset: i as u64 * 4096, buf: b.as_mut_ptr(), len: 4096 })
            .collect();
        engine.submit(file.as_raw_fd(), Dir::Write, &reqs).unwrap();
        for b in bufs.iter_mut() {
            b.as_mut_slice().fill(0);
        }
        engine.submit(file.as_raw_fd(), Dir::Read, &reqs).unwrap();
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as u8 + 1), "buffer {i}");
        }
        // Reading past the end is a short read, reported as an error.
        let mut tail = AlignedBuf::new(8192);
        let past = IoReq { offset: 63 * 4096, buf: tail.as_mut_ptr(), len: 8192 };
        let e = engine.submit(file.as_raw_fd(), Dir::Read, &[past]).unwrap_err();
        assert!(e.to_string().contains("short read"), "{e}");
        let s = engine.stats();
        assert_eq!(s.reads, 64);
        assert_eq!(s.writes, 64);
        assert!(s.inflight_max >= 1);
    }

    #[test]
    fn pread_engine_roundtrip() {
        roundtrip(&PreadEngine::new(2, 32));
    }

    #[test]
    fn uring_engine_roundtrip() {
        match UringEngine::new(16) {
            Ok(e) => {
                roundtrip(&e);
                assert!(e.stats().inflight_max > 1, "io_uring keeps several requests in flight");
            }
            Err(e) => eprintln!("io_uring unavailable here, engine not tested: {e}"),
        }
    }

    /// What one engine writes the other reads back, byte for byte, with direct I/O.
    #[test]
    fn engines_agree_with_each_other() {
        let Ok(uring) = UringEngine::new(8) else {
            eprintln!("io_uring unavailable here: nothing to compare");
            return;
        };
        let pread = PreadEngine::new(2, 8);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).create(true).truncate(true);
            o.clone().custom_flags(libc::O_DIRECT).open(&path).or_else(|_| o.open(&path)).unwrap()
        };
        file.set_len(1 << 20).unwrap();
        let engines: [&dyn IoEngine; 2] = [&uring, &pread];
        for (w, r) in [(0, 1), (1, 0)] {
            let mut out = AlignedBuf::new(256 * 1024);
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ w as u64;
            for b in out.as_mut_slice() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            // 64 requests of 4 KiB scattered over the file, in a shuffled order.
            let reqs: Vec<IoReq> = (0..64u64)
                .map(|i| IoReq {
                    offset: ((i * 37) % 64) * 8192,
                    buf: unsafe { out.as_mut_ptr().add(i as usize * 4096) },
                    len: 4096,
                })
                .collect();
            engines[w].submit(file.as_raw_fd(), Dir::Write, &reqs).unwrap();
            let mut back = AlignedBuf::new(256 * 1024);
            let rreqs: Vec<IoReq> = reqs
                .iter()
                .enumerate()
                .map(|(i, q)| IoReq { buf: unsafe { back.as_mut_ptr().add(i * 4096) }, ..*q })
                .collect();
            engines[r].submit(file.as_raw_fd(), Dir::Read, &rreqs).unwrap();
            assert!(
                out.as_slice() == back.as_slice(),
                "written by {}, read by {}",
                engines[w].name(),
                engines[r].name()
            );
        }
    }

    #[test]
    fn fault_plan_fails_the_counted_request() {
        let plan = FaultPlan::new();
        let engine = FaultyEngine { inner: Arc::new(PreadEngine::new(1, 8)), plan: Arc::clone(&plan) };
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(dir.path().join("f")).unwrap();
        let mut b = AlignedBuf::new(4096);
        let req = IoReq { offset: 0, buf: b.as_mut_ptr(), len: 4096 };
        plan.fail_writes_after(1);
        engine.submit(file.as_raw_fd(), Dir::Write, &[req]).unwrap();
        let e = engine.submit(file.as_raw_fd(), Dir::Write, &[req]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io);
        engine.submit(file.as_raw_fd(), Dir::Write, &[req]).unwrap();
        assert_eq!(plan.injected.load(Ordering::SeqCst), 1);
    }
}

//! The background inserter: the misses of async lookups fetched from the table and
//! inserted together on the cache's side stream.

use super::*;

impl Inner {
    /// The background inserter's work: the misses of the queued lookups, fetched and
    /// inserted together on the side stream.
    pub(crate) fn insert_jobs(&self, jobs: Vec<Job>) -> Result<()> {
        let _cx = self.dev.enter()?;
        let mut misses: Vec<u64> = Vec::new();
        let mut give = Vec::with_capacity(jobs.len());
        let mut first_err = None;
        for mut job in jobs {
            let r = (|| -> Result<()> {
                self.dev.wait(job.scratch.copied)?;
                let counted = job.scratch.host.u64s(0, PAYLOAD_HEAD)[job.parity] as usize;
                let m = counted.min(job.cap);
                if counted > m {
                    self.stats.lock().async_dropped += (counted - m) as u64;
                }
                if m > job.count_hint {
                    let h = job.count_hint;
                    // SAFETY: the find is done (waited); the pinned buffer is ours.
                    unsafe {
                        self.dev.dtoh(
                            job.scratch.host.ptr.add(8 * (PAYLOAD_HEAD + 3 * h)),
                            job.scratch.dev_buf.ptr + 8 * (PAYLOAD_HEAD + 3 * h) as u64,
                            8 * 3 * (m - h),
                            self.side,
                        )?
                    };
                    self.dev.record(job.scratch.copied, self.side)?;
                    self.dev.wait(job.scratch.copied)?;
                }
                misses.extend_from_slice(job.scratch.host.u64s(8 * PAYLOAD_HEAD, 3 * m));
                self.record_window((job.n - counted) as u64, job.n as u64);
                let mut stats = self.stats.lock();
                stats.hits += (job.n - counted) as u64;
                stats.misses += counted as u64;
                stats.default_answers += counted as u64;
                Ok(())
            })();
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
            give.push(job.scratch);
        }
        for s in give {
            self.give_scratch(s); // before the table is read: the lookups may reuse them
        }
        match first_err {
            Some(e) => Err(e),
            None if misses.is_empty() => Ok(()),
            None => {
                let n = misses.len() / 3;
                // After the payload's miss counts: the next find with this scratch needs
                // its count zero (a find zeroes the one the one after it uses).
                let base = FILL_BASE;
                let mut s = self.take_scratch(FillLayout::most(base, self.row_bytes, n))?;
                self.dev.wait(s.last)?;
                let r = self.fill(&mut s, base, self.side, None, &misses, C_ASYNC_INSERTS);
                self.give_scratch(s);
                r
            }
        }
    }
}

pub(crate) fn insert_loop(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let jobs: Vec<Job> = {
            let mut q = inner.queue.lock();
            if q.jobs.is_empty() {
                if q.closed {
                    return;
                }
                // Hold the cache only while working: wait with a timeout, then let go.
                inner.queue_cv.wait_for(&mut q, std::time::Duration::from_millis(20));
                if q.jobs.is_empty() {
                    drop(q);
                    // Lookups that stopped coming leave their misses unread: read them.
                    if let Ok(_cx) = inner.dev.enter() {
                        let _ = inner.poll_unread(false);
                    }
                    continue;
                }
            }
            q.busy = true;
            q.jobs.drain(..).collect()
        };
        // A panic would leave `wait` waiting forever: it becomes the inserter's error.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.insert_jobs(jobs)))
            .unwrap_or_else(|_| Err(Error::new(ErrorKind::Corrupt, "the GPU cache's inserter panicked")));
        let mut q = inner.queue.lock();
        q.busy = false;
        if let Err(e) = r {
            inner.stats.lock().async_errors += 1;
            q.error.get_or_insert(e.to_string());
        }
        inner.queue_cv.notify_all();
    }
}

//! A lookup: **find** (and **pool**) launched on the caller's stream, then, with misses,
//! their rows read from the table and **fill** launched (sync), or the misses queued for
//! the background inserter (async).

use super::*;

impl Inner {
    pub(crate) fn lookup(
        &self,
        ids: u64,
        n: usize,
        out: u64,
        stream: Stream,
        given: u64,
        pooled: Option<Bags>,
    ) -> Result<Option<usize>> {
        self.check_open()?;
        let _cx = self.dev.enter()?; // the caller's thread may never have used the device
        if let Some(e) = self.queue.lock().error.take() {
            return Err(Error::new(ErrorKind::Io, format!("a background insert of the GPU cache failed: {e}")));
        }
        if self.opts.policy == Policy::Custom && given == 0 {
            return Err(invalid("policy custom needs the scores of the ids"));
        }
        // No ids, or no bags to pool them into: nothing to launch (and no count to read).
        if pooled.map_or(n == 0, |b| b.bags == 0) {
            return Ok(Some(0));
        }
        if self.unread.lock().len() >= POLL_AT {
            self.poll_unread(false)?;
        }
        // An async lookup's misses are filled from the inserter's own scratch: this one
        // needs room for the find only. A sync one fills from it too (grown now: growing
        // later would lose the misses' places).
        let planned_async = self.asynchronous(&self.state.lock());
        let cap = if planned_async { n.min(self.opts.async_miss_cap.max(1)) } else { n };
        let fl = FindLayout::new(cap);
        let room = if planned_async { fl.end } else { fl.end + FillLayout::most(0, self.row_bytes, n) };
        let mut s = self.take_scratch(room)?;
        // The previous user's copies out of the pinned buffer and its launches are done
        // long before in practice; this wait is what makes reusing it safe.
        self.dev.wait(s.last)?;
        let (asynchronous, hint) = {
            let mut st = self.state.lock();
            self.enter_ordered(&mut st, stream)?;
            self.apply_pending(&mut st, stream)?;
            st.clock += 1;
            let asynchronous = planned_async;
            let hint = st.miss_hint.min(cap);
            let payload = s.dev_buf.ptr + fl.payload as u64;
            let miss_at = s.dev_buf.ptr + fl.miss_at as u64;
            // The last warp copies the count and the first `hint` misses to the pinned
            // buffer itself: no copy to launch, and none to wait for but the kernel.
            let warps = pooled.map_or(n, |b| b.bags);
            let reported = warps <= self.opts.report_warps_max;
            let host = if reported { s.host.dev_ptr } else { 0 };
            let r = Report { host, done: payload + 16, hint: hint as u64, warps: warps as u64 };
            match pooled {
                None => {
                    let vec4 = self.desc.dtype == 0 && self.dim.is_multiple_of(4) && out.is_multiple_of(16);
                    let args = FindArgs {
                        c: self.desc_now(&st),
                        ids,
                        out,
                        dflt: self.dflt.ptr,
                        payload,
                        miss_at,
                        given,
                        n: n as u64,
                        cap: cap as u64,
                        r,
                        parity: s.parity,
                        vec4: u32::from(vec4),
                    };
                    self.dev.launch(Kernel::Find, n as u64 * 32, bytes_of(&args), stream)?;
                }
                Some(b) => {
                    let args = PoolArgs {
                        c: self.desc_now(&st),
                        ids,
                        offsets: b.offsets,
                        weights: b.weights,
                        out,
                        dflt: self.dflt.ptr,
                        payload,
                        miss_at,
                        miss_w: s.dev_buf.ptr + fl.miss_w as u64,
                        given,
                        n: n as u64,
                        bags: b.bags as u64,
                        cap: cap as u64,
                        r,
                        parity: s.parity,
                        mean: u32::from(b.mean),
                        add_default: u32::from(asynchronous),
                        pad: 0,
                    };
                    self.dev.launch(Kernel::Pool, b.bags as u64 * 32, bytes_of(&args), stream)?;
                }
            }
            if !reported {
                // SAFETY: the pinned buffer is this caller's until the scratch goes back,
                // and nobody reads it before `copied`.
                unsafe { self.dev.dtoh(s.host.ptr, payload, 8 * (PAYLOAD_HEAD + 3 * hint), stream)? };
            }
            self.mark(&mut st, s.copied, stream)?;
            s.last = s.copied;
            (asynchronous, hint)
        };
        let parity = s.parity as usize;
        s.parity ^= 1;
        if asynchronous {
            // No wait: the misses are read once the copy is done, by a later call
            // (poll_unread) or the inserter; an all-hit lookup's scratch just goes back.
            let mut unread = self.unread.lock();
            unread.push_back(Job { scratch: s, n, count_hint: hint, parity, cap });
            let over = unread.len() > ASYNC_JOBS_MAX;
            drop(unread);
            if over {
                self.poll_unread(true)?;
            }
            self.stats.lock().lookups += 1;
            return Ok(None);
        }
        self.dev.wait(s.copied)?; // the one host sync
        let m = s.host.u64s(0, PAYLOAD_HEAD)[parity] as usize;
        if m > hint {
            // More misses than the hint: their rest, and a second wait.
            // SAFETY: as above.
            unsafe {
                self.dev.dtoh(
                    s.host.ptr.add(8 * (PAYLOAD_HEAD + 3 * hint)),
                    s.dev_buf.ptr + 8 * (PAYLOAD_HEAD + 3 * hint) as u64,
                    8 * 3 * (m - hint),
                    stream,
                )?
            };
            self.dev.record(s.copied, stream)?;
            self.dev.wait(s.copied)?;
        }
        {
            let mut st = self.state.lock();
            st.miss_hint = (2 * m).max(MISS_HINT_MIN);
        }
        let result = if m > 0 {
            let misses: Vec<u64> = s.host.u64s(8 * PAYLOAD_HEAD, 3 * m).to_vec();
            let miss_w = if pooled.is_some() { s.dev_buf.ptr + fl.miss_w as u64 } else { 0 };
            let answer = Answer { out, miss_at: s.dev_buf.ptr + fl.miss_at as u64, miss_w, n: m };
            self.fill(&mut s, fl.end, stream, Some(answer), &misses, C_SYNC_INSERTS)
        } else {
            Ok(())
        };
        self.give_scratch(s);
        result?;
        self.record_window((n - m) as u64, n as u64);
        let mut stats = self.stats.lock();
        stats.lookups += 1;
        stats.hits += (n - m) as u64;
        stats.misses += m as u64;
        stats.host_syncs += 1 + u64::from(m > hint);
        Ok(Some(n - m))
    }

    /// Fetches the rows of `misses` ((key, version, score) triples) from the table and, in
    /// one copy and one launch on `stream`, answers them (`answer`) and inserts the keys
    /// the table holds. Uses `s` after byte `base`.
    pub(crate) fn fill(
        &self,
        s: &mut Scratch,
        base: usize,
        stream: Stream,
        answer: Option<Answer>,
        misses: &[u64],
        which: u32,
    ) -> Result<()> {
        let m = misses.len() / 3;
        let mut at: HashMap<u64, u32> = HashMap::with_capacity(m);
        let mut uniq: Vec<u64> = Vec::with_capacity(m);
        let mut ver: Vec<u32> = Vec::with_capacity(m);
        let mut score: Vec<u64> = Vec::with_capacity(m);
        let mut row_of: Vec<u32> = Vec::with_capacity(m);
        for t in misses.chunks_exact(3) {
            let (k, v, sc) = (t[0], t[1] as u32, t[2]);
            let u = *at.entry(k).or_insert_with(|| {
                uniq.push(k);
                ver.push(v);
                score.push(0);
                (uniq.len() - 1) as u32
            });
            let u = u as usize;
            score[u] = score[u].max(sc);
            row_of.push(u as u32);
        }
        let u_n = uniq.len();
        let answers = if answer.is_some() { m } else { 0 };
        let most = FillLayout::new(base, self.row_bytes, answers, u_n, u_n, u_n);
        s.reserve(&self.dev, most.end, stream)?;
        let mut found = vec![false; u_n];
        {
            let rows = s.host.slice_mut(most.rows, u_n * self.row_bytes);
            if self.stored == 0 && self.table.meta().dtype != DType::F32 {
                // SAFETY: 256-aligned base, f32 rows.
                let f = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr().cast::<f32>(), u_n * self.dim) };
                self.table.lookup(&uniq, f, &mut found)?;
            } else {
                self.table.lookup_stored(&uniq, rows, &mut found)?;
            }
        }
        // The keys to insert, grouped by bucket, by key within one: the misses arrive in
        // the order the device's warps counted them (any order), and which of a bucket's
        // new keys get its free slots must not depend on it.
        let nb = self.desc.n_buckets as u64;
        let mut ins: Vec<(u64, u32)> = (0..u_n)
            .filter(|&u| found[u] && uniq[u] < LOCKED_KEY)
            .map(|u| (bucket_of(mix(uniq[u]), nb), u as u32))
            .collect();
        ins.sort_unstable_by_key(|&(b, u)| (b, uniq[u as usize]));
        let mut groups: Vec<u32> = Vec::new();
        for (i, (b, _)) in ins.iter().enumerate() {
            if i == 0 || ins[i - 1].0 != *b {
                groups.push(i as u32);
            }
        }
        let n_groups = groups.len();
        groups.push(ins.len() as u32);
        let lay = FillLayout::new(base, self.row_bytes, answers, u_n, ins.len(), n_groups);
        let h = &mut s.host;
        let k = ins.len();
        h.u64s(lay.keys, k).iter_mut().zip(&ins).for_each(|(d, &(_, u))| *d = uniq[u as usize]);
        h.u64s(lay.key_score, k).iter_mut().zip(&ins).for_each(|(d, &(_, u))| *d = score[u as usize]);
        h.u32s(lay.row_of, answers).copy_from_slice(&row_of[..answers]);
        h.u32s(lay.key_row, k).iter_mut().zip(&ins).for_each(|(d, &(_, u))| *d = u);
        h.u32s(lay.key_ver, k).iter_mut().zip(&ins).for_each(|(d, &(_, u))| *d = ver[u as usize]);
        h.u32s(lay.groups, n_groups + 1).copy_from_slice(&groups);
        let d = s.dev_buf.ptr;
        let at_dev = |off: usize| d + off as u64;
        let mut st = self.state.lock();
        self.enter_ordered(&mut st, stream)?;
        // SAFETY: the pinned bytes stay unchanged until `done` (the next user waits).
        unsafe { self.dev.htod(at_dev(base), h.ptr.add(base), lay.end - base, stream)? };
        let args = FillArgs {
            c: self.desc_now(&st),
            out: answer.as_ref().map_or(0, |a| a.out),
            miss_at: answer.as_ref().map_or(0, |a| a.miss_at),
            row_of: at_dev(lay.row_of),
            rows: at_dev(lay.rows),
            keys: at_dev(lay.keys),
            key_row: at_dev(lay.key_row),
            key_ver: at_dev(lay.key_ver),
            key_score: at_dev(lay.key_score),
            groups: at_dev(lay.groups),
            miss_w: answer.as_ref().map_or(0, |a| a.miss_w),
            n_answer: answers as u64,
            n_groups: n_groups as u64,
            stored: self.stored,
            row_bytes: self.row_bytes as u32,
            which,
            pad: 0,
        };
        debug_assert!(answer.as_ref().is_none_or(|a| a.n == answers));
        self.dev.launch(Kernel::Fill, (answers + n_groups) as u64 * 32, bytes_of(&args), stream)?;
        self.mark(&mut st, s.done, stream)?;
        s.last = s.done;
        Ok(())
    }
}

pub(crate) struct Answer {
    out: u64,
    miss_at: u64,
    /// Pooled: the misses' weights (`miss_at` holds their bags); 0: rows.
    miss_w: u64,
    n: usize,
}

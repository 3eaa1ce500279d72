//! A table of a remote store: each batch split by shard into requests, sent at once,
//! the replies put back in the caller's order.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use embank_core::TableMeta;
use embank_core::{Error, ExportCursor, Result};

use super::route::Req;
use super::Client;
use crate::proto::{self, as_bytes, mask_bytes, Op};

/// A table of a remote store: the operations of `embank_core::Table`, over the wire.
#[derive(Clone)]
pub struct RemoteTable {
    pub(super) client: Client,
    pub(super) name: String,
    pub(super) dim: usize,
    /// The name requests carry (each server's id for it is learnt on first use).
    pub(super) id: Arc<str>,
    pub(super) meta: TableMeta,
}

impl std::fmt::Debug for RemoteTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTable").field("name", &self.name).field("dim", &self.dim).finish()
    }
}

/// Requests for a keyed operation, with each request's positions in the caller's batch.
pub(super) struct Plan {
    pub(super) reqs: Vec<Req>,
    pub(super) positions: Vec<Vec<usize>>,
}

impl RemoteTable {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table's description (from shard 0; every shard was created alike).
    pub fn meta(&self) -> TableMeta {
        self.meta.clone()
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub(super) fn check_rows(&self, what: &str, keys: usize, rows: usize) -> Result<()> {
        if rows != keys * self.dim {
            return Err(Error::invalid(format!(
                "{what}: table {:?} has dim {}, so {keys} keys need {} row elements, got {rows}",
                self.name,
                self.dim,
                keys * self.dim
            )));
        }
        Ok(())
    }

    /// Splits `keys` by shard and into requests; `rows` (if any) travel after the keys.
    pub(super) fn plan(&self, op: Op, keys: &[u64], rows: Option<&[f32]>) -> Plan {
        self.plan_with(op, &[], keys, rows)
    }

    /// [`plan`](Self::plan) with `prefix` words before each request's keys.
    pub(super) fn plan_with(&self, op: Op, prefix: &[u64], keys: &[u64], rows: Option<&[f32]>) -> Plan {
        self.plan_wide(op, prefix, keys, rows, self.dim)
    }

    /// [`plan_with`](Self::plan_with) with rows of `d` elements (records with state).
    pub(super) fn plan_wide(&self, op: Op, prefix: &[u64], keys: &[u64], rows: Option<&[f32]>, d: usize) -> Plan {
        let topo = self.client.topology();
        let n = topo.shards.len();
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); n];
        if n == 1 {
            by_shard[0] = (0..keys.len()).collect();
        } else {
            for (i, &k) in keys.iter().enumerate() {
                by_shard[proto::shard_of(k, n as u32) as usize].push(i);
            }
        }
        let max = self.client.inner.opts.keys_per_request_max;
        let mut plan = Plan { reqs: Vec::new(), positions: Vec::new() };
        for (shard, positions) in by_shard.into_iter().enumerate() {
            for chunk in positions.chunks(max) {
                let rows_len = rows.map_or(0, |_| chunk.len() * proto::row_bytes(d));
                let mut body = Vec::with_capacity(prefix.len() * 8 + chunk.len() * 8 + rows_len);
                for w in prefix {
                    body.extend_from_slice(&w.to_le_bytes());
                }
                for &i in chunk {
                    body.extend_from_slice(&keys[i].to_le_bytes());
                }
                if let Some(rows) = rows {
                    for &i in chunk {
                        body.extend_from_slice(as_bytes(&rows[i * d..(i + 1) * d]));
                    }
                }
                plan.reqs.push(Req {
                    shard: Arc::clone(&topo.shards[shard]),
                    op,
                    table: Some(Arc::clone(&self.id)),
                    count: chunk.len() as u32,
                    body,
                    min_checkpoint: self.client.inner.opts.min_checkpoint,
                });
                plan.positions.push(chunk.to_vec());
            }
        }
        plan
    }

    /// Copies reply rows (`body[at..]`, one per position) into `out`.
    pub(super) fn scatter(&self, body: &[u8], at: usize, positions: &[usize], out: &mut [f32]) -> Result<()> {
        scatter_wide(body, at, positions, out, self.dim)
    }

    /// Rows of `keys` into `out`; missing rows are created with the initializer.
    pub fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.pull_min(keys, out, self.client.inner.opts.min_checkpoint)
    }

    /// [`pull`](Self::pull) from replicas serving checkpoint `min_checkpoint` or later
    /// (for a read-only replica group; a writable primary takes pulls alone).
    pub fn pull_min(&self, keys: &[u64], out: &mut [f32], min_checkpoint: Option<u64>) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let mut plan = self.plan(Op::Pull, keys, None);
        let min_checkpoint = min_checkpoint.or(self.client.inner.opts.min_checkpoint);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min_checkpoint);
        self.client.run(&plan.reqs, |i, _, _, body| self.scatter(&body, 0, &plan.positions[i], out))
    }

    /// Rows of `keys` and a found mask; never creates rows.
    pub fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.lookup_min(keys, out, found, self.client.inner.opts.min_checkpoint)
    }

    /// [`lookup`](Self::lookup) from replicas serving checkpoint `min_checkpoint` or later
    /// (the publisher's batch id): a model never mixes rows of different training
    /// checkpoints unknowingly. Fails if a shard has no such replica yet. `None`: the
    /// client's `min_checkpoint`.
    ///
    /// What is atomic: each shard's part of the call. On a shard of read-only replicas (fed
    /// by an update stream) a part of more than one request (more keys than
    /// `keys_per_request_max`) is read at one checkpoint, the newest a replica serves when
    /// the call begins (each request an exact read of it, answered by any replica still
    /// holding it); a part of one request is one checkpoint anyway. Different shards may
    /// answer at different checkpoints: for one checkpoint across shards (and tables),
    /// read with [`lookup_at`](Self::lookup_at) at a checkpoint every shard serves (the
    /// lowest `batch_id` of [`Client::served`]).
    pub fn lookup_min(
        &self,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
        min_checkpoint: Option<u64>,
    ) -> Result<()> {
        self.check_rows("lookup", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let mut plan = self.plan(Op::Lookup, keys, None);
        let min_checkpoint = min_checkpoint.or(self.client.inner.opts.min_checkpoint);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min_checkpoint);
        self.pin_checkpoints(&mut plan, min_checkpoint)?;
        self.client.run(&plan.reqs, |i, _, _, body| self.read_mask(&body, &plan.positions[i], out, found))
    }

    /// Makes every shard of read-only replicas whose part of `plan` takes more than one
    /// request read at one checkpoint: the newest one of its replicas serves now (at
    /// least `min_checkpoint`), each request an exact read (`LOOKUP_AT`) of it.
    fn pin_checkpoints(&self, plan: &mut Plan, min_checkpoint: Option<u64>) -> Result<()> {
        let mut per_shard: Vec<usize> = Vec::new();
        for r in &plan.reqs {
            if per_shard.len() <= r.shard.index {
                per_shard.resize(r.shard.index + 1, 0);
            }
            per_shard[r.shard.index] += 1;
        }
        let mut pinned: Vec<Option<u64>> = vec![None; per_shard.len()];
        for req in plan.reqs.iter_mut() {
            let shard = Arc::clone(&req.shard);
            if per_shard[shard.index] < 2 || !shard.replicas.iter().all(|e| e.read_only.load(Ordering::Relaxed)) {
                continue;
            }
            let n = match pinned[shard.index] {
                Some(n) => n,
                None => {
                    let n = self.client.serving_now(&shard, min_checkpoint.unwrap_or(0))?;
                    pinned[shard.index] = Some(n);
                    n
                }
            };
            let mut body = Vec::with_capacity(8 + req.body.len());
            body.extend_from_slice(&n.to_le_bytes());
            body.extend_from_slice(&req.body);
            req.body = body;
            req.op = Op::LookupAt;
            req.min_checkpoint = Some(n);
        }
        Ok(())
    }

    /// Rows of `keys` as the table stores them (`row_bytes` bytes each, see
    /// `embank_core::Table::lookup_stored`) and a found mask; never creates rows. The
    /// rows cross the network as stored: an int8 row of dim 128 in 136 bytes, not 512.
    pub fn lookup_stored(&self, keys: &[u64], out: &mut [u8], found: &mut [bool]) -> Result<()> {
        let rb = self.meta.dtype.row_bytes(self.dim);
        embank_core::check_stored_lens(&self.name, self.meta.dtype, self.dim, keys.len(), out.len(), found.len())?;
        let mut plan = self.plan(Op::LookupStored, keys, None);
        let min_checkpoint = self.client.inner.opts.min_checkpoint;
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = min_checkpoint);
        self.client.run(&plan.reqs, |i, _, _, body| {
            let positions = &plan.positions[i];
            let m = mask_bytes(positions.len());
            if body.len() != m + positions.len() * rb {
                return Err(Error::corrupt(format!(
                    "lookup_stored reply of {} bytes for {} rows of {rb} bytes",
                    body.len(),
                    positions.len()
                )));
            }
            for (j, &p) in positions.iter().enumerate() {
                found[p] = body[j / 8] & (1 << (j % 8)) != 0;
                out[p * rb..(p + 1) * rb].copy_from_slice(&body[m + j * rb..m + (j + 1) * rb]);
            }
            Ok(())
        })
    }

    /// Rows of `keys` and a found mask exactly as they were at the publisher's checkpoint
    /// `batch_id` (a replica group fed by an update stream; a primary: its retained
    /// checkpoint of that batch id), every shard at that same checkpoint: a model reading
    /// several tables at one `batch_id` never mixes two. Each shard's replicas holding it
    /// answer (see [`Client::served`]'s `readable`); fails with `NotFound` when none does.
    pub fn lookup_at(&self, batch_id: u64, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        self.check_rows("lookup_at", keys.len(), out.len())?;
        if found.len() != keys.len() {
            return Err(Error::invalid(format!("lookup: {} keys but a found-mask of {}", keys.len(), found.len())));
        }
        let mut plan = self.plan_with(Op::LookupAt, &[batch_id], keys, None);
        plan.reqs.iter_mut().for_each(|r| r.min_checkpoint = Some(batch_id));
        self.client.run(&plan.reqs, |i, _, _, body| self.read_mask(&body, &plan.positions[i], out, found))
    }

    /// Reads a lookup reply (found mask, then rows) into `out` and `found`.
    pub(super) fn read_mask(
        &self,
        body: &[u8],
        positions: &[usize],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        let m = mask_bytes(positions.len());
        if body.len() < m {
            return Err(Error::corrupt("lookup reply shorter than its mask"));
        }
        for (j, &p) in positions.iter().enumerate() {
            found[p] = body[j / 8] & (1 << (j % 8)) != 0;
        }
        self.scatter(body, m, positions, out)
    }

    pub(super) fn check_finite(&self, what: &str, keys: &[u64], rows: &[f32]) -> Result<()> {
        if let Some(i) = rows.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(format!(
                "{what}: row of key {} holds a non-finite value ({}); nothing was written",
                keys[i / self.dim],
                rows[i]
            )));
        }
        Ok(())
    }

    /// Writes rows; with duplicate keys the last row wins (as embedded).
    pub fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        self.check_rows("push", keys.len(), rows.len())?;
        self.check_finite("push", keys, rows)?;
        let (ukeys, urows) = last_of_each(keys, rows, self.dim);
        let plan = self.plan(Op::Push, &ukeys, Some(&urows));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// Applies the table's optimizer; gradients of duplicate keys are summed first.
    pub fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.check_rows("push_grad", keys.len(), grads.len())?;
        self.check_finite("push_grad", keys, grads)?;
        let (ukeys, sums) = embank_core::sum_duplicates(keys, grads, self.dim);
        let plan = self.plan(Op::PushGrad, &ukeys, Some(&sums));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// [`push_grad`](Self::push_grad) as part of training step `step` (see
    /// `embank_core::Table::push_grad_at`): every shard's part carries the step, so an
    /// optimizer with a table step (FBGEMM's Adam and LAMB kinds) bias-corrects with it.
    pub fn push_grad_at(&self, keys: &[u64], grads: &[f32], step: u64) -> Result<()> {
        if step == 0 {
            return Err(Error::invalid("push_grad: training steps count from 1, got step 0; nothing was written"));
        }
        self.check_rows("push_grad", keys.len(), grads.len())?;
        self.check_finite("push_grad", keys, grads)?;
        let (ukeys, sums) = embank_core::sum_duplicates(keys, grads, self.dim);
        let plan = self.plan_with(Op::PushGradAt, &[step], &ukeys, Some(&sums));
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// The training step of the table's last update: the newest of its shards' (each
    /// keeps its own; a shard no step reached says 0).
    pub fn optimizer_step(&self) -> Result<u64> {
        let replies = self.client.broadcast(Op::OpenTable, self.name.as_bytes(), None)?;
        let mut step = 0;
        for (_, body) in replies {
            let m: TableMeta =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad table description: {e}")))?;
            step = step.max(m.optimizer_step);
        }
        Ok(step)
    }

    /// A training worker's pull under the table's staleness bound (see
    /// `embank_core::Table::pull_held`). Keys are deduplicated per shard request by the
    /// server; `timeout` bounds the wait of each shard.
    ///
    /// Holds are taken in one global order, (shard, key), so that workers pulling
    /// overlapping batches cannot deadlock across shards: the requests go out one after
    /// the other, shard 0's first, each shard's keys sorted (the server takes a request's
    /// keys in sorted order). Slower than a plain pull's parallel requests, but two
    /// workers each holding a key the other waits for on another shard would otherwise
    /// wait until their timeouts.
    pub fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()> {
        self.check_rows("pull", keys.len(), out.len())?;
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_unstable_by_key(|&i| (self.shard_of(keys[i]), keys[i]));
        let sorted: Vec<u64> = order.iter().map(|&i| keys[i]).collect();
        let plan = self.plan_with(Op::PullHeld, &[worker, timeout.as_millis() as u64], &sorted, None);
        let mut rows = vec![0f32; out.len()];
        for (i, req) in plan.reqs.iter().enumerate() {
            self.client.run(std::slice::from_ref(req), |_, _, _, body| {
                self.scatter(&body, 0, &plan.positions[i], &mut rows)
            })?;
        }
        let d = self.dim;
        for (j, &i) in order.iter().enumerate() {
            out[i * d..(i + 1) * d].copy_from_slice(&rows[j * d..(j + 1) * d]);
        }
        Ok(())
    }

    /// A training worker's push_grad: applies it and gives back the worker's holds.
    pub fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.push_grad_held_at(worker, keys, grads, None)
    }

    /// [`push_grad_held`](Self::push_grad_held) as part of training step `step` (`None`:
    /// a step of its own, as `push_grad`).
    pub fn push_grad_held_at(&self, worker: u64, keys: &[u64], grads: &[f32], step: Option<u64>) -> Result<()> {
        if step == Some(0) {
            return Err(Error::invalid("push_grad: training steps count from 1, got step 0; nothing was written"));
        }
        self.check_rows("push_grad", keys.len(), grads.len())?;
        self.check_finite("push_grad", keys, grads)?;
        let (ukeys, sums) = embank_core::sum_duplicates(keys, grads, self.dim);
        let plan = match step {
            Some(s) => self.plan_with(Op::PushGradHeldAt, &[worker, s], &ukeys, Some(&sums)),
            None => self.plan_with(Op::PushGradHeld, &[worker], &ukeys, Some(&sums)),
        };
        self.client.run(&plan.reqs, |_, _, _, _| Ok(()))
    }

    /// Gives back every hold of `worker` on every shard; returns how many.
    pub fn release(&self, worker: u64) -> Result<u64> {
        let replies = self.client.broadcast(Op::Release, &worker.to_le_bytes(), Some(&self.id))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    /// Deletes keys; returns how many were present.
    pub fn delete(&self, keys: &[u64]) -> Result<u64> {
        let mut seen = HashSet::with_capacity(keys.len());
        let uniq: Vec<u64> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let plan = self.plan(Op::Delete, &uniq, None);
        let mut gone = 0;
        self.client.run(&plan.reqs, |_, _, _, body| {
            gone += u64_reply(&body)?;
            Ok(())
        })?;
        Ok(gone)
    }

    /// Asks each shard to load these rows into its row cache. `false` if any shard dropped the hint.
    pub fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        let plan = self.plan(Op::Lookahead, keys, None);
        let mut all = true;
        self.client.run(&plan.reqs, |_, _, _, body| {
            all &= u64_reply(&body)? == 1;
            Ok(())
        })?;
        Ok(all)
    }

    /// Live rows over every shard.
    pub fn len(&self) -> Result<u64> {
        let replies = self.client.broadcast(Op::Len, &[], Some(&self.id))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Evicts rows past their TTL on every shard; returns how many.
    pub fn evict_expired(&self) -> Result<u64> {
        let replies = self.client.broadcast(Op::EvictExpired, &[], Some(&self.id))?;
        replies.iter().map(|(_, b)| u64_reply(b)).sum()
    }

    /// Changes the optimizer's learning rate on every shard.
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        self.client.broadcast(Op::SetLr, &lr.to_le_bytes(), Some(&self.id)).map(|_| ())
    }

    /// The table's statistics with the embedded table's fields, summed over the
    /// shards, and each shard's own under `"shards"`.
    pub fn stats(&self) -> Result<serde_json::Value> {
        let replies = self.client.broadcast_from(Op::TableStats, &[], Some(&self.id))?;
        let mut shards = Vec::new();
        for (s, r, _, body) in replies {
            let mut v: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| Error::corrupt(format!("bad stats: {e}")))?;
            v["shard"] = serde_json::json!(s.replicas[r].addr);
            shards.push(v);
        }
        let mut total = merge_stats(&shards);
        total["shards"] = serde_json::Value::Array(shards);
        Ok(total)
    }

    /// Streams every `(key, row)`, shard after shard, in chunks of at most `chunk_keys`.
    pub fn export(&self, chunk_keys: usize, f: impl FnMut(&[u64], &[f32]) -> Result<()>) -> Result<()> {
        self.export_pages(None, chunk_keys, f)
    }

    /// Streams every `(key, row)` as it was at the publisher's checkpoint `batch_id`
    /// (each shard from a replica holding it), in chunks of at most `chunk_keys`; a key
    /// may come twice, with the same row. Fails with `NotFound` if a shard's replicas drop
    /// the checkpoint before their pages are read (start again at a newer one).
    pub fn export_at(
        &self,
        batch_id: u64,
        chunk_keys: usize,
        f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        self.export_pages(Some(batch_id), chunk_keys, f)
    }

    fn export_pages(
        &self,
        at: Option<u64>,
        chunk_keys: usize,
        mut f: impl FnMut(&[u64], &[f32]) -> Result<()>,
    ) -> Result<()> {
        let d = self.dim;
        let topo = self.client.topology();
        for shard in &topo.shards {
            let mut cursor = ExportCursor::START;
            loop {
                let mut body = Vec::with_capacity(32);
                if let Some(b) = at {
                    body.extend_from_slice(&b.to_le_bytes());
                }
                body.extend_from_slice(&cursor.generation.to_le_bytes());
                body.extend_from_slice(&cursor.bucket.to_le_bytes());
                body.extend_from_slice(&(chunk_keys as u64).to_le_bytes());
                let req = Req {
                    shard: Arc::clone(shard),
                    op: if at.is_some() { Op::ExportAt } else { Op::Export },
                    table: Some(Arc::clone(&self.id)),
                    count: 0,
                    body,
                    min_checkpoint: at,
                };
                let mut page = None;
                self.client.run(std::slice::from_ref(&req), |_, _, h, b| {
                    page = Some((h.count as usize, b));
                    Ok(())
                })?;
                let (n, b) = page.expect("one reply");
                if b.len() != 24 + n * 8 + n * proto::row_bytes(d) {
                    return Err(Error::corrupt("export page of the wrong length"));
                }
                let word = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
                let (generation, bucket, done) = (word(0), word(8), word(16));
                let keys: Vec<u64> = (0..n).map(|i| word(24 + i * 8)).collect();
                let mut rows = vec![0f32; n * d];
                let positions: Vec<usize> = (0..n).collect();
                self.scatter(&b, 24 + n * 8, &positions, &mut rows)?;
                if n > 0 {
                    f(&keys, &rows)?;
                }
                if done == 1 {
                    break;
                }
                cursor = ExportCursor { generation, bucket };
            }
        }
        Ok(())
    }

    /// Which shard serves `key` (for tests and tools).
    pub fn shard_of(&self, key: u64) -> usize {
        proto::shard_of(key, self.client.shard_count() as u32) as usize
    }
}

pub(super) fn u64_reply(body: &[u8]) -> Result<u64> {
    let b: [u8; 8] = body.try_into().map_err(|_| Error::corrupt("expected an 8-byte reply"))?;
    Ok(u64::from_le_bytes(b))
}

/// Numeric statistics that are the same on every shard, not parts of a total.
pub(super) const KEEP_FIRST: [&str; 5] = ["dim", "io_align", "depth", "admit_after", "staleness_bound"];

/// Sums statistics documents field by field: numbers add up, arrays of numbers add up
/// element-wise, `tables` are merged by name, ratios are recomputed from their parts,
/// anything else is taken from the first document.
pub fn merge_stats(docs: &[serde_json::Value]) -> serde_json::Value {
    use serde_json::Value;
    let Some(first) = docs.first() else { return Value::Null };
    match first {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                let parts: Vec<Value> = docs.iter().map(|d| d.get(k).cloned().unwrap_or(Value::Null)).collect();
                let merged = if k == "tables" {
                    merge_tables(&parts)
                } else if k == "shard" || k == "path" {
                    continue;
                } else if KEEP_FIRST.contains(&k.as_str()) {
                    v.clone()
                } else {
                    match v {
                        Value::Number(_) | Value::Object(_) => merge_stats(&parts),
                        Value::Array(a) if a.iter().all(Value::is_number) => {
                            let n = parts.iter().filter_map(Value::as_array).map(Vec::len).max().unwrap_or(0);
                            Value::Array(
                                (0..n)
                                    .map(|i| {
                                        merge_stats(&parts.iter().filter_map(|p| p.get(i).cloned()).collect::<Vec<_>>())
                                    })
                                    .collect(),
                            )
                        }
                        _ => v.clone(),
                    }
                };
                out.insert(k.clone(), merged);
            }
            let num = |out: &serde_json::Map<String, Value>, k: &str| out.get(k).and_then(Value::as_f64);
            if let (Some(rows), Some(slots)) = (num(&out, "rows"), num(&out, "slots")) {
                if slots > 0.0 {
                    out.insert("load_factor".into(), serde_json::json!(rows / slots));
                }
            }
            if let (Some(h), Some(m)) = (num(&out, "cache_hits"), num(&out, "cache_misses")) {
                let rate = if h + m > 0.0 { serde_json::json!(h / (h + m)) } else { Value::Null };
                out.insert("cache_hit_rate".into(), rate);
            }
            Value::Object(out)
        }
        Value::Number(_) => {
            if docs.iter().all(|d| d.as_u64().is_some()) {
                serde_json::json!(docs.iter().filter_map(Value::as_u64).sum::<u64>())
            } else {
                serde_json::json!(docs.iter().filter_map(Value::as_f64).sum::<f64>())
            }
        }
        other => other.clone(),
    }
}

pub(super) fn merge_tables(parts: &[serde_json::Value]) -> serde_json::Value {
    let mut by_name: Vec<(String, Vec<serde_json::Value>)> = Vec::new();
    for list in parts.iter().filter_map(serde_json::Value::as_array) {
        for t in list {
            let name = t["name"].as_str().unwrap_or_default().to_string();
            match by_name.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => v.push(t.clone()),
                None => by_name.push((name, vec![t.clone()])),
            }
        }
    }
    serde_json::Value::Array(by_name.iter().map(|(_, docs)| merge_stats(docs)).collect())
}

/// Copies reply rows of `width` f32 each (`body[at..]`, one per position) into `out`.
pub(super) fn scatter_wide(body: &[u8], at: usize, positions: &[usize], out: &mut [f32], width: usize) -> Result<()> {
    let row_bytes = proto::row_bytes(width);
    if body.len() != at + positions.len() * row_bytes {
        return Err(Error::corrupt(format!(
            "reply of {} bytes for {} rows of {width} elements",
            body.len(),
            positions.len()
        )));
    }
    for (j, &i) in positions.iter().enumerate() {
        let src = &body[at + j * row_bytes..at + (j + 1) * row_bytes];
        for (x, b) in out[i * width..(i + 1) * width].iter_mut().zip(src.chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    Ok(())
}

/// Each key once with its last row of `width` elements: requests run in parallel, so
/// order cannot decide which of a key's rows is written.
pub(super) fn last_of_each(keys: &[u64], rows: &[f32], width: usize) -> (Vec<u64>, Vec<f32>) {
    let mut seen = HashSet::with_capacity(keys.len());
    let mut last: Vec<usize> = (0..keys.len()).rev().filter(|&i| seen.insert(keys[i])).collect();
    if last.len() == keys.len() {
        return (keys.to_vec(), rows.to_vec());
    }
    last.reverse();
    (
        last.iter().map(|&i| keys[i]).collect(),
        last.iter().flat_map(|&i| rows[i * width..(i + 1) * width].iter().copied()).collect(),
    )
}

impl embank_core::TableApi for RemoteTable {
    fn name(&self) -> &str {
        RemoteTable::name(self)
    }
    fn dim(&self) -> usize {
        RemoteTable::dim(self)
    }
    fn meta(&self) -> TableMeta {
        RemoteTable::meta(self)
    }
    fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        RemoteTable::pull(self, keys, out)
    }
    fn is_remote(&self) -> bool {
        true
    }
    fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        RemoteTable::lookup(self, keys, out, found)
    }
    fn lookup_with_state(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        RemoteTable::lookup_with_state(self, keys, out, found)
    }
    fn push_with_state(&self, keys: &[u64], records: &[f32]) -> Result<()> {
        RemoteTable::push_with_state(self, keys, records)
    }
    fn lookup_stored(&self, keys: &[u64], out: &mut [u8], found: &mut [bool]) -> Result<()> {
        RemoteTable::lookup_stored(self, keys, out, found)
    }
    fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        RemoteTable::push(self, keys, rows)
    }
    fn delete(&self, keys: &[u64]) -> Result<u64> {
        RemoteTable::delete(self, keys)
    }
    fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        RemoteTable::push_grad(self, keys, grads)
    }
    fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()> {
        RemoteTable::pull_held(self, worker, keys, out, timeout)
    }
    fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        RemoteTable::push_grad_held(self, worker, keys, grads)
    }
    fn push_grad_at(&self, keys: &[u64], grads: &[f32], step: u64, _distinct: bool) -> Result<()> {
        RemoteTable::push_grad_at(self, keys, grads, step)
    }
    fn push_grad_held_at(&self, worker: u64, keys: &[u64], grads: &[f32], step: u64) -> Result<()> {
        RemoteTable::push_grad_held_at(self, worker, keys, grads, Some(step))
    }
    fn optimizer_step(&self) -> Result<u64> {
        RemoteTable::optimizer_step(self)
    }
    fn release(&self, worker: u64) -> Result<u64> {
        RemoteTable::release(self, worker)
    }
    fn set_lr(&self, lr: f32) -> Result<()> {
        RemoteTable::set_lr(self, lr)
    }
    fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        RemoteTable::lookahead(self, keys)
    }
    fn evict_expired(&self) -> Result<u64> {
        RemoteTable::evict_expired(self)
    }
    fn len(&self) -> Result<u64> {
        RemoteTable::len(self)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        RemoteTable::stats(self)
    }
    fn lookup_min(&self, keys: &[u64], out: &mut [f32], found: &mut [bool], min: Option<u64>) -> Result<()> {
        RemoteTable::lookup_min(self, keys, out, found, min)
    }
    fn export(&self, chunk_keys: usize, f: embank_core::ChunkSink<'_>) -> Result<()> {
        RemoteTable::export(self, chunk_keys, f)
    }
}

#[cfg(test)]
mod tests {
    use super::merge_stats;
    use serde_json::json;

    #[test]
    pub(super) fn stats_merge_sums_and_recomputes_ratios() {
        let a = json!({"rows": 3, "slots": 10, "load_factor": 0.3, "dim": 4, "medium": "mmap",
                       "probe_histogram": [3, 0], "cache_hits": 1, "cache_misses": 1, "cache_hit_rate": 0.5,
                       "tables": [{"name": "t", "rows": 3}], "shard": "a"});
        let b = json!({"rows": 5, "slots": 10, "load_factor": 0.5, "dim": 4, "medium": "mmap",
                       "probe_histogram": [4, 1], "cache_hits": 3, "cache_misses": 0, "cache_hit_rate": 1.0,
                       "tables": [{"name": "t", "rows": 5}, {"name": "u", "rows": 1}], "shard": "b"});
        let m = merge_stats(&[a, b]);
        assert_eq!(m["rows"], 8);
        assert_eq!(m["dim"], 4);
        assert_eq!(m["load_factor"], 0.4);
        assert_eq!(m["cache_hit_rate"], 0.8);
        assert_eq!(m["probe_histogram"], json!([7, 1]));
        assert_eq!(m["medium"], "mmap");
        assert_eq!(m["tables"], json!([{"name": "t", "rows": 8}, {"name": "u", "rows": 1}]));
        assert!(m.get("shard").is_none());
    }
}

//! What each request does, by opcode family: the store's (tables, checkpoints, what a
//! replica serves), reads of rows, writes of rows, a worker's held keys, and a table's
//! own (length, statistics, learning rate, export pages).

use std::io::IoSlice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use embank_core::{Error, ErrorKind, ExportCursor, Table, TableOptions};
use serde::Deserialize;

use super::conn::{Conn, Failure, Handled, Refusal};
use crate::proto::{self, as_bytes, status, Header, Op, HEADER_BYTES};
use crate::proto::{found_mask, write_all_vectored};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    name: String,
    options: TableOptions,
}

impl Conn<'_> {
    /// Runs one request: checks the token, the connection limit and read-only, then
    /// hands it to its family.
    pub(super) fn handle(&mut self, h: &Header, body: &[u64]) -> Handled {
        // An unknown opcode is answered as unknown only once the token is presented: before,
        // every frame but a HELLO is refused and its connection closed.
        let known = Op::from_u16(h.opcode);
        let raw = &as_bytes(body)[..h.body_len as usize];
        if known == Some(Op::Hello) && !raw.is_empty() && self.ctx.opts.token.is_none() {
            // A client that sends a token believes the server checks it: say it does not,
            // rather than let a misconfigured cluster run without the auth it was meant to have.
            return Err(Failure::Refused(Refusal {
                status: status::UNAUTHORIZED,
                message: "this server takes no token: connect without one, or set the same token on the server".into(),
                close: true,
            }));
        }
        if !self.authed {
            if known != Some(Op::Hello) {
                return Err(Failure::Refused(Refusal {
                    status: status::UNAUTHORIZED,
                    message: "this server requires a token: send HELLO with it first".into(),
                    close: true,
                }));
            }
            let expected = self.ctx.opts.token.as_deref().unwrap_or("").as_bytes();
            if !proto::token_eq(raw, expected) {
                let message = match (raw.is_empty(), expected.is_empty()) {
                    (true, _) => "this server requires a token: connect with token=...",
                    (false, true) => "this server takes no token: connect without one",
                    (false, false) => "wrong token",
                };
                return Err(Failure::Refused(Refusal {
                    status: status::UNAUTHORIZED,
                    message: message.into(),
                    close: true,
                }));
            }
            self.authed = true;
        }
        let Some(op) = known else {
            return Err(Failure::from(Refusal::frame(status::UNKNOWN_OPCODE, format!("unknown opcode {}", h.opcode))));
        };
        if !self.established {
            self.establish()?;
        }
        if let Some(why) = &self.ctx.opts.read_only {
            if op.writes() {
                return Err(Failure::Refused(Refusal::engine(Error::new(
                    embank_core::ErrorKind::Unsupported,
                    format!("{} refused: {why}", op.name()),
                ))));
            }
        }
        let reads_tables = !matches!(op, Op::Hello | Op::Served | Op::StoreStats | Op::ListTables | Op::Checkpoints);
        if reads_tables && self.ctx.view.get().is_some_and(|v| v.is_bootstrapping()) {
            return Err(Failure::from(Refusal::engine(Error::new(
                ErrorKind::Unavailable,
                "this replica is copying a sibling's checkpoint and takes no reads yet",
            ))));
        }
        match op {
            Op::Hello => {
                let info = serde_json::json!({
                    "server": "embank",
                    "version": env!("CARGO_PKG_VERSION"),
                    "protocol": proto::VERSION,
                    "keys_per_request_max": self.ctx.opts.keys_per_request_max,
                    "frame_bytes_max": self.ctx.opts.frame_bytes_max,
                    "read_only": self.ctx.opts.read_only.is_some(),
                    "map_version": self.ctx.opts.shard_map.as_deref().and_then(super::map_version),
                });
                self.answer(h, 0, info.to_string().as_bytes())
            }
            Op::ListTables => {
                let names = self.ctx.store.tables()?;
                let body = serde_json::to_vec(&names).expect("names serialize");
                self.answer(h, names.len() as u32, &body)
            }
            Op::OpenTable | Op::CreateTable => {
                let text = std::str::from_utf8(raw)
                    .map_err(|_| Refusal::frame(status::BAD_FRAME, "table name or options are not UTF-8".into()))?;
                let table = if op == Op::OpenTable {
                    self.ctx.store.table(text)
                } else {
                    let c: CreateBody = serde_json::from_str(text)
                        .map_err(|e| Refusal::engine(Error::config(format!("bad create_table request: {e}"))))?;
                    self.ctx.store.create_table(&c.name, c.options)
                }?;
                let meta = table.meta();
                self.ctx.tables.write().insert(meta.id, table);
                let body = serde_json::to_vec(&meta).expect("meta serializes");
                let head = Header { table_id: meta.id, ..*h }.reply(meta.dim, body.len(), status::OK).encode();
                self.answer_parts(&mut [IoSlice::new(&head), IoSlice::new(&body)])
            }
            Op::DropTable => {
                let name = std::str::from_utf8(raw)
                    .map_err(|_| Refusal::frame(status::BAD_FRAME, "table name is not UTF-8".into()))?;
                let id = self.ctx.store.table(name).map(|t| t.meta().id).ok();
                self.ctx.store.drop_table(name)?;
                if let Some(id) = id {
                    self.ctx.tables.write().remove(&id);
                }
                self.answer(h, 0, &[])
            }
            Op::StoreStats => {
                let s = self.ctx.store.stats()?;
                self.answer(h, 0, &serde_json::to_vec(&s).expect("stats serialize"))
            }
            Op::Flush => {
                self.ctx.store.flush()?;
                self.answer(h, 0, &[])
            }
            Op::Checkpoint | Op::Restore => {
                // CHECKPOINT: the batch id, then the checkpoint's metadata blob (any length).
                if h.body_len < 8 || (op == Op::Restore && h.body_len != 8) {
                    return Err(Failure::from(Refusal::frame(
                        status::BAD_FRAME,
                        format!("{} takes an 8-byte batch id", op.name()),
                    )));
                }
                if op == Op::Checkpoint {
                    let meta = &as_bytes(body)[8..h.body_len as usize];
                    self.ctx.store.checkpoint_with_meta(body[0], meta)?;
                } else {
                    self.ctx.store.restore(body[0])?;
                    // Every table handle was reopened: forget the old ones (ids stay the same).
                    self.ctx.tables.write().clear();
                }
                self.answer(h, 0, &[])
            }
            Op::Served => {
                let reply = match self.ctx.metrics.replica.get() {
                    Some(f) => {
                        let r = f();
                        let readable = crate::stream::view::readable(&self.ctx.store);
                        // The served checkpoint's stream position: where a new replica that
                        // copies it goes on from.
                        let meta = r
                            .checkpoint_batch_id
                            .and_then(|b| crate::stream::view::own_checkpoint(&self.ctx.store, b).ok())
                            .map(|(_, m)| m);
                        serde_json::json!({"batch_id": r.checkpoint_batch_id, "seq": r.checkpoint_seq, "replica": true, "state": r.state, "readable": readable, "meta": meta})
                    }
                    None => {
                        let list = self.ctx.store.checkpoints()?;
                        let readable: Vec<u64> = list.iter().map(|c| c.batch_id).collect();
                        let last = list.last();
                        serde_json::json!({"batch_id": last.map(|c| c.batch_id), "seq": last.map(|c| c.seq), "replica": false, "state": "primary", "readable": readable})
                    }
                };
                self.answer(h, 0, reply.to_string().as_bytes())
            }
            Op::Checkpoints => {
                let list = self.ctx.store.checkpoints()?;
                self.answer(h, list.len() as u32, &serde_json::to_vec(&list).expect("serialize"))
            }
            _ => {
                let table = self.checked_table(op, h)?;
                match op {
                    Op::Pull | Op::Lookup | Op::LookupAt | Op::LookupStored => self.read_op(op, h, &table, body),
                    Op::Push | Op::PushGrad | Op::Delete | Op::Lookahead => self.write_op(op, h, &table, body),
                    Op::LookupWithState | Op::PushWithState => self.state_op(op, h, &table, body),
                    Op::PullHeld | Op::PushGradHeld | Op::PushGradHeldAt | Op::Release => {
                        self.held_op(op, h, &table, body)
                    }
                    Op::PushGradAt => {
                        let (n, dim) = (h.count as usize, table.dim());
                        let (step, body) = body.split_at(1);
                        let (keys, grads) = proto::split_keyed(&body[..n + (n * dim).div_ceil(2)], n);
                        table.push_grad_at(keys, &grads[..n * dim], step[0], false)?;
                        self.answer(h, 0, &[])
                    }
                    _ => self.table_admin_op(op, h, &table, body),
                }
            }
        }
    }

    /// The request's table, its key count and body length checked.
    fn checked_table(&self, op: Op, h: &Header) -> std::result::Result<Table, Refusal> {
        let table = self.table(h.table_id)?;
        let dim = table.dim();
        if op.has_keys() {
            if h.count > self.ctx.opts.keys_per_request_max {
                return Err(Refusal::frame(
                    status::TOO_LARGE,
                    format!(
                        "{} keys in one request; this server takes at most {} (keys_per_request_max)",
                        h.count, self.ctx.opts.keys_per_request_max
                    ),
                ));
            }
            let width = if op == Op::PushWithState { dim + table.state_len() } else { dim };
            let want = proto::keyed_body_len(op, h.count, width);
            if want != h.body_len as u64 {
                return Err(Refusal::frame(
                    status::BAD_FRAME,
                    format!(
                        "{} of {} keys to table {:?} (dim {dim}) needs a body of {want} bytes, got {}{}",
                        op.name(),
                        h.count,
                        table.name(),
                        h.body_len,
                        if op.has_rows() { " (wrong dim?)" } else { "" }
                    ),
                ));
            }
        }
        Ok(table)
    }

    /// Reads of rows: pulls (a read-only replica answers them as lookups), lookups through a replica's served view, exact reads at a checkpoint.
    fn read_op(&mut self, op: Op, h: &Header, table: &Table, body: &[u64]) -> Handled {
        let (n, dim) = (h.count as usize, table.dim());
        let (prefix, body) = body.split_at(op.prefix_words().min(body.len()));
        match op {
            Op::Pull | Op::Lookup => {
                let keys = &body[..n];
                // A pull on a read-only replica answers like a lookup without the mask.
                let with_mask = op == Op::Lookup;
                let create = op == Op::Pull && self.ctx.opts.read_only.is_none();
                let view = self.ctx.view.get();
                if view.is_none()
                    && self.ctx.opts.zero_copy
                    && proto::row_bytes(dim) >= self.ctx.opts.zero_copy_row_bytes_min
                {
                    let metrics = Arc::clone(&self.ctx.metrics);
                    let stream = &mut self.stream;
                    let sent = table.with_rows(keys, create, |rows, found| {
                        let mask = if with_mask { found_mask(found) } else { Vec::new() };
                        send_borrowed_rows(stream, &metrics, h, &mask, rows, proto::row_bytes(dim))
                    })?;
                    if let Some(r) = sent {
                        self.ctx.metrics.replies_zero_copy.fetch_add(1, Ordering::Relaxed);
                        return Ok(r?);
                    }
                }
                self.ctx.metrics.replies_copied.fetch_add(1, Ordering::Relaxed);
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let mask = if create {
                    table.pull(keys, &mut rows)?;
                    Vec::new()
                } else {
                    let mut found = vec![false; n];
                    match view {
                        Some(v) => v.lookup(table, keys, &mut rows, &mut found),
                        None => table.lookup(keys, &mut rows, &mut found),
                    }?;
                    if with_mask {
                        found_mask(&found)
                    } else {
                        Vec::new()
                    }
                };
                let head = h.reply(h.count, mask.len() + rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                let r = self.send(&mut [IoSlice::new(&head), IoSlice::new(&mask), IoSlice::new(as_bytes(&rows))]);
                self.rows = rows;
                Ok(r?)
            }
            Op::LookupStored => {
                let keys = &body[..n];
                let rb = table.row_bytes();
                let view = self.ctx.view.get();
                if view.is_none() && self.ctx.opts.zero_copy && rb >= self.ctx.opts.zero_copy_row_bytes_min {
                    let metrics = Arc::clone(&self.ctx.metrics);
                    let stream = &mut self.stream;
                    let sent = table.with_stored_rows(keys, |rows, found| {
                        send_borrowed_rows(stream, &metrics, h, &found_mask(found), rows, rb)
                    })?;
                    if let Some(r) = sent {
                        self.ctx.metrics.replies_zero_copy.fetch_add(1, Ordering::Relaxed);
                        return Ok(r?);
                    }
                }
                self.ctx.metrics.replies_copied.fetch_add(1, Ordering::Relaxed);
                let mut stored = vec![0u8; n * rb];
                let mut found = vec![false; n];
                match view {
                    // A replica's served view reads decoded rows: encoded here again.
                    Some(v) => {
                        let mut rows = std::mem::take(&mut self.rows);
                        rows.clear();
                        rows.resize(n * dim, 0.0);
                        let read = v.lookup(table, keys, &mut rows, &mut found);
                        embank_core::encode_rows(table.meta().dtype, dim, &rows, &mut stored);
                        self.rows = rows;
                        read
                    }
                    None => table.lookup_stored(keys, &mut stored, &mut found),
                }?;
                let mask = found_mask(&found);
                let head = h.reply(h.count, mask.len() + stored.len(), status::OK).encode();
                Ok(self.send(&mut [IoSlice::new(&head), IoSlice::new(&mask), IoSlice::new(&stored)])?)
            }
            Op::LookupAt => {
                let (batch_id, keys) = (prefix[0], &body[..n]);
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let mut found = vec![false; n];
                let read = match self.ctx.view.get() {
                    Some(v) => v.lookup_at(&self.ctx.store, table, batch_id, keys, &mut rows, &mut found),
                    None => self.ctx.store.lookup_checkpoint(table.name(), batch_id, keys, &mut rows, &mut found),
                };
                let sent = match read {
                    Ok(()) => {
                        let mask = found_mask(&found);
                        let head =
                            h.reply(h.count, mask.len() + rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                        self.answer_parts(&mut [
                            IoSlice::new(&head),
                            IoSlice::new(&mask),
                            IoSlice::new(as_bytes(&rows)),
                        ])
                    }
                    Err(e) => Err(e.into()),
                };
                self.rows = rows;
                sent
            }
            _ => unreachable!("read_op takes {}", op.name()),
        }
    }

    /// Writes of rows: pushes, gradients, deletes, and look-ahead hints.
    fn write_op(&mut self, op: Op, h: &Header, table: &Table, body: &[u64]) -> Handled {
        let (n, dim) = (h.count as usize, table.dim());

        match op {
            Op::Push | Op::PushGrad => {
                let (keys, rows) = proto::split_keyed(&body[..n + (n * dim).div_ceil(2)], n);
                let rows = &rows[..n * dim];
                if op == Op::Push { table.push(keys, rows) } else { table.push_grad(keys, rows) }?;
                self.answer(h, 0, &[])
            }
            Op::Delete => {
                let gone = table.delete(&body[..n])?;
                self.answer(h, 0, &gone.to_le_bytes())
            }
            Op::Lookahead => {
                let queued = table.lookahead(&body[..n])?;
                self.answer(h, 0, &(queued as u64).to_le_bytes())
            }
            _ => unreachable!("write_op takes {}", op.name()),
        }
    }

    /// Rows with their optimizer state, read or written (state dicts of served tables).
    /// A replica serves rows through its view, which keeps no state: refused there.
    fn state_op(&mut self, op: Op, h: &Header, table: &Table, body: &[u64]) -> Handled {
        if self.ctx.view.get().is_some() {
            return Err(Failure::from(embank_core::Error::new(
                embank_core::ErrorKind::Unsupported,
                format!(
                    "{}: a replica serves rows without their optimizer state; read it from the trainer's store",
                    op.name()
                ),
            )));
        }
        let (n, w) = (h.count as usize, table.dim() + table.state_len());
        match op {
            Op::LookupWithState => {
                let keys = &body[..n];
                let mut records = vec![0f32; n * w];
                let mut found = vec![false; n];
                table.lookup_with_state(keys, &mut records, &mut found)?;
                let mask = found_mask(&found);
                let head = h.reply(h.count, mask.len() + records.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                self.answer_parts(&mut [IoSlice::new(&head), IoSlice::new(&mask), IoSlice::new(as_bytes(&records))])
            }
            Op::PushWithState => {
                let (keys, records) = proto::split_keyed(&body[..n + (n * w).div_ceil(2)], n);
                table.push_with_state(keys, &records[..n * w])?;
                self.answer(h, 0, &[])
            }
            _ => unreachable!("state_op takes {}", op.name()),
        }
    }

    /// A bounded-staleness worker's holds: pulls that hold keys, the gradients that give them back, and a release.
    fn held_op(&mut self, op: Op, h: &Header, table: &Table, body: &[u64]) -> Handled {
        let (n, dim) = (h.count as usize, table.dim());
        let (prefix, body) = body.split_at(op.prefix_words().min(body.len()));
        match op {
            Op::PullHeld => {
                let (worker, timeout) = (prefix[0], std::time::Duration::from_millis(prefix[1]));
                let mut rows = std::mem::take(&mut self.rows);
                rows.clear();
                rows.resize(n * dim, 0.0);
                let r = table.pull_held(worker, &body[..n], &mut rows, timeout);
                let sent = match r {
                    Ok(()) => {
                        let head = h.reply(h.count, rows.len() * proto::ROW_ELEMENT_BYTES, status::OK).encode();
                        self.answer_parts(&mut [IoSlice::new(&head), IoSlice::new(as_bytes(&rows))])
                    }
                    Err(e) => Err(e.into()),
                };
                self.rows = rows;
                sent
            }
            Op::PushGradHeld | Op::PushGradHeldAt => {
                let (keys, grads) = proto::split_keyed(&body[..n + (n * dim).div_ceil(2)], n);
                let step = (op == Op::PushGradHeldAt).then(|| prefix[1]);
                table.push_grad_held_at(prefix[0], keys, &grads[..n * dim], step)?;
                self.answer(h, 0, &[])
            }
            Op::Release => {
                if h.body_len != 8 {
                    return Err(Failure::from(Refusal::frame(
                        status::BAD_FRAME,
                        "release takes an 8-byte worker id".into(),
                    )));
                }
                let n = table.release(body[0]);
                self.answer(h, 0, &n.to_le_bytes())
            }
            _ => unreachable!("held_op takes {}", op.name()),
        }
    }

    /// A table's own: length, statistics, learning rate, expiry, export pages.
    fn table_admin_op(&mut self, op: Op, h: &Header, table: &Table, body: &[u64]) -> Handled {
        match op {
            Op::EvictExpired => {
                let gone = table.evict_expired()?;
                self.answer(h, 0, &gone.to_le_bytes())
            }
            Op::Len => {
                let len = table.len()?;
                self.answer(h, 0, &len.to_le_bytes())
            }
            Op::TableStats => {
                let s = table.stats()?;
                self.answer(h, 0, &serde_json::to_vec(&s).expect("stats serialize"))
            }
            Op::SetLr => {
                if h.body_len != 4 {
                    return Err(Failure::from(Refusal::frame(status::BAD_FRAME, "set_lr takes a 4-byte f32".into())));
                }
                let lr = f32::from_le_bytes(as_bytes(body)[..4].try_into().unwrap());
                table.set_lr(lr)?;
                self.answer(h, 0, &[])
            }
            Op::Export | Op::ExportAt => {
                let at = usize::from(op == Op::ExportAt);
                if h.body_len as usize != 24 + 8 * at {
                    return Err(Failure::from(Refusal::frame(
                        status::BAD_FRAME,
                        format!(
                            "{} takes {}a 24-byte cursor",
                            op.name(),
                            if at == 1 { "a checkpoint and " } else { "" }
                        ),
                    )));
                }
                let cursor = ExportCursor { generation: body[at], bucket: body[at + 1] };
                let max = (body[at + 2] as usize).clamp(1, self.ctx.opts.keys_per_request_max as usize);
                let mut keys = Vec::new();
                let mut rows = std::mem::take(&mut self.rows);
                let page = if at == 1 {
                    // A replica's own checkpoints count on their own: find the one taken at
                    // the publisher's checkpoint asked for.
                    let store = &self.ctx.store;
                    let own = match self.ctx.view.get() {
                        Some(_) => crate::stream::view::own_checkpoint(store, body[0]).map(|(b, _)| b),
                        None => Ok(body[0]),
                    };
                    // Kept retained while the export goes on, however long it takes.
                    own.and_then(|b| self.ctx.lease_checkpoint(b).map(|()| b))
                        .and_then(|b| store.export_checkpoint_page(table.name(), b, cursor, max, &mut keys, &mut rows))
                        .map_err(|e| match e.kind() {
                            ErrorKind::NotFound if self.ctx.view.get().is_some() => {
                                crate::stream::view::not_held(store, body[0])
                            }
                            _ => e,
                        })
                } else {
                    table.export_page(cursor, max, &mut keys, &mut rows)
                };
                let next = match page {
                    Ok(n) => n,
                    Err(e) => {
                        self.rows = rows;
                        return Err(e.into());
                    }
                };
                let (g, b, done) = match next {
                    Some(c) => (c.generation, c.bucket, 0u64),
                    None => (u64::MAX, 0, 1),
                };
                let mut cur = [0u8; 24];
                cur[..8].copy_from_slice(&g.to_le_bytes());
                cur[8..16].copy_from_slice(&b.to_le_bytes());
                cur[16..].copy_from_slice(&done.to_le_bytes());
                let body_len = 24 + keys.len() * 8 + rows.len() * proto::ROW_ELEMENT_BYTES;
                let head = h.reply(keys.len() as u32, body_len, status::OK).encode();
                let r = self.send(&mut [
                    IoSlice::new(&head),
                    IoSlice::new(&cur),
                    IoSlice::new(as_bytes(&keys)),
                    IoSlice::new(as_bytes(&rows)),
                ]);
                self.rows = rows;
                Ok(r?)
            }
            _ => unreachable!("table_admin_op takes {}", op.name()),
        }
    }
}

/// A reply of `mask` (may be empty) and then `rows`, each `row_bytes` long and borrowed from
/// the mapped rows file, in one vectored write (counted in the sent bytes).
fn send_borrowed_rows(
    stream: &mut impl std::io::Write,
    metrics: &crate::metrics::Metrics,
    h: &Header,
    mask: &[u8],
    rows: &[&[u8]],
    row_bytes: usize,
) -> std::io::Result<()> {
    let body_len = mask.len() + rows.len() * row_bytes;
    let head = h.reply(h.count, body_len, status::OK).encode();
    let mut parts = Vec::with_capacity(rows.len() + 2);
    parts.push(IoSlice::new(&head));
    if !mask.is_empty() {
        parts.push(IoSlice::new(mask));
    }
    parts.extend(rows.iter().map(|r| IoSlice::new(r)));
    metrics.bytes_out.fetch_add((HEADER_BYTES + body_len) as u64, Ordering::Relaxed);
    write_all_vectored(stream, &mut parts)
}

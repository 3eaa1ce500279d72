//! One interface above the core for a store and its tables wherever they live: the
//! embedded [`Store`]/[`Table`] implement it here, `embank-net`'s client and
//! remote table implement it over the wire, and the Python bindings hold a
//! `dyn` of each instead of matching a backend in every method. Every method
//! carries a batch (or is a rare administrative call): one virtual call per
//! batch, never per row.

use std::sync::Arc;
use std::time::Duration;

use crate::catalog::TableMeta;
use crate::checkpoint::CheckpointInfo;
use crate::error::{Error, ErrorKind, Result};
use crate::store::Store;
use crate::table::{Table, TableOptions};

/// A chunk consumer of an export.
pub type ChunkSink<'a> = &'a mut dyn FnMut(&[u64], &[f32]) -> Result<()>;

/// The batch operations of one table (see [`Table`] for their meaning).
pub trait TableApi: Send + Sync {
    fn name(&self) -> &str;
    fn dim(&self) -> usize;
    fn meta(&self) -> TableMeta;
    fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()>;
    fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()>;
    /// [`lookup`](Self::lookup) answered only by replicas serving the publisher's
    /// checkpoint `min` or later (remote replica groups; elsewhere `min` is refused).
    fn lookup_min(&self, keys: &[u64], out: &mut [f32], found: &mut [bool], min: Option<u64>) -> Result<()> {
        match min {
            None => self.lookup(keys, out, found),
            Some(_) => Err(Error::new(
                ErrorKind::Unsupported,
                "min_checkpoint applies to tables of replicas fed by an update stream (embank.connect)",
            )),
        }
    }
    /// Rows as stored, not decoded (see [`Table::lookup_stored`]): `row_bytes` bytes a
    /// key in the table's element type. The default looks the rows up decoded and
    /// encodes them here (what a remote table does: the wire carries `f32` rows).
    fn lookup_stored(&self, keys: &[u64], out: &mut [u8], found: &mut [bool]) -> Result<()> {
        let meta = self.meta();
        let dim = meta.dim as usize;
        crate::layout::check_stored_lens(&meta.name, meta.dtype, dim, keys.len(), out.len(), found.len())?;
        let mut rows = vec![0f32; keys.len() * dim];
        self.lookup(keys, &mut rows, found)?;
        crate::layout::encode_rows(meta.dtype, dim, &rows, out);
        Ok(())
    }
    /// Pooled rows of bags (see [`Table::lookup_pooled`]). The default looks the
    /// distinct ids up in one batch and pools here, without a pooled cache: what a
    /// remote table does, since a bag's ids live on several shards.
    fn lookup_pooled(
        &self,
        ids: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        mode: crate::pooled::Pooling,
        out: &mut [f32],
    ) -> Result<()> {
        let dim = self.dim();
        let bags = crate::pooled::check_batch(ids, offsets, weights, mode, dim, out)?;
        let lookup = |keys: &[u64], rows: &mut [f32]| self.lookup(keys, rows, &mut vec![false; keys.len()]);
        crate::pooled::pool_bags(ids, offsets, weights, mode, dim, 0..bags, lookup, out)
    }
    fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()>;
    fn delete(&self, keys: &[u64]) -> Result<u64>;
    fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()>;
    /// `push_grad` of keys the caller knows are distinct (a fused collection's
    /// backward). The default is `push_grad`; an embedded table skips summing duplicates.
    fn push_grad_distinct(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        self.push_grad(keys, grads)
    }
    /// `push_grad` (`push_grad_distinct` when `distinct`) as part of training step `step`
    /// ([`Table::push_grad_at`]: the step that the optimizers with a table step, FBGEMM's
    /// Adam and LAMB kinds, bias-correct with). The default, a served table's, pushes
    /// without the step where the optimizer has no use for it and otherwise refuses: the
    /// wire does not carry the step.
    fn push_grad_at(&self, keys: &[u64], grads: &[f32], step: u64, distinct: bool) -> Result<()> {
        let meta = self.meta();
        refuse_table_step(&meta.name, &meta.optimizer)?;
        let _ = step;
        if distinct {
            self.push_grad_distinct(keys, grads)
        } else {
            self.push_grad(keys, grads)
        }
    }
    fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()>;
    fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()>;
    /// `push_grad_held` as part of training step `step` (see [`push_grad_at`](Self::push_grad_at),
    /// whose default this shares).
    fn push_grad_held_at(&self, worker: u64, keys: &[u64], grads: &[f32], step: u64) -> Result<()> {
        let meta = self.meta();
        refuse_table_step(&meta.name, &meta.optimizer)?;
        let _ = step;
        self.push_grad_held(worker, keys, grads)
    }
    /// The training step of the table's last update ([`Table::optimizer_step`]; a served
    /// table: 0, since its tables with a table step are refused).
    fn optimizer_step(&self) -> Result<u64> {
        Ok(0)
    }
    fn release(&self, worker: u64) -> Result<u64>;
    fn set_lr(&self, lr: f32) -> Result<()>;
    fn lookahead(&self, keys: &[u64]) -> Result<bool>;
    fn evict_expired(&self) -> Result<u64>;
    fn len(&self) -> Result<u64>;
    /// True for a table behind the network (its calls are round trips).
    fn is_remote(&self) -> bool {
        false
    }
    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Statistics as JSON (the embedded table's fields; remote tables add per-shard ones).
    fn stats_json(&self) -> Result<serde_json::Value>;
    fn export(&self, chunk_keys: usize, f: ChunkSink<'_>) -> Result<()>;
    /// Hot placement ([`Table::place_hot`]); its report as JSON. Embedded tables only.
    fn place_hot(&self, _keys: &[u64]) -> Result<serde_json::Value> {
        Err(Error::new(ErrorKind::Unsupported, "hot placement runs where the store is (embank serve places its own)"))
    }
    /// Of `keys` the table holds, the fraction in their home index bucket, and how many it holds.
    fn home_fraction(&self, _keys: &[u64]) -> Result<(f64, u64)> {
        Err(Error::new(ErrorKind::Unsupported, "home_fraction runs where the store is"))
    }
    /// Rows with their optimizer state ([`Table::lookup_with_state`]).
    fn lookup_with_state(&self, _keys: &[u64], _out: &mut [f32], _found: &mut [bool]) -> Result<()> {
        Err(Error::new(ErrorKind::Unsupported, "reading optimizer state runs where the store is"))
    }
    /// Writes rows with their optimizer state ([`Table::push_with_state`]).
    fn push_with_state(&self, _keys: &[u64], _records: &[f32]) -> Result<()> {
        Err(Error::new(ErrorKind::Unsupported, "writing optimizer state runs where the store is"))
    }
}

/// Refuses a served table whose optimizer bias-corrects with the table's training step:
/// the wire protocol carries no step, and counting calls would be wrong wherever one
/// training step pushes more than once (several workers, ranks or shards).
pub(crate) fn refuse_table_step(table: &str, optimizer: &crate::optim::Optimizer) -> Result<()> {
    if !optimizer.uses_table_step() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Unsupported,
        format!(
            "table {:?}: the {} optimizer bias-corrects with the table's training step, which the wire \
             protocol does not carry yet; train it in an embedded store (embank.open), or serve it with \
             another optimizer (embank.optim.Adam counts its steps per row)",
            table,
            optimizer.name()
        ),
    ))
}

/// True when stats JSON (a table's, or a remote table's with its shards') says a
/// background repair is still running.
pub fn repair_pending(stats: &serde_json::Value) -> bool {
    match stats {
        serde_json::Value::Object(m) => {
            m.get("recovered").and_then(|r| r.get("pending")).and_then(|p| p.as_bool()) == Some(true)
                || m.values().any(repair_pending)
        }
        serde_json::Value::Array(v) => v.iter().any(repair_pending),
        _ => false,
    }
}

/// The operations of one store (see [`Store`] for their meaning).
pub trait StoreApi: Send + Sync {
    /// The directory, or `tcp://host:port,...` for a remote store.
    fn location(&self) -> String;
    fn is_remote(&self) -> bool;
    fn is_closed(&self) -> bool;
    fn create_table(&self, name: &str, options: TableOptions) -> Result<Arc<dyn TableApi>>;
    fn table(&self, name: &str) -> Result<Arc<dyn TableApi>>;
    fn tables(&self) -> Result<Vec<String>>;
    fn drop_table(&self, name: &str) -> Result<()>;
    fn flush(&self) -> Result<()>;
    /// Embedded: flushes and closes every table. Remote: flushes the shards, then closes
    /// the client's connections (the servers keep running).
    fn close(&self) -> Result<()>;
    fn checkpoint(&self, batch_id: u64, meta: &[u8]) -> Result<()>;
    fn checkpoints(&self) -> Result<Vec<CheckpointInfo>>;
    fn restore(&self, batch_id: u64) -> Result<()>;
    fn stats_json(&self) -> Result<serde_json::Value>;
    /// Which checkpoint the store serves, per shard: `[{"batch_id", "seq", "replica",
    /// "state", "readable"}]` (embedded: its newest retained checkpoint, nulls when none;
    /// `readable`: the checkpoints it can be read at exactly, oldest first).
    fn served(&self) -> Result<serde_json::Value> {
        let list = self.checkpoints()?;
        let readable: Vec<u64> = list.iter().map(|c| c.batch_id).collect();
        let last = list.last();
        Ok(serde_json::json!([{
            "batch_id": last.map(|c| c.batch_id),
            "seq": last.map(|c| c.seq),
            "replica": false,
            "state": "primary",
            "readable": readable,
        }]))
    }
    /// Waits until no table's background repair after a crash is pending (row counts
    /// are then exact). Remote: polls the tables' stats on the shards.
    fn wait_repaired(&self) -> Result<()> {
        loop {
            let mut pending = false;
            for name in self.tables()? {
                pending |= repair_pending(&self.table(&name)?.stats_json()?);
            }
            if !pending {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    /// Streams a table as it was at a checkpoint (runs where the store is).
    fn export_checkpoint(&self, _name: &str, _batch_id: u64, _chunk_keys: usize, _f: ChunkSink<'_>) -> Result<()> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "exporting a checkpoint runs where the store is (embank export --checkpoint on the shard)",
        ))
    }
    /// Rows written since a checkpoint and keys deleted since (runs where the store is).
    fn export_changes(&self, _name: &str, _batch_id: u64) -> Result<(Vec<u64>, Vec<f32>, Vec<u64>)> {
        Err(Error::new(ErrorKind::Unsupported, "incremental exports run where the store is"))
    }
    /// Keys of a table looked up as they were at a retained checkpoint (runs where the
    /// store is).
    fn lookup_checkpoint(
        &self,
        _name: &str,
        _batch_id: u64,
        _keys: &[u64],
        _out: &mut [f32],
        _found: &mut [bool],
    ) -> Result<()> {
        Err(Error::new(ErrorKind::Unsupported, "reading a table at a checkpoint runs where the store is"))
    }
}

impl TableApi for Table {
    fn name(&self) -> &str {
        Table::name(self)
    }
    fn dim(&self) -> usize {
        Table::dim(self)
    }
    fn meta(&self) -> TableMeta {
        Table::meta(self)
    }
    fn pull(&self, keys: &[u64], out: &mut [f32]) -> Result<()> {
        Table::pull(self, keys, out)
    }
    fn lookup(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        Table::lookup(self, keys, out, found)
    }
    fn lookup_stored(&self, keys: &[u64], out: &mut [u8], found: &mut [bool]) -> Result<()> {
        Table::lookup_stored(self, keys, out, found)
    }
    fn lookup_pooled(
        &self,
        ids: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        mode: crate::pooled::Pooling,
        out: &mut [f32],
    ) -> Result<()> {
        Table::lookup_pooled(self, ids, offsets, weights, mode, out)
    }
    fn push(&self, keys: &[u64], rows: &[f32]) -> Result<()> {
        Table::push(self, keys, rows)
    }
    fn delete(&self, keys: &[u64]) -> Result<u64> {
        Table::delete(self, keys)
    }
    fn push_grad(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        Table::push_grad(self, keys, grads)
    }
    fn push_grad_distinct(&self, keys: &[u64], grads: &[f32]) -> Result<()> {
        Table::push_grad_distinct(self, keys, grads)
    }
    fn pull_held(&self, worker: u64, keys: &[u64], out: &mut [f32], timeout: Duration) -> Result<()> {
        Table::pull_held(self, worker, keys, out, timeout)
    }
    fn push_grad_held(&self, worker: u64, keys: &[u64], grads: &[f32]) -> Result<()> {
        Table::push_grad_held(self, worker, keys, grads)
    }
    fn push_grad_at(&self, keys: &[u64], grads: &[f32], step: u64, distinct: bool) -> Result<()> {
        Table::push_grad_at(self, keys, grads, step, distinct)
    }
    fn push_grad_held_at(&self, worker: u64, keys: &[u64], grads: &[f32], step: u64) -> Result<()> {
        Table::push_grad_held_at(self, worker, keys, grads, Some(step))
    }
    fn optimizer_step(&self) -> Result<u64> {
        Ok(Table::optimizer_step(self))
    }
    fn release(&self, worker: u64) -> Result<u64> {
        Ok(Table::release(self, worker))
    }
    fn set_lr(&self, lr: f32) -> Result<()> {
        Table::set_lr(self, lr)
    }
    fn lookahead(&self, keys: &[u64]) -> Result<bool> {
        Table::lookahead(self, keys)
    }
    fn evict_expired(&self) -> Result<u64> {
        Table::evict_expired(self)
    }
    fn len(&self) -> Result<u64> {
        Table::len(self)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        Ok(serde_json::to_value(Table::stats(self)?).expect("stats serialize"))
    }
    fn export(&self, chunk_keys: usize, f: ChunkSink<'_>) -> Result<()> {
        Table::export(self, chunk_keys, f)
    }
    fn place_hot(&self, keys: &[u64]) -> Result<serde_json::Value> {
        Ok(serde_json::to_value(Table::place_hot(self, keys)?).expect("report serializes"))
    }
    fn home_fraction(&self, keys: &[u64]) -> Result<(f64, u64)> {
        Table::home_fraction(self, keys)
    }
    fn lookup_with_state(&self, keys: &[u64], out: &mut [f32], found: &mut [bool]) -> Result<()> {
        Table::lookup_with_state(self, keys, out, found)
    }
    fn push_with_state(&self, keys: &[u64], records: &[f32]) -> Result<()> {
        Table::push_with_state(self, keys, records)
    }
}

impl StoreApi for Store {
    fn wait_repaired(&self) -> Result<()> {
        Store::wait_repaired(self)
    }
    fn location(&self) -> String {
        self.path().display().to_string()
    }
    fn is_remote(&self) -> bool {
        false
    }
    fn is_closed(&self) -> bool {
        Store::is_closed(self)
    }
    fn create_table(&self, name: &str, options: TableOptions) -> Result<Arc<dyn TableApi>> {
        Ok(Arc::new(Store::create_table(self, name, options)?))
    }
    fn table(&self, name: &str) -> Result<Arc<dyn TableApi>> {
        Ok(Arc::new(Store::table(self, name)?))
    }
    fn tables(&self) -> Result<Vec<String>> {
        Store::tables(self)
    }
    fn drop_table(&self, name: &str) -> Result<()> {
        Store::drop_table(self, name)
    }
    fn flush(&self) -> Result<()> {
        Store::flush(self)
    }
    fn close(&self) -> Result<()> {
        Store::close(self)
    }
    fn checkpoint(&self, batch_id: u64, meta: &[u8]) -> Result<()> {
        Store::checkpoint_with_meta(self, batch_id, meta)
    }
    fn checkpoints(&self) -> Result<Vec<CheckpointInfo>> {
        Store::checkpoints(self)
    }
    fn restore(&self, batch_id: u64) -> Result<()> {
        Store::restore(self, batch_id)
    }
    fn stats_json(&self) -> Result<serde_json::Value> {
        Ok(serde_json::to_value(Store::stats(self)?).expect("stats serialize"))
    }
    fn export_checkpoint(&self, name: &str, batch_id: u64, chunk_keys: usize, f: ChunkSink<'_>) -> Result<()> {
        Store::export_checkpoint(self, name, batch_id, chunk_keys, f)
    }
    fn export_changes(&self, name: &str, batch_id: u64) -> Result<(Vec<u64>, Vec<f32>, Vec<u64>)> {
        Store::export_changes(self, name, batch_id)
    }
    fn lookup_checkpoint(
        &self,
        name: &str,
        batch_id: u64,
        keys: &[u64],
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        Store::lookup_checkpoint(self, name, batch_id, keys, out, found)
    }
}

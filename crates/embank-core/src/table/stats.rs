//! The numbers a table reports.

use std::sync::atomic::Ordering;

use super::options::TableStats;
use super::{State, Table};
use crate::catalog::Placement;
use crate::error::Result;
use crate::lifecycle::Lifecycle;
use crate::medium::Medium;

impl Table {
    pub fn stats(&self) -> Result<TableStats> {
        let st = self.state()?;
        let State { index, medium, .. } = &*st;
        let rows = index.len();
        let meta = self.meta();
        let c = &self.shared.counters;
        let (hits, misses) = (c.hits.load(Ordering::Relaxed), c.misses.load(Ordering::Relaxed));
        let alloc = medium.alloc();
        let info = medium.info();
        Ok(TableStats {
            name: self.shared.config.name.to_string(),
            dim: self.dim() as u32,
            dtype: meta.dtype.name(),
            rows,
            capacity: (self.shared.config.load_factor_max * index.slot_count() as f64) as u64,
            slots: index.slot_count(),
            buckets: index.bucket_count(),
            load_factor: rows as f64 / index.slot_count() as f64,
            growth: self.shared.config.growth,
            grow_count: meta.grow_count,
            index_bytes: index.file_bytes(),
            rows_file_bytes: alloc.file_bytes(),
            record_bytes: alloc.stride(),
            bytes_mapped: index.file_bytes() + info.bytes_mapped,
            records_used: alloc.next_record(),
            records_free: alloc.free_records(),
            records_pending: alloc.pending_records(),
            probe_histogram: index.probe_histogram(),
            recovered: self.recover_stats(),
            medium: medium.kind().name(),
            placement: self.shared.config.placement.name(),
            direct_io: info.direct_io,
            io_align: info.io_align,
            io: info.io,
            optimizer: self.optimizer(),
            cache_hits: hits,
            cache_misses: misses,
            cache_hit_rate: (hits + misses > 0 && self.shared.config.placement != Placement::Bypass)
                .then(|| hits as f64 / (hits + misses) as f64),
            medium_rows_read: c.rows_read.load(Ordering::Relaxed),
            lookahead_rows: c.lookahead_rows.load(Ordering::Relaxed),
            hot_placements: c.placements.load(Ordering::Relaxed),
            staleness_bound: self.staleness_bound(),
            holds_outstanding: self.shared.training.holds.as_ref().map_or(0, |h| h.outstanding().0),
            holding_workers: self.shared.training.holds.as_ref().map_or(0, |h| h.outstanding().1),
            lifecycle: self.shared.lifecycle.as_ref().map(Lifecycle::stats),
        })
    }
}

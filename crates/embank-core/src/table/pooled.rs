//! `lookup_pooled`: inference bags pooled in the store, through the store's
//! pooled-embedding cache when it has one (`pooled.rs` at the crate root; it hears
//! of changed rows from the tier stack's notice, so a cached bag never outlives a
//! change of one of its rows).

use super::Table;
use crate::error::Result;
use crate::pooled::{bag_hash, check_batch, pool_bags, Pooling};

impl Table {
    /// Pooled rows of bags, as `torch.nn.EmbeddingBag` computes them: bag `b` is
    /// `ids[offsets[b]..offsets[b + 1]]` (`offsets` has one entry more than there are
    /// bags, starts at 0, ends at `ids.len()`, never decreases), pooled by `mode` —
    /// the sum (weighted by `weights`, one per id, if given) or the mean (no weights;
    /// an empty bag pools to zeros) — into `out[b * dim..]`. Rows are read as
    /// [`lookup`](Self::lookup) reads them: a missing id contributes the table's
    /// missing-row default and nothing is created.
    ///
    /// With a pooled-embedding cache (`StoreOptions::pooled_cache_bytes`), a bag whose
    /// whole id sequence (and weights and mode) was pooled before is answered from it;
    /// the others are looked up in one batch and cached.
    pub fn lookup_pooled(
        &self,
        ids: &[u64],
        offsets: &[usize],
        weights: Option<&[f32]>,
        mode: Pooling,
        out: &mut [f32],
    ) -> Result<()> {
        let dim = self.dim();
        let bags = check_batch(ids, offsets, weights, mode, dim, out)?;
        let table = self.shared.config.id;
        let cache = self.shared.runtime.pooled.as_deref();
        let mut hit = vec![false; bags];
        let (hashes, epoch) = match cache {
            Some(c) => {
                let hashes: Vec<u128> = (0..bags)
                    .map(|b| {
                        let (lo, hi) = (offsets[b], offsets[b + 1]);
                        bag_hash(table, mode, &ids[lo..hi], weights.map(|w| &w[lo..hi]))
                    })
                    .collect();
                let epoch = c.get_batch(table, mode, ids, offsets, weights, &hashes, dim, out, &mut hit);
                (hashes, epoch)
            }
            None => (Vec::new(), 0),
        };
        let missed: Vec<usize> = (0..bags).filter(|&b| !hit[b]).collect();
        if missed.is_empty() {
            return Ok(());
        }
        // One lookup of the distinct ids of every missed bag.
        let lookup = |keys: &[u64], rows: &mut [f32]| self.lookup(keys, rows, &mut vec![false; keys.len()]);
        pool_bags(ids, offsets, weights, mode, dim, missed.iter().copied(), lookup, out)?;
        if let Some(c) = cache {
            c.insert_batch(table, mode, epoch, &missed, ids, offsets, weights, &hashes, dim, out);
        }
        Ok(())
    }
}
